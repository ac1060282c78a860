"""The int8-activation MMA (a8_triton.a8_mm's tiles of 16, 32 and 64 rows): int8 tl.dots into
int32 sums, one a weight group (Q6_K's groups of 16 in pairs), each group's float term
(a8_gemv.group_term) added to the accumulator in K's order, as the GEMV adds them, so a row's
bits are the same from either (a8_triton.py says the arithmetic and the parts of K).

The ways to the groups' sums (`dot`), the same integers and so the same bits:

    diagonal   one dot a K step against the rows' codes laid out block-diagonally
    batched    one dot a step batched over its groups (Q6_K's in pairs)
    groups     a 2D dot a group of 32, its sums in the accumulator's layout; the step's
               terms loaded at once (with `ahead`, a step early) and each group's picked
    direct     as groups, each group's terms loaded by themselves where the sums lie
    joined     the step's dots joined along a dimension each thread keeps, the terms
               broadcast over it once a step

and "gluon", a8_gluon.py's kernels for Q4_K and Q6_K on CUDA (operands straight into the MMA's
registers), or "ring", a8_ring.py's (the operands through a ring of super-blocks in shared
memory; Q8_0 and IQ4_XS too): a8_mm's default at a8_gluon.GLUON_TILES' tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.arrive import counters
from strata.kernels.pdl import enter, launch_options
from strata.kernels.quant.a8 import Codes
from strata.kernels.quant.a8_gemv import add_in_order, group_term
from strata.kernels.quant.a8_parts import add_parts, finish_parts, k_parts, store_rows
from strata.kernels.quant.blocks import BLOCKS, Part
from strata.kernels.quant.reads import (IQ4_NL, IQ4_XS, Q8_0, TYPE_IDS, _codes, _planes,
                                        _term_loads, _term_values, _terms)

DOTS = ("diagonal", "batched", "groups", "direct", "joined")   # ways to the groups' sums
GLUONS = ("gluon", "ring")   # a8_gluon.py's and a8_ring.py's kernels (Q4_K, Q6_K, Q8_0, CUDA)
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
def _a8_mm_kernel(q_ptr, dx_ptr, qs_ptr, p0, p1, p2, p3, s0, s1, s2, s3, res_ptr, out_ptr,
                  fin_ptr, count_ptr, M, N, K, stride_rm, stride_om,
                  QTYPE: tl.constexpr, S: tl.constexpr, HAS_RES: tl.constexpr,
                  FIXUP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEP: tl.constexpr,
                  DOT: tl.constexpr, P: tl.constexpr, AHEAD: tl.constexpr,
                  PDL: tl.constexpr):
    """The MMA tiles (16 to 64 rows); the GEMV's are a8_gemv.py's. Program (row block,
    column block, part of K): each K step's groups' exact sums come from int8 dots
    (_step_dot, DOT the index of the way in DOTS: the same integers, so the same bits), the
    part's terms added in order from zero; its sum into out,
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
    if DOT == 4:
        return _step_joined(acc, q_ptr, dx_ptr, qs_ptr, p0, p1, p2, p3, s0, s1, s2, s3, m,
                            m_ok, n, n_ok, K, k0, QTYPE, S, STEP, BLOCK_M, BLOCK_N)
    if DOT == 3:
        return _step_direct(acc, q_ptr, dx_ptr, qs_ptr, p0, p1, p2, p3, s0, s1, s2, s3, m,
                            m_ok, n, n_ok, K, k0, QTYPE, S, STEP, BLOCK_M, BLOCK_N)
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
    gi = tl.arange(0, G)
    k32 = tl.arange(0, 32)
    if SIGNED:                                                # signed: a * (u - 128), b = 0
        b = b * 0.0
    for c in tl.static_range(STEP // 32):
        u, q = _chunk_operands(q_ptr, p0, p1, s0, s1, m, m_ok, n, n_ok, K, k0, c, QTYPE, S,
                               BLOCK_N)
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


@triton.jit
def _step_direct(acc, q_ptr, dx_ptr, qs_ptr, p0, p1, p2, p3, s0, s1, s2, s3, m, m_ok, n, n_ok,
                 K, k0, QTYPE: tl.constexpr, S: tl.constexpr, STEP: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """_step_dot's fourth way (DOT 3): _step_groups' dot a group of 32, each group's terms
    (the weight's a and b [BN], the rows' scales and sums of codes [BM]) loaded by themselves,
    which lets Triton load them in the layout of the sums instead of picking each group's
    from the step's and moving it there."""
    for c in tl.static_range(STEP // 32):
        lo, hi = _chunk_sums(q_ptr, p0, p1, s0, s1, m, m_ok, n, n_ok, K, k0, c, QTYPE, S,
                             BLOCK_N)
        acc = _chunk_terms(acc, lo, hi, dx_ptr, qs_ptr, p2, p3, s2, s3, m, m_ok, n, n_ok, K,
                           k0 + 32 * c, QTYPE, S, BLOCK_M)
    return acc


@triton.jit
def _chunk_terms(acc, lo, hi, dx_ptr, qs_ptr, p2, p3, s2, s3, m, m_ok, n, n_ok, K, k,
                 QTYPE: tl.constexpr, S: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc + the terms of the groups in quants k .. k + 31 (_chunk_sums' lo, hi), each
    group's terms loaded by themselves."""
    SIGNED: tl.constexpr = QTYPE == Q8_0 or QTYPE == IQ4_NL or QTYPE == IQ4_XS
    for h in tl.static_range(32 // S):
        g = k // S + h
        a, b = _terms(p2, p3, s2, s3, n, n_ok, g, QTYPE, 1)             # [BN, 1]
        if SIGNED:
            b = b * 0.0
        qs, dx = _row_scales(qs_ptr, dx_ptr, m, m_ok, K, g, 1, S)       # [BM, 1]
        dg = tl.reshape(dx, (1, BLOCK_M))
        cg = tl.reshape(qs.to(tl.float32), (1, BLOCK_M)) * dg
        acc += group_term(lo if h == 0 else hi, a * dg, b * cg)
    return acc


@triton.jit
def _chunk_operands(q_ptr, p0, p1, s0, s1, m, m_ok, n, n_ok, K, k0, c: tl.constexpr,
                    QTYPE: tl.constexpr, S: tl.constexpr, BLOCK_N: tl.constexpr):
    """The int8 dot's operands of quants k0 + 32 c .. + 31: the weight's codes [BN, 32] (the
    signed types' less 128) and the rows' codes [32, BM]."""
    SIGNED: tl.constexpr = QTYPE == Q8_0 or QTYPE == IQ4_NL or QTYPE == IQ4_XS
    k32 = tl.arange(0, 32)
    u = tl.reshape(_codes(p0, p1, s0, s1, n, n_ok, k0 // S + c * (32 // S), QTYPE, S, 32 // S,
                          BLOCK_N), (BLOCK_N, 32))
    if SIGNED:
        u = u - 128
    u = u.to(tl.int8)
    q = tl.trans(tl.load(q_ptr + m[:, None] * K + k0 + 32 * c + k32[None, :],
                         mask=m_ok[:, None], other=0))                    # [32, BM]
    return u, q


@triton.jit
def _chunk_sums(q_ptr, p0, p1, s0, s1, m, m_ok, n, n_ok, K, k0, c: tl.constexpr,
                QTYPE: tl.constexpr, S: tl.constexpr, BLOCK_N: tl.constexpr):
    """The integer sums [BN, BM] of the two groups of 16 in quants k0 + 32 c .. + 31 (S 16:
    the pair's codes twice, the other group's activation codes zeroed), or twice the one group
    of 32."""
    k32 = tl.arange(0, 32)
    u, q = _chunk_operands(q_ptr, p0, p1, s0, s1, m, m_ok, n, n_ok, K, k0, c, QTYPE, S, BLOCK_N)
    if S == 16:
        lo = tl.dot(u, tl.where((k32 < 16)[:, None], q, 0).to(tl.int8), out_dtype=tl.int32)
        hi = tl.dot(u, tl.where((k32 < 16)[:, None], 0, q).to(tl.int8), out_dtype=tl.int32)
        return lo, hi
    isum = tl.dot(u, q, out_dtype=tl.int32)
    return isum, isum


@triton.jit
def _in_order(x0, x1, x2, x3, x4, x5, x6, x7, C: tl.constexpr):
    """[D0, D1, C]: x0 .. x(C - 1) [D0, D1] stacked along a last dimension that stays in the
    thread (joins, even and odd halves: flat index 2i + h is the (2i + h)-th)."""
    if C == 1:
        return x0[:, :, None]
    elif C == 2:
        return tl.join(x0, x1)
    elif C == 4:
        return tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)),
                          (x0.shape[0], x0.shape[1], 4))
    else:
        return tl.reshape(tl.join(tl.join(tl.join(x0, x4), tl.join(x2, x6)),
                                  tl.join(tl.join(x1, x5), tl.join(x3, x7))),
                          (x0.shape[0], x0.shape[1], 8))


@triton.jit
def _step_joined(acc, q_ptr, dx_ptr, qs_ptr, p0, p1, p2, p3, s0, s1, s2, s3, m, m_ok, n, n_ok,
                 K, k0, QTYPE: tl.constexpr, S: tl.constexpr, STEP: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """_step_dot's fifth way (DOT 4): a dot a group of 32 (_chunk_sums), the step's sums joined
    into [BN, BM, G] along a last dimension each thread keeps (_in_order), the step's terms
    broadcast over it and added in order (add_in_order), as the batched way's."""
    SIGNED: tl.constexpr = QTYPE == Q8_0 or QTYPE == IQ4_NL or QTYPE == IQ4_XS
    G: tl.constexpr = STEP // S
    C: tl.constexpr = STEP // 32
    g0 = k0 // S
    a0, b0 = _chunk_sums(q_ptr, p0, p1, s0, s1, m, m_ok, n, n_ok, K, k0, 0, QTYPE, S, BLOCK_N)
    a1, b1, a2, b2, a3, b3 = a0, b0, a0, b0, a0, b0
    a4, b4, a5, b5, a6, b6, a7, b7 = a0, b0, a0, b0, a0, b0, a0, b0
    if C > 1:
        a1, b1 = _chunk_sums(q_ptr, p0, p1, s0, s1, m, m_ok, n, n_ok, K, k0, 1, QTYPE, S, BLOCK_N)
    if C > 2:
        a2, b2 = _chunk_sums(q_ptr, p0, p1, s0, s1, m, m_ok, n, n_ok, K, k0, 2, QTYPE, S, BLOCK_N)
        a3, b3 = _chunk_sums(q_ptr, p0, p1, s0, s1, m, m_ok, n, n_ok, K, k0, 3, QTYPE, S, BLOCK_N)
    if C > 4:
        a4, b4 = _chunk_sums(q_ptr, p0, p1, s0, s1, m, m_ok, n, n_ok, K, k0, 4, QTYPE, S, BLOCK_N)
        a5, b5 = _chunk_sums(q_ptr, p0, p1, s0, s1, m, m_ok, n, n_ok, K, k0, 5, QTYPE, S, BLOCK_N)
        a6, b6 = _chunk_sums(q_ptr, p0, p1, s0, s1, m, m_ok, n, n_ok, K, k0, 6, QTYPE, S, BLOCK_N)
        a7, b7 = _chunk_sums(q_ptr, p0, p1, s0, s1, m, m_ok, n, n_ok, K, k0, 7, QTYPE, S, BLOCK_N)
    isum = _in_order(a0, a1, a2, a3, a4, a5, a6, a7, C)
    if S == 16:
        isum = tl.reshape(tl.join(isum, _in_order(b0, b1, b2, b3, b4, b5, b6, b7, C)),
                          (BLOCK_N, BLOCK_M, G))
    a, b = _terms(p2, p3, s2, s3, n, n_ok, g0, QTYPE, G)                 # [BN, G]
    if SIGNED:
        b = b * 0.0
    qs, dx = _row_scales(qs_ptr, dx_ptr, m, m_ok, K, g0, G, S)          # [BM, G]
    c = qs.to(tl.float32) * dx
    t = group_term(isum, a[:, None, :] * dx[None, :, :], b[:, None, :] * c[None, :, :])
    return add_in_order(acc, t, BLOCK_N, BLOCK_M, G)


def a8_mma(x: Codes, part: Part, res: torch.Tensor | None, out: torch.Tensor, block_m: int,
           block_n: int, block_k: int, warps: int, dot: str, ahead: bool, parts: int
           ) -> torch.Tensor:
    """out [M, N] (+ res) = x's rows @ part^T by the MMA (a8_triton.a8_mm checks the blocks);
    dot "gluon" or "ring": by a8_gluon.py's kernels (Q4_K and Q6_K, on CUDA) or a8_ring.py's
    (a8_ring.RING_TYPES), their own blocks."""
    if dot == "gluon":
        from strata.kernels.quant.a8_gluon import gluon_mm
        return gluon_mm(x, part, res, out, block_m=block_m, parts=parts)
    if dot == "ring":   # where no ring fits the device's shared memory, the registers' kernel
        # (Q4_K, Q6_K; 2 stages of the others' fit every GPU from sm_80: 84 KB at 64 rows)
        from strata.kernels.quant.a8_gluon import GLUON_TYPES, gluon_mm
        from strata.kernels.quant.a8_ring import ring_mm, ring_stages
        if part.qtype not in GLUON_TYPES or ring_stages(part, 64, block_m, x.q.device)[0]:
            return ring_mm(x, part, res, out, block_m=block_m, parts=parts)
        return gluon_mm(x, part, res, out, block_m=block_m, parts=parts)
    q = x.q
    m, k = q.shape
    p = k_parts(part.rows, k, parts)
    r = res if res is not None else out
    dst = out if p == 1 else torch.empty(p, m, part.rows, dtype=torch.float32, device=q.device)
    planes, strides = _planes(part)
    grid = (triton.cdiv(m, block_m), triton.cdiv(part.rows, block_n), p)
    count = counters(q.device, grid[0] * grid[1]) if p > 1 else None
    _a8_mm_kernel[grid](q, x.dx, x.qs, *planes, *strides, r, dst, out,
                        q if count is None else count, m, part.rows, k, r.stride(0),
                        out.stride(0), QTYPE=TYPE_IDS[part.qtype], S=BLOCKS[part.qtype][2],
                        HAS_RES=res is not None, FIXUP=count is not None, BLOCK_M=block_m,
                        BLOCK_N=block_n, STEP=block_k, DOT=DOTS.index(dot), P=p,
                        AHEAD=ahead, num_warps=warps,
                        enable_fp_fusion=False,   # a8_triton.py: no tile-dependent FMAs
                        **launch_options(q.device))
    if p > 1 and count is None:
        add_parts(dst, res, out)
    return out
