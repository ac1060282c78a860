"""The GEMV of int8 activations against quantized weights (windows of 1 to 8 rows): a8_mm's
arithmetic (a8.py) with the integer sums taken four products an instruction.

Each K step of 256 quants (fewer where K is short) reads a column's codes as 32-bit words of
four bytes and the rows' int8 codes as words, and sums them with dp4a (PTX `dp4a.u32.s32`:
four unsigned bytes times four signed bytes, added to an int32). Where a type's codes are
nibbles (Q4_0, Q4_1, Q4_K), two nibble planes (Q8_0) or nibbles with high bits beside them
(Q5_0, Q5_1, Q5_K, Q6_K: a word of the group's high bits, nibble-aligned), a word of eight
codes gives its two byte words by masks and shifts, against the rows' codes as the quantizer
also stores them, in pair order (codes 0, 2, 4, 6 and 1, 3, 5, 7 of each eight): Q6_K's
16-code groups by one chain of dp4a a group (but in 4-row tiles), the rest by summing the
words' products. The codebook types (IQ4_NL, IQ4_XS) have nibbles too, looked up into their
codebook values + 128 a word at a time (_codebook_asm: prmt, 13 instructions for eight codes),
in the same pair order. Then, per
(row, column), the groups' float terms (group_term) are added one by one in order along K,
exactly as a8_mm's MMA adds them, so a row gets the same bits from either kernel
(tests/kernels/test_quant_a8.py). Under the Triton interpreter, dp4a is the same sum of four
products written out. For a [gate | up] weight (a8_gated.py) a program takes the same columns
of both halves, writes act(gate) * up and can quantize those rows for the down projection
(quantize_blocks, the row quantizer's arithmetic). K's parts and their sums: a8_parts.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from strata.kernels.arrive import arrive, counters
from strata.kernels.fused_triton import gate_act
from strata.kernels.pdl import enter, launch_options
from strata.kernels.quant.a8 import Codes
from strata.kernels.quant.a8_parts import (PARTS, add_parts, finish_parts, gemv_step, k_parts,
                                           load_parts, store_rows, tile_index)
from strata.kernels.quant.blocks import BLOCKS, Part, program_width
from strata.kernels.quant.reads import (IQ4_NL, IQ4_W0, IQ4_W1, IQ4_W2, IQ4_W3, IQ4_XS, Q5_0,
                                        Q5_1, Q5_K, Q6_K, Q8_0, TYPE_IDS, _planes, _terms)

HIGH_NIBBLES = tl.constexpr(0xF0F0F0F0 - (1 << 32))   # as int32


@dataclass(frozen=True)
class Pairs:
    """Routed experts' (row, expert) pairs as the GEMV reads them: pair p is activation row
    p // per against weight rows ids[p] * erows + w0 .. + n - 1 (ids int32 [P], a window's
    experts [M, k] flattened: per k; or per 1 where the activation rows are the pairs')."""
    ids: torch.Tensor
    per: int
    erows: int
    w0: int
    n: int

    @staticmethod
    def args(pairs: Pairs | None, dummy: torch.Tensor) -> tuple:
        """The kernel's (ids_ptr, per, erows, w_0)."""
        if pairs is None:
            return dummy, 1, 0, 0
        return pairs.ids, pairs.per, pairs.erows, pairs.w0


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """c + the sum of a's four unsigned bytes times b's four signed bytes (int32 words)."""
    a, b = tl.broadcast(a, b)
    c = a * 0 + c
    if ASM:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                         [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
    else:   # the four bytes along a new last axis: few operations for Triton's interpreter
        at: tl.constexpr = len(a.shape)
        shift = tl.arange(0, 4) * 8
        ua = (tl.expand_dims(a, at) >> shift) & 0xFF
        sb = (tl.expand_dims(b, at) << (24 - shift)) >> 24
        return c + tl.sum(ua * sb, at)


@triton.jit
def _add8(acc, t, D0: tl.constexpr, D1: tl.constexpr):
    """acc + t[..., 0] + t[..., 1] + ... + t[..., 7], one by one: t [D0, D1, 8] is taken
    apart by splits (g = 4a + 2b + c), which move values, never add them."""
    c0, c1 = tl.split(tl.reshape(t, (D0, D1, 2, 2, 2)))       # [D0, D1, a, b]
    c0b0, c0b1 = tl.split(c0)                                 # [D0, D1, a]
    c1b0, c1b1 = tl.split(c1)
    t0, t4 = tl.split(c0b0)
    t2, t6 = tl.split(c0b1)
    t1, t5 = tl.split(c1b0)
    t3, t7 = tl.split(c1b1)
    return acc + t0 + t1 + t2 + t3 + t4 + t5 + t6 + t7


@triton.jit
def add_in_order(acc, t, D0: tl.constexpr, D1: tl.constexpr, G: tl.constexpr):
    """acc [D0, D1] + the G groups' terms t [D0, D1, G] one by one, group 0 first: the order
    every int8 kernel adds a row's terms in (G 1, 2, 4, 8 or 16)."""
    if G == 1:
        return acc + tl.reshape(t, (D0, D1))
    elif G == 2:
        t0, t1 = tl.split(t)
        return acc + t0 + t1
    elif G == 4:
        b0, b1 = tl.split(tl.reshape(t, (D0, D1, 2, 2)))       # g = 2a + b
        t0, t2 = tl.split(b0)
        t1, t3 = tl.split(b1)
        return acc + t0 + t1 + t2 + t3
    elif G == 8:
        return _add8(acc, t, D0, D1)
    else:                                                     # 16: two halves of 8
        lo, hi = tl.split(tl.permute(tl.reshape(t, (D0, D1, 2, 8)), (0, 1, 3, 2)))
        return _add8(_add8(acc, lo, D0, D1), hi, D0, D1)


@triton.jit
def group_term(isum, ad, bc):
    """A group's float term of each (row, column): fma(a dx, isum, b qs dx), where ad and bc
    are the products a * dx and b * (qs * dx), rounded once each. isum becomes a float by the
    magic number (|isum| < 2^22: 1.5 * 2^23 + isum is exact in fp32), not by a conversion,
    which runs at an eighth of the FMA rate. Every int8 kernel computes this, so a row's
    terms are the same bits in any of them."""
    f = (isum + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    return tl.fma(ad, f, bc)


@triton.jit
def _group_dots(lo, hi, even, odd, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                G: tl.constexpr, ASM: tl.constexpr):
    """int32 [BM, BN, G]: each 16-code group's sum of codes times the rows' codes, one chain
    of four dp4a a (row, column, group) over the group's two words (lo, hi [BN, 2 G]: the
    codes' even and odd bytes; even, odd [BM, 2 G]: the rows' codes in the same pair order)."""
    l0, l1 = tl.split(tl.reshape(lo, (BLOCK_N, G, 2)))
    h0, h1 = tl.split(tl.reshape(hi, (BLOCK_N, G, 2)))
    e0, e1 = tl.split(tl.reshape(even, (BLOCK_M, G, 2)))
    o0, o1 = tl.split(tl.reshape(odd, (BLOCK_M, G, 2)))
    s = _dp4a(l0[None, :, :], e0[:, None, :], 0, ASM)
    s = _dp4a(h0[None, :, :], o0[:, None, :], s, ASM)
    s = _dp4a(l1[None, :, :], e1[:, None, :], s, ASM)
    return _dp4a(h1[None, :, :], o1[:, None, :], s, ASM)


@triton.jit
def _a8_gemv_kernel(qw_ptr, dx_ptr, ids_ptr, per, erows, w_0, p0, p1, p2, p3, s0, s1, s2, s3,
                    res_ptr, out_ptr, fin_ptr, count_ptr, cq_ptr, cqp_ptr, cdx_ptr, cqs_ptr,
                    cdc_ptr, M,
                    N, K, UP, stride_rm, stride_om, QTYPE: tl.constexpr, S: tl.constexpr,
                    HAS_RES: tl.constexpr, FIXUP: tl.constexpr,
                    ASM: tl.constexpr, PAIRS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, STEP: tl.constexpr, STAGES: tl.constexpr,
                    P: tl.constexpr, L, L4, L8, L32, ACT: tl.constexpr, CODES: tl.constexpr,
                    PDL: tl.constexpr):
    """Program (row block, column block, part of K): the part's L quants (L4, L8, L32: L / 4,
    / 8, / 32), its sum into out, or with P > 1 into out's rows of that part (a8_gemv).
    ACT >= 0 (a8_gated.py): gate rows wn and up rows wn + UP; with one part out [M, N] gets
    act(gate) * up (fused_triton's silu_mul) of both, each rounded to out's dtype first, as
    the projection's output would be, and with CODES (BLOCK_N 32) those rows quantized too,
    as quantize_rows would (the planes cq, cqp, cdx, cqs of Codes [M, N]); with P > 1 the
    part's gate and up sums go to out's rows of that part [P, M, 2N], gate then up. FIXUP
    (P > 1): the tile's last program to finish its part adds the parts into fin (+ res; for
    ACT, with the act and the codes), as add_parts or add_gated_parts would after the launch
    (kernels/arrive.py's counters at count).
    PAIRS (BLOCK_M 1): output row m is activation row m // per against weight rows
    ids[m] * erows + w_0 + n (routed experts: pair m is row m // k's rank m % k)."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    enter(PDL)
    xm, wn = m, n
    if PAIRS:   # BLOCK_M 1: indices from the pair's expert, nothing computed on the host
        xm = m // per
        wn = n + tl.load(ids_ptr + tl.program_id(0)) * erows + w_0
    G: tl.constexpr = STEP // S                 # groups a step
    AW: tl.constexpr = STEP // 4                # the rows' words a step
    gi = tl.arange(0, G)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ones = tl.full([1, 1], 0x01010101, tl.int32)
    part = tl.program_id(2)
    qw_ptr += part * L4                         # the part's first quants, words and groups
    dx_ptr += part * L32
    g_part = part * (L // S)
    for k0 in tl.range(0, L, STEP, num_stages=STAGES):
        aw = tl.load(qw_ptr + xm[:, None] * (K // 4) + k0 // 4 + tl.arange(0, AW)[None, :],
                     mask=m_ok[:, None], other=0)                         # [BM, AW]
        # each group's sum of the rows' codes: dp4a against bytes of one (fewer instructions
        # here than loading the quantizer's sums, which the MMA takes)
        qs = tl.sum(tl.reshape(_dp4a(ones, aw, 0, ASM), (BLOCK_M, G, S // 4)), 2)
        dx = tl.load(dx_ptr + xm[:, None] * (K // 32) + ((k0 // S + gi) * S // 32)[None, :],
                     mask=m_ok[:, None], other=0.0)                        # [BM, G]
        w0, g0 = part * L8 + k0 // 8, g_part + k0 // S
        acc = _gemv_step(acc, aw, qs, dx, p0, p1, p2, p3, s0, s1, s2, s3, wn, n_ok, w0, g0,
                         QTYPE, S, ASM, BLOCK_M, BLOCK_N, STEP)
        if ACT >= 0:   # the same step of the up half's rows
            acc_up = _gemv_step(acc_up, aw, qs, dx, p0, p1, p2, p3, s0, s1, s2, s3, wn + UP,
                                n_ok, w0, g0, QTYPE, S, ASM, BLOCK_M, BLOCK_N, STEP)
    if ACT >= 0 and P > 1:   # both sums of this part, for a8_gated's add_gated_parts
        at = out_ptr + part * M * 2 * N
        store_rows(acc, res_ptr, at, m, n, m_ok, n_ok, 0, 2 * N, False)
        store_rows(acc_up, res_ptr, at + N, m, n, m_ok, n_ok, 0, 2 * N, False)
        if FIXUP:   # the last part's program adds the parts, as add_gated_parts would
            if arrive(count_ptr + tile_index(), P):
                gate = load_parts(out_ptr, m, n, m_ok, n_ok, M, 2 * N, P, BLOCK_M, BLOCK_N)
                up = load_parts(out_ptr + N, m, n, m_ok, n_ok, M, 2 * N, P, BLOCK_M, BLOCK_N)
                gated_rows(gate, up, fin_ptr, m, n, m_ok, n_ok, N, stride_om, cq_ptr, cqp_ptr,
                           cdx_ptr, cqs_ptr, cdc_ptr, ACT, CODES, BLOCK_M, 1)
    elif ACT >= 0:   # silu_mul's arithmetic on the projection's rounded outputs
        gated_rows(0.0 + acc, 0.0 + acc_up, out_ptr, m, n, m_ok, n_ok, N, stride_om, cq_ptr,
                   cqp_ptr, cdx_ptr, cqs_ptr, cdc_ptr, ACT, CODES, BLOCK_M, 1)
    elif P == 1:   # the parts' sum from zero, as every kernel adds them (_add_parts_kernel)
        store_rows(0.0 + acc, res_ptr, out_ptr, m, n, m_ok, n_ok, stride_rm, stride_om, HAS_RES)
    else:
        finish_parts(acc, out_ptr, res_ptr, fin_ptr, count_ptr, m, n, m_ok, n_ok, M, N,
                     stride_rm, stride_om, part, P, HAS_RES, FIXUP, BLOCK_M, BLOCK_N)


@triton.jit
def gated_rows(gate, up, out_ptr, m, n, m_ok, n_ok, N, stride_om, cq_ptr, cqp_ptr, cdx_ptr,
               cqs_ptr, cdc_ptr, ACT: tl.constexpr, CODES: tl.constexpr, BLOCK_M: tl.constexpr,
               NB: tl.constexpr):
    """act(gate) * up of fp32 sums [BM, BN], each rounded to out's dtype first (silu_mul's
    arithmetic on the projection's outputs), into out; with CODES (BLOCK_N 32 NB, whole
    blocks of N) those rows quantized too, as quantize_rows would: the down projection's
    input, no kernel of its own."""
    dtype = out_ptr.dtype.element_ty
    h = (gate_act(gate.to(dtype).to(tl.float32), ACT) * up.to(dtype).to(tl.float32)).to(dtype)
    store_rows(h, out_ptr, out_ptr, m, n, m_ok, n_ok, stride_om, stride_om, False)
    if CODES:
        quantize_blocks(h.to(tl.float32), m, m_ok, m * 0 + tl.program_id(1) * NB, N, cq_ptr,
                        cqp_ptr, cdx_ptr, cqs_ptr, cdc_ptr, BLOCK_M, NB)


def _codebook_asm() -> str:
    """PTX: a qs word of eight IQ4 codes (code j in bits 4j) -> two words of their codebook
    values + 128 (reads.IQ4_W0 .. W3), a byte each: codes 0, 2, 4, 6 and 1, 3, 5, 7. prmt
    looks codes 0-3 and 4-7 up in entries 0-7 and in 8-15 by their low three bits (selectors
    with the fourth bit cleared: prmt's default mode would replicate a sign there), a prmt a
    half keeps each code's entry by its fourth bit, and two more deal the bytes out in pairs.
    13 instructions for eight codes."""
    words = [int(w) & 0xFFFFFFFF for w in (IQ4_W0, IQ4_W1, IQ4_W2, IQ4_W3)]
    return ("{ .reg .b32 v0, v1, v2, v3, s, t, a0, a1, b0, b1, x, y; " +
            " ".join(f"mov.b32 v{i}, {w:#010x};" for i, w in enumerate(words)) +
            " and.b32 s, $2, 0x77777777; shr.b32 t, s, 16;"
            " prmt.b32 a0, v0, v1, s; prmt.b32 a1, v2, v3, s;"
            " prmt.b32 b0, v0, v1, t; prmt.b32 b1, v2, v3, t;"
            " and.b32 x, $2, 0x88888888; shr.b32 x, x, 1; or.b32 x, x, 0x32103210;"
            " shr.b32 y, x, 16; prmt.b32 a0, a0, a1, x; prmt.b32 b0, b0, b1, y;"
            " prmt.b32 $0, a0, b0, 0x6420; prmt.b32 $1, a0, b0, 0x7531; }")


CODEBOOK_PAIRS = tl.constexpr(_codebook_asm())


@triton.jit
def _codebook_bytes(x):
    """int32 words of four codes 0..15, a byte each -> their codebook values + 128, a byte
    each (reads.py's four table words)."""
    out = x & 0
    for i in tl.static_range(4):
        c = (x >> (8 * i)) & 15
        word = tl.where(c < 8, tl.where(c < 4, IQ4_W0, IQ4_W1), tl.where(c < 12, IQ4_W2, IQ4_W3))
        out = out | (((word >> ((c & 3) * 8)) & 0xFF) << (8 * i))
    return out


@triton.jit
def _codebook_pairs(w, ASM: tl.constexpr):
    """IQ4 qs words of eight codes (code j in bits 4j) -> (even, odd): the codebook values +
    128 of codes 0, 2, 4, 6 and of 1, 3, 5, 7, a byte each, as the nibble types' masks give
    their codes (by prmt on CUDA, _codebook_asm; by table words elsewhere)."""
    if ASM:
        return tl.inline_asm_elementwise(CODEBOOK_PAIRS, "=r,=r,r", [w],
                                         dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        return _codebook_bytes(w & 0x0F0F0F0F), _codebook_bytes((w >> 4) & 0x0F0F0F0F)


@triton.jit
def _gemv_step(acc, aw, qs, dx, p0, p1, p2, p3, s0, s1, s2, s3, wn, n_ok, w0, g0,
               QTYPE: tl.constexpr, S: tl.constexpr, ASM: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEP: tl.constexpr):
    """acc [BM, BN] + one K step's group terms of weight rows wn, in order: the rows' code
    words aw [BM, STEP / 4] (in pair order), their sums a group qs and
    scales dx [BM, G]; the step's first code word w0 (of eight codes) and group g0 in a
    weight row."""
    G: tl.constexpr = STEP // S
    gi = tl.arange(0, G)
    # the high bits a code of the 5- and 6-bit types (a qh word a group, code j of the group's
    # qs word i at bits HIGH * i + 4 j: reads.py's _codes)
    HIGH: tl.constexpr = (2 if QTYPE == Q6_K else
                          1 if QTYPE == Q5_0 or QTYPE == Q5_1 or QTYPE == Q5_K else 0)
    SIGNED: tl.constexpr = QTYPE == Q8_0 or QTYPE == IQ4_NL or QTYPE == IQ4_XS
    # a word of eight codes (quants 8c .. 8c + 7; code j in bits 4j): the even codes'
    # bytes w & 0x0F0F0F0F and the odd codes' (w >> 4) & 0x0F0F0F0F, against the
    # rows' words in pair order, (q0, q2, q4, q6) and (q1, q3, q5, q7)
    CW: tl.constexpr = STEP // 8
    at = wn[:, None] * s0 + w0 + tl.arange(0, CW)[None, :]
    w = tl.load(p0 + at, mask=n_ok[:, None], other=0)           # [BN, CW]
    if QTYPE == IQ4_NL or QTYPE == IQ4_XS:                        # their codebook values
        lo, hi = _codebook_pairs(w, ASM)
    else:
        lo = w & 0x0F0F0F0F
        hi = (w >> 4) & 0x0F0F0F0F
    if QTYPE == Q8_0:                                             # the high nibbles
        h = tl.load(p1 + at, mask=n_ok[:, None], other=0)
        lo = lo | ((h << 4) & HIGH_NIBBLES)
        hi = hi | (h & HIGH_NIBBLES)
    elif HIGH > 0:   # each qs word's high bits, nibble-aligned: above the low nibbles
        hw = tl.load(p1 + wn[:, None] * s1 + (g0 + gi)[None, :],
                     mask=n_ok[:, None], other=0)                  # [BN, G]
        x = tl.reshape(hw[:, :, None] >> (HIGH * tl.arange(0, S // 8))[None, None, :],
                       (BLOCK_N, CW))
        MB: tl.constexpr = ((1 << HIGH) - 1) * 0x01010101
        lo = lo | ((x & MB) << 4)
        hi = hi | (((x >> 4) & MB) << 4)
    even, odd = tl.split(tl.reshape(aw, (BLOCK_M, CW, 2)))   # the rows' pair order
    if S == 16 and BLOCK_M != 4:   # Q6_K: faster on an H100 as a chain a group
        isum = _group_dots(lo, hi, even, odd, BLOCK_M, BLOCK_N, G, ASM)
    else:   # the words' products summed (a chain of 8 was 2-3x slower for Q4_K)
        prod = _dp4a(lo[None, :, :], even[:, None, :],
                     _dp4a(hi[None, :, :], odd[:, None, :], 0, ASM), ASM)
        isum = tl.sum(tl.reshape(prod, (BLOCK_M, BLOCK_N, G, S // 8)), 3)
    a, b = _terms(p2, p3, s2, s3, wn, n_ok, g0, QTYPE, G)                     # [BN, G]
    if SIGNED:                                           # codes taken signed: u - 128, b = 0
        isum = isum - 128 * qs[:, None, :]
        b = b * 0.0
    t = group_term(isum, dx[:, None, :] * a[None, :, :],
                   (qs.to(tl.float32) * dx)[:, None, :] * b[None, :, :])
    return add_in_order(acc, t, BLOCK_M, BLOCK_N, G)


@triton.jit
def quantize_blocks(y, m, m_ok, b0, K, q_ptr, qp_ptr, dx_ptr, qs_ptr, dc_ptr,
                    R: tl.constexpr, NB: tl.constexpr):
    """Values y fp32 [R, NB * 32] into Codes' planes [M, K] (a8.py: codes, the codes in pair
    order, scales, each 16 codes' sum and the dc plane): y's row i is blocks b0[i] ..
    b0[i] + NB - 1 (of 32)
    of row m[i], each block from its own values alone. The row quantizer's arithmetic, and
    that of any kernel that quantizes the rows it writes: its one product and sum is an
    explicit fma, so it is the same with and without FP fusion."""
    yb = tl.reshape(y, (R, NB, 32))
    amax = tl.max(tl.abs(yb), 2)                                             # [R, NB]
    inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)[:, :, None]
    q = tl.where(yb >= 0, tl.floor(tl.fma(yb, inv, 0.5)), -tl.floor(tl.fma(-yb, inv, 0.5)))
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    ok = m_ok[:, None]
    at = m[:, None] * K + b0[:, None] * 32 + tl.arange(0, NB * 32)[None, :]
    tl.store(q_ptr + at, tl.reshape(q, (R, NB * 32)).to(tl.int8), mask=ok)
    pairs = tl.permute(tl.reshape(q, (R, NB * 4, 4, 2)), (0, 1, 3, 2))   # 0, 2, 4, 6, 1, 3, 5, 7
    tl.store(qp_ptr + at, tl.reshape(pairs, (R, NB * 32)).to(tl.int8), mask=ok)
    dx = amax / 127.0
    tl.store(dx_ptr + m[:, None] * (K // 32) + b0[:, None] + tl.arange(0, NB)[None, :], dx,
             mask=ok)
    qs = tl.sum(tl.reshape(q.to(tl.int32), (R, 2 * NB, 16)), 2)
    tl.store(qs_ptr + m[:, None] * (K // 16) + 2 * b0[:, None] + tl.arange(0, 2 * NB)[None, :],
             qs, mask=ok)
    q0, q1 = tl.split(tl.reshape(qs, (R, NB, 2)))
    c0, c1 = q0.to(tl.float32) * dx, q1.to(tl.float32) * dx
    dc = tl.join(tl.join(dx, c0), tl.join((q0 + q1).to(tl.float32) * dx, c1))   # dx, c, c0, c1
    tl.store(dc_ptr + m[:, None] * (K // 8) + 4 * b0[:, None] + tl.arange(0, 4 * NB)[None, :],
             tl.reshape(dc, (R, 4 * NB)), mask=ok)


def a8_gemv(x: Codes, part: Part, res: torch.Tensor | None, out: torch.Tensor, block_m: int,
            block_n: int | None = None, stages: int = 3, warps: int = 4,
            pairs: Pairs | None = None, parts: int = PARTS) -> torch.Tensor:
    """a8_mm's GEMV tiles (a8_triton.py checks the shapes): out [M, N] =
    rows x (codes, scales, sums) @ part^T (+ res). pairs, block_m 1: a8_pairs' out [P, n],
    row p = codes row p // pairs.per @ rows pairs.first(p) .. + n - 1 of part^T.
    parts: k_parts' most (a8_mm's). With more than one part, a program a part writes its sums
    to a scratch [parts, M, N] and the tile's last program adds them in order
    (kernels/arrive.py), or _add_parts_kernel does where there are no counters. block_n:
    columns a program (default blocks.program_width's of 32)."""
    q = x.qp   # the rows' codes in pair order, as the weight's words give their codes
    block_n = block_n or program_width(q.device, 32)
    k = q.shape[1]
    r = res if res is not None else out
    cols = pairs.n if pairs is not None else part.rows
    m = pairs.ids.shape[0] if pairs is not None else q.shape[0]
    planes, strides = _planes(part)
    p = k_parts(part.rows, k, parts)   # the weight's (pairs: the packed experts' as a whole)
    dst = out if p == 1 else torch.empty(p, m, cols, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(cols, block_n), p)
    count = counters(q.device, grid[0] * grid[1]) if p > 1 else None
    _a8_gemv_kernel[grid](q.view(torch.int32), x.dx, *Pairs.args(pairs, q), *planes, *strides, r,
                          dst, out, q if count is None else count, q, q, x.dx, x.qs, x.dc, m,
                          cols, k, 0, r.stride(0), out.stride(0), QTYPE=TYPE_IDS[part.qtype],
                          S=BLOCKS[part.qtype][2], HAS_RES=res is not None,
                          FIXUP=count is not None,
                          ASM=q.device.type == "cuda", PAIRS=pairs is not None,
                          BLOCK_M=block_m, BLOCK_N=block_n, STEP=gemv_step(k), STAGES=stages,
                          P=p, L=k // p, L4=k // p // 4, L8=k // p // 8, L32=k // p // 32,
                          ACT=-1, CODES=False, num_warps=warps,
                          **launch_options(q.device),
                          enable_fp_fusion=False)   # as a8_mm: no tile-dependent FMAs
    if p > 1 and count is None:
        add_parts(dst, res, out)
    return out
