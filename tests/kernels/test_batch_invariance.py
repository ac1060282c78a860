"""A decode row's bits do not depend on how many rows share its window (issue 14): the same row
alone (in an 8-row window of pad rows) and among 7, 15, 31 and 63 other rows gives identical
bits, for every kernel of a decode window on its own and for a whole stage's layers and head.

On the CPU the plain-torch path runs (matmuls and norms in blocks of 8 rows); with
TRITON_INTERPRET=1 the "cpu" kernel cases run the Triton kernels under the interpreter; on CUDA
(marked gpu) the Triton kernels themselves, every row tile of the skinny matmul, and the stage
replayed from a CUDA graph at each window size. The windows mix slots, positions, pad rows and
a slot with several rows (a token and its drafts)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from strata.kernels import fused
from strata.kernels.attention.window import attend_rows
from strata.kernels.policy import KernelPolicy
from strata.kernels.sampling.sample import SamplingRow, sample_row
from strata.model.gguf_file import ModelFile
from strata.model.mkmodel import SHAPES, write_random_gguf
from strata.stage_worker.model import KVCache, Rows, StageModel
from strata.stage_worker.runner import WindowRunner
from conftest import triton_devices
from test_attention_chunk import rowwise_interpreter_dot  # noqa: F401 (a fixture)

# the target row alone (a window of its own, then 8 rows with pad rows), then among 7, 15,
# 31 and 63 others. A window of its own shows the blocking matters: on the CPU an unblocked
# torch matmul of 1 row differs from one of 8 (multiples of 8 agreed on the machines tried).
SIZES = (1, 8, 16, 32, 64)
CTX = 192


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _windows(x: torch.Tensor, seed: int, sizes=SIZES):
    """(window, index of row 0 of x) pairs: x[0] alone among zero pad rows, then among other
    random rows at a varying index."""
    g = _gen(seed)
    for n in sizes:
        if n == 1:
            yield x[:1], 0
            continue
        if n == 8:
            w = torch.zeros(8, *x.shape[1:], dtype=x.dtype, device=x.device)
            at = 0
        else:
            w = torch.randn(n, *x.shape[1:], generator=g).to(x.device, x.dtype)
            at = (5 * n) // 7
        w[at] = x[0]
        yield w, at


def _dtype(device: str) -> torch.dtype:
    return torch.float32 if device == "cpu" else torch.bfloat16   # interpreter: fp32


# --- each kernel on its own -------------------------------------------------------------------

PROJECTIONS = [  # (kind, n, k): shapes the blocks divide, small enough for the interpreter
    ("plain", 96, 128), ("res", 64, 128), ("qkv", 128, 64), ("gate_up", 256, 64),
    ("head", 320, 64)]
L8B = [("qkv", 6144, 4096), ("res", 4096, 4096), ("gate_up", 28672, 4096),
       ("res", 4096, 14336), ("head", 128256, 4096)]
SMOL = [("qkv", 960, 576), ("res", 576, 576), ("gate_up", 3072, 576), ("res", 576, 1536),
        ("head", 49152, 576)]
# the row tiles: one that fits the window (every weight), a 16-row tile over row blocks, and
# the default policy's choice (16-row tiles for small weights, else one that fits)
TILES = {"fit": dict(row_tiles=(16, 32, 64), fit_min_bytes=0), "16": dict(row_tiles=(16,)),
         "default": {}}


def _project(kind: str, x: torch.Tensor, w: torch.Tensor, norm, res, policy) -> torch.Tensor:
    if kind == "qkv":
        return fused.norm_linear_rows(x, norm, 1e-5, w, policy, decode=True)
    if kind == "gate_up":
        return fused.norm_gate_up_silu(x, norm, 1e-5, w, policy, decode=True)
    if kind == "head":
        return fused.norm_head_rows(x, norm, 1e-5, w, policy)
    return fused.linear_rows(x, w, res if kind == "res" else None, policy, decode=True)


def _check_projection(kind, n, k, device, policy, sizes=SIZES, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    like = dict(device=device, dtype=_dtype(device))
    w = torch.randn(n, k, generator=g, device=device).mul_(0.05).to(like["dtype"])
    norm = (1 + 0.1 * torch.randn(k, generator=g, device=device)).to(**like)
    x = torch.randn(1, k, generator=g, device=device).to(**like)
    out_n = n // 2 if kind == "gate_up" else n
    res = torch.randn(1, out_n, generator=g, device=device).to(**like)
    ref = None
    for (window, at), (res_w, _) in zip(_windows(x, seed + 1, sizes),
                                        _windows(res, seed + 2, sizes)):
        out = _project(kind, window, w, norm, res_w, policy)
        assert out is not None, f"{kind} {n}x{k}: no skinny kernel takes it"
        if ref is None:
            ref = out[at]
        assert torch.equal(out[at], ref), f"{kind} {n}x{k}: {window.shape[0]} rows differ"


def _policy(device: str, tiles: str) -> KernelPolicy:
    return dataclasses.replace(KernelPolicy.for_device(device), **TILES[tiles])


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("tiles", ["fit", "16"])
@pytest.mark.parametrize("kind, n, k", PROJECTIONS)
def test_skinny_projection_rows_are_invariant(device, tiles, kind, n, k,
                                             rowwise_interpreter_dot):
    """Under the interpreter, its dot made row-independent (numpy's is not: see the fixture),
    the kernels' row tiles and masks (every tile, and rows a tile masks: 24 and 40); on CUDA,
    the tensor cores' tiles of 16, 32 and 64 rows."""
    policy = _policy(device, tiles)
    assert policy.triton
    sizes = (1, 8, 24, 40) if device == "cpu" else SIZES
    _check_projection(kind, n, k, device, policy, sizes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tiles", ["fit", "16"])
@pytest.mark.parametrize("kind, n, k", L8B + SMOL)
def test_skinny_projection_rows_are_invariant_at_model_shapes_on_gpu(tiles, kind, n, k):
    """llama3-8b's and SmolLM2's projections, windows of every row tile (and rows the tile
    masks: 24 and 40)."""
    _check_projection(kind, n, k, "cuda", _policy("cuda", tiles),
                      sizes=(1, 8, 16, 24, 32, 40, 64))


@pytest.mark.parametrize("kind, n, k", [p for p in PROJECTIONS if p[0] != "head"] + SMOL[:-1])
def test_plain_torch_projections_are_invariant(kind, n, k):
    """The plain-torch path (no Triton): the matmuls and norms of a decode window in blocks
    of 8 rows (the head: test_stage_rows_are_invariant)."""
    _check_projection(kind, n, k, "cpu", KernelPolicy(triton=False))


def _row_kernels(device: str, policy: KernelPolicy, seed: int = 3):
    """(name, fn(rows, at) -> [R, ...] output, x) for the row-wise kernels of a decode window
    (row `at` is the target's: slot 0, position 100)."""
    g = _gen(seed)
    dtype = _dtype(device)
    heads, kv, hd, d = 4, 2, 16, 64
    weight = (1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype)
    cos, sin = (torch.randn(CTX, hd // 2, generator=g).to(device) for _ in range(2))
    k_cache = torch.randn(4, kv, CTX, hd, generator=g).to(device, dtype)
    v_cache = torch.randn(4, kv, CTX, hd, generator=g).to(device, dtype)

    def rows_of(n: int, at: int):   # row r: slot r % 3, position 7 + 5 r % 150
        slot = [r % 3 for r in range(n)]
        pos = [7 + 5 * r % 150 for r in range(n)]
        slot[at], pos[at] = 0, 100
        return torch.tensor(slot, device=device), torch.tensor(pos, device=device)

    def rope(x, at):
        slot, pos = rows_of(x.shape[0], at)
        kc, vc = k_cache.clone(), v_cache.clone()
        q = fused.rope_write_kv(x, cos, sin, slot, pos, kc, vc, heads, policy)
        return torch.cat([q.flatten(1), kc[slot, :, pos].flatten(1), vc[slot, :, pos].flatten(1)],
                         1)

    def attention(q, at):
        slot, pos = rows_of(q.shape[0], at)
        return attend_rows(q.view(q.shape[0], heads, hd), k_cache, v_cache, slot, pos + 1,
                           policy).flatten(1)

    return [
        ("rms_norm", lambda x, _: fused.rms_norm_rows(x, weight, 1e-5, policy, decode=True),
         torch.randn(1, d, generator=g)),
        ("silu_mul", lambda x, _: fused.silu_mul(x, policy), torch.randn(1, 2 * d, generator=g)),
        ("rope_write_kv", rope, torch.randn(1, (heads + 2 * kv) * hd, generator=g)),
        ("attention", attention, torch.randn(1, heads * hd, generator=g)),
    ]


def _check_row_kernels(device: str, policy: KernelPolicy, sizes=SIZES) -> None:
    for name, fn, x in _row_kernels(device, policy):
        ref = None
        for window, at in _windows(x.to(device, _dtype(device)), 7, sizes):
            out = fn(window, at)[at]
            ref = out if ref is None else ref
            assert torch.equal(out, ref), f"{name}: {window.shape[0]} rows differ"


@pytest.mark.parametrize("device", triton_devices())
def test_triton_row_kernels_are_invariant(device, rowwise_interpreter_dot):
    """One program per row (and head, or block of columns): the interpreter, which runs each
    program alone, needs no more than a few rows to show it."""
    sizes = (1, 8, 24) if device == "cpu" else SIZES
    _check_row_kernels(device, KernelPolicy.for_device(device), sizes)


def test_plain_torch_row_kernels_are_invariant():
    _check_row_kernels("cpu", KernelPolicy(triton=False))


# --- a whole stage: layers and head ---------------------------------------------------------

def _shape(name: str, layers: int, **changes):
    return dataclasses.replace(SHAPES[name], n_layers=layers, **changes)


# name: (layers, vocabulary on the CPU): every matmul shape of the real model (llama3-1b's
# weights are of 16 MB and more in bf16); on the CPU the vocabulary is cut (the head's rows).
# llama3-8b's layer runs on CUDA only: there cuBLAS gives a row other bits at 64 rows than at
# 8 (its o and down projections), so the stage test fails if a decode matmul goes to cuBLAS.
MODELS = {"tiny": (4, None), "smollm2-135m": (2, 4096), "llama3-1b": (1, 4096),
          "llama3-8b": (1, None)}


@pytest.fixture(scope="module", params=list(MODELS))
def model_file(request, tmp_path_factory) -> ModelFile:
    layers, vocab = MODELS[request.param]
    if request.param == "llama3-8b" and not torch.cuda.is_available():
        pytest.skip("llama3-8b's layer: on CUDA only (a GB in fp32 on the CPU)")
    shape = _shape(request.param, layers)
    if vocab and not torch.cuda.is_available():
        shape = dataclasses.replace(shape, vocab=vocab)
    weight_type = "F32" if request.param == "tiny" else "BF16"
    path = tmp_path_factory.mktemp("models") / f"{request.param}.gguf"
    return ModelFile(write_random_gguf(path, shape, seed=4, weight_type=weight_type,
                                       std=0.2, fast=True))


def _decode_windows(vocab: int, sizes=SIZES):
    """(window rows [(slot, position, token)], where the target rows sit) for each size: the
    target is slot 0's row at position 40 and slot 1's token and 3 drafts (positions 30-33);
    alone they make a window of their own (size 1: 5 rows) or share an 8-row window with pad
    rows; then they sit among rows of slots 2-7 at other positions (some with drafts) and pad
    rows."""
    rng = np.random.default_rng(5)
    target = [(0, 40, 11), (1, 30, 12), (1, 31, 13), (1, 32, 14), (1, 33, 15)]
    for n in sizes:
        if n == 1:
            yield target, list(range(len(target)))
            continue
        if n == 8:
            rows = target + [(-1, 0, 0)] * 3
            yield rows, list(range(len(target)))
            continue
        others = []
        while len(others) < n - len(target):
            slot = int(rng.integers(2, 8))
            start = int(rng.integers(20, 60))
            for p in range(start, start + int(rng.integers(1, 4))):   # 1 to 3 rows a slot
                others.append((slot, p, int(rng.integers(0, vocab))) if rng.random() < 0.9
                              else (-1, 0, 0))
        others = others[: n - len(target)]
        at = (3 * n) // 8
        rows = others[:at] + target + others[at:]
        yield rows, list(range(at, at + len(target)))


def _prefill(model: StageModel, cache: KVCache, runner=None) -> None:
    """The target slots' positions [0, 48) as one prompt chunk each (the other slots' rows
    read what their slots hold: zeros, or what earlier windows wrote)."""
    rng = np.random.default_rng(6)
    for slot in (0, 1):
        tokens = rng.integers(0, model.cfg.vocab, size=48).tolist()
        rows = Rows([slot] * 48, list(range(48)))
        if runner is not None:
            runner.run(torch.tensor(tokens), rows, chunk=True)
        else:
            model(torch.tensor(tokens, device=model.device), rows, cache, chunk=True)
        cache.filled[slot] = 48


def _stage_outputs(model: StageModel, cache: KVCache, rows, at, runner=None):
    """The target rows' hidden states, fp32 logits, argmax, sampled tokens (the last stage's
    sampling of each row, seeded) and KV (layer 0 and last)."""
    ids = torch.tensor([t for *_, t in rows])
    r = Rows([s for s, *_ in rows], [p for _, p, _ in rows])
    if runner is None:
        hidden = model(ids.to(model.device), r, cache)
        logits = model.logits(hidden)
        argmax = logits.argmax(-1)
    else:
        hidden, head = runner.run(ids, r, sample_rows=list(range(len(rows))))
        logits, argmax = head.logits[head.rows], head.argmax[head.rows]
    kv = [c[s, :, p].clone() for c in (cache.k[0], cache.v[-1]) for s, p, _ in
          (rows[i] for i in at)]
    sampled = torch.tensor([sample_row(logits[i], SamplingRow(0.8, 40, 0.9, 0.05, u))
                            for i, u in zip(at, (0.13, 0.37, 0.61, 0.85, 0.99))])
    return [hidden[at].clone(), logits[at].clone(), argmax[at].clone(), sampled, *kv]


def _same(outs: list, size: int) -> None:
    names = ["hidden", "logits", "argmax", "sampled tokens"] + ["kv"] * (len(outs[0]) - 4)
    for name, x, y in zip(names, outs[0], outs[-1]):
        assert torch.equal(x, y), f"{name} of a row differs alone and in a {size}-row window"


def test_stage_rows_are_invariant(model_file, rowwise_interpreter_dot):
    """A whole stage's layers and head (CPU: fp32 plain torch; under TRITON_INTERPRET=1 the
    Triton kernels): the target rows alone and among 8, 16, 32 and 64-row windows."""
    model = StageModel(model_file, 0, model_file.config.n_layers, ctx=CTX)
    cache = KVCache(len(model.layers), 8, model.cfg, CTX, model.device, model.dtype)
    with torch.inference_mode():
        _prefill(model, cache)
        outs = []
        for rows, at in _decode_windows(model.cfg.vocab):
            outs.append(_stage_outputs(model, cache, rows, at))
            _same(outs, len(rows))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tiles", ["default", "fit"])
def test_stage_rows_are_invariant_on_gpu_eager_and_graphed(model_file, tiles):
    """bf16 on CUDA, every decode size from 8 to 64 rows: eagerly, and replayed from one CUDA
    graph per size (layers and head in the window's graph), all the same bits."""
    model = StageModel(model_file, 0, model_file.config.n_layers, ctx=CTX, device="cuda:0",
                       policy=_policy("cuda:0", tiles))
    sizes = tuple(range(8, 65, 8))
    runner = eager_and_graphed_rows_are_invariant(model, sizes)
    assert {k for k in runner.graphs if k[0] == "layers+head"} == {
        ("layers+head", n) for n in sizes}
    assert runner.captures == len(runner.graphs) == len(sizes) + 1   # and the chunk


def eager_and_graphed_rows_are_invariant(model: StageModel, sizes) -> WindowRunner:
    """The target rows in windows of each size, eagerly and replayed from one CUDA graph per
    size (layers and head in the window's graph): all the same bits. Returns the runner."""
    runs = []
    with torch.inference_mode():
        for graphed in (False, True):
            ctx = model.cos.shape[0]   # the model's rotary table: its context
            cache = KVCache(len(model.layers), 8, model.cfg, ctx, model.device, model.dtype)
            runner = WindowRunner(model, cache, 16) if graphed else None
            _prefill(model, cache, runner)
            outs = []
            for rows, at in _decode_windows(model.cfg.vocab, sizes):
                outs.append(_stage_outputs(model, cache, rows, at, runner))
                _same(outs, len(rows))
            runs.append(outs[0])
    _same(runs, 8)
    return runner


def test_a_stage_refuses_decode_windows_past_64_rows(tiny_model):
    """A decode window holds at most 64 rows (the largest row tile); a prompt chunk may hold
    more."""
    from strata.protocol.messages import Window
    from strata.stage_worker.checks import RowError, check_window
    from strata.stage_worker.config import WorkerConfig

    cfg = WorkerConfig(model=str(tiny_model), stage=0, layer_start=0, layer_end=4,
                       listen="ipc://a", coordinator="ipc://b", next=None, slots=2, ctx=CTX)
    model = ModelFile(tiny_model).config

    def window(n: int, chunk: bool) -> Window:
        return Window(3, [0] * n, list(range(n)), [1] * n, chunk=chunk)

    check_window(window(64, False), [], cfg, model, True, [0, 0])
    check_window(window(65, True), [], cfg, model, True, [0, 0])
    with pytest.raises(RowError, match="window 3 has 65 rows; a decode window holds at most 64"):
        check_window(window(65, False), [], cfg, model, True, [0, 0])
