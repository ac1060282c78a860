"""Triton kernels of int8 activations against quantized weights (kernels/quant_a8.py says the
arithmetic; its plain-torch reference is a8_mm_reference):

    quantize_rows   each window row alone, one program a row: (rmsnorm and) int8 codes with a
                    scale per 32 values
    a8_mm           out = rows' codes @ w^T (+ res): per weight group an exact int32 sum,
                    then dx * (a * sum(u q) + b * sum(q)) added group by group along K

a8_mm has two ways to the integer sums, chosen by the window's rows: a GEMV (1 to 4 rows, a
row tile of 1, 2 or 4: kernels/quant_a8_gemv.py, four products a dp4a) and an MMA (more rows:
tile 16, 32 or 64, int8 tl.dot into int32: a group of 32 quants a K=32 dot, each of Q6_K's
groups of 16 a K=32 dot with the other's codes zeroed; a8_pairs' expert rows sum products in
int32 lanes). Both add each (row, column)'s float terms in
the same order, group by group, so a row gets the same bits from either and from any tile
(tests/test_quant_a8.py). Both launch with enable_fp_fusion=False: compiled for sm_90, Triton
fuses `a * isum + b * qs` into one FMA one way for tiles of 1 and 2 rows and the other way
from 4 rows up (Q4_K, Q5_K, Q4_1, Q5_1: their b is not zero), which changes a row's bits
between tiles; without fusion every tile rounds each product alone. The codes and scales come
from kernels/quant_triton.py's `_codes` and `_terms`, a group at a time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.quant import BLOCKS, Part
from strata.kernels.quant_a8 import QBLOCK
from strata.kernels.quant_a8_gemv import a8_gemv
from strata.kernels.quant_triton import IQ4_NL, IQ4_XS, Q8_0, TYPE_IDS, _codes, _planes, _terms
from strata.kernels.skinny_triton import MAX_ROWS, ROW_TILES

GEMV_TILES = (1, 2, 4)   # row tiles of the GEMV; more rows take the MMA's ROW_TILES


@triton.jit
def _quantize_rows_kernel(x_ptr, g_ptr, q_ptr, dx_ptr, K, eps, stride_xm,
                          NORM: tl.constexpr, BLOCK: tl.constexpr):
    """Row program_id(0): q [M, K] int8 and dx [M, K / 32] (kernels/quant_a8.py)."""
    m = tl.program_id(0)
    row = x_ptr + m * stride_xm
    r = 1.0
    if NORM:
        sq = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            xf = tl.load(row + k0 + tl.arange(0, BLOCK)).to(tl.float32)
            sq += xf * xf
        r = tl.rsqrt(tl.sum(sq, 0) / K + eps)
    NB: tl.constexpr = BLOCK // 32
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        y = tl.load(row + k).to(tl.float32)
        if NORM:
            y = y * r * tl.load(g_ptr + k).to(tl.float32)
        yb = tl.reshape(y, (NB, 32))
        amax = tl.max(tl.abs(yb), 1)
        inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
        v = yb * inv[:, None]
        q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(q_ptr + m * K + k, tl.reshape(q, (BLOCK,)).to(tl.int8))
        tl.store(dx_ptr + m * (K // 32) + k0 // 32 + tl.arange(0, NB), amax / 127.0)


@triton.jit
def _a8_mm_kernel(q_ptr, dx_ptr, p0, p1, p2, p3, s0, s1, s2, s3, res_ptr, out_ptr,
                  M, N, K, stride_rm, stride_om,
                  QTYPE: tl.constexpr, S: tl.constexpr, HAS_RES: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The MMA tiles (16 to 64 rows); the GEMV's are kernels/quant_a8_gemv.py's."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    xm, wn = m, n
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)            # out^T, as quant_triton's
    for k0 in range(0, K, BLOCK_K):
        if S == 16:   # Q6_K: a K=32 dot a group of 16, the other group's codes zeroed
            for j in tl.static_range(BLOCK_K // 32):
                g = k0 // S + 2 * j
                u = tl.reshape(_codes(p0, p1, s0, s1, wn, n_ok, g, QTYPE, S, 2, BLOCK_N),
                               (BLOCK_N, 32))
                a2, b2 = _terms(p2, p3, s2, s3, wn, n_ok, g, QTYPE, 2)    # [BN, 2]
                kk = g * S + tl.arange(0, 32)
                q = tl.load(q_ptr + xm[:, None] * K + kk[None, :], mask=m_ok[:, None], other=0)
                dx = tl.load(dx_ptr + xm * (K // 32) + (g * S) // 32, mask=m_ok, other=0.0)
                half = tl.arange(0, 32) // 16
                for h in tl.static_range(2):
                    isum = tl.dot(tl.where(half[None, :] == h, u, 0).to(tl.int8), tl.trans(q),
                                  out_dtype=tl.int32)
                    qs = tl.sum(tl.where(half[None, :] == h, q.to(tl.int32), 0), 1)
                    pick = tl.arange(0, 2)[None, :] == h                  # group h's terms
                    a = tl.sum(tl.where(pick, a2, 0.0), 1)
                    b = tl.sum(tl.where(pick, b2, 0.0), 1)
                    t = a[:, None] * isum.to(tl.float32) + b[:, None] * qs.to(tl.float32)[None, :]
                    acc += t * dx[None, :]
        for j in tl.static_range(0 if S == 16 else BLOCK_K // S):
            g = k0 // S + j                                   # the weight group
            u = tl.reshape(_codes(p0, p1, s0, s1, wn, n_ok, g, QTYPE, S, 1, BLOCK_N),
                           (BLOCK_N, S))
            a, b = _terms(p2, p3, s2, s3, wn, n_ok, g, QTYPE, 1)
            a = tl.reshape(a, (BLOCK_N,))
            b = tl.reshape(b, (BLOCK_N,))
            if QTYPE == Q8_0 or QTYPE == IQ4_NL or QTYPE == IQ4_XS:   # signed: a * (u - 128)
                u = u - 128
                b = b * 0.0
            kk = g * S + tl.arange(0, S)
            q = tl.load(q_ptr + xm[:, None] * K + kk[None, :], mask=m_ok[:, None], other=0)
            dx = tl.load(dx_ptr + xm * (K // 32) + (g * S) // 32, mask=m_ok, other=0.0)
            qs = tl.sum(q.to(tl.int32), 1)                    # exact
            isum = tl.dot(u.to(tl.int8), tl.trans(q), out_dtype=tl.int32)
            t = a[:, None] * isum.to(tl.float32) + b[:, None] * qs.to(tl.float32)[None, :]
            acc += t * dx[None, :]
    out = tl.trans(acc)                                       # [BM, BN]
    ok = m_ok[:, None] & n_ok[None, :]
    if HAS_RES:
        out += tl.load(res_ptr + m[:, None] * stride_rm + n[None, :], mask=ok,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=ok)


def _block(k: int) -> int:
    return next(b for b in (256, 128, 64, 32) if k % b == 0)


def quantize_rows(x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32, rows contiguous) -> (q int8 [M, K], dx fp32 [M, K/32])."""
    m, k = x.shape
    if k % QBLOCK:
        raise ValueError(f"int8 activations: a row of {k} values is not whole blocks of "
                         f"{QBLOCK}")
    assert x.stride(1) == 1 and (norm is None or norm.is_contiguous())
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    dx = torch.empty(m, k // QBLOCK, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, norm if norm is not None else x, q, dx, k, eps,
                                    x.stride(0), NORM=norm is not None, BLOCK=_block(k),
                                    num_warps=4)
    return q, dx


def a8_row_tile(m: int) -> int:
    """The row tile of a window of m rows: the GEMV's up to 4 rows, then the MMA's."""
    return next(t for t in (*GEMV_TILES, *ROW_TILES) if m <= t or t == ROW_TILES[-1])


def a8_mm(q: torch.Tensor, dx: torch.Tensor, part: Part, res: torch.Tensor | None = None, *,
          out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
          block_m: int | None = None, block_n: int = 32, block_k: int = 128,
          warps: int = 4, gemv_n: int = 32, stages: int = 3) -> torch.Tensor:
    """q, dx: quantize_rows' [M, K] codes and scales; part: a quantized [N, K] weight; res:
    [M, N] or None -> [M, N] (into `out`, which may be a column slice of a wider tensor).
    block_m: a GEMV tile (1, 2, 4) or an MMA tile (16, 32, 64); default the smallest that
    holds the rows. block_k: quants a step,
    whole groups. The GEMV tiles take kernels/quant_a8_gemv.py's dp4a kernel (gemv_n columns
    a program, `stages` K steps in flight); the MMA tiles block_n and block_k."""
    m, k = q.shape
    group = BLOCKS[part.qtype][2]
    block_m = block_m or a8_row_tile(m)
    block_k = min(block_k, _block(k))
    if (m > MAX_ROWS or part.cols != k or block_m not in (*GEMV_TILES, *ROW_TILES)
            or k % block_k or block_k % group):
        raise ValueError(f"int8-activation kernel: {m} rows of {k}, {part.qtype} weight "
                         f"[{part.rows}, {part.cols}] do not fit blocks ({block_m} rows, "
                         f"{block_k} quants a step)")
    if out is None:
        out = torch.empty(m, part.rows, dtype=out_dtype, device=q.device)
    assert out.shape == (m, part.rows) and out.stride(1) == 1 and q.is_contiguous()
    if block_m in GEMV_TILES:
        return a8_gemv(q, dx, part, res, out, block_m, block_n=gemv_n, stages=stages,
                       warps=warps)
    r = res if res is not None else out
    planes, strides = _planes(part)
    grid = (triton.cdiv(m, block_m), triton.cdiv(part.rows, block_n))
    _a8_mm_kernel[grid](q, dx, *planes, *strides, r, out, m, part.rows, k, r.stride(0),
                        out.stride(0), QTYPE=TYPE_IDS[part.qtype], S=group,
                        HAS_RES=res is not None, BLOCK_M=block_m,
                        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                        enable_fp_fusion=False)   # see the module: no tile-dependent FMAs
    return out


def a8_pairs(q: torch.Tensor, dx: torch.Tensor, part: Part, xrows: torch.Tensor,
             wrows: torch.Tensor, n: int, out: torch.Tensor, *, block_n: int = 32,
             warps: int = 4) -> torch.Tensor:
    """Routed experts' GEMVs, one a pair: out[p] = codes row xrows[p] @ rows wrows[p] ..
    wrows[p] + n - 1 of `part`^T (int32 [P] each; out [P, n], which may be a column slice).
    Each pair is computed alone by the dp4a GEMV, with a8_mm's arithmetic."""
    p, k = xrows.shape[0], q.shape[1]
    if part.cols != k or k % BLOCKS[part.qtype][2] or k % QBLOCK:
        raise ValueError(f"int8-activation expert kernel: rows of {k} against a "
                         f"{part.qtype} weight [{part.rows}, {part.cols}]")
    assert out.shape == (p, n) and out.stride(1) == 1 and q.is_contiguous()
    return a8_gemv(q, dx, part, None, out, 1, block_n=block_n, warps=warps,
                   pairs=(xrows, wrows, n))
