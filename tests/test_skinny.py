"""The decode-window matmul (kernels/skinny_triton.py, dispatched by fused.linear_rows): the
reference product on CUDA and under Triton's interpreter, each row's bits independent of the
other rows of its window, the residual in the epilogue, and cuBLAS kept where it should be."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import fused
from conftest import triton_devices

BLOCKS = {"block_n": 32, "block_k": 64, "stages": 2, "warps": 4}  # small shapes for the interpreter


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
    want = sk.skinny_mm_torch(x, w, res)
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
    assert sk.BLOCK_M == fused.SKINNY_MAX_ROWS
    w, x = torch.zeros(96, 256), torch.zeros(17, 256)
    with pytest.raises(ValueError, match="do not fit blocks"):
        sk.skinny_mm(x, w, **BLOCKS)            # 17 rows
    with pytest.raises(ValueError, match="do not fit blocks"):
        sk.skinny_mm(x[:8], w[:90], **BLOCKS)   # 90 columns, blocks of 32


def test_linear_rows_picks_by_shape_and_keeps_cublas_off_cuda():
    # llama3-8b's projections take the skinny kernel; SmolLM2's (small) stay on cuBLAS
    assert fused.skinny_blocks(6144, 4096, False)["block_n"] == 64
    assert fused.skinny_blocks(28672, 4096, False)["block_n"] == 128
    assert fused.skinny_blocks(4096, 14336, True)["block_k"] == 256
    assert fused.skinny_blocks(960, 576, False) is None
    assert fused.skinny_blocks(4100, 14336, True) is None   # no block divides 4100
    # on a CPU (no interpreter) the tensor path is unchanged: linear and addmm, bit for bit
    g = torch.Generator().manual_seed(4)
    x, w, res = torch.randn(8, 64, generator=g), torch.randn(32, 64, generator=g), \
        torch.randn(8, 32, generator=g)
    if fused._use_triton(x):
        pytest.skip("TRITON_INTERPRET=1: the CPU runs the Triton kernels")
    assert torch.equal(fused.linear_rows(x, w), F.linear(x, w))
    assert torch.equal(fused.linear_rows(x, w, res), torch.addmm(res, x, w.t()))
