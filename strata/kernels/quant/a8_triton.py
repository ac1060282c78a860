"""Triton kernels of int8 activations against quantized weights (a8.py says the
arithmetic; its plain-torch reference is a8_mm_reference):

    quantize_rows   each window row alone, a program a chunk of a row: (rmsnorm and) int8
                    codes with a scale per 32 values
    a8_mm           out = rows' codes @ w^T (+ res): per weight group an exact int32 sum,
                    then a dx sum(u q) + b dx sum(q) added group by group along K

a8_mm has two ways to the integer sums, chosen by the window's rows: a GEMV (1 to 8 rows, a row
tile of 1, 2, 4 or 8: a8_gemv.py, four products a dp4a) and an MMA (more rows: tile 16, 32 or
64: int8 tl.dots into int32, batched over a K step's groups (Q6_K's groups of 16 in pairs), one
dot against the rows' codes laid out block-diagonally so that each group's sums come apart, or
a 2D dot a group of 32 whose sums stay in the accumulator's layout). K is cut into parts that
depend on the weight's shape alone (a8_parts.k_parts): every kernel adds each (row, column)'s
float terms group by group from zero within a part, then the parts in order, so a row gets the
same bits from either and from any tile (tests/kernels/test_quant_a8.py). The GEMV takes a
program a part and so does the MMA (more programs for a narrow weight with long rows), and a
second kernel adds the parts. A group's term is a8_gemv.group_term's explicit
fma(a dx, isum, b qs dx), the same in every kernel; the kernels launch with
enable_fp_fusion=False so that Triton fuses no other product and sum, which it did one way for
tiles of 1 and 2 rows and the other way from 4 rows up on sm_90 (changing a row's bits between
tiles). The codes and scales come from
reads.py's `_codes` and `_terms`, a K step at a time, the codes' sums a group from the
quantizer; the terms are added by `add_in_order`.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from strata.kernels.arrive import counters
from strata.kernels.pdl import enter, launch_options
from strata.kernels.quant.a8 import QBLOCK, Codes
from strata.kernels.quant.a8_gated import a8_gate_up
from strata.kernels.quant.a8_gemv import (Pairs, a8_gemv, add_in_order, group_term,
                                          quantize_blocks)
from strata.kernels.quant.a8_parts import (PARTS, add_parts, finish_parts, gemv_step, k_parts,
                                           store_rows)
from strata.kernels.quant.blocks import BLOCKS, Part
from strata.kernels.quant.reads import (IQ4_NL, IQ4_XS, Q8_0, TYPE_IDS, _codes, _planes,
                                        _term_loads, _term_values, _terms)
from strata.kernels.skinny_triton import MAX_ROWS, ROW_TILES

GEMV_TILES = (1, 2, 4, 8)   # row tiles of the GEMV; more rows take the MMA's ROW_TILES
DOTS = ("diagonal", "batched", "groups")   # the MMA's ways to the groups' integer sums
# (Q6_K?, row tile, rows longer than the weight is tall (K > N: a down projection)) -> the
# MMA's block_n, block_k, dot and whether the scales load a step ahead: the fastest of
# tools/gpu/bench_a8.py's for llama3-8b's qkv [6144, 4096] and down [4096, 14336] on an H100
MMA_BLOCKS = {(False, 16, False): (64, 64, "groups", True),
              (False, 16, True): (64, 128, "groups", True),
              (False, 32, False): (64, 64, "groups", True),
              (False, 32, True): (64, 64, "groups", False),
              (False, 64, False): (64, 64, "groups", True),
              (False, 64, True): (128, 32, "groups", False),
              (True, 16, False): (64, 64, "diagonal", False),
              (True, 16, True): (64, 64, "diagonal", False),
              (True, 32, False): (64, 64, "diagonal", False),
              (True, 32, True): (64, 64, "diagonal", False),
              (True, 64, False): (64, 64, "groups", False),
              (True, 64, True): (128, 32, "groups", True)}


@triton.jit
def _quantize_rows_kernel(x_ptr, g_ptr, q_ptr, qp_ptr, dx_ptr, qs_ptr, K, eps, stride_xm,
                          NORM: tl.constexpr, BLOCK: tl.constexpr, KP: tl.constexpr,
                          PDL: tl.constexpr):
    """Program (row m, chunk c): the codes q [M, K] int8 (and again in pair order, qp),
    scales dx [M, K / 32] (a8.py) and the codes' sums qs [M, K / 16] int32 of the row's values
    [c BLOCK, (c + 1) BLOCK). With NORM each program reads the whole row (KP: K up to a power
    of two) in one load for its rmsnorm: every program of a row adds the same squares in the
    same order, so they share its scale r bit for bit."""
    enter(PDL)
    m = tl.program_id(0)
    c = tl.program_id(1)
    row = x_ptr + m * stride_xm
    r = 1.0
    if NORM:
        ka = tl.arange(0, KP)
        xa = tl.load(row + ka, mask=ka < K, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(xa * xa, 0) / K + eps)
    NB: tl.constexpr = BLOCK // 32
    k = c * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(row + k).to(tl.float32)
    if NORM:
        y = y * r * tl.load(g_ptr + k).to(tl.float32)
    rows = tl.zeros([1], tl.int32) + m
    quantize_blocks(y[None, :], rows, rows >= 0, rows * 0 + c * NB, K, q_ptr, qp_ptr, dx_ptr,
                    qs_ptr, 1, NB)


@triton.jit
def _a8_mm_kernel(q_ptr, dx_ptr, qs_ptr, p0, p1, p2, p3, s0, s1, s2, s3, res_ptr, out_ptr,
                  fin_ptr, count_ptr, M, N, K, stride_rm, stride_om,
                  QTYPE: tl.constexpr, S: tl.constexpr, HAS_RES: tl.constexpr,
                  FIXUP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEP: tl.constexpr,
                  DOT: tl.constexpr, P: tl.constexpr, AHEAD: tl.constexpr,
                  PDL: tl.constexpr):
    """The MMA tiles (16 to 64 rows); the GEMV's are a8_gemv.py's. Program (row block,
    column block, part of K): each K step's groups' exact sums come from int8 dots
    (_step_dot: block-diagonal, DOT 0, batched, DOT 1, or a dot a group, DOT 2: the same
    integers, so the same bits), the part's terms added in order from zero; its sum into out,
    or with P > 1 into the scratch rows of that part, which the tile's last program (FIXUP:
    into fin) or _add_parts_kernel adds in order, as for the GEMV. AHEAD (DOT 2): the next
    step's scales (the weight's and the rows') are loaded before this step's arithmetic, as
    the codes are by Triton's pipelining: the same values, so the same bits."""
    enter(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    part = tl.program_id(2)
    L = K // P                                                # quants a part of K
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)            # out^T
    G: tl.constexpr = STEP // S
    last = part * L + L - STEP
    if AHEAD and DOT == 2:
        v0, v1, v2, v3, v4 = _term_loads(p2, p3, s2, s3, n, n_ok, part * L // S, QTYPE, G)
        qs, dx = _row_scales(qs_ptr, dx_ptr, m, m_ok, K, part * L // S, G, S)
        for k0 in range(part * L, part * L + L, STEP):
            ahead = tl.minimum(k0 + STEP, last) // S          # the last step loads itself
            w0, w1, w2, w3, w4 = _term_loads(p2, p3, s2, s3, n, n_ok, ahead, QTYPE, G)
            qs_n, dx_n = _row_scales(qs_ptr, dx_ptr, m, m_ok, K, ahead, G, S)
            a, b = _term_values(v0, v1, v2, v3, v4, k0 // S, QTYPE, G)
            acc = _step_groups(acc, q_ptr, a, b, qs, dx, p0, p1, s0, s1, m, m_ok, n, n_ok, K,
                               k0, QTYPE, S, STEP, BLOCK_M, BLOCK_N)
            v0, v1, v2, v3, v4, qs, dx = w0, w1, w2, w3, w4, qs_n, dx_n
    else:
        for k0 in range(part * L, part * L + L, STEP):
            acc = _step_dot(acc, q_ptr, dx_ptr, qs_ptr, p0, p1, p2, p3, s0, s1, s2, s3, m,
                            m_ok, n, n_ok, M, K, k0, QTYPE, S, STEP, BLOCK_M, BLOCK_N, DOT)
    if P == 1:   # the parts' sum from zero, as _add_parts_kernel adds them
        store_rows(0.0 + tl.trans(acc), res_ptr, out_ptr, m, n, m_ok, n_ok, stride_rm,
                   stride_om, HAS_RES)
    else:
        finish_parts(tl.trans(acc), out_ptr, res_ptr, fin_ptr, count_ptr, m, n, m_ok, n_ok,
                     M, N, stride_rm, stride_om, part, P, HAS_RES, FIXUP, BLOCK_M, BLOCK_N)


@triton.jit
def group_sums(qs_ptr, m, m_ok, K, g0, G: tl.constexpr, S: tl.constexpr):
    """int32 [BM, G]: rows m's sums of codes over groups g0 .. g0 + G - 1 (of S quants),
    from the quantizer's sums per 16 (two a group of 32: exact)."""
    at = qs_ptr + m[:, None] * (K // 16) + ((g0 + tl.arange(0, G)) * (S // 16))[None, :]
    qs = tl.load(at, mask=m_ok[:, None], other=0)
    if S == 32:
        qs += tl.load(at + 1, mask=m_ok[:, None], other=0)
    return qs


@triton.jit
def _row_scales(qs_ptr, dx_ptr, m, m_ok, K, g0, G: tl.constexpr, S: tl.constexpr):
    """The rows' sums of codes (int32) and scales, [BM, G] each, of groups g0 .. g0 + G - 1."""
    qs = group_sums(qs_ptr, m, m_ok, K, g0, G, S)
    dx = tl.load(dx_ptr + m[:, None] * (K // 32) + ((g0 + tl.arange(0, G)) * S // 32)[None, :],
                 mask=m_ok[:, None], other=0.0)
    return qs, dx


@triton.jit
def _step_dot(acc, q_ptr, dx_ptr, qs_ptr, p0, p1, p2, p3, s0, s1, s2, s3, m, m_ok, n, n_ok,
              M, K, k0, QTYPE: tl.constexpr, S: tl.constexpr, STEP: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    """acc [BN, BM] + a K step's G groups' terms in order, their integer sums [BN, BM, G]
    from one dot: against the rows' codes laid out block-diagonally (DOT 0), [STEP, G BM] with
    group g's quants against columns g BM .. (zeros elsewhere: G times the products the sums
    need), or batched over the groups (DOT 1), [G, BN, S] x [G, S, BM]; Q6_K's 16-quant
    groups (int8 dots take K of 32) batched in pairs, twice: against the rows' codes with the
    pair's second group zeroed, then its first (twice the products the sums need)."""
    G: tl.constexpr = STEP // S
    g0 = k0 // S
    if DOT == 2:
        a, b = _terms(p2, p3, s2, s3, n, n_ok, g0, QTYPE, G)                 # [BN, G]
        qs, dx = _row_scales(qs_ptr, dx_ptr, m, m_ok, K, g0, G, S)
        return _step_groups(acc, q_ptr, a, b, qs, dx, p0, p1, s0, s1, m, m_ok, n, n_ok, K, k0,
                            QTYPE, S, STEP, BLOCK_M, BLOCK_N)
    kk = tl.arange(0, STEP)
    u = tl.reshape(_codes(p0, p1, s0, s1, n, n_ok, g0, QTYPE, S, G, BLOCK_N), (BLOCK_N, STEP))
    a, b = _terms(p2, p3, s2, s3, n, n_ok, g0, QTYPE, G)                   # [BN, G]
    if QTYPE == Q8_0 or QTYPE == IQ4_NL or QTYPE == IQ4_XS:   # signed: a * (u - 128)
        u = u - 128
        b = b * 0.0
    if DOT == 1 and S == 16:   # two groups a dot of 32, the other group's codes zeroed
        C: tl.constexpr = STEP // 32
        q = tl.load(q_ptr + m[:, None] * K + k0 + kk[None, :], mask=m_ok[:, None], other=0)
        u3 = tl.permute(tl.reshape(u.to(tl.int8), (BLOCK_N, C, 32)), (1, 0, 2))  # [C, BN, 32]
        q3 = tl.permute(tl.reshape(q, (BLOCK_M, C, 32)), (1, 2, 0))              # [C, 32, BM]
        first = (tl.arange(0, 32) < 16)[None, :, None]
        even = tl.dot(u3, tl.where(first, q3, 0).to(tl.int8), out_dtype=tl.int32)  # [C, BN, BM]
        odd = tl.dot(u3, tl.where(first, 0, q3).to(tl.int8), out_dtype=tl.int32)
        isum = tl.reshape(tl.permute(tl.join(even, odd), (1, 2, 0, 3)),
                          (BLOCK_N, BLOCK_M, G))                      # group 2c + h at [.., c, h]
    elif DOT == 1:
        q = tl.load(q_ptr + m[:, None] * K + k0 + kk[None, :], mask=m_ok[:, None], other=0)
        u3 = tl.permute(tl.reshape(u.to(tl.int8), (BLOCK_N, G, S)), (1, 0, 2))   # [G, BN, S]
        q3 = tl.permute(tl.reshape(q, (BLOCK_M, G, S)), (1, 2, 0))               # [G, S, BM]
        isum = tl.permute(tl.dot(u3, q3, out_dtype=tl.int32), (1, 2, 0))         # [BN, BM, G]
    else:
        kq = kk[:, None]
        col = tl.arange(0, G * BLOCK_M)[None, :]
        cm = tl.program_id(0) * BLOCK_M + col % BLOCK_M
        qd = tl.load(q_ptr + cm * K + k0 + kq, mask=(kq // S == col // BLOCK_M) & (cm < M),
                     other=0)                                                    # [STEP, G BM]
        isum = tl.dot(u.to(tl.int8), qd, out_dtype=tl.int32)                     # [BN, G BM]
        isum = tl.permute(tl.reshape(isum, (BLOCK_N, G, BLOCK_M)), (0, 2, 1))   # [BN, BM, G]
    qs, dx = _row_scales(qs_ptr, dx_ptr, m, m_ok, K, g0, G, S)                  # [BM, G]
    qs = qs.to(tl.float32)
    t = group_term(isum, a[:, None, :] * dx[None, :, :], b[:, None, :] * (qs * dx)[None, :, :])
    return add_in_order(acc, t, BLOCK_N, BLOCK_M, G)


@triton.jit
def _pick(x, gi, g):
    """x [D, G]'s column g, [D] (a select and a sum of zeros: exact)."""
    return tl.sum(tl.where(gi[None, :] == g, x, 0), 1)


@triton.jit
def _step_groups(acc, q_ptr, a, b, qs, dx, p0, p1, s0, s1, m, m_ok, n, n_ok, K, k0,
                 QTYPE: tl.constexpr, S: tl.constexpr, STEP: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """_step_dot's third way (DOT 2): a 2D int8 dot a group of 32 ([BN, 32] x [32, BM], the
    sums in the accumulator's own layout), its term added to acc at once, group by group;
    Q6_K's groups of 16 take a dot of their pair's 32 codes twice, the other group's
    activation codes zeroed. a, b [BN, G]: the weight's terms (_terms); qs, dx [BM, G]: the
    rows' sums of codes and scales (_row_scales)."""
    G: tl.constexpr = STEP // S
    SIGNED: tl.constexpr = QTYPE == Q8_0 or QTYPE == IQ4_NL or QTYPE == IQ4_XS
    g0 = k0 // S
    gi = tl.arange(0, G)
    k32 = tl.arange(0, 32)
    if SIGNED:                                                # signed: a * (u - 128), b = 0
        b = b * 0.0
    for c in tl.static_range(STEP // 32):
        u = tl.reshape(_codes(p0, p1, s0, s1, n, n_ok, g0 + c * (32 // S), QTYPE, S, 32 // S,
                              BLOCK_N), (BLOCK_N, 32))
        if SIGNED:
            u = u - 128
        u = u.to(tl.int8)
        q = tl.trans(tl.load(q_ptr + m[:, None] * K + k0 + 32 * c + k32[None, :],
                             mask=m_ok[:, None], other=0))                    # [32, BM]
        for h in tl.static_range(32 // S):
            g = c * (32 // S) + h
            if S == 16:
                isum = tl.dot(u, tl.where((k32 // 16 == h)[:, None], q, 0).to(tl.int8),
                              out_dtype=tl.int32)
            else:
                isum = tl.dot(u, q, out_dtype=tl.int32)                          # [BN, BM]
            ag = _pick(a, gi, g)
            bg = _pick(b, gi, g)
            dg = _pick(dx, gi, g)
            cg = _pick(qs, gi, g).to(tl.float32) * dg
            acc += group_term(isum, ag[:, None] * dg[None, :], bg[:, None] * cg[None, :])
    return acc


def quantize_rows(x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0
                  ) -> Codes:
    """x [M, K] (K a multiple of 32, rows contiguous) -> its rows' Codes (a8.py)."""
    m, k = x.shape
    if k % QBLOCK:
        raise ValueError(f"int8 activations: a row of {k} values is not whole blocks of "
                         f"{QBLOCK}")
    assert x.stride(1) == 1 and (norm is None or norm.is_contiguous())
    c = Codes.empty(m, k, x.device)
    q, qp, dx, qs = c.q, c.qp, c.dx, c.qs
    if m:
        block = gemv_step(k)
        kp = triton.next_power_of_2(k)
        _quantize_rows_kernel[(m, k // block)](
            x, norm if norm is not None else x, q, qp, dx, qs, k, eps, x.stride(0),
            NORM=norm is not None, BLOCK=block, KP=kp,
            num_warps=8 if norm is not None and kp > 4096 else 4,
            enable_fp_fusion=False,   # as every kernel that quantizes rows (quantize_blocks)
            **launch_options(x.device))
    return c


def a8_row_tile(m: int) -> int:
    """The row tile of a window of m rows: the GEMV's up to 8 rows, then the MMA's."""
    return next(t for t in (*GEMV_TILES, *ROW_TILES) if m <= t or t == ROW_TILES[-1])


def a8_mm(x: Codes, part: Part, res: torch.Tensor | None = None, *,
          out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
          block_m: int | None = None, block_n: int | None = None,
          block_k: int | None = None, warps: int = 4, gemv_n: int | None = None,
          stages: int | None = None, dot: str | None = None, parts: int = PARTS,
          ahead: bool | None = None) -> torch.Tensor:
    """x: quantize_rows' [M, K] rows; part: a quantized [N, K] weight; res:
    [M, N] or None -> [M, N] (into `out`, which may be a column slice of a wider tensor).
    block_m: a GEMV tile (1, 2, 4, 8) or an MMA tile (16, 32, 64); default the smallest that
    holds the rows. The GEMV tiles take a8_gemv.py's dp4a kernel (gemv_n columns a program,
    default 16 for Q6_K and 32 for the rest; `stages` K steps in flight, default 2 for 8 rows
    and 3 for fewer); the MMA tiles block_n columns a program and block_k quants a step (at
    most K's step), their groups' sums by `dot`: "batched" (over the step's groups; Q6_K's
    in pairs), "diagonal" (block-diagonal) or "groups" (a 2D dot a group of 32, Q6_K's pairs
    twice; Hopper's wgmma from block_n 64); the same bits any way, the defaults MMA_BLOCKS'
    (tools/gpu/bench_a8.py --mma times them); ahead: whether the MMA's "groups" way loads
    each step's scales a step ahead (the same bits; default MMA_BLOCKS'). parts: the most parts
    of K (k_parts; a row's bits depend on it, so every call on a weight must pass the same:
    leave it be outside experiments)."""
    q = x.q
    m, k = q.shape
    group = BLOCKS[part.qtype][2]
    block_m = block_m or a8_row_tile(m)
    mma = MMA_BLOCKS.get((part.qtype == "Q6_K", block_m, part.cols > part.rows),
                         (None, None, None, None))
    block_k = min(block_k or mma[1] or 128, gemv_step(k))
    if (m > MAX_ROWS or part.cols != k or block_m not in (*GEMV_TILES, *ROW_TILES)
            or (k // k_parts(part.rows, k, parts)) % block_k or block_k % 32
            or (dot or "batched") not in DOTS):
        raise ValueError(f"int8-activation kernel: {m} rows of {k}, {part.qtype} weight "
                         f"[{part.rows}, {part.cols}] do not fit blocks ({block_m} rows, "
                         f"{block_k} quants a step)")
    if out is None:
        out = torch.empty(m, part.rows, dtype=out_dtype, device=q.device)
    assert out.shape == (m, part.rows) and out.stride(1) == 1 and q.is_contiguous()
    if block_m in GEMV_TILES:   # blocks from tools/gpu/bench_a8.py on an H100
        return a8_gemv(x, part, res, out, block_m,
                       block_n=gemv_n or (16 if part.qtype == "Q6_K" else 32),
                       stages=stages or (2 if block_m == 8 else 3), warps=warps,
                       parts=parts)
    block_n = block_n or mma[0]
    p = k_parts(part.rows, k, parts)
    r = res if res is not None else out
    dst = out if p == 1 else torch.empty(p, m, part.rows, dtype=torch.float32, device=q.device)
    planes, strides = _planes(part)
    dot = dot or mma[2]
    grid = (triton.cdiv(m, block_m), triton.cdiv(part.rows, block_n), p)
    count = counters(q.device, grid[0] * grid[1]) if p > 1 else None
    _a8_mm_kernel[grid](q, x.dx, x.qs, *planes, *strides, r, dst, out,
                        q if count is None else count, m, part.rows, k, r.stride(0),
                        out.stride(0), QTYPE=TYPE_IDS[part.qtype], S=group,
                        HAS_RES=res is not None, FIXUP=count is not None, BLOCK_M=block_m,
                        BLOCK_N=block_n, STEP=block_k, DOT=DOTS.index(dot), P=p,
                        AHEAD=bool(mma[3] if ahead is None else ahead),
                        num_warps=warps,
                        enable_fp_fusion=False,   # see the module: no tile-dependent FMAs
                        **launch_options(q.device))
    if p > 1 and count is None:
        add_parts(dst, res, out)
    return out


def a8_gate_up_silu(x: Codes, part: Part, act: str, out_dtype: torch.dtype,
                    codes: bool = False) -> torch.Tensor | Codes:
    """act(gate) * up [M, F] of [gate | up] = x's rows @ part^T ([2F, K]), each half rounded
    to out_dtype first: fused_triton's silu_mul of a8_mm's output, the same bits; for the
    GEMV's windows in one or two kernels (a8_gated.py). codes: return those rows quantized
    (quantize_rows' Codes, with the rows), there by the same kernels, where F is whole
    blocks of 32 (else the rows alone)."""
    m = x.q.shape[0]
    f = part.rows // 2
    codes = codes and f % QBLOCK == 0
    tile = a8_row_tile(m)
    if tile in GEMV_TILES and part.rows % 2 == 0:
        out = torch.empty(m, f, dtype=out_dtype, device=x.q.device)
        c = Codes.empty(m, f, x.q.device) if codes else None
        a8_gate_up(x, part, act, out, tile, block_n=16 if part.qtype == "Q6_K" else 32,
                   stages=2 if tile == 8 else 3, codes=c)
        return dataclasses.replace(c, rows=out) if codes else out
    from strata.kernels.fused_triton import silu_mul
    out = silu_mul(a8_mm(x, part, out_dtype=out_dtype), act)
    return dataclasses.replace(quantize_rows(out), rows=out) if codes else out


def a8_pairs(x: Codes, part: Part, pairs: Pairs, out: torch.Tensor, *, block_n: int = 32,
             warps: int = 4) -> torch.Tensor:
    """Routed experts' GEMVs, one a pair: out[p] = row p // pairs.per of x @ rows
    pairs.ids[p] * pairs.erows + pairs.w0 .. + pairs.n - 1 of `part`^T (out [P, n], which may
    be a column slice). Each pair is computed alone by the dp4a GEMV, with a8_mm's
    arithmetic; K in the parts of `part` as a whole (all experts packed: one part for
    qwen3-30b-a3b's, whose programs then walk K in order instead of adding 8 parts)."""
    p, k, n = pairs.ids.shape[0], x.q.shape[1], pairs.n
    if part.cols != k or k % BLOCKS[part.qtype][2] or k % QBLOCK:
        raise ValueError(f"int8-activation expert kernel: rows of {k} against a "
                         f"{part.qtype} weight [{part.rows}, {part.cols}]")
    assert out.shape == (p, n) and out.stride(1) == 1 and x.q.is_contiguous()
    return a8_gemv(x, part, None, out, 1, block_n=block_n, warps=warps, pairs=pairs)
