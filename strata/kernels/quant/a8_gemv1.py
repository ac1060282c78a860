"""The 1-row GEMV a thread a column (Q4_K and Q6_K; behind STRATA_A8_GEMV1=1): a8_gemv.py's
arithmetic for windows of one row, laid out so that nothing crosses threads; a8_mm's
projections and a8_gate_up_silu's [gate | up] (a8_gemv1_gated: a thread the same column of
both halves, act(gate) * up and its rows quantized for the down projection, as a8_gated.py
writes them).

a8_gemv.py's programs spread a column's K step over several threads: each group's integer sum
is theirs to add, and the group terms, which must be added one by one in K's order, then move
between threads (shuffles) to the one that adds them. Here a thread holds one column: for each
group it takes the column's code words ([BLOCK_N, 4] words 4 to a thread, so Triton keeps a
column in one thread), the row's code words and its dx and c ([4] and [2] vectors, the same in
every thread), sums the group by chains of dp4a, and adds the group's term to its own
accumulator, group after group along the part: a super-block a loop step, its scales loaded
once and its groups unrolled. Counted for sm_90 with Triton 3.6 (`tools/sass_count.py --kernel
a8-gemv1 --block-n 128 --warps 4 --stages 1|3`): Q4_K 1.39 instructions a weight (1.66 with
the loads pipelined through shared memory) against a8_gemv's 4.70 (`--kernel a8-gemv --block-n
32`), Q6_K 2.11 (2.5) against 7.03 (`--block-n 16 --stages 3`); not yet timed
(tools/gpu/bench_gemv1.py).

The bits are a8_mm's (tests/kernels/test_quant_a8_gemv1.py): the same group terms
(a8_gemv.group_term of reads._term_values' a and b, dx and c = qs dx from the quantizer's dc
plane), added from zero in K's order within each part, the parts as a8_parts adds them.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from strata.kernels.arrive import counters
from strata.kernels.fused_triton import ACTS
from strata.kernels.pdl import enter, launch_options
from strata.kernels.quant.a8 import Codes
from strata.kernels.quant.a8_gemv import HIGH_NIBBLES, _dp4a, gated_rows, group_term
from strata.kernels.quant.a8_parts import (PARTS, add_parts, finish_parts, gemv_step, k_parts,
                                           store_rows)
from strata.kernels.quant.blocks import Part
from strata.kernels.quant.reads import _planes

TYPES = ("Q4_K", "Q6_K")


def gemv1_fits(part: Part, m: int, k: int) -> bool:
    """Whether a8_mm takes this kernel: asked for (STRATA_A8_GEMV1=1), one row, a Q4_K or
    Q6_K weight (K whole super-blocks)."""
    return (os.environ.get("STRATA_A8_GEMV1") == "1" and m == 1 and part.qtype in TYPES
            and gemv_step(k) == 256)


def gated_fits(part: Part, m: int, k: int, codes: bool) -> bool:
    """Whether a8_gate_up_silu takes a8_gemv1_gated: as gemv1_fits, K in one part, and with
    codes the halves whole blocks of 128 columns (a program's)."""
    f = part.rows // 2
    return (gemv1_fits(part, m, k) and part.rows % 2 == 0 and k_parts(part.rows, k) == 1
            and (not codes or f % 128 == 0))


@triton.jit
def _float(u):
    """An integer 0 .. 2^23 - 1 as fp32 by the magic number (no conversion instruction)."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _signed_float(v):
    """An int8 as fp32 by the magic number: (v + 128) as 2^23 + v + 128, less 2^23 + 128."""
    return ((v.to(tl.int32) + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _q4k_ab(v0, v1, v2, d, nd, J: tl.constexpr):
    """a, b [BN] of group J of a Q4_K super-block (reads._term_values' arithmetic: d sc and
    -(dmin mn), here as (-dmin) mn, the same bits): its 6-bit scale and min (llama.cpp's
    get_scale_min_k4) from the three scale words."""
    SH: tl.constexpr = 8 * (J % 4)
    if J < 4:
        sc = (v0 >> SH) & 63
        mn = (v1 >> SH) & 63
    else:
        sc = ((v2 >> SH) & 15) | (((v0 >> (SH + 6)) & 3) << 4)
        mn = ((v2 >> (SH + 4)) & 15) | (((v1 >> (SH + 6)) & 3) << 4)
    return d * _float(sc), nd * _float(mn)


@triton.jit
def _dp4a0(a, b, ASM: tl.constexpr):
    """The sum of a's four unsigned bytes times b's four signed bytes (a8_gemv._dp4a from
    zero: the immediate 0, no register to clear)."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return _dp4a(a, b, 0, ASM)


@triton.jit
def _pairs(a):
    """A [4] word vector (the same in every thread) -> its words 0, 2 and 1, 3 as scalars."""
    even, odd = tl.split(tl.reshape(a, (2, 2)))
    e0, e1 = tl.split(even)
    o0, o1 = tl.split(odd)
    return e0, o0, e1, o1


@triton.jit
def _dot8(w, a0, a1, ASM: tl.constexpr):
    """A group's integer sum [BN]: its 4 code words (w [BN, 4]) against the row's 8 words in
    pair order (a0, a1 [4]: even and odd words of code words 0, 1 and of 2, 3), a chain of
    dp4a for the low nibbles and one for the high ones, taken in place (16 times their value:
    that chain's sum shifted back, exactly). The splits move values within a thread."""
    w02, w13 = tl.split(tl.reshape(w, (w.shape[0], 2, 2)))       # (w0, w2), (w1, w3)
    w0, w2 = tl.split(w02)
    w1, w3 = tl.split(w13)
    e0, o0, e1, o1 = _pairs(a0)
    e2, o2, e3, o3 = _pairs(a1)
    lo = _dp4a0(w0 & 0x0F0F0F0F, e0, ASM)
    lo = _dp4a(w1 & 0x0F0F0F0F, e1, lo, ASM)
    lo = _dp4a(w2 & 0x0F0F0F0F, e2, lo, ASM)
    lo = _dp4a(w3 & 0x0F0F0F0F, e3, lo, ASM)
    hi = _dp4a0(w0 & HIGH_NIBBLES, o0, ASM)
    hi = _dp4a(w1 & HIGH_NIBBLES, o1, hi, ASM)
    hi = _dp4a(w2 & HIGH_NIBBLES, o2, hi, ASM)
    hi = _dp4a(w3 & HIGH_NIBBLES, o3, hi, ASM)
    return lo + (hi >> 4)


@triton.jit
def _sb_words(p0, p2, p3, s0, s2, s3, nc, sb):
    """Super-block sb of columns nc: its 32 code words as 8 groups' [BN, 4], its 3 scale
    words and d, -dmin."""
    wp = p0 + nc[:, None] * s0 + 32 * sb + tl.arange(0, 4)[None, :]
    base = p2 + nc * s2 + 3 * sb
    return (tl.load(wp), tl.load(wp + 4), tl.load(wp + 8), tl.load(wp + 12), tl.load(wp + 16),
            tl.load(wp + 20), tl.load(wp + 24), tl.load(wp + 28), tl.load(base),
            tl.load(base + 1), tl.load(base + 2), tl.load(p3 + nc * s3 + 2 * sb).to(tl.float32),
            -tl.load(p3 + nc * s3 + 2 * sb + 1).to(tl.float32))


@triton.jit
def _sb_terms(acc, w0, w1, w2, w3, w4, w5, w6, w7, v0, v1, v2, d, nd, ap, dp,
              ASM: tl.constexpr):
    """acc [BN] + a super-block's 8 group terms in order: its words (_sb_words) against the
    row's code words at ap and its dc at dp ([4] and [2] pointers), all loaded before the
    first dot."""
    a0, a1, a2, a3 = tl.load(ap), tl.load(ap + 4), tl.load(ap + 8), tl.load(ap + 12)
    a4, a5, a6, a7 = tl.load(ap + 16), tl.load(ap + 20), tl.load(ap + 24), tl.load(ap + 28)
    a8, a9, a10, a11 = tl.load(ap + 32), tl.load(ap + 36), tl.load(ap + 40), tl.load(ap + 44)
    a12, a13, a14, a15 = tl.load(ap + 48), tl.load(ap + 52), tl.load(ap + 56), tl.load(ap + 60)
    c0, c1, c2, c3 = tl.load(dp), tl.load(dp + 4), tl.load(dp + 8), tl.load(dp + 12)
    c4, c5, c6, c7 = tl.load(dp + 16), tl.load(dp + 20), tl.load(dp + 24), tl.load(dp + 28)
    acc = _term(acc, w0, a0, a1, c0, v0, v1, v2, d, nd, 0, ASM)
    acc = _term(acc, w1, a2, a3, c1, v0, v1, v2, d, nd, 1, ASM)
    acc = _term(acc, w2, a4, a5, c2, v0, v1, v2, d, nd, 2, ASM)
    acc = _term(acc, w3, a6, a7, c3, v0, v1, v2, d, nd, 3, ASM)
    acc = _term(acc, w4, a8, a9, c4, v0, v1, v2, d, nd, 4, ASM)
    acc = _term(acc, w5, a10, a11, c5, v0, v1, v2, d, nd, 5, ASM)
    acc = _term(acc, w6, a12, a13, c6, v0, v1, v2, d, nd, 6, ASM)
    return _term(acc, w7, a14, a15, c7, v0, v1, v2, d, nd, 7, ASM)


@triton.jit
def _term(acc, w, a0, a1, dc, v0, v1, v2, d, nd, J: tl.constexpr, ASM: tl.constexpr):
    """acc + group J's term (a8_gemv.group_term): its integer sum, a d sc, b -dmin mn, and the
    row's dx and c (dc [2])."""
    a, b = _q4k_ab(v0, v1, v2, d, nd, J)
    dx, c = tl.split(dc)
    return acc + group_term(_dot8(w, a0, a1, ASM), dx * a, c * b)


@triton.jit
def _scalars4(v):
    """[BN, 4] (in-thread) -> its 4 columns as [BN] tensors, in order."""
    v02, v13 = tl.split(tl.reshape(v, (v.shape[0], 2, 2)))
    v0, v2 = tl.split(v02)
    v1, v3 = tl.split(v13)
    return v0, v1, v2, v3


@triton.jit
def _q6k_codes(w, x):
    """A Q6_K qs word (8 low nibbles) and its group's qh word shifted to it (x: two bits a
    code, nibble-aligned) -> the codes' even and odd bytes (a8_gemv._gemv_step's)."""
    lo = (w & 0x0F0F0F0F) | ((x & 0x03030303) << 4)
    hi = ((w >> 4) & 0x0F0F0F0F) | (((x >> 4) & 0x03030303) << 4)
    return lo, hi


@triton.jit
def _q6k_group(w0, w1, h, e0, o0, e1, o1, ASM: tl.constexpr):
    """A Q6_K group's integer sum [BN]: its 2 qs words, its qh word h, the row's 4 words."""
    lo, hi = _q6k_codes(w0, h)
    s = _dp4a(hi, o0, _dp4a0(lo, e0, ASM), ASM)
    lo, hi = _q6k_codes(w1, h >> 2)
    return _dp4a(hi, o1, _dp4a(lo, e1, s, ASM), ASM)


@triton.jit
def _q6k_block(acc, w, ha, hb, sa, sb, a0, a1, dc, d, ASM: tl.constexpr):
    """acc + the terms of a block's two Q6_K groups of 16, in order: their 4 qs words w
    [BN, 4], qh words ha, hb and int8 scales sa, sb ([BN] each), the row's 8 words (a0, a1
    [4]) and the block's dc [4] (dx, c, c0, c1: c0 and c1 each half's codes' sum times dx);
    a = d sc, b = -32 a (reads._term_values')."""
    w0, w1, w2, w3 = _scalars4(w)
    e0, o0, e1, o1 = _pairs(a0)
    e2, o2, e3, o3 = _pairs(a1)
    dx_c0, c_c1 = tl.split(tl.reshape(dc, (2, 2)))   # (dx, c0), (c, c1)
    dx, c0 = tl.split(dx_c0)
    _, c1 = tl.split(c_c1)
    a = d * _signed_float(sa)
    acc = acc + group_term(_q6k_group(w0, w1, ha, e0, o0, e1, o1, ASM), dx * a, c0 * (-32.0 * a))
    a = d * _signed_float(sb)
    return acc + group_term(_q6k_group(w2, w3, hb, e2, o2, e3, o3, ASM), dx * a,
                           c1 * (-32.0 * a))


@triton.jit
def _q6k_sb(acc, p0, p1, p2, p3, s0, s1, s2, s3, nc, sb, ap, dp, ASM: tl.constexpr):
    """acc + a Q6_K super-block's 16 group terms in order (groups of 16 quants, two a block
    of 32): its 32 qs words, 16 qh words, 16 int8 scales and d of columns nc against the
    row's 64 words at ap and its 8 blocks' dc at dp ([4] pointers); a quad of groups a
    step."""
    wp = p0 + nc[:, None] * s0 + 32 * sb + tl.arange(0, 4)[None, :]
    hp = p1 + nc[:, None] * s1 + 16 * sb + tl.arange(0, 4)[None, :]
    sp = p2 + nc[:, None] * s2 + 16 * sb + tl.arange(0, 4)[None, :]
    d = tl.load(p3 + nc * s3 + sb).to(tl.float32)
    for q in tl.static_range(4):   # groups 4q .. 4q + 3: blocks 2q and 2q + 1
        h0, h1, h2, h3 = _scalars4(tl.load(hp + 4 * q))
        c0, c1, c2, c3 = _scalars4(tl.load(sp + 4 * q))
        acc = _q6k_block(acc, tl.load(wp + 8 * q), h0, h1, c0, c1, tl.load(ap + 16 * q),
                         tl.load(ap + 16 * q + 4), tl.load(dp + 8 * q), d, ASM)
        acc = _q6k_block(acc, tl.load(wp + 8 * q + 4), h2, h3, c2, c3,
                         tl.load(ap + 16 * q + 8), tl.load(ap + 16 * q + 12),
                         tl.load(dp + 8 * q + 4), d, ASM)
    return acc


@triton.jit
def _a8_gemv1_kernel(qw_ptr, dc_ptr, p0, p1, p2, p3, s0, s1, s2, s3, res_ptr, out_ptr, fin_ptr,
                     count_ptr, cq_ptr, cqp_ptr, cdx_ptr, cqs_ptr, cdc_ptr, M, N, K, UP,
                     stride_rm, stride_om, HAS_RES: tl.constexpr, FIXUP: tl.constexpr,
                     ASM: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr, L,
                     STAGES: tl.constexpr, ACT: tl.constexpr, CODES: tl.constexpr,
                     Q6: tl.constexpr, PDL: tl.constexpr):
    """Program (row, column block, part of K): the part's L quants of row m against columns
    n, a thread a column; into out, or with P > 1 its part's rows of out (a8_gemv's). ACT >= 0
    (P 1): gate columns n and up columns n + UP, act(gate) * up into out as a8_gemv's
    gated_rows writes it (with CODES those rows quantized into the planes cq .. cdc). Triton
    pipelines the loads STAGES - 1 super-blocks ahead of their sums."""
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    enter(PDL)
    part = tl.program_id(2)
    acc = tl.zeros([BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_N], tl.float32)
    first = part * (L // 256)
    last = first + L // 256 - 1
    nc = tl.minimum(n, N - 1)   # columns past N read the last one (no masks: no registers to
    #                             clear before each load), and are not stored
    ap = qw_ptr + m * (K // 4) + tl.arange(0, 4)   # the row's words, dc: [4], [2] vectors
    dp = dc_ptr + m * (K // 8) + tl.arange(0, 2)   # dx, c (Q4_K)
    dp4 = dc_ptr + m * (K // 8) + tl.arange(0, 4)  # dx, c, c0, c1 (Q6_K: groups of 16)
    for sb in tl.range(first, last + 1, num_stages=STAGES):   # loads STAGES - 1 ahead
        if Q6:
            acc = _q6k_sb(acc, p0, p1, p2, p3, s0, s1, s2, s3, nc, sb, ap + 64 * sb,
                          dp4 + 32 * sb, ASM)
            if ACT >= 0:   # the up half's same columns
                acc_up = _q6k_sb(acc_up, p0, p1, p2, p3, s0, s1, s2, s3, nc + UP, sb,
                                 ap + 64 * sb, dp4 + 32 * sb, ASM)
        else:
            w0, w1, w2, w3, w4, w5, w6, w7, v0, v1, v2, d, nd = _sb_words(p0, p2, p3, s0, s2,
                                                                          s3, nc, sb)
            acc = _sb_terms(acc, w0, w1, w2, w3, w4, w5, w6, w7, v0, v1, v2, d, nd,
                            ap + 64 * sb, dp + 32 * sb, ASM)
            if ACT >= 0:
                w0, w1, w2, w3, w4, w5, w6, w7, v0, v1, v2, d, nd = _sb_words(
                    p0, p2, p3, s0, s2, s3, nc + UP, sb)
                acc_up = _sb_terms(acc_up, w0, w1, w2, w3, w4, w5, w6, w7, v0, v1, v2, d, nd,
                                   ap + 64 * sb, dp + 32 * sb, ASM)
    ms = m + tl.arange(0, 1)
    if ACT >= 0:   # silu_mul's arithmetic on the projection's rounded outputs (one part)
        gated_rows(0.0 + acc[None, :], 0.0 + acc_up[None, :], out_ptr, ms, n, ms < M, n_ok, N,
                   stride_om, cq_ptr, cqp_ptr, cdx_ptr, cqs_ptr, cdc_ptr, ACT, CODES, 1,
                   BLOCK_N // 32)
    elif P == 1:   # the parts' sum from zero, as every kernel adds them
        store_rows(0.0 + acc[None, :], res_ptr, out_ptr, ms, n, ms < M, n_ok, stride_rm,
                   stride_om, HAS_RES)
    else:
        finish_parts(acc[None, :], out_ptr, res_ptr, fin_ptr, count_ptr, ms, n, ms < M, n_ok,
                     M, N, stride_rm, stride_om, part, P, HAS_RES, FIXUP, 1, BLOCK_N)


def a8_gemv1(x: Codes, part: Part, res: torch.Tensor | None, out: torch.Tensor,
             block_n: int = 128, warps: int = 4, stages: int = 3,
             parts: int = PARTS) -> torch.Tensor:
    """out [1, N] = the row x (its codes in pair order and dc plane) @ part^T (+ res), part a
    Q4_K or Q6_K weight [N, K]: a8_gemv's bits for one row (the module says how). block_n: columns a
    program, a thread each (32 x warps)."""
    return _launch(x, part, res, out, -1, None, block_n, warps, stages, parts)


def a8_gemv1_gated(x: Codes, part: Part, act: str, out: torch.Tensor, codes: Codes | None,
                   block_n: int = 128, warps: int = 4, stages: int = 3) -> torch.Tensor:
    """out [1, F] = act(gate) * up of [gate | up] = the row x @ part^T (part [2F, K], Q4_K or
    Q6_K, K in one part), as a8_gated.a8_gate_up writes it, and with codes (F whole blocks of
    block_n) those rows quantized into codes' planes: its bits (the module says how)."""
    assert k_parts(part.rows, part.cols) == 1 and part.rows == 2 * out.shape[1]
    assert codes is None or out.shape[1] % block_n == 0
    return _launch(x, part, None, out, ACTS[act], codes, block_n, warps, stages, PARTS)


def _launch(x: Codes, part: Part, res: torch.Tensor | None, out: torch.Tensor, act: int,
            codes: Codes | None, block_n: int, warps: int, stages: int,
            parts: int) -> torch.Tensor:
    assert part.qtype in TYPES and block_n == 32 * warps
    q = x.qp
    m, k = q.shape
    assert m == 1 and k % 256 == 0 and part.cols == k
    r = res if res is not None else out
    planes, strides = _planes(part)
    cols = out.shape[1]
    p = k_parts(part.rows, k, parts)
    dst = out if p == 1 else torch.empty(p, m, cols, dtype=torch.float32, device=q.device)
    grid = (m, triton.cdiv(cols, block_n), p)
    count = counters(q.device, grid[0] * grid[1]) if p > 1 else None
    c = codes if codes is not None else x
    _a8_gemv1_kernel[grid](q.view(torch.int32), x.dc, *planes, *strides, r, dst, out,
                           q if count is None else count, c.q, c.qp, c.dx, c.qs, c.dc, m, cols,
                           k, cols, r.stride(0), out.stride(0), HAS_RES=res is not None,
                           FIXUP=count is not None, ASM=q.device.type == "cuda",
                           BLOCK_N=block_n, P=p, L=k // p, STAGES=stages, ACT=act,
                           CODES=codes is not None, Q6=part.qtype == "Q6_K", num_warps=warps,
                           **launch_options(q.device),
                           enable_fp_fusion=False)   # as every int8 kernel
    if p > 1 and count is None:
        add_parts(dst, res, out)
    return out
