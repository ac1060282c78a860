"""A super-block's group terms for a8_gemv1.py, a thread a column, by the weight's type: `_sb`
(Q6_K: 16 groups of 16, their qh bits above the nibbles; Q4_K, Q5_K, Q8_0 and IQ4_XS: 8 groups
of 32, the last two taken signed). Each term is
a8_gemv.group_term of reads._term_values' a and b, added in K's order; integers become floats
by the magic number where the value allows (no conversion instruction)."""
from __future__ import annotations

import triton
import triton.language as tl

from strata.kernels.quant.a8_gemv import HIGH_NIBBLES, _codebook_pairs, _dp4a, group_term
from strata.kernels.quant.reads import IQ4_XS, Q4_K, Q5_K, Q6_K, Q8_0
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
    get_scale_min_k4) from the three scale words, as a8_gluon._q4k_terms in Gluon."""
    SH: tl.constexpr = 8 * (J % 4)
    if J < 4:
        sc = (v0 >> SH) & 63
        mn = (v1 >> SH) & 63
    else:
        sc = ((v2 >> SH) & 15) | (((v0 >> (SH + 6)) & 3) << 4)
        mn = ((v2 >> (SH + 4)) & 15) | (((v1 >> (SH + 6)) & 3) << 4)
    return (d * _float(sc))[:, None], (nd * _float(mn))[:, None]


@triton.jit
def _dp4a0(a, b, ASM: tl.constexpr):
    """The sum of a's four unsigned bytes times b's four signed bytes (a8_gemv._dp4a from
    zero: the immediate 0, no register to clear)."""
    a, b = tl.broadcast(a, b)
    if ASM:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return _dp4a(a, b, 0, ASM)


@triton.jit
def _rows(p, nc):
    """The rows' values at p [R, W] (the same in every thread), loaded by each thread into
    its own [BN, R, W] copy: a thread then holds what its column's sums take, and no layout
    moves them between threads."""
    return tl.load(p[None, :, :] + 0 * nc[:, None, None])


@triton.jit
def _pairs(a):
    """[BN, R, 4] words of the rows -> words 0, 1, 2, 3 as [BN, R] tensors: the even and odd
    words (pair order) of two code words, (e0, o0, e1, o1)."""
    even, odd = tl.split(tl.reshape(a, (a.shape[0], a.shape[1], 2, 2)))
    e0, e1 = tl.split(even)
    o0, o1 = tl.split(odd)
    return e0, o0, e1, o1


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
    """A Q6_K group's integer sums [BN, R]: its 2 qs words and qh word h ([BN, 1]), the
    rows' 4 words ([1, R])."""
    lo, hi = _q6k_codes(w0, h)
    s = _dp4a(hi, o0, _dp4a0(lo, e0, ASM), ASM)
    lo, hi = _q6k_codes(w1, h >> 2)
    return _dp4a(hi, o1, _dp4a(lo, e1, s, ASM), ASM)


@triton.jit
def _q6k_block(acc, w, ha, hb, sa, sb, a0, a1, dc, d, ASM: tl.constexpr):
    """acc [BN, R] + the terms of a block's two Q6_K groups of 16, in order: their 4 qs
    words w [BN, 4], qh words ha, hb and int8 scales sa, sb ([BN] each), the rows' 8 words
    (a0, a1 [R, 4]) and the block's dc [R, 4] (dx, c, c0, c1: c0 and c1 each half's codes'
    sum times dx); a = d sc, b = -32 a (reads._term_values')."""
    w0, w1, w2, w3 = _scalars4(w)
    e0, o0, e1, o1 = _pairs(a0)
    e2, o2, e3, o3 = _pairs(a1)
    dx_c0, c_c1 = tl.split(tl.reshape(dc, (dc.shape[0], dc.shape[1], 2, 2)))   # (dx, c0), (c, c1)
    dx, c0 = tl.split(dx_c0)
    _, c1 = tl.split(c_c1)
    a = (d * _signed_float(sa))[:, None]
    acc = acc + group_term(_q6k_group(w0[:, None], w1[:, None], ha[:, None], e0, o0, e1, o1, ASM),
                           dx * a, c0 * (-32.0 * a))
    a = (d * _signed_float(sb))[:, None]
    return acc + group_term(_q6k_group(w2[:, None], w3[:, None], hb[:, None], e2, o2, e3, o3,
                                       ASM), dx * a, c1 * (-32.0 * a))


@triton.jit
def _q6k_sb(acc, p0, p1, p2, p3, s0, s1, s2, s3, nc, sb, ap, dp, ASM: tl.constexpr):
    """acc [BN, R] + a Q6_K super-block's 16 group terms in order (groups of 16 quants, two
    a block of 32): its 32 qs words, 16 qh words, 16 int8 scales and d of columns nc against
    the rows' 64 words at ap and their 8 blocks' dc at dp ([R, 4] pointers); a quad of
    groups a step."""
    wp = p0 + nc[:, None] * s0 + 32 * sb + tl.arange(0, 4)[None, :]
    hp = p1 + nc[:, None] * s1 + 16 * sb + tl.arange(0, 4)[None, :]
    sp = p2 + nc[:, None] * s2 + 16 * sb + tl.arange(0, 4)[None, :]
    d = tl.load(p3 + nc * s3 + sb).to(tl.float32)
    for q in tl.static_range(4):   # groups 4q .. 4q + 3: blocks 2q and 2q + 1
        h0, h1, h2, h3 = _scalars4(tl.load(hp + 4 * q))
        c0, c1, c2, c3 = _scalars4(tl.load(sp + 4 * q))
        acc = _q6k_block(acc, tl.load(wp + 8 * q), h0, h1, c0, c1, _rows(ap + 16 * q, nc),
                         _rows(ap + 16 * q + 4, nc), _rows(dp + 8 * q, nc), d, ASM)
        acc = _q6k_block(acc, tl.load(wp + 8 * q + 4), h2, h3, c2, c3,
                         _rows(ap + 16 * q + 8, nc), _rows(ap + 16 * q + 12, nc),
                         _rows(dp + 8 * q + 4, nc), d, ASM)
    return acc


@triton.jit
def _codes32(w, p1, s1, nc, g, QT: tl.constexpr, ASM: tl.constexpr):
    """Group g's 4 code words w [BN, 4] of Q4_K, Q5_K (its qh word's bits above the nibbles),
    Q8_0 (its high nibbles' words) or IQ4_XS (codebook values + 128) -> each word's even and
    odd bytes as 8 [BN] tensors (lo0, hi0, .. lo3, hi3), a8_gemv._gemv_step's (Q4_K's odd
    bytes left in place, 16 times their codes)."""
    w0, w1, w2, w3 = _scalars4(w)
    if QT == Q4_K:   # the high nibbles in place: 16 times their codes (_sb32 shifts back)
        l0, h0 = w0 & 0x0F0F0F0F, w0 & HIGH_NIBBLES
        l1, h1 = w1 & 0x0F0F0F0F, w1 & HIGH_NIBBLES
        l2, h2 = w2 & 0x0F0F0F0F, w2 & HIGH_NIBBLES
        l3, h3 = w3 & 0x0F0F0F0F, w3 & HIGH_NIBBLES
    elif QT == Q5_K:
        h = tl.load(p1 + nc * s1 + g)
        l0, h0 = _q5_codes(w0, h)
        l1, h1 = _q5_codes(w1, h >> 1)
        l2, h2 = _q5_codes(w2, h >> 2)
        l3, h3 = _q5_codes(w3, h >> 3)
    elif QT == Q8_0:
        x0, x1, x2, x3 = _scalars4(tl.load(p1 + nc[:, None] * s1 + 4 * g
                                           + tl.arange(0, 4)[None, :]))
        l0, h0 = _q8_codes(w0, x0)
        l1, h1 = _q8_codes(w1, x1)
        l2, h2 = _q8_codes(w2, x2)
        l3, h3 = _q8_codes(w3, x3)
    else:   # IQ4_XS
        l0, h0 = _codebook_pairs(w0, ASM)
        l1, h1 = _codebook_pairs(w1, ASM)
        l2, h2 = _codebook_pairs(w2, ASM)
        l3, h3 = _codebook_pairs(w3, ASM)
    return l0, h0, l1, h1, l2, h2, l3, h3


@triton.jit
def _q5_codes(w, x):
    """A Q5_K qs word and its group's qh word shifted to it (a bit a code) -> even, odd bytes."""
    return ((w & 0x0F0F0F0F) | ((x & 0x01010101) << 4),
            ((w >> 4) & 0x0F0F0F0F) | (((x >> 4) & 0x01010101) << 4))


@triton.jit
def _q8_codes(w, x):
    """A Q8_0 word of low nibbles and its word of high nibbles -> even, odd bytes (u + 128)."""
    return ((w & 0x0F0F0F0F) | ((x << 4) & HIGH_NIBBLES),
            ((w >> 4) & 0x0F0F0F0F) | (x & HIGH_NIBBLES))


@triton.jit
def _sb32(acc, p0, p1, p2, p3, s0, s1, s2, s3, nc, sb, ap, dp, qsp, NW, QT: tl.constexpr,
          ASM: tl.constexpr, QMAJOR: tl.constexpr):
    """acc [BN, R] + a Q4_K, Q5_K, Q8_0 or IQ4_XS super-block's 8 group terms of columns nc,
    in order, as a8_gemv._gemv_step takes them: reads._term_values' a and b (Q8_0 and IQ4_XS:
    their codes taken signed, u - 128, the group's sum less 128 times the row's codes' sum
    from the qs plane at qsp, [R, 1] pointers, and b zeroed); the rows' words at ap, dx and c
    at dp ([R, 4], [R, 2] pointers). QMAJOR: the qs plane p0 laid out a group before the next
    ([K / 32, NW, 4] words: a8_gemv1.group_major), so a warp's columns read side by side."""
    SIGNED: tl.constexpr = QT == Q8_0 or QT == IQ4_XS
    if QMAJOR:
        wp = p0 + nc[:, None] * 4 + (8 * sb) * (4 * NW) + tl.arange(0, 4)[None, :]
        gs = 4 * NW
    else:
        wp = p0 + nc[:, None] * s0 + 32 * sb + tl.arange(0, 4)[None, :]
        gs = 4
    if QT == Q4_K or QT == Q5_K:   # 6-bit scales and mins
        base = p2 + nc * s2 + 3 * sb
        v0, v1, v2 = tl.load(base), tl.load(base + 1), tl.load(base + 2)
        d = tl.load(p3 + nc * s3 + 2 * sb).to(tl.float32)
        nd = -tl.load(p3 + nc * s3 + 2 * sb + 1).to(tl.float32)
    elif QT == IQ4_XS:   # scales_h, scales_l (groups 0-3, 4-7), d
        base = p2 + nc * s2 + 3 * sb
        high = tl.load(base).to(tl.int32) & 0xFFFF
        low03 = tl.load(base + 1).to(tl.int32) & 0xFFFF
        low47 = tl.load(base + 2).to(tl.int32) & 0xFFFF
        d = tl.load(p3 + nc * s3 + sb).to(tl.float32)
    for j in tl.static_range(8):
        g = 8 * sb + j
        l0, h0, l1, h1, l2, h2, l3, h3 = _codes32(tl.load(wp + gs * j), p1, s1, nc, g, QT, ASM)
        l0, h0, l1, h1 = l0[:, None], h0[:, None], l1[:, None], h1[:, None]
        l2, h2, l3, h3 = l2[:, None], h2[:, None], l3[:, None], h3[:, None]
        e0, o0, e1, o1 = _pairs(_rows(ap + 8 * j, nc))
        e2, o2, e3, o3 = _pairs(_rows(ap + 8 * j + 4, nc))
        isum = _dp4a(l3, e3, _dp4a(l2, e2, _dp4a(l1, e1, _dp4a0(l0, e0, ASM), ASM), ASM), ASM)
        if QT == Q4_K:   # a chain of its own, shifted back exactly
            hi = _dp4a(h3, o3, _dp4a(h2, o2, _dp4a(h1, o1, _dp4a0(h0, o0, ASM), ASM), ASM), ASM)
            isum = isum + (hi >> 4)
        else:
            isum = _dp4a(h3, o3, _dp4a(h2, o2, _dp4a(h1, o1, _dp4a(h0, o0, isum, ASM), ASM), ASM),
                         ASM)
        if QT == Q4_K or QT == Q5_K:
            a, b = _q4k_ab(v0, v1, v2, d, nd, j)
        elif QT == Q8_0:
            a = tl.load(p2 + nc * s2 + g).to(tl.float32)[:, None]
            b = -128.0 * a
        else:
            ls = (((low03 if j < 4 else low47) >> (4 * (j % 4))) & 15) | (
                ((high >> (2 * j)) & 3) << 4)
            a = (d * (ls - 32).to(tl.float32))[:, None]
            b = -128.0 * a
        if SIGNED:
            q0, q1 = tl.split(_rows(qsp + 2 * g + tl.arange(0, 2)[None, :], nc))
            isum = isum - 128 * (q0 + q1)
            b = b * 0.0
        dx, c = tl.split(_rows(dp + 4 * j, nc))
        acc = acc + group_term(isum, dx * a, c * b)
    return acc


@triton.jit
def _sb(acc, p0, p1, p2, p3, s0, s1, s2, s3, nc, sb, ap, dp, dp4, qsp, NW, QT: tl.constexpr,
        ASM: tl.constexpr, QMAJOR: tl.constexpr):
    """acc [BN, R] + super-block sb's group terms of columns nc against the rows', in order,
    by the weight's type."""
    if QT == Q6_K:
        return _q6k_sb(acc, p0, p1, p2, p3, s0, s1, s2, s3, nc, sb, ap, dp4, ASM)
    else:
        return _sb32(acc, p0, p1, p2, p3, s0, s1, s2, s3, nc, sb, ap, dp, qsp, NW, QT, ASM,
                     QMAJOR)
