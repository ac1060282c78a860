"""The int8-activation MMA for Q4_K and Q6_K weights in Gluon (Triton's language with
explicit layouts), the operands loaded from global memory straight into the registers of
mma.sync m16n8k32, with no trip through shared memory and no barrier.

The integer sum of a group, sum_k u_k q_k, does not depend on the order of k, so both operands
take the same permutation of a group's 32 quants, chosen so that a thread's A fragment (the 8 k
slots 4t .. 4t + 3 and 16 + 4t .. 16 + 4t + 3 of its rows, t = lane % 4) is one 32-bit word of
the weight's qs plane: slots 4t + i take the word's low nibbles (quants 8t + 2i), slots 16 + 4t
+ i its high ones (8t + 2i + 1). The rows' codes in pair order (Codes.qp: each 8 as 0, 2, 4, 6,
1, 3, 5, 7) give the B fragment of the same slots as two 4-byte pieces. Q6_K's groups of 16 take
a thread's word from one group (words 0, 1 of a 32-quant chunk are its first group's), the high
bits from the group's qh word, and the sums of each group from the codes with the other group's
slots zeroed (a thread's words or zero). Each group's sums then take a8_gemv.group_term's float
term, added to the accumulator group by group in K's order within a part of K
(a8_parts.k_parts), then the parts in order by the tile's last program: the arithmetic of every
int8 kernel, so its bits are a8_mm's. a8_mm takes it on CUDA at GLUON_TILES' small row tiles,
where it was faster (a8_ring.py's kernels at the larger ones; tools/gpu/gluon_a8.py times them
beside a8_mm, or compiles them for sm_90 without a GPU); STRATA_A8_DOT=gluon at every tile
from 4 rows. Gluon does not run under
Triton's interpreter: its bits are checked on a GPU (`python -m pytest -m gpu
tests/kernels/test_quant_a8_gluon.py`).
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from strata.kernels.arrive import counters
from strata.kernels.quant.a8_codes import Q6K_HI, Q6K_LO, _and, _high_codes, _nibbles
from strata.kernels.quant.a8_layouts import dc_layout, mma_layout, raw_layout
from strata.kernels.quant.a8_parts import PARTS, add_parts, k_parts


@gluon.jit
def _ld(at, ok, EVEN: gl.constexpr):
    """A load, masked unless the blocks are whole (EVEN: no predicates, no zeroing)."""
    if EVEN:
        return gl.load(at)
    return gl.load(at, mask=ok, other=0)


@gluon.jit
def _program(BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
    """The program's part of K and the first weight row and window row of its tile."""
    return gl.program_id(2), gl.program_id(0) * BLOCK_N, gl.program_id(1) * BLOCK_M


@gluon.jit
def _weight_at(w_ptr, s0, n0, N, BLOCK_N: gl.constexpr, RAW: gl.constexpr):
    """A group's 16 bytes of the qs plane for rows n0 .. [BN, 16] (RAW: thread t the bytes
    4t .. 4t + 3 of its rows): the rows, the bytes, their addresses (at group 0) and mask."""
    na = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, RAW))
    sa = gl.arange(0, 16, layout=gl.SliceLayout(0, RAW))
    return na, sa, w_ptr + na[:, None] * (4 * s0) + sa[None, :], (na < N)[:, None]


@gluon.jit
def _tile(n0, m0, N, M, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, MMA: gl.constexpr):
    """The accumulator's weight rows n and window rows m, in its layout, with their masks."""
    n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    return n, n < N, m, m < M


@gluon.jit
def _finish(acc, dst_ptr, res_ptr, out_ptr, count_ptr, n, n_ok, m, m_ok, M, N, stride_rm,
            stride_om, P: gl.constexpr, HAS_RES: gl.constexpr, FIXUP: gl.constexpr):
    """A part's sums acc [BN, BM] (weight rows n, window rows m) to out[m, n] as a8_parts'
    kernels write them: with one part, 0 + acc (+ res) in out's dtype; with more, into the
    part's scratch dst [P, M, N], and with FIXUP the tile's last program to arrive (as
    kernels/arrive.arrive) adds the parts in order from zero (+ res) into out."""
    ok = n_ok[:, None] & m_ok[None, :]
    if P == 1:
        _store_rows(0.0 + acc, res_ptr, out_ptr, n, m, ok, stride_rm, stride_om, HAS_RES)
    else:
        gl.store(dst_ptr + gl.program_id(2) * M * N + m[None, :] * N + n[:, None], acc, mask=ok)
        if FIXUP:
            tile = count_ptr + gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)
            gl.thread_barrier()
            seen = gl.atomic_add(tile, 1, sem="acq_rel", scope="gpu")
            gl.thread_barrier()
            if seen == P - 1:
                gl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")
                s = gl.zeros_like(acc)
                for p in gl.static_range(P):
                    s = s + gl.load(dst_ptr + (p * M + m[None, :]) * N + n[:, None], mask=ok,
                                    other=0.0, cache_modifier=".cg")
                _store_rows(s, res_ptr, out_ptr, n, m, ok, stride_rm, stride_om, HAS_RES)


@gluon.jit
def _store_rows(s, res_ptr, out_ptr, n, m, ok, stride_rm, stride_om, HAS_RES: gl.constexpr):
    """s [BN, BM] fp32 (+ res[m, n]) into out[m, n] in out's dtype (a8_parts.store_rows)."""
    if HAS_RES:
        s += gl.load(res_ptr + m[None, :] * stride_rm + n[:, None], mask=ok,
                     other=0.0).to(gl.float32)
    gl.store(out_ptr + m[None, :] * stride_om + n[:, None], s.to(out_ptr.dtype.element_ty),
             mask=ok)


@gluon.jit
def _rows_at(qp_ptr, M, K, m0, BLOCK_M: gl.constexpr, B_L: gl.constexpr, DC: gl.constexpr,
             W: gl.constexpr):
    """Where a group's B fragments [32, BM] lie in the rows' pair-order codes (slot s of row m:
    byte 8 (s % 16 // 4) + 4 (s >= 16) + s % 4 of the group, 4 bytes a load), and the first W
    of the rows' dc plane values [BM, W] (Codes.dc; DC: dc_layout), each with its mask."""
    sb = gl.arange(0, 32, layout=gl.SliceLayout(1, B_L))
    mb = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, B_L))
    kb = (sb % 16) // 4 * 8 + (sb >= 16).to(gl.int32) * 4 + sb % 4
    kb = gl.max_contiguous(gl.multiple_of(kb, 4), 4)
    md = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, DC))
    dc_at = (K // 32 * 4) * md[:, None] + gl.arange(0, W, layout=gl.SliceLayout(0, DC))[None, :]
    return qp_ptr + mb[None, :] * K + kb[:, None], (mb < M)[None, :], dc_at, (md < M)[:, None]


@gluon.jit
def _q4k_scales(sc_ptr, dm_ptr, n, n_ok, s2, s3, sb, EVEN: gl.constexpr):
    """What Q4_K super-block sb of rows n keeps for its 8 groups' terms: its three scale
    words and d, dmin (reads.py's _term_loads)."""
    base = sc_ptr + n * s2 + 3 * sb
    v0 = _ld(base, n_ok, EVEN)
    v1 = _ld(base + 1, n_ok, EVEN)
    v2 = _ld(base + 2, n_ok, EVEN)
    d = _ld(dm_ptr + n * s3 + 2 * sb, n_ok, EVEN).to(gl.float32)
    dmin = _ld(dm_ptr + n * s3 + 2 * sb + 1, n_ok, EVEN).to(gl.float32)
    return v0, v1, v2, d, dmin


@gluon.jit
def _q4k_words(a_at, a_ok, sb, EVEN: gl.constexpr):
    """Super-block sb's 8 groups' bytes of the rows (_weight_at's [BN, 16] each), a tuple."""
    g = 8 * sb
    return (_ld(a_at + 16 * g, a_ok, EVEN), _ld(a_at + 16 * (g + 1), a_ok, EVEN),
            _ld(a_at + 16 * (g + 2), a_ok, EVEN), _ld(a_at + 16 * (g + 3), a_ok, EVEN),
            _ld(a_at + 16 * (g + 4), a_ok, EVEN), _ld(a_at + 16 * (g + 5), a_ok, EVEN),
            _ld(a_at + 16 * (g + 6), a_ok, EVEN), _ld(a_at + 16 * (g + 7), a_ok, EVEN))


@gluon.jit
def _q4k_terms(v0, v1, v2, d, dmin, j: gl.constexpr):
    """a, b fp32 [BN] of group j of the super-block (_q4k_scales'): w = a u + b."""
    sh: gl.constexpr = 8 * (j % 4)
    if j < 4:
        sc = (v0 >> sh) & 63
        mn = (v1 >> sh) & 63
    else:
        sc = ((v2 >> sh) & 15) | (((v0 >> (sh + 6)) & 3) << 4)
        mn = ((v2 >> (sh + 4)) & 15) | (((v1 >> (sh + 6)) & 3) << 4)
    return d * _small_float(sc), -(dmin * _small_float(mn))


@gluon.jit
def _small_float(i):
    """int32 in [0, 2^23) -> fp32, exact, by the magic number (no conversion instruction)."""
    return (i | 0x4B000000).to(gl.float32, bitcast=True) - 8388608.0


@gluon.jit
def _add_term(acc, isum, a, b, dc, MMA: gl.constexpr):
    """acc + a group's terms, a8_gemv.group_term's fma(a dx, isum, b c) of each (weight row,
    window row): isum the mma's 1.5 * 2^23 + the sums (as int32 bits), a and b [BN] the
    weight's terms, dc [BM, 2] the rows' dx and c (Codes.dc, in dc_layout)."""
    cols_l: gl.constexpr = gl.SliceLayout(0, MMA)
    dx, c = gl.split(dc)
    dx = gl.convert_layout(dx, cols_l, assert_trivial=True)
    c = gl.convert_layout(c, cols_l, assert_trivial=True)
    f = isum.to(gl.float32, bitcast=True) - 12582912.0  # group_term's magic number
    return acc + gl.fma(a[:, None] * dx[None, :], f, b[:, None] * c[None, :])


@gluon.jit
def _q4k_mma_kernel(qp_ptr, dc_ptr, w_ptr, sc_ptr, dm_ptr, dst_ptr, res_ptr, out_ptr,
                    count_ptr, M, N, K, L, s0, s2, s3, stride_rm, stride_om,
                    BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, MMA: gl.constexpr,
                    RAW: gl.constexpr, DC: gl.constexpr, EVEN: gl.constexpr,
                    P: gl.constexpr, HAS_RES: gl.constexpr, FIXUP: gl.constexpr,
                    AHEAD: gl.constexpr):
    """Program (column block, row block, part of K): the part's terms of rows m and weight
    rows n, added group by group from zero, finished as _finish says (out [M, N] = the parts
    in order + res). w_ptr: the qs plane as bytes;
    dc_ptr: the rows' Codes.dc, fp32 [M, K / 32, 4] (each group's dx and qs dx first).
    MMA (mma_layout): the accumulator's. DC (dc_layout): [BM, 2] as the accumulator holds its
    columns, the pair in the thread.
    RAW (raw_layout): the layout of a group's 16 bytes of BLOCK_N rows in which each thread
    holds the word whose nibbles its A fragment takes."""
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    part, n0, m0 = _program(BLOCK_N, BLOCK_M)
    # A: the group's 16 bytes of each row [BN, 16] (thread t: bytes 4t .. 4t + 3), then its
    # low nibbles at slots 0 .. 15 and high ones at 16 .. 31: [BN, 32] in the A fragments
    na, sa, a_at, a_ok = _weight_at(w_ptr, s0, n0, N, BLOCK_N, RAW)
    b_at, b_ok, dc_at, dc_ok = _rows_at(qp_ptr, M, K, m0, BLOCK_M, b_l, DC, 2)
    n, n_ok, m, m_ok = _tile(n0, m0, N, M, BLOCK_N, BLOCK_M, MMA)   # the terms' rows, columns
    magic = gl.full([BLOCK_N, BLOCK_M], 0x4B400000, gl.int32, layout=MMA)
    acc = gl.full([BLOCK_N, BLOCK_M], 0.0, gl.float32, layout=MMA)
    first = part * (L // 256)
    last = first + L // 256 - 1
    if AHEAD:   # the first super-block's weight words and scales before the loop
        raws = _q4k_words(a_at, a_ok, first, EVEN)
        scales = _q4k_scales(sc_ptr, dm_ptr, n, n_ok, s2, s3, first, EVEN)
    for sbk in range(first, last + 1):
        if AHEAD:   # this super-block's, loaded a step before; the next one's loads go out
            here = raws
            v0, v1, v2, d, dmin = scales
            ahead = sbk + (sbk < last).to(gl.int32)
            raws = _q4k_words(a_at, a_ok, ahead, EVEN)
            scales = _q4k_scales(sc_ptr, dm_ptr, n, n_ok, s2, s3, ahead, EVEN)
        else:
            v0, v1, v2, d, dmin = _q4k_scales(sc_ptr, dm_ptr, n, n_ok, s2, s3, sbk, EVEN)
        for j in gl.static_range(8):
            g = 8 * sbk + j
            if AHEAD:
                raw = here[j]
            else:
                raw = _ld(a_at + 16 * g, a_ok, EVEN)
            u = gl.reshape(gl.permute(gl.join(_nibbles(raw, 0), _nibbles(raw, 4)), (0, 2, 1)),
                           (BLOCK_N, 32))
            u = gl.convert_layout(u, a_l, assert_trivial=True)
            q = _ld(b_at + 32 * g, b_ok, EVEN)
            isum = mma_v2(u, q, magic)                        # 1.5 * 2^23 + the sums
            a, b = _q4k_terms(v0, v1, v2, d, dmin, j)
            acc = _add_term(acc, isum, a, b, _ld(dc_ptr + 4 * g + dc_at, dc_ok, EVEN), MMA)
    _finish(acc, dst_ptr, res_ptr, out_ptr, count_ptr, n, n_ok, m, m_ok, M, N, stride_rm,
            stride_om, P, HAS_RES, FIXUP)


@gluon.jit
def _q6k_mma_kernel(qp_ptr, dc_ptr, w_ptr, qh_ptr, sc_ptr, dm_ptr, dst_ptr, res_ptr, out_ptr,
                    count_ptr, M, N, K, L, s0, s1, s2, s3, stride_rm, stride_om,
                    BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, MMA: gl.constexpr,
                    RAW: gl.constexpr, DC: gl.constexpr, EVEN: gl.constexpr,
                    P: gl.constexpr, HAS_RES: gl.constexpr, FIXUP: gl.constexpr):
    """_q4k_mma_kernel for Q6_K: groups of 16, so a chunk of 32 quants is two groups, thread
    t's word from group t // 2 (slots 0 .. 7 and 16 .. 23 group 2c, the rest 2c + 1); each
    group's sums from the weight's codes with the other group's slots zeroed (a thread's words
    or zero). w_ptr, qh_ptr: the
    qs and qh planes as bytes; dc_ptr: Codes.dc (dx, the chunk's qs dx, each group's qs dx)."""
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    cols_l: gl.constexpr = gl.SliceLayout(0, MMA)
    part, n0, m0 = _program(BLOCK_N, BLOCK_M)
    na, sa, a_at, a_ok = _weight_at(w_ptr, s0, n0, N, BLOCK_N, RAW)
    h_at = qh_ptr + na[:, None] * (4 * s1) + (sa // 8 * 4 + sa % 4)[None, :]
    shift = (gl.full([BLOCK_N, 16], 0, gl.int8, layout=RAW)
             + ((sa // 4) % 2 * 2).to(gl.int8)[None, :])           # 2 a, a = (byte / 4) % 2
    b_at, b_ok, dc_at, dc_ok = _rows_at(qp_ptr, M, K, m0, BLOCK_M, b_l, DC, 4)
    ka = gl.arange(0, 32, layout=gl.SliceLayout(0, a_l))
    first = gl.full([BLOCK_N, 32], 0, gl.int8, layout=a_l) + gl.where(ka % 16 < 8, -1, 0).to(
        gl.int8)[None, :]                                    # 0xFF at group 2c's slots
    n, n_ok, m, m_ok = _tile(n0, m0, N, M, BLOCK_N, BLOCK_M, MMA)
    magic = gl.full([BLOCK_N, BLOCK_M], 0x4B400000, gl.int32, layout=MMA)
    acc = gl.full([BLOCK_N, BLOCK_M], 0.0, gl.float32, layout=MMA)
    for sbk in range(part * (L // 256), (part + 1) * (L // 256)):
        d = _ld(dm_ptr + n * s3 + sbk, n_ok, EVEN).to(gl.float32)
        for c in gl.static_range(8):                          # chunks of 32: groups 2c, 2c + 1
            ch = 8 * sbk + c
            raw = _ld(a_at + 16 * ch, a_ok, EVEN)
            qh = _ld(h_at + 8 * ch, a_ok, EVEN)
            lo, hi = _high_codes(raw, qh, shift, Q6K_LO, Q6K_HI)
            u = gl.reshape(gl.permute(gl.join(lo, hi), (0, 2, 1)), (BLOCK_N, 32))
            u = gl.convert_layout(u, a_l, assert_trivial=True)
            q = _ld(b_at + 32 * ch, b_ok, EVEN)
            s_a = mma_v2(_and(u, first, 0), q, magic)       # a thread's slots: one group's
            s_b = mma_v2(_and(u, first, 1), q, magic)
            even, odd = gl.split(gl.reshape(                  # (dx, qs0 dx), (qs dx, qs1 dx)
                _ld(dc_ptr + 4 * ch + dc_at, dc_ok, EVEN), (BLOCK_M, 2, 2)))
            dx, c0 = gl.split(even)
            _, c1 = gl.split(odd)
            dx = gl.convert_layout(dx, cols_l, assert_trivial=True)
            for h in gl.static_range(2):
                sc = _ld(sc_ptr + n * s2 + 2 * ch + h, n_ok, EVEN).to(gl.float32)
                a = d * sc
                cg = gl.convert_layout(c0 if h == 0 else c1, cols_l, assert_trivial=True)
                f = (s_a if h == 0 else s_b).to(gl.float32, bitcast=True) - 12582912.0
                acc += gl.fma(a[:, None] * dx[None, :], f, (-32.0 * a)[:, None] * cg[None, :])
    _finish(acc, dst_ptr, res_ptr, out_ptr, count_ptr, n, n_ok, m, m_ok, M, N, stride_rm,
            stride_om, P, HAS_RES, FIXUP)


GLUON_TYPES = ("Q4_K", "Q6_K")
# The row tiles at which a8_mm takes Gluon kernels on CUDA by default, and which: these
# kernels ("gluon") or a8_ring.py's ("ring"), where they beat the GEMV and the Triton MMA at
# the llama3-8b shapes (tools/gpu/gluon_a8.py, on an H100 and an H200; Q8_0's, IQ4_XS's and
# Q5_K's against the GEMV and the Triton MMA on an H100); a GEMV tile's rows run as an 8-row
# tile
GLUON_TILES = {"Q4_K": {4: "gluon", 8: "gluon", 16: "ring", 32: "ring", 64: "ring"},
               "Q6_K": {16: "ring", 32: "ring", 64: "ring"},
               "IQ4_XS": {8: "ring", 16: "ring", 32: "ring", 64: "ring"},
               "Q5_K": {8: "ring", 16: "ring", 64: "ring"},
               "Q8_0": {16: "ring", 64: "ring"}}


def gluon_fits(part, k: int, parts: int = PARTS, types: tuple = GLUON_TYPES) -> bool:
    """Whether the Gluon kernels take this weight: of their types (the registers' kernels'
    by default), whole super-blocks a part."""
    return part.qtype in types and (k // k_parts(part.rows, k, parts)) % 256 == 0


def plan(x, part, res, out, block_n: int, block_m: int, warps: int, parts: int,
         maxnreg: int | None = None, what: str = "Gluon MMA", warps_m: int = 1,
         types: tuple = GLUON_TYPES) -> tuple:
    """A Gluon MMA launch's pieces for rows x and a part (raises where gluon_fits says no, or
    where the warps do not tile the blocks; warps_m: mma_layout's):
    out (made fp32 [M, N] if None), the grid, the finishing arguments (dst, res, out,
    counters), the kernel's integers from M (M, N, K, a part's K) and its constexprs, and
    then(), which adds the parts where no counters did (during a capture, before any exist)."""
    m, k = x.q.shape
    if not gluon_fits(part, k, parts, types):
        raise ValueError(f"int8-activation {what}: a {part.qtype} weight [{part.rows}, "
                         f"{part.cols}] is not {' or '.join(types)} in whole super-blocks "
                         "a part")
    if (warps_m < 1 or warps % warps_m or block_m % (8 * warps_m)
            or block_n % (16 * (warps // warps_m))):
        raise ValueError(f"int8-activation {what}: {warps} warps, {warps_m} of them along the "
                         f"window's rows, do not tile {block_n} x {block_m} blocks (a warp "
                         "takes 16 weight rows by 8 window rows at least)")
    p = k_parts(part.rows, k, parts)
    if out is None:
        out = torch.empty(m, part.rows, dtype=torch.float32, device=x.q.device)
    dst = out if p == 1 else torch.empty(p, m, part.rows, dtype=torch.float32,
                                         device=x.q.device)
    grid = (triton.cdiv(part.rows, block_n), triton.cdiv(m, block_m), p)
    count = counters(x.q.device, grid[0] * grid[1]) if p > 1 else None
    r = res if res is not None else out
    blocks = dict(BLOCK_N=block_n, BLOCK_M=block_m, MMA=mma_layout(warps, warps_m),
                  RAW=raw_layout(block_n, warps, warps_m),
                  DC=dc_layout(block_m, warps, 4 if part.qtype == "Q6_K" else 2, warps_m),
                  EVEN=m % block_m == 0 and part.rows % block_n == 0, P=p,
                  HAS_RES=res is not None, FIXUP=count is not None, num_warps=warps,
                  enable_fp_fusion=False,   # as every int8 kernel (a8_triton.py)
                  **({"maxnreg": maxnreg} if maxnreg else {}))

    def then() -> torch.Tensor:
        if p > 1 and count is None:
            add_parts(dst, res, out)
        return out
    return (out, grid, (dst, r, out, out if count is None else count), (m, part.rows, k, k // p),
            blocks, then)


def gluon_mm(x, part, res=None, out=None, *, block_n: int = 64, block_m: int = 16,
             warps: int = 4, parts: int = PARTS, ahead: bool = False,
             maxnreg: int | None = None) -> torch.Tensor:
    """a8_mm(x, part, res)'s product for a Q4_K or Q6_K part by the Gluon kernels, into out
    (default fp32 [M, N]). ahead (Q4_K): each super-block's weight words and scales loaded a
    step before its arithmetic, in registers; maxnreg: ptxas's cap on a thread's registers
    (more programs an SM); the same bits either way (experiments)."""
    out, grid, finish, sizes, blocks, then = plan(x, part, res, out, block_n, block_m, warps,
                                                  parts, maxnreg)
    pl = part.planes
    strides = (finish[1].stride(0), out.stride(0))
    if part.qtype == "Q6_K":
        _q6k_mma_kernel[grid](x.qp, x.dc, pl["qs"].view(torch.int8), pl["qh"].view(torch.int8),
                              pl["sc"], pl["dm"], *finish, *sizes, pl["qs"].stride(0),
                              pl["qh"].stride(0), pl["sc"].stride(0), pl["dm"].stride(0),
                              *strides, **blocks)
    else:
        assert part.qtype == "Q4_K"
        _q4k_mma_kernel[grid](x.qp, x.dc, pl["qs"].view(torch.int8), pl["sc"], pl["dm"],
                              *finish, *sizes, pl["qs"].stride(0), pl["sc"].stride(0),
                              pl["dm"].stride(0), *strides, AHEAD=ahead, **blocks)
    return then()
