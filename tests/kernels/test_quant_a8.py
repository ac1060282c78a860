"""Int8 activations against quantized weights (kernels/quant/a8.py, a8_triton.py): the
row quantizer against its plain-torch twin, the kernels against the exact integer block sums
in float64 and against gguf-py's weights times the rows, and a row's bits alone, in the GEMV
tiles (1, 2, 4 rows) and among others in the MMA tiles (16 to 64 rows) with torch.equal.
Under the interpreter (the "cpu" cases) and on CUDA (marked gpu)."""
from __future__ import annotations

import pytest
import torch

from strata.kernels.quant.a8 import a8_mm_reference, quantize_rows_torch
from strata.kernels.quant.weight import KERNEL_TYPES, Part
from conftest import triton_devices
from test_quant_kernels import _weight
from test_moe_stage import moe_file  # noqa: F401 (a fixture)
from test_quant_stage import mixed  # noqa: F401 (a fixture)

TYPES = KERNEL_TYPES
K = 256   # one K-quant super-block: a few programs under the interpreter


def _x(rows: int, k: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, 5] *= 30.0                      # an outlier column, as real activations have
    return x.to(device, torch.float32 if device == "cpu" else torch.bfloat16)


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("supers", [2, 3])   # rows of 2 and 3 chunks: K a power of two or not
def test_rows_quantize_as_the_plain_torch_twin(device, norm, supers):
    from strata.kernels.quant.a8_triton import quantize_rows
    k = supers * K
    x = _x(5, k, device)
    g = torch.rand(k, generator=torch.Generator().manual_seed(1)).to(x) + 0.5
    c = quantize_rows(x, g if norm else None, 1e-5)
    q, dx = c.q, c.dx
    q_ref, dx_ref = quantize_rows_torch(x, g if norm else None, 1e-5)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-6, atol=0)
    # codes may differ by one where y / dx lies within rounding of a half
    assert (q.int() - q_ref.int()).abs().max() <= 1
    assert (q != q_ref).float().mean() < 0.01
    assert q.abs().max() == 127                 # each block's largest value takes the end code
    # a row alone gives the same codes and scales
    # the sums of each 16 codes, exact; the codes in pair order (0, 2, 4, 6, 1, 3, 5, 7)
    assert torch.equal(c.qs.cpu(), q.cpu().view(5, k // 16, 16).int().sum(-1, dtype=torch.int32))
    assert torch.equal(c.qp, q.view(5, k // 8, 4, 2).transpose(2, 3).reshape(5, k))
    # a row alone gives the same codes, scales and sums
    one = quantize_rows(x[3:4].contiguous(), g if norm else None, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip((one.q, one.dx, one.qs, one.qp, one.dc),
                                                 (q[3:4], dx[3:4], c.qs[3:4], c.qp[3:4],
                                                  c.dc[3:4])))


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("qtype", TYPES)
def test_the_kernel_is_the_integer_block_sums(device, qtype):
    """Against a8_mm_reference on the same codes (float64 terms: only the fp32 rounding of
    the kernel's sums differs), and against gguf-py's weights times the unquantized rows
    (what int8 activations change: a small relative error)."""
    from strata.kernels.quant.a8_triton import a8_mm, quantize_rows
    w, w_ref = _weight(qtype, 48, K, device, seed=3)
    x = _x(6, K, device, seed=2)
    c = quantize_rows(x)
    part = w.parts[0]
    want = a8_mm_reference(c.q.cpu(), c.dx.cpu(), Part(
        qtype, part.rows, part.cols, {k: v.cpu() for k, v in part.planes.items()}))
    for tile in (4, 16):                          # the GEMV over row blocks, and the MMA
        out = a8_mm(c, part, block_m=tile).double().cpu()
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    exact = x.double().cpu() @ w_ref.T
    err = (want - exact).abs().max() / exact.abs().max()
    assert err < 0.03, f"{qtype}: int8 activations moved the product by {err:.3%}"


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("qtype", TYPES)
def test_the_mma_dots_give_the_same_bits(device, qtype):
    """The MMA tiles' ways to the groups' integer sums (a8_mm's `dot`: batched, Q6_K's groups
    in pairs; block-diagonal; a dot a group, its terms picked from the step's, loaded by
    themselves, or the step's sums joined): the same bits, with a residual, in tiles of 16 and
    32 rows, at K steps of 256 and 64 (Q6_K: 16 and 4 groups a step), near the exact sums; and
    a dot a group with the scales loaded a step ahead (a8_mm's ahead)."""
    from strata.kernels.quant.a8_triton import a8_mm, quantize_rows
    w, _ = _weight(qtype, 32, K, device, seed=7)
    x, res = _x(20, K, device, seed=8), _x(20, 32, device, seed=9)
    c = quantize_rows(x)
    part = w.parts[0]
    for tile, step in ((16, 256), (32, 64)):
        want = a8_mm(c, part, res, block_m=tile, block_n=32, block_k=step, dot="diagonal")
        for dot, ahead in (("batched", False), ("groups", False), ("groups", True),
                           ("direct", False), ("joined", False)):
            got = a8_mm(c, part, res, block_m=tile, block_n=32, block_k=step, dot=dot,
                        ahead=ahead)
            assert torch.equal(got, want), f"{dot} (ahead {ahead}): {tile} rows, steps of {step}"
    exact = a8_mm_reference(c.q.cpu(), c.dx.cpu(), Part(
        qtype, part.rows, part.cols, {k: v.cpu() for k, v in part.planes.items()}))
    torch.testing.assert_close((got - res.float()).double().cpu(), exact, rtol=1e-5,
                               atol=2e-2 * exact.abs().max().item() if device != "cpu" else
                               1e-6 * exact.abs().max().item())


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0", "IQ4_XS"])
def test_a_rows_bits_are_the_same_in_every_tile(device, qtype):
    """Row 0 alone (GEMV tiles 1, 2 and 4), among 4 and 24 rows, over GEMV blocks of 4 and 8
    rows, MMA blocks of 16 and in one tile of 32 or 64 rows: the same bits, with a residual
    added."""
    from strata.kernels.quant.a8_triton import a8_mm, quantize_rows
    w, _ = _weight(qtype, 32, K, device, seed=5)
    x = _x(24, K, device, seed=4)
    res = _x(24, 32, device, seed=6)
    c = quantize_rows(x)
    part = w.parts[0]
    outs = [a8_mm(c[:1], part, res[:1], block_m=t) for t in (1, 2, 4)]
    outs += [a8_mm(c[:4], part, res[:4], block_m=4)]
    outs += [a8_mm(c, part, res, block_m=t) for t in (4, 8, 16, 32, 64)]
    for out in outs[1:]:
        assert torch.equal(out[0], outs[0][0])
    for out in outs[5:]:
        assert torch.equal(out, outs[4]), "rows differ between row tiles"


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("qtype", TYPES)
def test_a_rows_bits_are_the_same_alone_and_among_1_to_63_others(device, qtype):
    """Row 0 alone and in windows of 2 to 64 rows at a8_mm's own choice of kernel and tile
    (a8_row_tile: every switch point of GEMV tiles 1, 2, 4, 8 and MMA tiles 16, 32, 64, and a
    size on either side of it): the same bits, with a residual added."""
    from strata.kernels.quant.a8_triton import a8_mm, a8_row_tile, quantize_rows
    w, _ = _weight(qtype, 32, K, device, seed=21)
    x, res = _x(64, K, device, seed=22), _x(64, 32, device, seed=23)
    c = quantize_rows(x)
    alone = a8_mm(c[:1], w.parts[0], res[:1])
    sizes = (2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64)
    assert {a8_row_tile(m) for m in (1, *sizes)} == {1, 2, 4, 8, 16, 32, 64}
    for m in sizes:
        got = a8_mm(c[:m], w.parts[0], res[:m])
        assert torch.equal(got[0], alone[0]), f"{qtype}: row 0 among {m} rows"


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_1", "Q8_0", "IQ4_XS"])
def test_a_rows_bits_are_the_same_in_every_tile_when_k_has_parts(device, qtype):
    """K = 1024: four parts of K, each summed alone, then in order. Row 0 alone in the GEMV,
    among 20 rows in the 8-row GEMV and in the MMA tiles (every dot): the same bits, near
    the exact block sums; and the parts are the weight's (one part gives other sums)."""
    from strata.kernels.quant.a8_parts import k_parts
    from strata.kernels.quant.a8_triton import a8_mm, quantize_rows
    # llama3-8b's down, o and qkv, and gate_up (wide enough alone); K's steps cut evenly
    assert [k_parts(n, k) for n, k in ((4096, 14336), (4096, 4096), (6144, 4096),
                                       (28672, 4096))] == [8, 8, 4, 1]
    assert [k_parts(16, k) for k in (1024, 3584, 576)] == [4, 2, 1]
    k = 4 * K
    w, _ = _weight(qtype, 16, k, device, seed=11)
    x, res = _x(20, k, device, seed=12), _x(20, 16, device, seed=13)
    c = quantize_rows(x)
    part = w.parts[0]
    alone = a8_mm(c[:1], part, res[:1], block_m=1)
    outs = [a8_mm(c, part, res, block_m=8), a8_mm(c, part, res, block_m=16),
            a8_mm(c, part, res, block_m=16, dot="diagonal"),
            a8_mm(c, part, res, block_m=32, dot="groups"),
            a8_mm(c, part, res, block_m=32, dot="groups", ahead=True)]
    for out in outs:
        assert torch.equal(out[0], alone[0])
        assert torch.equal(out, outs[0]), "rows differ between row tiles"
    want = a8_mm_reference(c.q.cpu(), c.dx.cpu(), Part(
        qtype, part.rows, part.cols, {n: v.cpu() for n, v in part.planes.items()}))
    got = outs[0] - res.float()
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5,
                               atol=2e-2 * want.abs().max().item() if device != "cpu" else
                               1e-6 * want.abs().max().item())
    one = a8_mm(c[:1], part, res[:1], block_m=1, parts=1)
    assert not torch.equal(one, alone), "the parts changed nothing: are they summed?"


@pytest.mark.parametrize("device", triton_devices())
def test_the_gemv_takes_short_steps_where_k_is_not_whole_256s(device):
    """K = 96: the dp4a GEMV steps 32 quants at a time (a group a step), and still adds the
    same terms in the same order as the MMA; a nibble type, two planes, a codebook."""
    from strata.kernels.quant.a8_parts import gemv_step
    from strata.kernels.quant.a8_triton import a8_mm, quantize_rows
    assert gemv_step(96) == 32 and gemv_step(576) == 64 and gemv_step(4096) == 256
    x = _x(3, 96, device, seed=7)
    c = quantize_rows(x)
    for qtype in ("Q4_1", "Q8_0", "IQ4_NL"):
        w, _ = _weight(qtype, 24, 96, device, seed=8)
        part = w.parts[0]
        gemv = a8_mm(c, part, block_m=4)
        assert torch.equal(gemv, a8_mm(c, part, block_m=16)), qtype
        want = a8_mm_reference(c.q.cpu(), c.dx.cpu(), Part(
            qtype, part.rows, part.cols, {k: v.cpu() for k, v in part.planes.items()}))
        torch.testing.assert_close(gemv.double().cpu(), want, rtol=1e-5,
                                   atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("device", triton_devices())
def test_shapes_the_kernel_does_not_take_are_refused(device, monkeypatch):
    from strata.kernels.quant.a8_triton import a8_mm, quantize_rows
    with pytest.raises(ValueError, match="not whole blocks of 32"):
        quantize_rows(torch.zeros(2, 48, device=device))
    w, _ = _weight("Q4_0", 16, 64, device)
    c = quantize_rows(torch.zeros(2, 128, device=device))
    with pytest.raises(ValueError, match="do not fit"):
        a8_mm(c, w.parts[0])                  # K 128 against the weight's 64
    monkeypatch.setenv("STRATA_A8_DOT", "fast")
    with pytest.raises(ValueError, match="STRATA_A8_DOT='fast' is no way .* triton, gluon or ring"):
        a8_mm(quantize_rows(torch.zeros(2, 64, device=device)), w.parts[0])


def _int8_stage(mixed, device: str):
    import dataclasses

    from strata.stage_worker.model import StageModel
    from test_quant_stage import CTX, SHAPE, _mode, _policy
    policy = dataclasses.replace(_policy(device), int8_activations=True)
    return StageModel(mixed, 0, SHAPE.n_layers, ctx=CTX, device=device, weights=_mode(device),
                      policy=policy)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_int8_stages_rows_are_invariant(mixed):
    """A Q4_K_M stage (q, k in Q4_K beside v in Q6_K, a Q6_K head) with int8 activations: the
    target rows alone and among 8, 16, 32 and 64 rows, hidden states, logits, sampled tokens
    and KV, the same bits. (Under the interpreter the test below takes a row through the
    same tiles: the GEMV's 1 to 8 rows and the MMA's 64.)"""
    from test_quant_stage import assert_stage_rows_invariant
    assert_stage_rows_invariant(_int8_stage(mixed, "cuda"), "cuda")


@pytest.mark.parametrize("device", triton_devices())
def test_a_lone_rows_gemv_windows_give_its_bits_among_others(mixed, device):
    """Slot 0's row alone in windows of 1, 2 and 4 rows (the dp4a GEMV's tiles) and among 8
    and 40 rows (the MMA's 16- and 64-row tiles): the same hidden state, logits, sampled
    token and KV; on CUDA eagerly and replayed from a CUDA graph a window size."""
    from strata.stage_worker.model import KVCache
    from strata.stage_worker.runner import WindowRunner
    from test_batch_invariance import _prefill, _same, _stage_outputs
    from test_quant_stage import CTX
    model = _int8_stage(mixed, device)
    target, pad = (0, 48, 11), (-1, 0, 0)
    others = [(s, p, (7 * s + p) % model.cfg.vocab) for s in range(1, 8) for p in range(40, 46)]
    windows = [([target], 0), ([target, pad], 0), ([target] + [pad] * 3, 0),
               (others[:3] + [target] + others[3:7], 3), (others[:13] + [target] + others[13:39], 13)]
    for graphed in (False, True) if device != "cpu" else (False,):
        cache = KVCache(len(model.layers), 8, model.cfg, CTX, model.device, model.dtype)
        runner = WindowRunner(model, cache, 16) if graphed else None
        with torch.inference_mode():
            _prefill(model, cache, runner)
            outs = []
            for rows, at in windows:
                outs.append(_stage_outputs(model, cache, rows, [at], runner))
                _same(outs, len(rows))


@pytest.mark.parametrize("device", triton_devices())
def test_an_int8_stages_logits_are_near_the_widened_files(mixed, device, monkeypatch):
    """Decode rows with int8 activations against the same file widened (a 48-token prompt
    chunk, then 16 rows): within what quantizing the rows changes (about 1% here), every
    projection of the decode window through the int8 kernel."""
    from strata.kernels.quant import a8_triton
    from test_quant_stage import assert_packed_is_widened, widened
    parts = []
    a8_mm = a8_triton.a8_mm
    monkeypatch.setattr(a8_triton, "a8_mm",
                        lambda x, part, *a, **k: parts.append(part.qtype) or
                        a8_mm(x, part, *a, **k))
    assert_packed_is_widened([_int8_stage(mixed, device), widened(mixed, device)], device,
                             tol=0.05)
    # 2 layers: qkv (Q4_K; Q4_K and Q6_K), o, gate_up, down; on CUDA the head too (fp32
    # hidden states on the CPU take its dense matmul)
    assert len(parts) == 9 + (device != "cpu") and "Q6_K" in parts, parts


@pytest.mark.parametrize("device", triton_devices())
def test_an_expert_pair_is_a_gemv_of_its_own(device):
    """a8_pairs: each (row, expert) pair's output is a8_mm's GEMV of that row against that
    expert's rows alone, the same bits, whichever pairs share the call; a pair's row from its
    index (row p // per) and its rows from its expert (ids[p] * erows + w0)."""
    from strata.kernels.quant.a8_gemv import Pairs
    from strata.kernels.quant.a8_triton import a8_mm, a8_pairs, quantize_rows
    experts, f = 4, 32
    w, _ = _weight("Q4_K", experts * f + 16, K, device, seed=7)
    part = w.parts[0]
    x = _x(3, K, device, seed=8)
    c = quantize_rows(x)
    chosen = torch.tensor([3, 1, 1, 0, 2, 3], dtype=torch.int32, device=device)  # 2 a row
    out = torch.empty(6, f, device=device, dtype=x.dtype)
    a8_pairs(c, part, Pairs(chosen, 2, f, 16, f), out)   # expert e: rows 16 + e f ..

    def alone(r: int, e: int) -> torch.Tensor:
        rows = slice(16 + e * f, 16 + (e + 1) * f)
        one = Part("Q4_K", f, K, {k: v[rows].contiguous() for k, v in part.planes.items()})
        return a8_mm(c[r:r + 1], one, block_m=1, out_dtype=x.dtype)[0]
    for p, e in enumerate(chosen.tolist()):
        assert torch.equal(out[p], alone(p // 2, e))
    again = torch.empty(1, f, device=device, dtype=x.dtype)   # a pair alone in its call
    a8_pairs(c[2:3], part, Pairs(chosen[4:5], 1, f, 16, f), again)
    assert torch.equal(again[0], out[4])


def _int8_moe_stage(moe_file, device: str):
    import dataclasses

    from strata.kernels.policy import KernelPolicy
    from strata.stage_worker.model import StageModel
    from test_moe_stage import CTX, _mode
    policy = dataclasses.replace(KernelPolicy.for_device(device), int8_activations=True)
    return StageModel(moe_file, 0, moe_file.config.n_layers, ctx=CTX, device=device,
                      weights=_mode(device), policy=policy)


@pytest.mark.parametrize("device", triton_devices())
def test_an_int8_moe_stage(moe_file, device, monkeypatch):
    """A packed MoE stage with int8 activations (its experts as each pair's GEMVs): its logits
    near the widened file's (within 8%), every routed layer's experts through a8_gated's
    gate/up kernel and a8_pairs' down, and the target rows alone and among 16 rows the same
    bits (among 8 to 64 on CUDA; each pair's kernels are the same at any window size, the
    dense projections' tiles are the dense stage's tests)."""
    from strata.kernels.quant import a8_gated, a8_triton
    from test_moe_stage import _interpreter_skips
    from test_quant_stage import assert_packed_is_widened, assert_stage_rows_invariant, widened
    _interpreter_skips(moe_file, device)
    calls = []
    a8_pairs, a8_gate_up = a8_triton.a8_pairs, a8_gated.a8_gate_up
    monkeypatch.setattr(a8_triton, "a8_pairs",
                        lambda *a, **k: calls.append("down") or a8_pairs(*a, **k))
    monkeypatch.setattr(a8_gated, "a8_gate_up",
                        lambda *a, **k: calls.append("gate_up") or a8_gate_up(*a, **k))
    # (about 5% on these 64-wide random rows: the dense projections' share, the experts'
    # int8 adds next to nothing to it)
    assert_packed_is_widened([_int8_moe_stage(moe_file, device), widened(moe_file, device)],
                             device, tol=0.08)
    cfg = moe_file.config
    assert calls == ["gate_up", "down"] * (cfg.n_layers - cfg.n_dense_first)
    assert_stage_rows_invariant(_int8_moe_stage(moe_file, device), device,
                                sizes=(1, 16) if device == "cpu" else None)
