"""The projections of a decode window (a few rows, large weights) as Triton kernels (their
plain-torch references: kernels/fused.py).

    skinny_mm     out = x @ w^T (+ res), or rmsnorm(x) @ w^T: the o and down projections
                  with the residual added in the epilogue (as addmm, without addmm's copy of
                  the residual), the qkv projection with its norm folded in, the head (final
                  norm folded in, fp32 logits)
    gate_up_silu  h = silu(g) * u of [g | u] = rmsnorm(x) @ [w_gate; w_up]^T: the FFN's norm,
                  projection and SiLU in one kernel

x is [M, K], a decode window of up to 64 rows. One program per (block of BLOCK_M rows, block
of BLOCK_N output columns) walks K in BLOCK_K steps, in order, with fp32 accumulators; the
weight is the MMA's M and the rows its N (swap-AB), so a tile of 16, 32 or 64 rows costs one
read of the weight tile. The blocks along K (and N) come from the weight's shape alone
(kernels/policy.py); BLOCK_M is the caller's choice: the smallest tile that holds the window
(one row block, so decode reads each weight once whatever M is), or a fixed tile with a grid
over row blocks. Every row is computed alone (rows past M are zeros that are never stored), with
the same K blocks and order whatever M and BLOCK_M are, so a row's bits do not depend on the
window's other rows (DESIGN.md, exactness 1 and 2; tests/kernels/test_batch_invariance.py checks
every tile against the others on CUDA). Row blocks are the grid's first axis: the programs that read
one weight tile run side by side and share it through L2.

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

from strata.kernels.fused_triton import ACTS, gate_act
from strata.kernels.pdl import enter, launch_options

ROW_TILES = (16, 32, 64)   # BLOCK_M: tensor-core tiles of a decode window's rows
MAX_ROWS = ROW_TILES[-1]
SMEM_BUDGET = 200 << 10    # bytes of shared memory the pipelined tiles may take (H200: 227 KB)


def row_tile(m: int, tiles: tuple[int, ...] = ROW_TILES) -> int:
    """BLOCK_M for a window of m rows: the smallest tile that holds them, else the largest
    (then a grid over row blocks)."""
    return next((t for t in tiles if m <= t), tiles[-1])


def fit_stages(stages: int, block_m: int, block_n: int, block_k: int, weights: int = 1) -> int:
    """The pipeline depth at most `stages` whose buffers (weight tiles and a row tile per
    stage, bf16) fit SMEM_BUDGET: deeper pipelines only hide latency, the arithmetic and its
    order stay those of the K blocks."""
    per_stage = (weights * block_n + block_m) * block_k * 2
    return max(1, min(stages, SMEM_BUDGET // per_stage))


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
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                   PDL: tl.constexpr):
    enter(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
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
                         BLOCK_K: tl.constexpr, STAGES: tl.constexpr, ACT: tl.constexpr,
                         PDL: tl.constexpr):
    enter(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)   # output columns: gate j, up F + j
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
    # rounded as the projection's output would be, then the activation in fp32 (as silu_mul)
    gate = _row_scale(acc_g, sq, K, eps, NORM).to(out_ptr.dtype.element_ty).to(tl.float32)
    up = _row_scale(acc_u, sq, K, eps, NORM).to(out_ptr.dtype.element_ty).to(tl.float32)
    h = gate_act(gate, ACT) * up
    tl.store(out_ptr + m[:, None] * stride_om + j[None, :], h.to(out_ptr.dtype.element_ty),
             mask=m[:, None] < M)


def _check(x: torch.Tensor, w: torch.Tensor, cols: int, block_m: int, block_n: int,
           block_k: int, norm: torch.Tensor | None = None,
           res: torch.Tensor | None = None) -> None:
    m, k = x.shape
    if (m > MAX_ROWS or block_m not in ROW_TILES or w.shape[1] != k or cols % block_n
            or k % block_k):
        raise ValueError(f"skinny kernel: x {tuple(x.shape)}, w {tuple(w.shape)} do not fit "
                         f"blocks ({block_m} rows, {block_n} x {block_k}; at most {MAX_ROWS} "
                         f"rows)")
    # the kernels read these without masks: internal invariants of the callers
    assert x.stride(1) == 1 and w.stride(1) == 1 and x.dtype == w.dtype
    assert norm is None or (norm.shape == (k,) and norm.is_contiguous())
    assert res is None or (res.shape == (m, w.shape[0]) and res.stride(1) == 1)


def skinny_mm(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor | None = None,
              norm: torch.Tensor | None = None, eps: float = 0.0, *, block_m: int | None = None,
              block_n: int = 64, block_k: int = 128, stages: int = 4, warps: int = 4,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [M, K] (M <= 64), w: [N, K], res: [M, N] or None, norm: the RMSNorm weight [K] to
    apply to x first, or None -> [M, N] in out_dtype (default x's; float32 keeps the
    accumulator's bits, as the head's logits want). block_m: a row tile (default row_tile(M)),
    block_n divides N, block_k K; stages is capped to what fits (fit_stages)."""
    n, block_m = w.shape[0], block_m or row_tile(x.shape[0])
    _check(x, w, n, block_m, block_n, block_k, norm, res)
    out = torch.empty(x.shape[0], n, dtype=out_dtype or x.dtype, device=x.device)
    r = res if res is not None else out
    grid = (triton.cdiv(x.shape[0], block_m), n // block_n)
    _skinny_kernel[grid](
        x, norm if norm is not None else x, w, r, out, x.shape[0], x.shape[1], eps,
        x.stride(0), w.stride(0), r.stride(0), out.stride(0),
        NORM=norm is not None, HAS_RES=res is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, STAGES=fit_stages(stages, block_m, block_n, block_k),
        num_warps=warps, **launch_options(x.device))
    return out


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor | None = None,
                 eps: float = 0.0, *, block_m: int | None = None, block_n: int = 64,
                 block_k: int = 128, stages: int = 3, warps: int = 4,
                 act: str = "silu") -> torch.Tensor:
    """x: [M, K] (M <= 64), w: [2F, K] = [w_gate; w_up], norm: [K] or None -> silu(g) * u
    [M, F] (act "gelu_tanh": gelu(g) * u); blocks as skinny_mm's (block_n counts output
    columns)."""
    f, block_m = w.shape[0] // 2, block_m or row_tile(x.shape[0])
    _check(x, w, f, block_m, block_n, block_k, norm)
    assert w.shape[0] % 2 == 0, "w is [w_gate; w_up]: an even number of rows"
    out = torch.empty(x.shape[0], f, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(x.shape[0], block_m), f // block_n)
    _gate_up_silu_kernel[grid](
        x, norm if norm is not None else x, w, out, x.shape[0], x.shape[1], f, eps,
        x.stride(0), w.stride(0), out.stride(0), NORM=norm is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k,
        STAGES=fit_stages(stages, block_m, block_n, block_k, weights=2), ACT=ACTS[act],
        num_warps=warps, **launch_options(x.device))
    return out
