"""The model families (model/families.py) against transformers' own modeling code: a tiny
random model of each (qwen3moe and glm4moe: 8 routed experts, 2 a row; glm4moe's in 2 groups,
with a correction bias, a shared expert and a dense first layer), written to GGUF as llama.cpp's converter writes it, gives
transformers' greedy tokens over 32 tokens and its logits within 1e-3 through strata's stages
split 1, 2 and 3 ways (CPU, fp32); the Triton path (RoPE on halves, windows, per-head norms,
GeGLU, routed experts) gives the plain-torch path's logits (interpreter, "cpu" cases, and CUDA); and a
launch of each family gives every request alone the tokens it gives in a batch, serial and
pipelined, greedy and seeded (`strata-bench exact`)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from click.testing import CliRunner

import hf_families as hf
from strata.bench.cli import main as bench
from strata.kernels.policy import KernelPolicy
from strata.model.gguf_file import ModelFile
from strata.stage_worker.model import KVCache, Rows, StageModel
from conftest import triton_devices

ARCHS = ("qwen2", "qwen3", "gemma3", "qwen3moe", "glm4moe")
MOE = ("qwen3moe", "glm4moe")
PROMPT = 20     # prompt tokens: past gemma3's window of 12, so the window is exercised
TOKENS = 32
CTX = 96


@pytest.fixture(scope="module", params=ARCHS)
def family(request, tmp_path_factory):
    model, path = hf.write(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, model, ModelFile(path)


def _prompt(seed: int = 1) -> list[int]:
    return torch.randint(0, hf.VOCAB, (PROMPT,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(stages: list[StageModel], prompt: list[int], steps: int = TOKENS
              ) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and each step's logits through the stages in turn: the prompt as one
    chunk, then one decode row a token."""
    caches = [KVCache(len(s.layers), 1, s.cfg, CTX, s.device, s.dtype) for s in stages]

    def run(tokens: list[int], start: int, chunk: bool) -> torch.Tensor:
        x = torch.tensor(tokens)
        rows = Rows([0] * len(tokens), list(range(start, start + len(tokens))))
        for stage, cache in zip(stages, caches):
            x = stage(x.to(stage.device), rows, cache, chunk=chunk)
        return stages[-1].logits(x[-1:])[0].float().cpu()

    out, logits = [], []
    with torch.inference_mode():
        step = run(prompt, 0, True)
        while True:
            logits.append(step)
            out.append(int(step.argmax()))
            if len(out) == steps:
                return out, torch.stack(logits)
            step = run([out[-1]], len(prompt) + len(out) - 1, False)


@pytest.mark.parametrize("split", [(), (4,), (2, 5)], ids=["1 stage", "2 stages", "3 stages"])
def test_a_family_gives_transformers_tokens_and_logits(family, split):
    arch, model, file = family
    prompt = _prompt()
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
    want_tokens = want.sequences[0, PROMPT:].tolist()
    edges = [0, *split, file.config.n_layers]
    stages = [StageModel(file, a, b, ctx=CTX) for a, b in zip(edges, edges[1:])]
    tokens, logits = _generate(stages, prompt)
    assert tokens == want_tokens, arch
    diff = (logits - torch.cat(want.logits).float()).abs().max().item()
    assert diff < 1e-3, f"{arch}: logits differ by {diff:.2e}"


@pytest.mark.parametrize("device", triton_devices())
def test_the_triton_path_gives_the_torch_paths_logits(family, device):
    """RoPE on halves, the sliding window in the per-row and chunk kernels, the scale, the
    per-head norms, GeGLU and the routed experts' kernels (kernels/moe_triton.py) with a
    shared expert, against the plain-torch path of the same file (under the interpreter, ~2 s
    a decode step and 0.4 s a prompt row: a prompt of hf.WINDOW + 2 tokens, then 3 tokens,
    the last 2 from decode rows)."""
    arch, _, file = family
    if device == "cpu" and arch in ("qwen3", "qwen3moe"):
        pytest.skip("under the interpreter gemma3, qwen2 and glm4moe cover the other families' "
                    "steps")
    torch_path = StageModel(file, 0, file.config.n_layers, ctx=CTX,
                            policy=KernelPolicy(triton=False))
    triton_path = StageModel(file, 0, file.config.n_layers, ctx=CTX, device=device,
                             policy=dataclasses.replace(KernelPolicy.for_device(device)))
    assert triton_path.policy.triton
    steps = 3 if device == "cpu" else TOKENS
    prompt = _prompt(2)[:hf.WINDOW + 2] if device == "cpu" else _prompt(2)   # past the window
    tokens, want = _generate([torch_path], prompt, steps)
    got_tokens, got = _generate([triton_path], prompt, steps)
    tol = 1e-4 if device == "cpu" else 5e-2
    assert (got - want).abs().max().item() < tol * max(1.0, want.abs().max().item()), arch
    if device == "cpu":
        assert got_tokens == tokens


@pytest.mark.slow
def test_a_family_batched_equals_alone_serial_and_pipelined(family, one_launch):
    """`strata-bench exact` serial, then pipelined, on one launch of the family's 2 stages
    (the group count is the scheduler's: the stages are the same). Serial, 10 requests share
    16-row windows (alone: 8 rows)."""
    arch, _, file = family
    for groups in ("1", "2"):
        out = CliRunner().invoke(bench, ["exact", "--model", str(file.path), "--layer-split",
                                         "3", "--ctx-size", "128", "--batch", "10",
                                         "--batch-groups", groups, "--requests", "10",
                                         "--tokens", "12"])
        assert out.exit_code == 0, (arch, out.output, out.exception)
        assert out.stdout.splitlines()[-1].startswith("all requests identical"), (
            arch, out.stdout)
        assert f"groups {groups}," in out.stdout
        if groups == "1":
            assert "# greedy together: decode windows of" in out.stdout
            assert "no row was compared across window sizes" not in out.stdout
    assert len(one_launch) == 2


@pytest.mark.slow
def test_glm_drafts_with_its_own_nextn_layer_and_stays_exact(tmp_path):
    """A GLM-4.5-style file with its NextN layer (blk.3.nextn.*, a routed block): the last
    stage drafts with it, no sidecar; batched requests with drafts equal each alone, and the
    drafted tokens equal plain decoding's (a random head's proposals are rarely kept: this
    checks the path, not the gain)."""
    _, path = hf.write("glm4moe", tmp_path, layers=3, nextn=True)
    common = ["--model", str(path), "--layer-split", "2", "--ctx-size", "128", "--batch", "2",
              "--tokens", "10", "--draft-tokens", "2"]
    for args in (["exact", "--batch-groups", "2", "--requests", "3"],
                 ["drafts", "--batch-groups", "1", "--clients", "2"]):
        out = CliRunner().invoke(bench, args + common)
        assert out.exit_code == 0, (args, out.output, out.exception)
        assert "mtp (the NextN head in the model file" in out.output
    assert "every request has the same tokens" in out.output
