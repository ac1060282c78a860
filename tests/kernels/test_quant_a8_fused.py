"""Kernels that write int8 activations' Codes for the next projection as they write their rows
(kernels/quant/a8_gated.py's gate/up for dense and routed experts, the decode attention), and
the gate/up GEMV with its activation: each bit for bit against the composition it replaces
(a8_mm or a8_pairs, silu_mul, quantize_rows). Under the interpreter (the "cpu" cases) and on
CUDA (marked gpu)."""
from __future__ import annotations

import pytest
import torch

from conftest import triton_devices
from test_quant_a8 import K, _x
from test_quant_kernels import _weight


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "IQ4_XS", "Q5_0"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_the_fused_gate_up_is_silu_mul_of_the_projection(device, qtype, act, monkeypatch):
    """a8_gate_up_silu: in the GEMV's windows one kernel (a program takes gate columns and
    the same up columns, then act(gate) * up) gives silu_mul of a8_mm's [gate | up], bit for
    bit; and row 0 alone gets its bits among 3, 8 and 20 rows (the 16-row tile: a8_mm, then
    silu_mul)."""
    from strata.kernels.fused_triton import silu_mul
    from strata.kernels.quant import a8_triton
    from strata.kernels.quant.a8_triton import a8_gate_up_silu, a8_mm, quantize_rows
    w, _ = _weight(qtype, 64, 3 * K, device, seed=31)   # three K steps, one part of K
    x = _x(20, 3 * K, device, seed=32)
    c = quantize_rows(x)
    part = w.parts[0]
    fused, real = [], a8_triton.a8_gate_up
    monkeypatch.setattr(a8_triton, "a8_gate_up",
                        lambda *a, **kw: fused.append(1) or real(*a, **kw))
    alone = a8_gate_up_silu(c[:1], part, act, x.dtype)
    for m in (1, 3, 8, 20):
        got = a8_gate_up_silu(c[:m], part, act, x.dtype)
        assert torch.equal(got, silu_mul(a8_mm(c[:m], part, out_dtype=x.dtype), act)), m
        assert torch.equal(got[0], alone[0]), f"row 0 among {m} rows"
    assert len(fused) == 4, "the windows of 1 to 8 rows did not take the fused kernel"
    assert got.shape == (20, 32) and got.abs().max() > 0


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "IQ4_XS"])
@pytest.mark.parametrize("steps", [3, 4])   # K of 768: one part; of 1024: four (k_parts)
def test_the_fused_gate_up_quantizes_its_rows_as_quantize_rows(device, qtype, steps,
                                                               monkeypatch):
    """a8_gate_up_silu(codes=True): the rows act(gate) * up and their Codes for the down
    projection, up to 8 rows in the GEMV's kernel (K in parts: and the kernel adding them),
    with no quantize_rows of its own; the same bits as a8_mm, silu_mul and quantize_rows of
    those rows (codes, pair order, scales, sums) at 1 to 20 rows."""
    from strata.kernels.fused_triton import silu_mul
    from strata.kernels.quant import a8_triton
    from strata.kernels.quant.a8_parts import k_parts
    from strata.kernels.quant.a8_triton import a8_gate_up_silu, a8_mm, quantize_rows
    w, _ = _weight(qtype, 128, steps * K, device, seed=41)   # F = 64: two blocks of 32
    c = quantize_rows(_x(20, steps * K, device, seed=42))
    part = w.parts[0]
    assert k_parts(part.rows, steps * K) == (1 if steps == 3 else 4)
    dtype = c.dx.dtype if device == "cpu" else torch.bfloat16
    calls, real = [], a8_triton.quantize_rows
    monkeypatch.setattr(a8_triton, "quantize_rows",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for m in (1, 3, 8, 20):
        got = a8_gate_up_silu(c[:m], part, "silu", dtype, codes=True)
        rows = silu_mul(a8_mm(c[:m], part, out_dtype=dtype))
        assert torch.equal(got.rows, rows), m
        want = real(rows)
        for name in ("q", "qp", "dx", "qs", "dc"):
            assert torch.equal(getattr(got, name), getattr(want, name)), f"{name}, {m} rows"
        assert got.q.abs().max() == 127
    assert len(calls) == 1, "up to 8 rows the kernels quantize their rows themselves"
    # F = 48 is not whole blocks of 32: the rows alone, as without codes
    w48, _ = _weight(qtype, 96, steps * K, device, seed=43)
    rows = a8_gate_up_silu(c[:3], w48.parts[0], "silu", got.rows.dtype, codes=True)
    assert isinstance(rows, torch.Tensor) and torch.equal(
        rows, a8_gate_up_silu(c[:3], w48.parts[0], "silu", got.rows.dtype))


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("steps", [1, 4])   # K of 256: one part; of 1024: parts (k_parts)
def test_the_experts_gate_up_kernels_are_the_pairs_silu_mul_and_quantize(device, steps):
    """experts_a8 with gate and up in one part (a8_gated's kernels, the act and the rows'
    quantization in them): the same bits as a8_pairs of gate and of up, silu_mul,
    quantize_rows and a8_pairs of down, the composition it replaces."""
    from strata.kernels.fused_triton import silu_mul
    from strata.kernels.moe_triton import experts_a8
    from strata.kernels.quant.a8_gemv import Pairs
    from strata.kernels.quant.a8_triton import a8_pairs, quantize_rows
    from strata.kernels.quant.weight import QuantWeight
    n_exp, f, d, k = 4, 64, steps * K, 2
    gate_up, _ = _weight("Q4_K", 2 * n_exp * f, d, device, seed=51)   # every gate, every up
    down, _ = _weight("Q8_0", n_exp * d, f, device, seed=52)          # [E * D, F]
    assert isinstance(gate_up, QuantWeight) and len(gate_up.parts) == 1
    h = _x(3, d, device, seed=53)
    experts = torch.tensor([[3, 1], [0, 3], [2, 2]], dtype=torch.int32, device=device)
    got = experts_a8(h, experts, gate_up, down, n_exp)
    ids = experts.reshape(-1)
    x = quantize_rows(h)
    gu = torch.empty(3 * k, 2 * f, dtype=h.dtype, device=device)
    a8_pairs(x, gate_up.parts[0], Pairs(ids, k, f, 0, f), gu[:, :f])
    a8_pairs(x, gate_up.parts[0], Pairs(ids, k, f, n_exp * f, f), gu[:, f:])
    want = torch.empty(3 * k, d, dtype=h.dtype, device=device)
    a8_pairs(quantize_rows(silu_mul(gu)), down.parts[0], Pairs(ids, 1, d, 0, d), want)
    assert torch.equal(got, want) and got.abs().max() > 0


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("hd", [64, 48])   # 48: not a power of two, quantized after the kernel
def test_the_attention_kernel_quantizes_its_rows_as_quantize_rows(device, hd):
    """attend_rows_triton(codes=...): the output rows [R, H hd] quantized in the kernel (each
    head's blocks; 4 query heads on 2 kv heads, pad rows included) bit for bit as
    quantize_rows quantizes them after it, and the output itself unchanged."""
    from strata.kernels.attention.decode_triton import attend_rows_triton
    from strata.kernels.quant.a8 import Codes
    from strata.kernels.quant.a8_triton import quantize_rows
    g = torch.Generator().manual_seed(61)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    k, v = (torch.randn(3, 2, 64, hd, generator=g).to(device, dtype) for _ in range(2))
    q = torch.randn(4, 4, hd, generator=g).to(device, dtype)
    slot = torch.tensor([0, 1, 2, 2], device=device)
    length = torch.tensor([5, 64, 0, 17], device=device)   # row 2 a pad row
    codes = Codes.empty(4, 4 * hd, q.device)
    out = attend_rows_triton(q, k, v, slot, length, codes=codes)
    assert torch.equal(out, attend_rows_triton(q, k, v, slot, length))
    want = quantize_rows(out.view(4, -1))
    for name in ("q", "qp", "dx", "qs", "dc"):
        assert torch.equal(getattr(codes, name), getattr(want, name)), name
    assert codes.q[2].abs().max() == 0 and codes.q.abs().max() == 127


@pytest.mark.parametrize("device", triton_devices())
def test_the_last_program_adds_the_parts_as_the_kernels_after_it_would(device, monkeypatch):
    """K in parts: the tile's last program adds them (kernels/arrive.py) in the GEMV, the
    MMA, the gate/up kernel with its codes and the experts' pairs, bit for bit as
    _add_parts_kernel and _add_gated_parts_kernel do after the launch where there are no
    counters (during a CUDA graph capture before any exist)."""
    from strata.kernels import arrive
    from strata.kernels.moe_triton import experts_a8
    from strata.kernels.quant import a8_gated, a8_gemv, a8_mma, a8_parts
    from strata.kernels.quant.a8_triton import a8_gate_up_silu, a8_mm, quantize_rows
    from strata.kernels.quant.weight import QuantWeight
    w, _ = _weight("Q4_K", 64, 4 * K, device, seed=71)               # four parts of K
    gate_up, _ = _weight("Q4_K", 2 * 4 * 32, 4 * K, device, seed=72)  # 4 experts, F 32
    down, _ = _weight("Q8_0", 4 * 4 * K, 32, device, seed=73)
    assert isinstance(gate_up, QuantWeight) and a8_parts.k_parts(256, 4 * K) == 4
    x = _x(16, 4 * K, device, seed=74)
    c, res = quantize_rows(x), _x(16, 64, device, seed=75)
    experts = torch.tensor([[3, 1], [0, 3], [2, 2]], dtype=torch.int32, device=device)
    dtype = x.dtype if device == "cpu" else torch.bfloat16

    def outputs() -> list[torch.Tensor]:
        codes = a8_gate_up_silu(c[:3], w.parts[0], "silu", dtype, codes=True)
        return [a8_mm(c[:1], w.parts[0], res[:1]), a8_mm(c[:8], w.parts[0], res[:8]),
                a8_mm(c, w.parts[0], res), codes.rows, codes.q, codes.dx, codes.qs, codes.dc,
                experts_a8(x[:3].to(dtype), experts, gate_up, down, 4)]
    seen = []
    for module in (a8_gemv, a8_gated, a8_mma):
        real = module.counters
        monkeypatch.setattr(module, "counters",
                            lambda *a, real=real: seen.append(1) or real(*a))
    fixed = outputs()
    assert seen and not arrive.counters(torch.device(device), 1).any()
    for module in (a8_gemv, a8_gated, a8_mma):
        monkeypatch.setattr(module, "counters", lambda *a: None)
    added = outputs()
    for i, (one, other) in enumerate(zip(fixed, added)):
        assert torch.equal(one, other), i
    assert fixed[2].abs().max() > 0 and fixed[-1].abs().max() > 0
