"""The Gluon int8-activation MMA for Q4_K, Q5_K, Q6_K and Q8_0 (IQ4_XS's in a8_ring_iq4.py) with its
operands through a ring of shared memory: each super-block's weight bytes, scales and the rows'
codes and dc plane are copied from global memory by cp.async `stages - 1` super-blocks ahead of
their arithmetic (a8_ring_io.py), so a program keeps that many loads in flight instead of
waiting on each super-block's (a8_gluon.py's kernels load them into registers as they go). The
warps then read a group's fragments from shared memory (ldmatrix): the rows' codes once a
program, not once a warp from global memory.

The arithmetic is a8_gluon.py's kernels', term for term (the same mma.sync sums, the same
group_term, groups in K's order, parts finished by _finish), so the bits are a8_mm's, which
takes ring_mm on CUDA at a8_gluon.GLUON_TILES' "ring" tiles (with STRATA_A8_DOT=ring every
RING_TYPES tile from 4 rows); tools/gpu/gluon_a8.py --stages times it beside a8_mm.

A slot holds a super-block of the tile: the weight's qs bytes [8 groups, BN rows, 16], its
scale words [4, BN] int32 (Q4_K: sc's three and the d, dmin pair; Q6_K: its 16 scales; Q8_0:
its 8 d; Q6_K, Q8_0 and Q5_K also their qh bytes), the rows' codes in slot order [8, BM, 32] (the
order a8_gluon._rows_at reads, copied 4 bytes at a time into place) and their dc [8, BM, 4]
fp32.
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from strata.kernels.quant.a8_codes import (Q5K_HI, Q5K_LO, Q6K_HI, Q6K_LO, _and, _high_codes,
                                          _nibbles)
from strata.kernels.quant.a8_gluon import _add_term, _finish, _ld, _program, _q4k_terms, _tile, plan
from strata.kernels.quant.a8_parts import PARTS
from strata.kernels.quant.a8_ring_io import (_bytes_sources, _copy_in, _half, _ring,
                                             _rows_sources, _word_ring, copy_layouts)
from strata.kernels.quant.a8_ring_iq4 import _iq4xs_ring_kernel

SHARED = 227 * 1024   # a program's shared memory on sm_90 (off CUDA, for the checks alone)
STAGES = (2, 3)        # the ring's default super-blocks, Q4_K's and Q8_0's, and Q6_K's
RING_TYPES = ("Q4_K", "Q6_K", "Q8_0", "IQ4_XS", "Q5_K")
# ptxas's cap on a thread's registers by default, by (type, row tile): Q4_K's 64-row tiles take
# 255 registers uncapped (two programs an SM); capped at 168 (three, a few spills) they ran in
# 98.0 and 46.4 us against 105.4 and 60.5 on an H100 at the llama3-8b down and qkv shapes
# (tools/gpu/gluon_a8.py --rows 64 --stages 2 --maxnreg 168), the same bits
REGISTERS = {("Q4_K", 64): 168}


@functools.cache
def _shared_limit(index: int) -> int:
    """The shared memory a program may take on CUDA device `index` (its opt-in limit), less a
    kilobyte for what Triton adds."""
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"] - 1024


def ring_stages(part, block_n: int, block_m: int, device: torch.device,
                stages: int | None = None) -> tuple[int, int, int]:
    """(stages, bytes a slot, the device's limit): the ring's stages for this weight's type and
    tiles, `stages` or the type's default (STAGES) made fewer until two programs fit an SM's
    shared memory (else until one does), 0 where not even 2 stages fit. Q6_K's 64-row tiles
    thus take 2 on an H100: 144.3 and 80.5 us against 3 stages' 205.8 and 96.1 at the
    llama3-8b down and qkv shapes (tools/gpu/gluon_a8.py --types Q6_K --rows 64 --stages 2),
    one program an SM at 3."""
    slot = (144 if part.qtype in ("Q4_K", "IQ4_XS") else 272) * block_n + 384 * block_m
    limit = SHARED
    if device.type == "cuda":
        limit = _shared_limit(device.index if device.index is not None
                              else torch.cuda.current_device())
    if stages is not None:
        return (stages if stages * slot <= limit else 0), slot, limit
    want = STAGES[part.qtype == "Q6_K"]
    fit = next((s for s in range(want, 1, -1) if 2 * s * slot <= limit), 0)
    fit = fit or next((s for s in range(want, 1, -1) if s * slot <= limit), 0)
    return fit, slot, limit


@gluon.jit
def _nibble_copy(ring_w, ring_h, ring_s, ring_b, ring_d, slot, sb, w_at, h_at, w_ok, h_ok,
                 s_at, s_ok, s_step, b_at, b_ok, d_at, d_ok, EVEN: gl.constexpr,
                 Q8: gl.constexpr, Q5: gl.constexpr):
    """Q4_K's, Q8_0's or Q5_K's (Q8, Q5: their qh bytes too) super-block sb's weight bytes,
    scale words, codes and dc into the ring's slot, one commit group."""
    _copy_in(ring_w, slot, w_at + 128 * sb, w_ok, EVEN)
    if Q8:
        _copy_in(ring_h, slot, h_at + 128 * sb, w_ok, EVEN)
    if Q5:   # a group's qh word, beside each of its four qs words
        _copy_in(ring_h, slot, h_at + 32 * sb, h_ok, EVEN)
    _copy_in(ring_s, slot, s_at + s_step * sb, s_ok, EVEN)
    _copy_in(ring_b, slot, b_at + 256 * sb, b_ok, EVEN)
    _copy_in(ring_d, slot, d_at + 32 * sb, d_ok, EVEN)
    async_copy.commit_group()


@gluon.jit
def _q8_codes(raw, high, HI: gl.constexpr):
    """int8 [..] Q8_0 words of low nibbles (raw) and high nibbles (high) -> the signed codes
    (u - 128) of their low (HI 0) or high (1) nibbles' quants, a word at a time."""
    if HI == 0:
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t; and.b32 $0, $1, 0x0F0F0F0F; shl.b32 t, $2, 4; "
            "and.b32 t, t, 0xF0F0F0F0; or.b32 $0, $0, t; xor.b32 $0, $0, 0x80808080; }",
            "=r,r,r", [raw, high], dtype=gl.int8, is_pure=True, pack=4)
    return gl.inline_asm_elementwise(
        "{ .reg .b32 t; shr.b32 $0, $1, 4; and.b32 $0, $0, 0x0F0F0F0F; "
        "and.b32 t, $2, 0xF0F0F0F0; or.b32 $0, $0, t; xor.b32 $0, $0, 0x80808080; }",
        "=r,r,r", [raw, high], dtype=gl.int8, is_pure=True, pack=4)


@gluon.jit
def _nibble_ring_kernel(qp_ptr, dc_ptr, w_ptr, qh_ptr, sc_ptr, dm_ptr, dst_ptr, res_ptr, out_ptr,
                        count_ptr, M, N, K, L, s0, s1, s2, s3, stride_rm, stride_om,
                        BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, MMA: gl.constexpr,
                        RAW: gl.constexpr, DC: gl.constexpr, EVEN: gl.constexpr,
                        P: gl.constexpr, HAS_RES: gl.constexpr, FIXUP: gl.constexpr,
                        STAGES: gl.constexpr, CW: gl.constexpr, CS: gl.constexpr,
                        CB: gl.constexpr, CD: gl.constexpr, Q8: gl.constexpr,
                        Q5: gl.constexpr, CH: gl.constexpr):
    """a8_gluon._q4k_mma_kernel with the ring (the module says how), or with Q8 Q8_0's, or
    with Q5 Q5_K's (Q4_K's scales; qh_ptr its qh plane as bytes, s1 its row in words: a
    group's word copied beside each of its four qs words, [8, BN, 16] in CH). w_ptr
    the qs plane as bytes (s0 its row in words). Q4_K: sc_ptr the scale words (int32), dm_ptr
    the d, dmin pairs as int32 words (s3 the plane's row in words). Q8_0: qh_ptr the high
    nibbles' plane as bytes (s1), sc_ptr its d plane as int32 words (s2; 4 a super-block),
    and its codes taken signed, u - 128, with b zeroed, as the GEMV takes them (a8_gemv.py).
    CW, CS, CB, CD: the copies' layouts (copy_layouts)."""
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    rows_l: gl.constexpr = gl.SliceLayout(1, MMA)
    part, n0, m0 = _program(BLOCK_N, BLOCK_M)
    ring_w, group_w = _ring(STAGES, gl.int8, BLOCK_N, 16)
    ring_h, group_h = ring_w, group_w
    if Q8 or Q5:
        ring_h, group_h = _ring(STAGES, gl.int8, BLOCK_N, 16)
    ring_s, words = _word_ring(STAGES, BLOCK_N)
    ring_b, group_b = _ring(STAGES, gl.int8, BLOCK_M, 32)
    ring_d, group_d = _ring(STAGES, gl.float32, BLOCK_M, 4)
    w_at, w_ok = _bytes_sources(w_ptr, n0, N, 4 * s0, BLOCK_N, CW)
    h_at, h_ok = _bytes_sources(qh_ptr, n0, N, 4 * s1, BLOCK_N, CW)
    if Q5:   # group ch's 4 bytes at each of the slot's 4 words: bytes 0-3, 0-3, 0-3, 0-3
        ch = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, CH)))
        nh = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, CH)))
        e = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, CH)))
        e = gl.max_contiguous(gl.multiple_of(e % 4, 4), 4)
        h_at = qh_ptr + nh[None, :, None] * (4 * s1) + (4 * ch)[:, None, None] + e[None, None, :]
        h_ok = (nh < N)[None, :, None]
    sa = gl.arange(0, 16, layout=gl.SliceLayout(0, RAW))
    shift = gl.full([BLOCK_N, 16], 0, gl.int8, layout=RAW) + (sa // 4).to(gl.int8)[None, :]
    c = gl.arange(0, 4, layout=gl.SliceLayout(1, CS))   # Q4_K: sc's three words, then dm's
    ns = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, CS))
    if Q8:
        s_at = sc_ptr + ns[None, :] * s2 + c[:, None]
        s_step = gl.full([4], 4, gl.int32, layout=gl.SliceLayout(1, CS))[:, None]
    else:
        s_at = gl.where((c < 3)[:, None], sc_ptr + ns[None, :] * s2 + c[:, None],
                        dm_ptr + ns[None, :] * s3 + 0 * c[:, None])
        s_step = gl.where(c < 3, 3, 1)[:, None]
    s_ok = (ns < N)[None, :]
    b_at, b_ok, d_at, d_ok = _rows_sources(qp_ptr, dc_ptr, m0, M, K, BLOCK_M, CB, CD)
    n, n_ok, m, m_ok = _tile(n0, m0, N, M, BLOCK_N, BLOCK_M, MMA)
    magic = gl.full([BLOCK_N, BLOCK_M], 0x4B400000, gl.int32, layout=MMA)
    acc = gl.full([BLOCK_N, BLOCK_M], 0.0, gl.float32, layout=MMA)
    first = part * (L // 256)
    last = first + L // 256 - 1
    for s in gl.static_range(STAGES - 1):   # the ring's first super-blocks (the last again
        _nibble_copy(ring_w, ring_h, ring_s, ring_b, ring_d, s, gl.minimum(first + s, last),
                     w_at, h_at, w_ok, h_ok, s_at, s_ok, s_step, b_at, b_ok, d_at, d_ok, EVEN,
                     Q8, Q5)                                # where the part is short)
    for sbk in range(first, last + 1):
        i = sbk - first
        async_copy.wait_group(STAGES - 2)   # this thread's copies of sbk have landed
        gl.thread_barrier()                 # everyone's, and slot i - 1 is read: refill it
        _nibble_copy(ring_w, ring_h, ring_s, ring_b, ring_d, (i + STAGES - 1) % STAGES,
                     gl.minimum(sbk + STAGES - 1, last), w_at, h_at, w_ok, h_ok, s_at, s_ok,
                     s_step, b_at, b_ok, d_at, d_ok, EVEN, Q8, Q5)
        slot = i % STAGES
        v0 = words.index(4 * slot).load(rows_l)
        v1 = words.index(4 * slot + 1).load(rows_l)
        v2 = words.index(4 * slot + 2).load(rows_l)
        v3 = words.index(4 * slot + 3).load(rows_l)
        if not Q8:
            d = _half(v3, 0)
            dmin = _half(v3, 1)
        for j in gl.static_range(8):
            raw = group_w.index(8 * slot + j).load(RAW)
            if Q8:
                high = group_h.index(8 * slot + j).load(RAW)
                u = gl.join(_q8_codes(raw, high, 0), _q8_codes(raw, high, 1))
                hw = v0 if j < 2 else v1 if j < 4 else v2 if j < 6 else v3   # group j's d:
                a = _half(hw, j % 2)                                          # half j % 2
                b = (-128.0 * a) * 0.0                      # the GEMV's zeroed b
            elif Q5:   # the qs word's codes with their fifth bits (shift: the word's index)
                lo, hi = _high_codes(raw, group_h.index(8 * slot + j).load(RAW), shift, Q5K_LO,
                                     Q5K_HI)
                u = gl.join(lo, hi)
                a, b = _q4k_terms(v0, v1, v2, d, dmin, j)
            else:
                u = gl.join(_nibbles(raw, 0), _nibbles(raw, 4))
                a, b = _q4k_terms(v0, v1, v2, d, dmin, j)
            u = gl.reshape(gl.permute(u, (0, 2, 1)), (BLOCK_N, 32))
            u = gl.convert_layout(u, a_l, assert_trivial=True)
            q = group_b.index(8 * slot + j).permute((1, 0)).load(b_l)
            isum = mma_v2(u, q, magic)                        # 1.5 * 2^23 + the sums
            acc = _add_term(acc, isum, a, b,
                            group_d.index(8 * slot + j).slice(0, 2, dim=1).load(DC), MMA)
    async_copy.wait_group(0)                # no copy left in flight at the exit
    _finish(acc, dst_ptr, res_ptr, out_ptr, count_ptr, n, n_ok, m, m_ok, M, N, stride_rm,
            stride_om, P, HAS_RES, FIXUP)


@gluon.jit
def _q6k_copy(ring_w, ring_h, ring_s, ring_b, ring_d, slot, sb, w_at, w_ok, h_at, h_ok, s_at,
              s_ok, b_at, b_ok, d_at, d_ok, EVEN: gl.constexpr):
    """Q6_K super-block sb's qs bytes, qh bytes, scale words, codes and dc into the ring's
    slot, one commit group."""
    _copy_in(ring_w, slot, w_at + 128 * sb, w_ok, EVEN)
    _copy_in(ring_h, slot, h_at + 64 * sb, h_ok, EVEN)
    _copy_in(ring_s, slot, s_at + 4 * sb, s_ok, EVEN)
    _copy_in(ring_b, slot, b_at + 256 * sb, b_ok, EVEN)
    _copy_in(ring_d, slot, d_at + 32 * sb, d_ok, EVEN)
    async_copy.commit_group()


@gluon.jit
def _q6k_ring_kernel(qp_ptr, dc_ptr, w_ptr, qh_ptr, sc_ptr, dm_ptr, dst_ptr, res_ptr, out_ptr,
                     count_ptr, M, N, K, L, s0, s1, s2, s3, stride_rm, stride_om,
                     BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, MMA: gl.constexpr,
                     RAW: gl.constexpr, DC: gl.constexpr, EVEN: gl.constexpr,
                     P: gl.constexpr, HAS_RES: gl.constexpr, FIXUP: gl.constexpr,
                     STAGES: gl.constexpr, CW: gl.constexpr, CS: gl.constexpr,
                     CB: gl.constexpr, CD: gl.constexpr, CH: gl.constexpr):
    """a8_gluon._q6k_mma_kernel with the ring: its slots hold the qs bytes [8, BN, 16], the
    qh bytes where each thread's word of them is read beside its qs word ([8, BN, 16]: bytes
    0-3, 0-3, 4-7, 4-7 of a chunk's 8; CH), the 16 scales as 4 words [4, BN], the rows' codes
    and dc; each row's d (fp16) is loaded into registers a super-block ahead. w_ptr, qh_ptr:
    bytes; sc_ptr: int32 words (s1: qh's row in words, s2: sc's)."""
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    rows_l: gl.constexpr = gl.SliceLayout(1, MMA)
    cols_l: gl.constexpr = gl.SliceLayout(0, MMA)
    part, n0, m0 = _program(BLOCK_N, BLOCK_M)
    ring_w, group_w = _ring(STAGES, gl.int8, BLOCK_N, 16)
    ring_h, group_h = _ring(STAGES, gl.int8, BLOCK_N, 16)
    ring_s, words = _word_ring(STAGES, BLOCK_N)
    ring_b, group_b = _ring(STAGES, gl.int8, BLOCK_M, 32)
    ring_d, group_d = _ring(STAGES, gl.float32, BLOCK_M, 4)
    w_at, w_ok = _bytes_sources(w_ptr, n0, N, 4 * s0, BLOCK_N, CW)
    ch = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, CH)))
    nh = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, CH)))
    e = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, CH)))
    e = gl.max_contiguous(gl.multiple_of(e // 8 * 4 + e % 4, 4), 4)
    h_at = qh_ptr + nh[None, :, None] * (4 * s1) + (8 * ch)[:, None, None] + e[None, None, :]
    h_ok = (nh < N)[None, :, None]
    c = gl.arange(0, 4, layout=gl.SliceLayout(1, CS))
    ns = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, CS))
    s_at = sc_ptr + ns[None, :] * s2 + c[:, None]
    s_ok = (ns < N)[None, :]
    b_at, b_ok, d_at, d_ok = _rows_sources(qp_ptr, dc_ptr, m0, M, K, BLOCK_M, CB, CD)
    sa = gl.arange(0, 16, layout=gl.SliceLayout(0, RAW))
    shift = (gl.full([BLOCK_N, 16], 0, gl.int8, layout=RAW)
             + ((sa // 4) % 2 * 2).to(gl.int8)[None, :])           # 2 a, a = (byte / 4) % 2
    ka = gl.arange(0, 32, layout=gl.SliceLayout(0, a_l))
    first = gl.full([BLOCK_N, 32], 0, gl.int8, layout=a_l) + gl.where(ka % 16 < 8, -1, 0).to(
        gl.int8)[None, :]                                    # 0xFF at group 2c's slots
    n, n_ok, m, m_ok = _tile(n0, m0, N, M, BLOCK_N, BLOCK_M, MMA)
    magic = gl.full([BLOCK_N, BLOCK_M], 0x4B400000, gl.int32, layout=MMA)
    acc = gl.full([BLOCK_N, BLOCK_M], 0.0, gl.float32, layout=MMA)
    lo_sb = part * (L // 256)
    hi_sb = lo_sb + L // 256 - 1
    for t in gl.static_range(STAGES - 1):
        _q6k_copy(ring_w, ring_h, ring_s, ring_b, ring_d, t, gl.minimum(lo_sb + t, hi_sb), w_at,
                  w_ok, h_at, h_ok, s_at, s_ok, b_at, b_ok, d_at, d_ok, EVEN)
    d_next = _ld(dm_ptr + n * s3 + lo_sb, n_ok, EVEN).to(gl.float32)
    for sbk in range(lo_sb, hi_sb + 1):
        i = sbk - lo_sb
        async_copy.wait_group(STAGES - 2)   # this thread's copies of sbk have landed
        gl.thread_barrier()                 # everyone's, and slot i - 1 is read: refill it
        _q6k_copy(ring_w, ring_h, ring_s, ring_b, ring_d, (i + STAGES - 1) % STAGES,
                  gl.minimum(sbk + STAGES - 1, hi_sb), w_at, w_ok, h_at, h_ok, s_at, s_ok, b_at,
                  b_ok, d_at, d_ok, EVEN)
        d = d_next
        d_next = _ld(dm_ptr + n * s3 + gl.minimum(sbk + 1, hi_sb), n_ok, EVEN).to(gl.float32)
        slot = i % STAGES
        for cc in gl.static_range(8):                          # chunks of 32: groups 2c, 2c + 1
            lo, hi = _high_codes(group_w.index(8 * slot + cc).load(RAW),
                                 group_h.index(8 * slot + cc).load(RAW), shift, Q6K_LO, Q6K_HI)
            u = gl.reshape(gl.permute(gl.join(lo, hi), (0, 2, 1)), (BLOCK_N, 32))
            u = gl.convert_layout(u, a_l, assert_trivial=True)
            q = group_b.index(8 * slot + cc).permute((1, 0)).load(b_l)
            s_a = mma_v2(_and(u, first, 0), q, magic)       # a thread's slots: one group's
            s_b = mma_v2(_and(u, first, 1), q, magic)
            even, odd = gl.split(gl.reshape(                  # (dx, qs0 dx), (qs dx, qs1 dx)
                group_d.index(8 * slot + cc).load(DC), (BLOCK_M, 2, 2)))
            dx, c0 = gl.split(even)
            _, c1 = gl.split(odd)
            dx = gl.convert_layout(dx, cols_l, assert_trivial=True)
            wd = words.index(4 * slot + cc // 2).load(rows_l)   # scales 4 (c // 2) .. + 3
            for h in gl.static_range(2):                    # scale 2 c + h: a byte of wd
                sc = ((wd << (24 - 8 * (2 * (cc % 2) + h))) >> 24).to(gl.float32)
                a = d * sc
                cg = gl.convert_layout(c0 if h == 0 else c1, cols_l, assert_trivial=True)
                f = (s_a if h == 0 else s_b).to(gl.float32, bitcast=True) - 12582912.0
                acc += gl.fma(a[:, None] * dx[None, :], f, (-32.0 * a)[:, None] * cg[None, :])
    async_copy.wait_group(0)                # no copy left in flight at the exit
    _finish(acc, dst_ptr, res_ptr, out_ptr, count_ptr, n, n_ok, m, m_ok, M, N, stride_rm,
            stride_om, P, HAS_RES, FIXUP)


def ring_args(part) -> tuple:
    """The part's planes as the ring kernel of its type reads them, and their row strides (two
    tuples, in the kernel's order). Q4_K: qs as bytes, sc as int32 words, dm's d, dmin pairs
    as int32 words (Q5_K: its qh as bytes too); Q8_0: qs and qh as bytes, d as int32 words;
    Q6_K: qs and qh as bytes, sc as int32 words, dm as it is; IQ4_XS: qs as bytes, sc and dm
    as they are."""
    pl = part.planes
    if part.qtype == "IQ4_XS":
        return ((pl["qs"].view(torch.int8), pl["sc"], pl["dm"]),
                (pl["qs"].stride(0), pl["sc"].stride(0), pl["dm"].stride(0)))
    if part.qtype == "Q6_K":
        sc = pl["sc"]
        return ((pl["qs"].view(torch.int8), pl["qh"].view(torch.int8), sc.view(torch.int32),
                 pl["dm"]), (pl["qs"].stride(0), pl["qh"].stride(0), sc.stride(0) // 4,
                             pl["dm"].stride(0)))
    halves = pl["d" if part.qtype == "Q8_0" else "dm"]
    if halves.stride(0) % 2 or halves.stride(1) != 1 or halves.data_ptr() % 4:
        raise ValueError(f"int8-activation ring MMA: {part.qtype}'s scale plane is not in "
                         "words")
    qs, words = pl["qs"].view(torch.int8), halves.view(torch.int32)
    if part.qtype == "Q5_K":
        return ((qs, pl["qh"].view(torch.int8), pl["sc"], words),
                (pl["qs"].stride(0), pl["qh"].stride(0), pl["sc"].stride(0),
                 halves.stride(0) // 2))
    if part.qtype == "Q8_0":
        return ((qs, pl["qh"].view(torch.int8), words, words),
                (pl["qs"].stride(0), pl["qh"].stride(0), halves.stride(0) // 2, 0))
    return ((qs, qs, pl["sc"], words),
            (pl["qs"].stride(0), 0, pl["sc"].stride(0), halves.stride(0) // 2))


def ring_mm(x, part, res=None, out=None, *, stages: int | None = None, block_n: int = 64,
            block_m: int = 16, warps: int = 4, parts: int = PARTS,
            maxnreg: int | None = None, warps_m: int = 1) -> torch.Tensor:
    """a8_gluon.gluon_mm's product (a8_mm's bits) for a part of a RING_TYPES type by the ring
    kernels, a ring of `stages` super-blocks (2 or more; default STAGES', the faster on an
    H200 by tools/gpu/gluon_a8.py --stages, fewer where the device's shared memory is less);
    maxnreg: ptxas's cap on a thread's registers (default REGISTERS' for the tile, else none)."""
    if maxnreg is None:
        maxnreg = REGISTERS.get((part.qtype, block_m))
    if stages is not None and stages < 2:
        raise ValueError(f"int8-activation ring MMA: {stages} stages (it takes 2 or more)")
    fit, slot, limit = ring_stages(part, block_n, block_m, x.q.device, stages)
    if not fit:
        want = stages or 2
        raise ValueError(f"int8-activation ring MMA: {want} stages of {block_n} x {block_m} "
                         f"tiles need {want * slot} bytes of shared memory, over the "
                         f"device's {limit}: take fewer stages or smaller tiles")
    stages = fit
    out, grid, finish, sizes, blocks, then = plan(x, part, res, out, block_n, block_m, warps,
                                                  parts, maxnreg, "ring MMA", warps_m,
                                                  RING_TYPES)
    planes, strides = ring_args(part)
    if any(t.dtype == torch.int8 and (t.data_ptr() % 16 or t.stride(0) % 16) for t in planes):
        raise ValueError(f"int8-activation ring MMA: a {part.qtype} weight's byte planes are "
                         "not in 16-byte rows (cp.async copies 16 bytes)")
    kernel, q8 = {"Q6_K": _q6k_ring_kernel, "IQ4_XS": _iq4xs_ring_kernel}.get(part.qtype), {}
    if kernel is None:
        kernel = _nibble_ring_kernel
        q8 = {"Q8": part.qtype == "Q8_0", "Q5": part.qtype == "Q5_K"}
    kernel[grid](x.qp, x.dc, *planes, *finish, *sizes, *strides, finish[1].stride(0),
                 out.stride(0), STAGES=stages, **q8, **copy_layouts(warps, part.qtype),
                 **blocks)
    return then()
