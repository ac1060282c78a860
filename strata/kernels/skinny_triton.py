"""A matmul for decode windows (a few rows, large weights) as one Triton kernel.

out[M, N] = x[M, K] @ w[N, K]^T (+ res[M, N]), M at most BLOCK_M (16). One program per
BLOCK_N output columns walks K in BLOCK_K steps, in order, with an fp32 accumulator; the
residual is added to the accumulator before the one rounding to the output dtype (as addmm's
epilogue, without addmm's copy of the residual). Every row is computed alone (rows past M
are zeros that are never stored), with the same blocks and order whatever M is, so a row's
bits do not depend on the window's other rows (DESIGN.md, exactness 1 and 2).

Decode is bound by reading w once: the grid has one program per column block, so a matrix
of N columns keeps N / BLOCK_N programs streaming its rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, res_ptr, out_ptr, M, K,
                   stride_xm, stride_wn, stride_rm, stride_om,
                   HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    row_ok = m[:, None] < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)       # out^T: the weight is the MMA's M
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_ptr + n[:, None] * stride_wn + (k0 + kk)[None, :])      # [BN, BK]
        x = tl.load(x_ptr + m[:, None] * stride_xm + (k0 + kk)[None, :], mask=row_ok,
                    other=0.0)                                                # [BM, BK]
        acc = tl.dot(w, tl.trans(x), acc)
    out = tl.trans(acc)                                                       # [BM, BN]
    if HAS_RES:
        out += tl.load(res_ptr + m[:, None] * stride_rm + n[None, :], mask=row_ok,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok)


def skinny_mm(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor | None = None, *,
              block_n: int = 64, block_k: int = 128, stages: int = 4,
              warps: int = 4) -> torch.Tensor:
    """x: [M, K] (M <= 16), w: [N, K], res: [M, N] or None -> [M, N] in x's dtype.
    N must divide by block_n and K by block_k (the llama shapes do)."""
    m, k = x.shape
    n = w.shape[0]
    if m > BLOCK_M or w.shape[1] != k or n % block_n or k % block_k:
        raise ValueError(f"skinny_mm: x {tuple(x.shape)}, w {tuple(w.shape)} do not fit blocks "
                         f"({BLOCK_M} rows, {block_n} x {block_k})")
    assert x.stride(1) == 1 and w.stride(1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    r = res if res is not None else out
    _skinny_kernel[(n // block_n,)](
        x, w, r, out, m, k, x.stride(0), w.stride(0), r.stride(0), out.stride(0),
        HAS_RES=res is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        STAGES=stages, num_warps=warps)
    return out


def skinny_mm_torch(x: torch.Tensor, w: torch.Tensor,
                    res: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: fp32 products and sums, one rounding."""
    out = x.float() @ w.float().t()
    if res is not None:
        out += res.float()
    return out.to(x.dtype)
