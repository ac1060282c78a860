"""The projections of a decode window (a few rows, large weights) as Triton kernels (their
plain-torch references: kernels/fused.py).

    skinny_mm     out = x @ w^T (+ res), or rmsnorm(x) @ w^T: the o and down projections
                  with the residual added in the epilogue (as addmm, without addmm's copy of
                  the residual), the qkv projection with its norm folded in, the head (final
                  norm folded in, fp32 logits)
    gate_up_silu  h = silu(g) * u of [g | u] = rmsnorm(x) @ [w_gate; w_up]^T: the FFN's norm,
                  projection and SiLU in one kernel

x is [M, K] with M at most BLOCK_M (16). One program per block of output columns walks K in
BLOCK_K steps, in order, with fp32 accumulators: decode reads each weight once, so the grid
has one program per column block to keep the whole weight streaming. Every row is computed
alone (rows past M are zeros that are never stored), with the same blocks and order whatever
M is, so a row's bits do not depend on the window's other rows (DESIGN.md, exactness 1 and 2).

The norm is folded into the product: a program reads x's tiles anyway, so it also sums each
row's squares as it goes (in K order, the same in every program), multiplies each tile by the
norm weight before the dot, and scales the row's sums by rsqrt(mean + eps) at the end:
rmsnorm(x) @ w^T = rsqrt(mean(x^2) + eps) * ((x * g) @ w^T). The two norms' kernels and
SiLU's go: 6 kernels a layer instead of 9. (RoPE and the KV write folded into the qkv kernel's
epilogue, as two accumulators of even and odd rows, ran at 23 us against 18.5 us for the
kernels apart on an H200, and programmatic dependent launch with an L2 prefetch of the next
weight made a stage slower: docs/BENCHMARKS.md.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


@triton.jit
def _x_tile(x_ptr, g_ptr, m, k, M, stride_xm, NORM: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows m, columns k of x (rows past M read as 0) and each row's sum of squares over k;
    with NORM the tile is multiplied by the norm weight g[k] and rounded to x's dtype."""
    x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m[:, None] < M, other=0.0)
    if NORM:
        xf = x.to(tl.float32)
        sq = tl.sum(xf * xf, 1)
        g = tl.load(g_ptr + k).to(tl.float32)
        x = (xf * g[None, :]).to(x_ptr.dtype.element_ty)
    else:
        sq = tl.zeros([BLOCK_M], tl.float32)
    return x, sq


@triton.jit
def _row_scale(acc, sq, K, eps, NORM: tl.constexpr):
    """acc^T [BLOCK_M, BLOCK_N], times each row's rsqrt(mean of squares + eps) with NORM."""
    out = tl.trans(acc)
    if NORM:
        out = out * tl.rsqrt(sq / K + eps)[:, None]
    return out


@triton.jit
def _skinny_kernel(x_ptr, g_ptr, w_ptr, res_ptr, out_ptr, M, K, eps,
                   stride_xm, stride_wn, stride_rm, stride_om,
                   NORM: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)       # out^T: the weight is the MMA's M
    sq = tl.zeros([BLOCK_M], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_ptr + n[:, None] * stride_wn + (k0 + kk)[None, :])      # [BN, BK]
        x, s = _x_tile(x_ptr, g_ptr, m, k0 + kk, M, stride_xm, NORM, BLOCK_M)
        sq += s
        acc = tl.dot(w, tl.trans(x), acc)
    out = _row_scale(acc, sq, K, eps, NORM)                                   # [BM, BN]
    row_ok = m[:, None] < M
    if HAS_RES:
        out += tl.load(res_ptr + m[:, None] * stride_rm + n[None, :], mask=row_ok,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok)


@triton.jit
def _gate_up_silu_kernel(x_ptr, g_ptr, w_ptr, out_ptr, M, K, F, eps,
                         stride_xm, stride_wn, stride_om,
                         NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    j = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)   # output columns: gate j, up F + j
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    sq = tl.zeros([BLOCK_M], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        wg = tl.load(w_ptr + j[:, None] * stride_wn + (k0 + kk)[None, :])
        wu = tl.load(w_ptr + (F + j)[:, None] * stride_wn + (k0 + kk)[None, :])
        x, s = _x_tile(x_ptr, g_ptr, m, k0 + kk, M, stride_xm, NORM, BLOCK_M)
        sq += s
        xt = tl.trans(x)
        acc_g = tl.dot(wg, xt, acc_g)
        acc_u = tl.dot(wu, xt, acc_u)
    # rounded as the projection's output would be, then SiLU in fp32 (as silu_mul)
    gate = _row_scale(acc_g, sq, K, eps, NORM).to(out_ptr.dtype.element_ty).to(tl.float32)
    up = _row_scale(acc_u, sq, K, eps, NORM).to(out_ptr.dtype.element_ty).to(tl.float32)
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + m[:, None] * stride_om + j[None, :], h.to(out_ptr.dtype.element_ty),
             mask=m[:, None] < M)


def _check(x: torch.Tensor, w: torch.Tensor, cols: int, block_n: int, block_k: int,
           norm: torch.Tensor | None = None, res: torch.Tensor | None = None) -> None:
    m, k = x.shape
    if m > BLOCK_M or w.shape[1] != k or cols % block_n or k % block_k:
        raise ValueError(f"skinny kernel: x {tuple(x.shape)}, w {tuple(w.shape)} do not fit "
                         f"blocks ({BLOCK_M} rows, {block_n} x {block_k})")
    # the kernels read these without masks: internal invariants of the callers
    assert x.stride(1) == 1 and w.stride(1) == 1 and x.dtype == w.dtype
    assert norm is None or (norm.shape == (k,) and norm.is_contiguous())
    assert res is None or (res.shape == (m, w.shape[0]) and res.stride(1) == 1)


def skinny_mm(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor | None = None,
              norm: torch.Tensor | None = None, eps: float = 0.0, *, block_n: int = 64,
              block_k: int = 128, stages: int = 4, warps: int = 4,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [M, K] (M <= 16), w: [N, K], res: [M, N] or None, norm: the RMSNorm weight [K] to
    apply to x first, or None -> [M, N] in out_dtype (default x's; float32 keeps the
    accumulator's bits, as the head's logits want). block_n divides N, block_k K."""
    n = w.shape[0]
    _check(x, w, n, block_n, block_k, norm, res)
    out = torch.empty(x.shape[0], n, dtype=out_dtype or x.dtype, device=x.device)
    r = res if res is not None else out
    _skinny_kernel[(n // block_n,)](
        x, norm if norm is not None else x, w, r, out, x.shape[0], x.shape[1], eps,
        x.stride(0), w.stride(0), r.stride(0), out.stride(0),
        NORM=norm is not None, HAS_RES=res is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=block_k, STAGES=stages, num_warps=warps)
    return out


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor | None = None,
                 eps: float = 0.0, *, block_n: int = 64, block_k: int = 128, stages: int = 3,
                 warps: int = 4) -> torch.Tensor:
    """x: [M, K], w: [2F, K] = [w_gate; w_up], norm: [K] or None -> silu(g) * u [M, F]."""
    f = w.shape[0] // 2
    _check(x, w, f, block_n, block_k, norm)
    assert w.shape[0] % 2 == 0, "w is [w_gate; w_up]: an even number of rows"
    out = torch.empty(x.shape[0], f, dtype=x.dtype, device=x.device)
    _gate_up_silu_kernel[(f // block_n,)](
        x, norm if norm is not None else x, w, out, x.shape[0], x.shape[1], f, eps,
        x.stride(0), w.stride(0), out.stride(0), NORM=norm is not None, BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, num_warps=warps)
    return out
