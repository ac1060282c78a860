"""The GEMV a thread a column (kernels/quant/a8_gemv1.py), its five types: a row's bits are
a8_mm's default GEMV's, alone and in a window of rows (a program a row), with K in one part or
several (added by the last program, or after the launch where there are no counters), with and
without the residual; a8_mm takes it only where asked. Under the interpreter (the "cpu" cases)
and on CUDA (marked gpu)."""
from __future__ import annotations

import pytest
import torch

from conftest import triton_devices
import test_quant_a8
from test_quant_a8 import K, _x
from test_quant_kernels import _weight
from test_quant_stage import mixed  # noqa: F401 (a fixture)


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("qtype, rows, supers, most, parts", [
    ("Q4_K", 160, 1, 8, 1), ("Q4_K", 16, 4, 8, 4), ("Q4_K", 16, 4, 1, 1), ("Q6_K", 160, 1, 8, 1),
    *((q, 16, 4, 2, 2) for q in ("Q4_K", "Q6_K", "Q5_K", "Q8_0", "IQ4_XS"))])
def test_one_row_has_the_gemvs_bits(device, qtype, rows, supers, most, parts, monkeypatch):
    """most: a8_mm's `parts` (k_parts' most), so a part holds 1 to 4 super-blocks."""
    from strata.kernels.quant.a8_gemv1 import a8_gemv1
    from strata.kernels.quant.a8_parts import k_parts
    from strata.kernels.quant.a8_triton import a8_mm, quantize_rows
    monkeypatch.delenv("STRATA_A8_GEMV1", raising=False)   # the reference: a8_gemv's
    k = supers * K
    assert k_parts(rows, k, most) == parts
    w, _ = _weight(qtype, rows, k, device, seed=21)
    part = w.parts[0]
    x, res = _x(3, k, device, seed=22), _x(3, rows, device, seed=23)
    c = quantize_rows(x)[1:2]   # a row of a window: its own planes, as a stage passes them
    for r in (None, res[1:2]):
        want = a8_mm(c, part, r, block_m=1, parts=most)
        out = torch.empty_like(want)
        got = a8_gemv1(c, part, r, out, block_n=32, warps=1, parts=most)
        assert torch.equal(got, want), (qtype, rows, k, most, r is not None)
    if parts > 1:   # the parts added after the launch where there are no counters
        monkeypatch.setattr("strata.kernels.quant.a8_gemv1.counters", lambda *a: None)
        out = torch.empty_like(want)
        assert torch.equal(a8_gemv1(c, part, res[1:2], out, block_n=32, warps=1, parts=most),
                           a8_mm(c, part, res[1:2], block_m=1, parts=most))


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("qtype", ["IQ4_XS"])
def test_a_window_of_rows_has_each_rows_bits(device, qtype, monkeypatch):
    """3 rows, in one program (a fourth masked) and a program each, K in 2 parts: each row's
    bits are its own alone, and a8_gemv's 4-row tile's."""
    from strata.kernels.quant.a8_gemv1 import a8_gemv1
    from strata.kernels.quant.a8_triton import a8_mm, quantize_rows
    monkeypatch.delenv("STRATA_A8_GEMV1", raising=False)
    w, _ = _weight(qtype, 16, 4 * K, device, seed=27)
    part = w.parts[0]
    c = quantize_rows(_x(3, 4 * K, device, seed=28))
    res = _x(3, 16, device, seed=29)
    got = a8_gemv1(c, part, res, torch.empty(3, 16, device=c.q.device), block_n=32, warps=1,
                   parts=2)
    assert torch.equal(got, a8_mm(c, part, res, block_m=4, parts=2))
    assert torch.equal(got, a8_gemv1(c, part, res, torch.empty_like(got), block_n=32, warps=1,
                                     parts=2, rows=1))
    for i in range(3):
        assert torch.equal(got[i:i + 1], a8_mm(c[i:i + 1], part, res[i:i + 1], block_m=1,
                                               parts=2)), i


@pytest.mark.parametrize("device", triton_devices())
def test_a8_mm_takes_it_where_asked(device, monkeypatch):
    """STRATA_A8_GEMV1=1: a8_mm's 1-row windows of a Q4_K weight take it (the same bits, and
    its kernel ran); unset, or another type, or more rows: a8_gemv's. =2: 2-row windows too
    (a8_gemv's bits, row by row); a value that is no count: a sentence."""
    from strata.kernels.quant import a8_gemv1, a8_triton
    from strata.kernels.quant.a8_triton import a8_mm, quantize_rows
    monkeypatch.delenv("STRATA_A8_GEMV1", raising=False)
    calls = []
    real = a8_gemv1.a8_gemv1
    monkeypatch.setattr(a8_gemv1, "a8_gemv1", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    w, _ = _weight("Q4_K", 64, K, device, seed=24)
    c = quantize_rows(_x(2, K, device, seed=25))
    plain = a8_mm(c[:1], w.parts[0])
    pair = a8_mm(c, w.parts[0])
    monkeypatch.setenv("STRATA_A8_GEMV1", "1")
    assert torch.equal(a8_mm(c[:1], w.parts[0]), plain) and calls == [1]
    a8_mm(c, w.parts[0])                                           # 2 rows: the GEMV's
    q4, _ = _weight("Q4_0", 64, K, device, seed=26)
    a8_mm(c[:1], q4.parts[0])                                      # another type
    assert calls == [1]
    assert a8_triton.a8_gemv1.gemv1_fits(w.parts[0], 1, K)
    monkeypatch.setenv("STRATA_A8_GEMV1", "2")                     # windows of up to 2 rows
    assert torch.equal(a8_mm(c, w.parts[0]), pair) and calls == [1, 1]
    monkeypatch.setenv("STRATA_A8_GEMV1", "yes")
    with pytest.raises(ValueError, match="a count of rows from 0 to 8"):
        a8_mm(c, w.parts[0])


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("qtype", ["Q4_K"])
def test_the_group_major_plane_gives_the_same_bits(device, qtype):
    """The qs plane laid out a group before the next (group_major), read in its place: the
    row-major plane's bits, 2 rows, K in 2 parts (every type of it reads the plane alike)."""
    from strata.kernels.quant.a8_gemv1 import a8_gemv1, group_major
    from strata.kernels.quant.a8_triton import quantize_rows
    w, _ = _weight(qtype, 48, 4 * K, device, seed=35)
    part = w.parts[0]
    qs = group_major(part)
    assert qs.shape == (4 * K // 32, 48, 4) and torch.equal(qs[3, 5], part.planes["qs"][5, 12:16])
    c = quantize_rows(_x(2, 4 * K, device, seed=36))
    want = a8_gemv1(c, part, None, torch.empty(2, 48, device=c.q.device), block_n=32, warps=1,
                    parts=2)
    got = a8_gemv1(c, part, None, torch.empty_like(want), block_n=32, warps=1, parts=2, qs=qs)
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", triton_devices())
def test_the_gated_half_of_two_rows(device, monkeypatch):
    """[gate | up] of a window of 2 rows (one program, with codes): a8_gated's bits."""
    from strata.kernels.quant.a8_triton import a8_gate_up_silu, quantize_rows
    monkeypatch.delenv("STRATA_A8_GEMV1", raising=False)
    x = quantize_rows(_x(2, K, device, seed=33))
    w, _ = _weight("Q5_K", 256, K, device, seed=34)
    want = a8_gate_up_silu(x, w.parts[0], "silu", torch.bfloat16, codes=True)
    monkeypatch.setenv("STRATA_A8_GEMV1", "2")
    got = a8_gate_up_silu(x, w.parts[0], "silu", torch.bfloat16, codes=True)
    assert all(torch.equal(a, b) for a, b in zip(
        (got.rows, got.q, got.qp, got.dx, got.qs, got.dc),
        (want.rows, want.q, want.qp, want.dx, want.qs, want.dc)))


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("qtype, act", [("Q4_K", "silu"), ("Q4_K", "gelu_tanh"),
                                        ("Q6_K", "silu"), ("Q5_K", "silu"), ("Q8_0", "silu"),
                                        ("IQ4_XS", "silu")])
def test_the_gated_half_has_a8_gate_up_silus_bits(device, qtype, act, monkeypatch):
    """[gate | up] of one row: act(gate) * up and, where asked, its rows quantized for the
    down projection: the bits of a8_gate_up_silu's default (a8_gated.py's kernel), and with
    STRATA_A8_GEMV1=1 a8_gate_up_silu takes it (with codes only where the halves are whole
    blocks of 128 columns)."""
    from strata.kernels.quant import a8_gemv1
    from strata.kernels.quant.a8_triton import a8_gate_up_silu, quantize_rows
    monkeypatch.delenv("STRATA_A8_GEMV1", raising=False)   # the reference: a8_gated's
    x = quantize_rows(_x(1, K, device, seed=31))
    for f in (128, 96):
        w, _ = _weight(qtype, 2 * f, K, device, seed=32)
        part = w.parts[0]
        want = a8_gate_up_silu(x, part, act, torch.bfloat16, codes=True)
        got_codes = a8_gemv1.Codes.empty(1, f, x.q.device) if f % 128 == 0 else None
        got = a8_gemv1.a8_gemv1_gated(x, part, act, torch.empty_like(want.rows), got_codes)
        assert torch.equal(got, want.rows), (act, f)
        if got_codes is not None:
            assert all(torch.equal(a, b) for a, b in zip(
                (got_codes.q, got_codes.qp, got_codes.dx, got_codes.qs, got_codes.dc),
                (want.q, want.qp, want.dx, want.qs, want.dc))), (act, f)
        calls = []
        real = a8_gemv1.a8_gemv1_gated
        monkeypatch.setattr(a8_gemv1, "a8_gemv1_gated",
                            lambda *a, **kw: calls.append(a[4] is not None) or real(*a, **kw))
        monkeypatch.setenv("STRATA_A8_GEMV1", "1")
        again = a8_gate_up_silu(x, part, act, torch.bfloat16, codes=True)
        assert torch.equal(again.rows, want.rows) and torch.equal(again.q, want.q)
        assert calls == ([True] if f % 128 == 0 else [])   # 96: a8_gated's
        monkeypatch.undo()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_XS"])
def test_with_it_a_row_is_the_same_alone_and_among_1_to_63_others(qtype, monkeypatch):
    """STRATA_A8_GEMV1=8: windows of 1 to 8 rows take it, the larger ones the MMA tiles; a
    row's bits are the same at every switch point."""
    monkeypatch.setenv("STRATA_A8_GEMV1", "8")
    test_quant_a8.test_a_rows_bits_are_the_same_alone_and_among_1_to_63_others("cuda", qtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_int8_stage_has_the_same_bits_with_it(mixed, monkeypatch):  # noqa: F811
    """A Q4_K_M stage with int8 activations (Q4_K and Q6_K projections, a Q6_K head), eager on
    CUDA: the target rows alone (a 5-row window) and among 8, 16 and 64 rows, hidden states,
    logits, sampled tokens and KV, the same bits with STRATA_A8_GEMV1=8 as without it."""
    from strata.stage_worker.model import KVCache
    from test_batch_invariance import _decode_windows, _prefill, _same, _stage_outputs
    from test_quant_a8 import _int8_stage
    from test_quant_stage import CTX
    model = _int8_stage(mixed, "cuda")
    runs = []
    for asked in ("0", "8"):
        monkeypatch.setenv("STRATA_A8_GEMV1", asked)
        cache = KVCache(len(model.layers), 8, model.cfg, CTX, model.device, model.dtype)
        outs = []
        with torch.inference_mode():
            _prefill(model, cache)
            for rows, at in _decode_windows(model.cfg.vocab, (1, 8, 16, 64)):
                outs.append(_stage_outputs(model, cache, rows, at))
                _same(outs, len(rows))
        runs.append(outs)
    for (rows, _), without, with_it in zip(_decode_windows(model.cfg.vocab, (1, 8, 16, 64)),
                                           *runs):
        assert all(torch.equal(a, b) for a, b in zip(without, with_it)), len(rows)
