"""The decode-window projections (kernels/skinny_triton.py, dispatched by fused.linear_rows,
norm_linear_rows and norm_gate_up_silu): their references on CUDA and under Triton's
interpreter, each row's bits independent of the other rows of its window, the residual, norm,
and SiLU folded in, and cuBLAS kept where it should be."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import fused
from strata.kernels.policy import MAX_DECODE_ROWS, KernelPolicy
from conftest import triton_devices

BLOCKS = {"block_n": 32, "block_k": 64, "stages": 2, "warps": 4}  # small shapes for the interpreter


def _call(f, *args, **kwargs):
    try:
        return f(*args, **kwargs)
    except Exception as e:  # triton's interpreter vs a numpy it does not support yet
        if "0-dimensional" in str(e):
            pytest.skip(f"triton's interpreter fails with this numpy: {e}")
        raise


def _interpreting() -> bool:
    return KernelPolicy.for_device("cpu").triton


def _skinny():
    return pytest.importorskip("strata.kernels.skinny_triton")


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("residual", [False, True])
def test_skinny_matches_reference_and_rows_are_independent(device, residual):
    sk = _skinny()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # interpreter: fp32 only
    g = torch.Generator().manual_seed(3)
    n, k = 96, 256
    w = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype)
    x = torch.randn(8, k, generator=g).to(device, dtype)
    res = torch.randn(8, n, generator=g).to(device, dtype) if residual else None
    try:
        got = sk.skinny_mm(x, w, res, **BLOCKS)
    except Exception as e:  # triton's interpreter vs a numpy it does not support yet
        if "0-dimensional" in str(e):
            pytest.skip(f"triton's interpreter fails with this numpy: {e}")
        raise
    want = fused.skinny_mm_torch(x, w, res)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # row 2 beside other rows, alone (1 row) and in a full window of 16: the same bits
    other = torch.randn(16, k, generator=g).to(device, dtype)
    other[2] = x[2]
    res16 = None if res is None else torch.cat([res, res])
    for rows, r in ((x[2:3], None if res is None else res[2:3]), (other, res16)):
        out = sk.skinny_mm(rows, w, r, **BLOCKS)
        assert torch.equal(out[0 if rows.shape[0] == 1 else 2], got[2])


def test_skinny_refuses_what_its_blocks_do_not_fit():
    sk = _skinny()
    assert sk.MAX_ROWS == MAX_DECODE_ROWS and sk.ROW_TILES == KernelPolicy(True).row_tiles
    assert [sk.row_tile(m) for m in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    w, x = torch.zeros(96, 256), torch.zeros(65, 256)
    with pytest.raises(ValueError, match="do not fit blocks"):
        sk.skinny_mm(x, w, **BLOCKS)            # 65 rows
    with pytest.raises(ValueError, match="do not fit blocks"):
        sk.skinny_mm(x[:8], w[:90], **BLOCKS)   # 90 columns, blocks of 32
    with pytest.raises(ValueError, match="do not fit blocks"):
        sk.skinny_mm(x[:8], w, block_m=8, **BLOCKS)   # not a row tile
    # deeper pipelines than fit in shared memory are cut, never the blocks
    assert sk.fit_stages(4, 16, 64, 256) == 4 and sk.fit_stages(4, 64, 64, 256) == 3


def test_linear_rows_picks_by_shape_and_keeps_cublas_off_cuda():
    # the weight's shape alone picks the blocks along N and K: llama3-8b's, SmolLM2's and the
    # tiny model's projections all take the skinny kernels
    blocks = KernelPolicy(triton=True).skinny_blocks
    assert blocks(6144, 4096, "qkv")["block_n"] == 64
    assert blocks(28672, 4096, "gate_up")["block_k"] == 64   # 64 gate + 64 up
    assert blocks(28672, 4096)["block_n"] == 128             # plain, unfolded
    assert blocks(4096, 14336, "res")["block_k"] == 256
    assert blocks(128256, 4096, "head")["block_n"] == 128   # llama3's head
    assert blocks(960, 576, "qkv")["block_k"] == 64 and blocks(49152, 576, "head")
    assert blocks(128, 64, "qkv") and blocks(256, 64, "gate_up") and blocks(320, 64, "head")
    assert blocks(4100, 14336, "res") is None   # no block divides 4100
    # the row tile follows the window; a prompt chunk never takes the skinny kernel
    policy = KernelPolicy(triton=True)
    w = torch.zeros(4096, 4096)
    tiles = [policy.skinny(torch.zeros(m, 4096), w, "res", decode=True)["block_m"]
             for m in (8, 16, 24, 64)]
    assert tiles == [16, 16, 32, 64]
    small = torch.zeros(576, 576)   # SmolLM2's o: 16-row tiles over row blocks
    assert policy.skinny(torch.zeros(64, 576), small, "res", decode=True)["block_m"] == 16
    assert policy.skinny(torch.zeros(32, 4096), w, "res", decode=False) is None
    # without the Triton kernels the projections are linear and addmm, bit for bit: a chunk
    # whole, a decode window in blocks of 8 rows
    g = torch.Generator().manual_seed(4)
    x, w, res = torch.randn(20, 64, generator=g), torch.randn(32, 64, generator=g), \
        torch.randn(20, 32, generator=g)
    torch_only = KernelPolicy(triton=False)
    assert torch.equal(fused.linear_rows(x, w, policy=torch_only), F.linear(x, w))
    assert torch.equal(fused.linear_rows(x, w, res, torch_only), torch.addmm(res, x, w.t()))
    xs = torch.cat([x, torch.zeros(4, 64)]).split(8)        # 20 rows: 3 blocks, the last padded
    rs = torch.cat([res, torch.zeros(4, 32)]).split(8)
    blocked = torch.cat([torch.addmm(r, b, w.t()) for b, r in zip(xs, rs)])[:20]
    assert torch.equal(fused.linear_rows(x, w, res, torch_only, decode=True), blocked)


def _cases(device):
    """fp32 under the interpreter (its bf16 is not the GPU's), bf16 on CUDA, and a tolerance."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    return dtype, (1e-4 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("device", triton_devices())
def test_norm_folded_into_the_product(device):
    """rmsnorm(x) @ w^T + res with the norm folded in: the reference, and rmsnorm then the
    product to within rounding; a row alone and among 15 others gives the same bits."""
    sk = _skinny()
    dtype, tol = _cases(device)
    g = torch.Generator().manual_seed(5)
    n, k = 64, 256
    w = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype)
    x = (3 * torch.randn(8, k, generator=g)).to(device, dtype)
    norm = (1 + 0.1 * torch.randn(k, generator=g)).to(device, dtype)
    res = torch.randn(8, n, generator=g).to(device, dtype)
    got = _call(sk.skinny_mm, x, w, res, norm, 1e-5, **BLOCKS)
    want = fused.skinny_mm_torch(x, w, res, norm, 1e-5)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    unfolded = fused.skinny_mm_torch(fused.rms_norm_rows_torch(x, norm, 1e-5), w, res)
    torch.testing.assert_close(got, unfolded, atol=2 * tol, rtol=2 * tol)
    other = torch.randn(16, k, generator=g).to(device, dtype)
    other[9] = x[4]
    res16 = torch.randn(16, n, generator=g).to(device, dtype)
    res16[9] = res[4]
    assert torch.equal(sk.skinny_mm(x[4:5], w, res[4:5], norm, 1e-5, **BLOCKS)[0], got[4])
    assert torch.equal(sk.skinny_mm(other, w, res16, norm, 1e-5, **BLOCKS)[9], got[4])


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("with_norm", [False, True])
def test_gate_up_silu(device, with_norm):
    sk = _skinny()
    dtype, tol = _cases(device)
    g = torch.Generator().manual_seed(6)
    f, k = 64, 256
    w = (torch.randn(2 * f, k, generator=g) * 0.05).to(device, dtype)
    x = (2 * torch.randn(8, k, generator=g)).to(device, dtype)
    norm = (1 + 0.1 * torch.randn(k, generator=g)).to(device, dtype) if with_norm else None
    got = _call(sk.gate_up_silu, x, w, norm, 1e-5, **BLOCKS)
    assert got.shape == (8, f)
    torch.testing.assert_close(got, fused.gate_up_silu_torch(x, w, norm, 1e-5), atol=tol, rtol=tol)
    if norm is None:   # the fold is silu_mul of the plain product
        want = fused.silu_mul_torch(fused.skinny_mm_torch(x, w))
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    other = torch.randn(16, k, generator=g).to(device, dtype)
    other[0] = x[6]
    assert torch.equal(sk.gate_up_silu(x[6:7], w, norm, 1e-5, **BLOCKS)[0], got[6])
    assert torch.equal(sk.gate_up_silu(other, w, norm, 1e-5, **BLOCKS)[0], got[6])


def test_folded_dispatch_falls_back_to_the_kernels_apart():
    """Without the Triton kernels, or without the folds, norm_linear_rows and
    norm_gate_up_silu are rms_norm_rows then the projection (then silu_mul), bit for bit."""
    g = torch.Generator().manual_seed(9)
    x, norm = torch.randn(3, 128, generator=g), 1 + 0.1 * torch.randn(128, generator=g)
    w, wg = torch.randn(96, 128, generator=g), torch.randn(64, 128, generator=g)
    for policy in (KernelPolicy(triton=False), KernelPolicy(triton=True, fold=frozenset())):
        if policy.triton and not _interpreting():
            continue   # the Triton kernels need CUDA or the interpreter
        for decode in (False, True):
            h = fused.rms_norm_rows(x, norm, 1e-5, policy, decode)
            assert torch.equal(fused.norm_linear_rows(x, norm, 1e-5, w, policy, decode),
                               fused.linear_rows(h, w, policy=policy, decode=decode))
            assert torch.equal(fused.norm_gate_up_silu(x, norm, 1e-5, wg, policy, decode),
                               fused.silu_mul(fused.linear_rows(h, wg, policy=policy,
                                                                decode=decode), policy))


@pytest.mark.parametrize("device", triton_devices())
def test_head_logits_in_fp32_with_the_final_norm(device):
    """The head: rmsnorm(x) @ w^T kept in fp32 (no rounding of the accumulator), against the
    reference, and a row's logits the same alone and in a block of 8."""
    sk = _skinny()
    dtype, tol = _cases(device)
    g = torch.Generator().manual_seed(10)
    w = (torch.randn(96, 128, generator=g) * 0.05).to(device, dtype)
    x = torch.randn(8, 128, generator=g).to(device, dtype)
    norm = (1 + 0.1 * torch.randn(128, generator=g)).to(device, dtype)
    got = _call(sk.skinny_mm, x, w, None, norm, 1e-5, out_dtype=torch.float32, **BLOCKS)
    assert got.dtype == torch.float32
    want = fused.skinny_mm_torch(x, w, None, norm, 1e-5, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, atol=tol / 10, rtol=tol / 10)
    alone = sk.skinny_mm(x[6:7], w, None, norm, 1e-5, out_dtype=torch.float32, **BLOCKS)
    assert torch.equal(alone[0], got[6])
