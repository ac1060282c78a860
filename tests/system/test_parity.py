"""The pipeline against one process and against transformers, on the real SmolLM2.

Five prompts, three greedy and two seeded, give the same tokens with 1, 2 and 3 stages (three
launches, so three sets of processes with different histories; 2 stages read the prompts in
the reverse order, so each seeded prompt runs first on one launch and after the others on
another: a draw depends on (seed, position) only); the greedy ones equal the single-process
forward and transformers' greedy choices, with transformers' fp32 model loaded from the same
GGUF; every sampled position's logits agree with it within 1e-3. Another seed gives other
tokens. The 3-stage and 2-stage launches are the session's (conftest's smollm2_stages and
smollm2_drafting_stages, whose last stage holds a NextN head that no request here asks to
draft with; 4 slots of 512 positions); this module uses their slot 0.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from strata.coordinator.engine.generate import generate_solo
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.sequence import Sequence
from strata.coordinator.windows import DEFAULT_CHUNK_ROWS, DEFAULT_WINDOW_ROWS
from strata.launch.plan import plan_stages
from strata.launch.session import launch_stages
from strata.model.gguf_file import ModelFile
from strata.model.tokenizer import Tokenizer
from strata.stage_worker.model import KVCache, Rows, StageModel

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "Les trois couleurs du drapeau français sont",
]
N_TOKENS = 10  # per prompt: five prompts of varied text, each run several times on a CPU
GREEDY = SamplingParams(max_tokens=N_TOKENS)
SEEDED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, seed=1234,
                        max_tokens=N_TOKENS)
# greedy on the code, the story and the chat turn; seeded sampling on the other two
PARAMS = [SEEDED, GREEDY, GREEDY, GREEDY, SEEDED]
GREEDY_AT = [i for i, p in enumerate(PARAMS) if p.temperature == 0]
CTX = 256

# SmolLM2 in three launches and in transformers; this process's forwards (the single-process
# one, transformers') on one torch thread (conftest's one_torch_thread)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def model(smollm2):
    file = ModelFile(smollm2)
    return file, Tokenizer.from_gguf(file.reader)


@pytest.fixture(scope="module")
def launches(model, smollm2_stages, smollm2_drafting_stages):
    """One launch per stage count, shared by the tests of this module: 1 stage its own, 2 and
    3 the session's."""
    file, _ = model
    shared = {len(run.plan): run for run in (smollm2_drafting_stages, smollm2_stages)}
    assert sorted(shared) == [2, 3] and all(run.ctx >= CTX for run in shared.values())
    plan = plan_stages("auto", ["cpu"], file.config.n_layers)
    with launch_stages(file, plan, slots=1, ctx=CTX, say=lambda s: None) as one:
        yield {1: one, **shared}


def generate(run, tok, prompts=PROMPTS, params=PARAMS, want_logits=False):
    """Generate N_TOKENS for every prompt (with its params) through real stage processes."""
    out_tokens, out_logits = [], []
    for prompt, params in zip(prompts, params, strict=True):
        logits = {}
        seq = Sequence(tok.encode(prompt), params, frozenset(), CTX, tok.decode)
        generate_solo(run.pipe, seq,
                      on_logits=(lambda p, l: logits.__setitem__(p, l.copy()))
                      if want_logits else None)
        out_tokens.append(seq.generated)
        out_logits.append(logits)
    return out_tokens, out_logits


@torch.inference_mode()
def single_process_greedy(model: StageModel, ids: list[int]) -> list[int]:
    """The same windows (fixed chunk and decode shapes) run by one StageModel in-process, with
    a fresh cache."""
    cfg = model.cfg
    cache = KVCache(cfg.n_layers, 1, cfg, CTX, model.device, model.dtype)

    def step(rows: list[tuple[int, int]], shape: int) -> int:
        pad = shape - len(rows)
        window = Rows([0] * len(rows) + [-1] * pad, [p for p, _ in rows] + [0] * pad)
        tokens = torch.tensor([t for _, t in rows] + [0] * pad)
        hidden = model(tokens, window, cache)
        block = torch.zeros(8, hidden.shape[1])
        block[0] = hidden[len(rows) - 1]
        return int(torch.argmax(model.logits(block)[0]))

    rows = list(enumerate(ids))
    for i in range(0, len(rows), DEFAULT_CHUNK_ROWS):
        token = step(rows[i:i + DEFAULT_CHUNK_ROWS], DEFAULT_CHUNK_ROWS)
    out = [token]
    while len(out) < N_TOKENS:
        out.append(step([(len(ids) + len(out) - 1, out[-1])], DEFAULT_WINDOW_ROWS))
    return out


@pytest.fixture(scope="module")
def runs(model, launches):
    """Stage count -> (tokens, logits) of every prompt, in PROMPTS' order."""
    _, tok = model
    out = {n: generate(run, tok, want_logits=True) for n, run in launches.items() if n != 2}
    tokens, logits = generate(launches[2], tok, PROMPTS[::-1], PARAMS[::-1], want_logits=True)
    return {**out, 2: (tokens[::-1], logits[::-1])}


def test_stage_counts_give_identical_tokens(runs):
    one, _ = runs[1]
    assert all(len(t) == N_TOKENS for t in one)
    for n in (2, 3):
        assert runs[n][0] == one, f"{n} stages differ from 1 stage"


def test_pipeline_equals_single_process_forward(model, runs):
    """The chat turn, the longest greedy prompt (the forward is the same code for the others:
    transformers checks them all, below)."""
    file, tok = model
    whole = StageModel(file, 0, file.config.n_layers, ctx=CTX)
    i = max(GREEDY_AT, key=lambda i: len(tok.encode(PROMPTS[i])))
    assert single_process_greedy(whole, tok.encode(PROMPTS[i])) == runs[1][0][i], PROMPTS[i]


@pytest.fixture(scope="module")
def hf_logits(hf_model):
    """transformers' logits of a token sequence, each sequence computed once (the stage counts'
    tokens are the same where the pipeline is right)."""
    seen = {}

    def logits(ids: list[int]) -> torch.Tensor:
        if tuple(ids) not in seen:
            with torch.inference_mode():
                seen[tuple(ids)] = hf_model(torch.tensor([ids])).logits[0]
        return seen[tuple(ids)]
    return logits


@pytest.mark.parametrize("n_stages", [1, 3])
def test_pipeline_equals_transformers(model, runs, hf_logits, n_stages):
    _, tok = model
    tokens, logits = runs[n_stages]
    for i, (prompt, generated, by_position) in enumerate(zip(PROMPTS, tokens, logits)):
        ids = tok.encode(prompt)
        ref = hf_logits(ids + generated)
        if i in GREEDY_AT:
            # transformers' greedy choice at every step, fed our tokens: equal at every step
            # means greedy generation gives the same sequence (no EOS stop: stop_ids is empty)
            assert ref[len(ids) - 1:-1].argmax(-1).tolist() == generated, prompt
        assert sorted(by_position) == list(range(len(ids), len(ids) + N_TOKENS))
        for position, ours in by_position.items():
            diff = (ref[position - 1] - torch.from_numpy(ours)).abs().max().item()
            assert diff < 1e-3, f"{prompt!r} position {position}: logits differ by {diff}"


def test_another_seed_gives_other_tokens(model, launches, runs):
    """The seed matters: seeded sampling is not greedy in disguise."""
    _, tok = model
    seeded = next(i for i in range(len(PROMPTS)) if i not in GREEDY_AT)
    other_seed, _ = generate(launches[1], tok, [PROMPTS[seeded]], [replace(SEEDED, seed=99)])
    assert other_seed[0] != runs[1][0][seeded]
