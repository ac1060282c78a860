"""The routed experts' Triton kernels (kernels/moe_route.py, moe_triton.py) against the plain-torch
reference (kernels/moe.py's route and moe_rows): the routing (softmax; sigmoid with a
correction bias in groups), the experts of decode windows and prompt chunks, dense and packed
in GGUF block types (against the dequantized weights), and a row's bits alone and among 7 and
15 others that chose other experts (torch.equal). Under the interpreter (the "cpu" cases,
fp32, tiny shapes) and on CUDA (bf16, marked gpu), where the invariance also runs at
qwen3-30b-a3b's shapes and the layer replays from a CUDA graph."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import quantize

from strata.kernels import moe
from strata.kernels.policy import KernelPolicy
from strata.kernels.quant.weight import QuantWeight, dequantize_torch, random_blocks
from strata.model.kquant_blocks import random_kquant_blocks
from conftest import triton_devices
from test_attention_chunk import rowwise_interpreter_dot  # noqa: F401 (a fixture)

E, K_USED, D, F = 8, 2, 64, 32      # tiny: the interpreter runs a program in Python


def _like(device: str) -> dict:
    return {"device": device, "dtype": torch.float32 if device == "cpu" else torch.bfloat16}


def _policy(device: str) -> KernelPolicy:
    policy = KernelPolicy.for_device(device)
    assert policy.triton
    return policy


def _dense(device: str, experts: int = E, d: int = D, f: int = F, seed: int = 0):
    """router [E, D], gate_up [E, 2F, D], down [E, D, F] of random values (drawn on the
    device: qwen3-30b-a3b's experts are 600M values)."""
    g = torch.Generator(device=device).manual_seed(seed)
    like = _like(device)
    return tuple(torch.randn(*shape, generator=g, device=device).mul(std).to(like["dtype"])
                 for shape, std in (((experts, d), 0.3), ((experts, 2 * f, d), 0.1),
                                    ((experts, d, f), 0.1)))


GLM = {"bias": "random", "scale": 2.5, "groups": (2, 1)}   # sigmoid, bias, groups
QWEN = {"bias": None, "scale": 1.0, "groups": (1, 1)}      # softmax


def _gating(kind: dict, device: str, experts: int = E) -> dict:
    bias = None
    if kind["bias"] is not None:
        bias = torch.randn(experts, generator=torch.Generator().manual_seed(9)).mul(0.5)
        bias = bias.to(device)
    return {"bias": bias, "scale": kind["scale"], "groups": kind["groups"]}


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("gating", [QWEN, GLM, {"bias": "random", "scale": 1.0,
                                                "groups": (4, 2)}], ids=["softmax", "sigmoid",
                                                                         "groups"])
def test_routing_is_the_references(device, gating):
    """The same experts in the same order as moe.route, weights within fp32 rounding, and each
    expert's count of pairs (without counting: the same experts and weights)."""
    from strata.kernels import moe_route
    experts, k = 16, 4
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(37, experts, generator=g).to(device)
    gate = _gating(gating, device, experts)
    ids, weights, counts = moe_route.route(logits, k, **gate)
    eye = torch.eye(experts, device=device)   # route() on logits: h = I, router = logits^T
    want_w, want_ids = moe.route(logits, eye, k, **gate)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    assert torch.equal(counts.long(), torch.bincount(want_ids.flatten(), minlength=experts))
    uncounted = moe_route.route(logits, k, **gate, count=False)   # the int8 experts' call
    assert uncounted[2] is None and torch.equal(uncounted[0], ids)
    assert torch.equal(uncounted[1], weights)


def _reference(x, h, router, gate_up, down, gating) -> torch.Tensor:
    """x + moe_rows in float64 (of h's and the weights' values)."""
    d = lambda t: None if t is None else t.double()  # noqa: E731
    return x.double() + moe.moe_rows(h.double(), router.double(), gate_up.double(),
                                     down.double(), K_USED, d(gating["bias"]),
                                     gating["scale"], gating["groups"])


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("gating", [QWEN, GLM], ids=["softmax", "sigmoid"])
def test_dense_experts_match_moe_rows(device, gating):
    """Decode windows of 1, 5 and 17 rows and a prompt chunk of 24."""
    router, gate_up, down = _dense(device)
    gate = _gating(gating, device)
    like = _like(device)
    g = torch.Generator().manual_seed(2)
    tol = 1e-5 if device == "cpu" else 3e-2
    for rows, decode in ((1, True), (5, True), (17, True), (24, False)):
        x, h = (torch.randn(rows, D, generator=g).to(**like) for _ in range(2))
        got = moe.moe_window(x, h, router, gate_up, down, K_USED, **gate,
                             policy=_policy(device), decode=decode)
        want = _reference(x, h, router, gate_up, down, gate)
        err = ((got.double() - want).norm() / want.norm()).item()
        assert got.dtype == like["dtype"] and err < tol, f"{rows} rows: {err:.2e}"


def _blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype.endswith("_K"):
        return random_kquant_blocks(qtype, rows, cols, rng)
    return quantize(rng.standard_normal((rows, cols), dtype=np.float32) * 0.05, QType[qtype])


def _packed(types: tuple[str, str, str], experts: int, d: int, f: int, device: str):
    """(gate_up, down) packed as the loader packs a file's [E, N, K] tensors (gate of every
    expert, then up), and their dequantized values [E, 2F, D], [E, D, F] (fp32)."""
    pieces, dense = [], []
    for i, (qtype, rows, cols) in enumerate(zip(types, (f, f, d), (d, d, f))):
        raw = torch.from_numpy(_blocks(qtype, experts * rows, cols, seed=10 + i))
        w = QuantWeight.from_blocks(qtype, raw, cols, device)
        pieces.append(w)
        dense.append(dequantize_torch(qtype, w.parts[0].planes).view(experts, rows, cols))
    gate_up = QuantWeight.cat(pieces[:2])
    return gate_up, pieces[2], torch.cat(dense[:2], 1), dense[2]


# gate, up, down: gate and up of one type (one part for [gate; up]) or of two (two parts),
# down of another, as llama-quantize's mixes give (Q4_K_M: down in Q6_K; GLM-4.5's down in Q5_0)
QUANT_CASES = [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q4_0", "Q4_1"), ("Q5_K", "Q5_1", "Q5_0")]


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("types", QUANT_CASES, ids=["+".join(t) for t in QUANT_CASES])
def test_packed_experts_match_the_dequantized_reference(device, types):
    """Packed experts through float_triton's tile dequantization, against moe_rows on the
    dequantized weights (a decode window of 3 rows and a prompt chunk of 6; K = 256, a
    super-block)."""
    experts, d, f = 4, 256, 256
    gate_up, down, gate_up_ref, down_ref = _packed(types, experts, d, f, device)
    assert len(gate_up.parts) == (1 if types[0] == types[1] else 2)
    like = _like(device)
    g = torch.Generator().manual_seed(3)
    router = torch.randn(experts, d, generator=g).mul(0.1).to(**like)
    tol = 1e-5 if device == "cpu" else 3e-2
    for rows, decode in ((3, True), (6, False)):
        x, h = (torch.randn(rows, d, generator=g).to(**like) for _ in range(2))
        got = moe.moe_window(x, h, router, gate_up, down, K_USED, policy=_policy(device),
                             decode=decode)
        want = _reference(x, h, router, gate_up_ref.to(like["dtype"]),
                          down_ref.to(like["dtype"]), QWEN | {"bias": None})
        err = ((got.double() - want.to(got.device)).norm() / want.norm()).item()
        assert err < tol, f"{types} {rows} rows: relative error {err:.2e}"


def _windows(x: torch.Tensor, sizes, seed: int):
    """(window, index of x's row): x alone, then among random rows (other experts) and two
    more copies of x (its experts' blocks hold other pairs of the same rows before it)."""
    g = torch.Generator().manual_seed(seed)
    for n in sizes:
        if n == 1:
            yield x, 0
            continue
        w = torch.randn(n, x.shape[1], generator=g).to(x.device, x.dtype)
        at = (5 * n) // 7
        w[at] = w[0] = w[n - 1] = x[0]
        yield w, at


def _invariant(device, weights, sizes, d: int, gating: dict) -> None:
    router, gate_up, down = weights
    like = _like(device)
    g = torch.Generator().manual_seed(4)
    x, h = (torch.randn(1, d, generator=g).to(**like) for _ in range(2))
    first = None
    for (window, at), (hw, _) in zip(_windows(x, sizes, 5), _windows(h, sizes, 6)):
        out = moe.moe_window(window, hw, router, gate_up, down, gating.get("k", K_USED),
                             bias=gating["bias"], scale=gating["scale"],
                             groups=gating["groups"], policy=_policy(device), decode=True)
        first = out[at] if first is None else first
        assert torch.equal(out[at], first), f"{window.shape[0]} rows differ"


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("weights", ["dense", "Q4_K"])
def test_a_rows_bits_do_not_depend_on_its_window(device, weights, rowwise_interpreter_dot):
    """A row alone, then among 7 and 15 others (on CUDA 31 and 63 too)."""
    sizes = (1, 8, 16) if device == "cpu" else (1, 8, 16, 32, 64)
    if weights == "dense":
        _invariant(device, _dense(device), sizes, D, _gating(GLM, device))
        return
    d = 256
    gate_up, down, _, _ = _packed(("Q4_K", "Q4_K", "Q6_K"), E, d, d, device)
    router = torch.randn(E, d, generator=torch.Generator().manual_seed(7)).to(**_like(device))
    _invariant(device, (router, gate_up, down), sizes, d, _gating(QWEN, device))


QWEN3_30B = {"experts": 128, "k": 8, "d": 2048, "f": 768}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("weights", ["bf16", "Q4_K"])
def test_rows_are_invariant_at_qwen3_30b_shapes_on_gpu(weights):
    """128 experts, 8 a row, d_model 2048, expert width 768; windows of 1 to 64 rows."""
    s = QWEN3_30B
    if weights == "bf16":
        router, gate_up, down = _dense("cuda", s["experts"], s["d"], s["f"])
    else:
        gen = torch.Generator(device="cuda").manual_seed(8)
        pieces = [QuantWeight.from_blocks(
            "Q4_K", random_blocks("Q4_K", s["experts"] * n, k, gen), k, "cuda")
            for n, k in ((s["f"], s["d"]), (s["f"], s["d"]), (s["d"], s["f"]))]
        gate_up, down = QuantWeight.cat(pieces[:2]), pieces[2]
        router = _dense("cuda", s["experts"], s["d"], s["f"])[0]
    _invariant("cuda", (router, gate_up, down), (1, 8, 16, 32, 64), s["d"],
               {**_gating(QWEN, "cuda"), "k": s["k"]})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_experts_replay_from_a_cuda_graph():
    """No host sync and fixed shapes: the layer's experts captured in a graph (a host sync
    fails the capture) and replayed on other rows give the eager bits."""
    from strata.stage_worker.graphs import Captured
    router, gate_up, down = _dense("cuda", 16, 256, 128)
    gate = _gating(GLM, "cuda", 16)
    policy = dataclasses.replace(_policy("cuda"))

    def layer(x, h):
        return (moe.moe_window(x, h, router, gate_up, down, 4, **gate, policy=policy,
                               decode=True),)
    g = torch.Generator().manual_seed(9)
    make = lambda: torch.randn(24, 256, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
    graph = Captured(layer, [make(), make()])
    for _ in range(3):
        x, h = make(), make()
        assert torch.equal(graph(x, h)[0], layer(x, h)[0])
