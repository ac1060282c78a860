"""Triton readers of packed GGUF blocks (weight.py says the layout), shared by every kernel over
quantized weights: a K step's unsigned codes (`_codes`: 16-byte loads of each row's words, split
into codes by shifts that stay in the loading thread), its groups' terms a and b (w = a u + b;
`_terms`, as `_term_loads` then `_term_values` for a kernel that loads a step ahead), the
dequantized tile (`_weights`), the QTYPE constexprs and the kernels' plane arguments
(`_planes`). The float kernels (float_triton.py), the int8-activation kernels (a8_gemv.py,
a8_triton.py) and the routed experts' (moe_triton.py) read weights through these alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.quant.blocks import IQ4_VALUES, PLANES, Part

# the QTYPE constexpr of the kernels
Q4_0, Q4_1, Q8_0 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
Q4_K, Q5_K, Q6_K = tl.constexpr(3), tl.constexpr(4), tl.constexpr(5)
Q5_0, Q5_1 = tl.constexpr(6), tl.constexpr(7)
IQ4_NL, IQ4_XS = tl.constexpr(8), tl.constexpr(9)


def _table_word(i: int) -> tl.constexpr:
    """Codebook entries 4i .. 4i + 3 (value + 128) as the bytes of an int32."""
    word = sum((IQ4_VALUES[4 * i + j] + 128) << (8 * j) for j in range(4))
    return tl.constexpr(word - (1 << 32) if word >= 1 << 31 else word)


IQ4_W0, IQ4_W1, IQ4_W2, IQ4_W3 = (_table_word(i) for i in range(4))
TYPE_IDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5, "Q5_0": 6,
            "Q5_1": 7, "IQ4_NL": 8, "IQ4_XS": 9}


@triton.jit
def _split8(w, MASK: tl.constexpr):
    """int32 words [...] -> [..., 2, 2, 2]: field j of each word, (w >> 4j) & MASK, at the
    flat index j of the new dimensions (joins: they stay in the thread that holds the word)."""
    return tl.join(tl.join(tl.join(w & MASK, (w >> 16) & MASK),
                           tl.join((w >> 8) & MASK, (w >> 24) & MASK)),
                   tl.join(tl.join((w >> 4) & MASK, (w >> 20) & MASK),
                           tl.join((w >> 12) & MASK, (w >> 28) & MASK)))


@triton.jit
def _codes(p0, p1, s0, s1, n, n_ok, g0, QTYPE: tl.constexpr, S: tl.constexpr,
           G: tl.constexpr, BLOCK_N: tl.constexpr):
    """int32 [BLOCK_N, G, S]: the unsigned codes of groups g0 .. g0 + G - 1 of rows n."""
    W: tl.constexpr = S // 8                                  # qs words a group
    wi = tl.arange(0, W)
    at = n[:, None, None] * s0 + ((g0 + tl.arange(0, G)) * W)[None, :, None] + wi[None, None, :]
    ok = n_ok[:, None, None]
    u = _split8(tl.load(p0 + at, mask=ok, other=0), 15)      # [BN, G, W, 2, 2, 2]
    if QTYPE == IQ4_NL or QTYPE == IQ4_XS:       # the codebook + 128, from four int32 words
        word = tl.where(u < 8, tl.where(u < 4, IQ4_W0, IQ4_W1), tl.where(u < 12, IQ4_W2, IQ4_W3))
        u = (word >> ((u & 3) * 8)) & 0xFF
    elif QTYPE == Q8_0:                                         # the high nibbles alike
        u = u | (_split8(tl.load(p1 + at, mask=ok, other=0), 15) << 4)
    elif QTYPE == Q5_0 or QTYPE == Q5_1 or QTYPE == Q5_K or QTYPE == Q6_K:
        bits: tl.constexpr = 2 if QTYPE == Q6_K else 1        # a qh word a group
        hw = tl.load(p1 + n[:, None] * s1 + (g0 + tl.arange(0, G))[None, :],
                     mask=n_ok[:, None], other=0)
        u = u | (_split8(hw[:, :, None] >> (bits * wi)[None, None, :], (1 << bits) - 1) << 4)
    return tl.reshape(u, (BLOCK_N, G, S))


@triton.jit
def _terms(p2, p3, s2, s3, n, n_ok, g0, QTYPE: tl.constexpr, G: tl.constexpr):
    """a, b fp32 [BLOCK_N, G]: the weights of group g0 + i are a[:, i] * u + b[:, i]."""
    v0, v1, v2, v3, v4 = _term_loads(p2, p3, s2, s3, n, n_ok, g0, QTYPE, G)
    return _term_values(v0, v1, v2, v3, v4, g0, QTYPE, G)


@triton.jit
def _term_loads(p2, p3, s2, s3, n, n_ok, g0, QTYPE: tl.constexpr, G: tl.constexpr):
    """What _terms reads for groups g0 .. g0 + G - 1 of rows n, as five values (0 where the
    type reads fewer); _term_values makes a and b of them, so that a kernel can load a step
    ahead of its arithmetic."""
    gi = g0 + tl.arange(0, G)
    ok = n_ok[:, None]
    v1, v2, v3, v4 = 0, 0, 0, 0
    if (QTYPE == Q4_0 or QTYPE == Q4_1 or QTYPE == Q8_0 or QTYPE == Q5_0 or QTYPE == Q5_1
            or QTYPE == IQ4_NL):                              # d (and m) a group
        v0 = tl.load(p2 + n[:, None] * s2 + gi[None, :], mask=ok, other=0.0)
        if QTYPE == Q4_1 or QTYPE == Q5_1:
            v1 = tl.load(p3 + n[:, None] * s3 + gi[None, :], mask=ok, other=0.0)
    elif QTYPE == IQ4_XS:                                     # scales_h, scales_l, d
        base = p2 + n[:, None] * s2 + 3 * (g0 // 8)
        v0 = tl.load(base, mask=ok, other=0)
        v1 = tl.load(base + 1, mask=ok, other=0)                # scales_l of groups 0 .. 3
        v3 = tl.load(base + 2, mask=ok, other=0)                # and of groups 4 .. 7
        v2 = tl.load(p3 + n * s3 + g0 // 8, mask=n_ok, other=0.0)
    elif QTYPE == Q6_K:                                       # d, an int8 per 16
        v0 = tl.load(p3 + n * s3 + g0 // 16, mask=n_ok, other=0.0)
        v1 = tl.load(p2 + n[:, None] * s2 + gi[None, :], mask=ok, other=0)
    else:                                                     # Q4_K, Q5_K: 3 words, d, dmin
        sb = g0 // 8
        base = p2 + n[:, None] * s2 + 3 * sb
        v0 = tl.load(base, mask=ok, other=0)
        v1 = tl.load(base + 1, mask=ok, other=0)
        v2 = tl.load(base + 2, mask=ok, other=0)
        v3 = tl.load(p3 + n * s3 + 2 * sb, mask=n_ok, other=0.0)
        v4 = tl.load(p3 + n * s3 + 2 * sb + 1, mask=n_ok, other=0.0)
    return v0, v1, v2, v3, v4


@triton.jit
def _term_values(v0, v1, v2, v3, v4, g0, QTYPE: tl.constexpr, G: tl.constexpr):
    """a, b fp32 [BLOCK_N, G] of _term_loads' values for groups g0 .. g0 + G - 1."""
    gi = g0 + tl.arange(0, G)
    if (QTYPE == Q4_0 or QTYPE == Q4_1 or QTYPE == Q8_0 or QTYPE == Q5_0 or QTYPE == Q5_1
            or QTYPE == IQ4_NL):
        a = v0.to(tl.float32)
        if QTYPE == Q4_0:
            b = -8.0 * a
        elif QTYPE == Q5_0:
            b = -16.0 * a
        elif QTYPE == Q4_1 or QTYPE == Q5_1:
            b = v1.to(tl.float32)
        else:                                                 # Q8_0, IQ4_NL
            b = -128.0 * a
    elif QTYPE == IQ4_XS:                                     # d * (6-bit scale - 32) a group
        j = (gi % 8)[None, :]
        high = v0.to(tl.int32) & 0xFFFF
        low = tl.where(j < 4, v1.to(tl.int32), v3.to(tl.int32)) & 0xFFFF
        ls = ((low >> (4 * (j % 4))) & 15) | (((high >> (2 * j)) & 3) << 4)
        a = v2.to(tl.float32)[:, None] * (ls - 32).to(tl.float32)
        b = -128.0 * a
    elif QTYPE == Q6_K:                                       # d * an int8 per 16
        a = v0.to(tl.float32)[:, None] * v1.to(tl.float32)
        b = -32.0 * a
    else:                                                     # Q4_K, Q5_K: 6-bit scales, mins
        j = (gi % 8)[None, :]                                 # the group in its super-block
        sh = 8 * (j % 4)
        low = j < 4                                           # llama.cpp's get_scale_min_k4
        sc = tl.where(low, (v0 >> sh) & 63, ((v2 >> sh) & 15) | (((v0 >> (sh + 6)) & 3) << 4))
        mn = tl.where(low, (v1 >> sh) & 63, ((v2 >> (sh + 4)) & 15) | (((v1 >> (sh + 6)) & 3) << 4))
        a = v3.to(tl.float32)[:, None] * sc.to(tl.float32)
        b = -(v4.to(tl.float32)[:, None] * mn.to(tl.float32))
    return a, b


@triton.jit
def _weights(p0, p1, p2, p3, s0, s1, s2, s3, n, n_ok, k0, QTYPE: tl.constexpr,
             S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_N, BLOCK_K]: rows n, quants k0 .. k0 + BLOCK_K - 1, dequantized. The codes
    become floats by the magic number (u | 0x4B000000 is 2^23 + u as fp32): no int-to-float
    conversion, which runs at a quarter of the FMA rate."""
    G: tl.constexpr = BLOCK_K // S
    u = _codes(p0, p1, s0, s1, n, n_ok, k0 // S, QTYPE, S, G, BLOCK_N)
    a, b = _terms(p2, p3, s2, s3, n, n_ok, k0 // S, QTYPE, G)
    f = (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return tl.reshape(f * a[:, :, None] + b[:, :, None], (BLOCK_N, BLOCK_K))



def _planes(part: Part) -> tuple[list[torch.Tensor], list[int]]:
    """The kernels' four plane arguments (p0 qs, p1 qh, p2 d or sc, p3 m or dm; absent ones
    repeat qs, never read) and their row strides."""
    p = part.planes
    names = {"qs": 0, "qh": 1, "d": 2, "sc": 2, "m": 3, "dm": 3}
    tensors = [p["qs"]] * 4
    for name in PLANES[part.qtype]:
        tensors[names[name]] = p[name]
    assert all(t.is_contiguous() for t in tensors)
    return tensors, [t.stride(0) for t in tensors]
