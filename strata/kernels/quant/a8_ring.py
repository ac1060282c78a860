"""The Gluon int8-activation MMA for Q4_K with its operands through a ring of shared memory:
each super-block's weight bytes, scales and the rows' codes and dc plane are copied from global
memory by cp.async `stages - 1` super-blocks ahead of their arithmetic, so a program keeps that
many loads in flight instead of waiting on each super-block's (a8_gluon.py's kernel loads them
into registers as it goes). The warps then read a group's fragments from shared memory: the
rows' codes once a program, not once a warp from global memory.

The arithmetic is a8_gluon._q4k_mma_kernel's, term for term (the same mma.sync sums, the same
group_term, groups in K's order, parts finished by _finish), so the bits are a8_mm's. An option
of a8_gluon.gluon_mm (`stages`), timed by tools/gpu/gluon_a8.py --stages, not a8_mm's default.

The ring's slots, a super-block each: the weight's qs bytes [8 groups, BN rows, 16], its scale
words and its d, dmin word [4, BN] int32, the rows' codes in slot order [8, BM, 32] (the slot
order a8_gluon._rows_at reads; copied 4 bytes at a time into place) and dc [8, BM, 4] fp32.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from strata.kernels.quant.a8_gluon import _finish, _nibbles, _program, _q4k_terms, _tile, plan
from strata.kernels.quant.a8_parts import PARTS


@gluon.jit
def _copy_sources(qp_ptr, dc_ptr, w_ptr, sc_ptr, dm_ptr, n0, m0, N, M, K, s0, s2, s3,
                  BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, CW: gl.constexpr,
                  CS: gl.constexpr, CB: gl.constexpr, CD: gl.constexpr):
    """The global addresses of super-block 0's slot contents and their masks: weight bytes
    [8, BN, 16] (CW), scale words [4, BN] (CS: sc's three, then dm's pair as one int32),
    the rows' codes [8, BM, 32] in slot order (CB), their dc [8, BM, 4] (CD). A super-block
    sb further: + 128 sb, + (3, 3, 3, 1) sb, + 256 sb, + 32 sb."""
    g = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, CW)))
    nw = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, CW)))
    b = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, CW)))
    w_at = (w_ptr + nw[None, :, None] * (4 * s0) + (16 * g)[:, None, None]
            + b[None, None, :])
    w_ok = (nw < N)[None, :, None]
    c = gl.arange(0, 4, layout=gl.SliceLayout(1, CS))
    ns = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, CS))
    s_at = gl.where((c < 3)[:, None], sc_ptr + ns[None, :] * s2 + c[:, None],
                    dm_ptr + ns[None, :] * s3 + 0 * c[:, None])
    s_step = gl.where(c < 3, 3, 1)
    s_ok = (ns < N)[None, :]
    gb = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, CB)))
    mb = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(2, CB)))
    sb = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, CB)))
    kb = (sb % 16) // 4 * 8 + (sb >= 16).to(gl.int32) * 4 + sb % 4   # a8_gluon._rows_at's
    kb = gl.max_contiguous(gl.multiple_of(kb, 4), 4)
    b_at = qp_ptr + mb[None, :, None] * K + (32 * gb)[:, None, None] + kb[None, None, :]
    b_ok = (mb < M)[None, :, None]
    gd = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, CD)))
    md = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(2, CD)))
    e = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, CD)))
    d_at = dc_ptr + md[None, :, None] * (K // 8) + (4 * gd)[:, None, None] + e[None, None, :]
    d_ok = (md < M)[None, :, None]
    return w_at, w_ok, s_at, s_step[:, None], s_ok, b_at, b_ok, d_at, d_ok


@gluon.jit
def _copy(ring_w, ring_s, ring_b, ring_d, slot, sb, w_at, w_ok, s_at, s_step, s_ok, b_at,
          b_ok, d_at, d_ok, EVEN: gl.constexpr):
    """Super-block sb's weight bytes, scales, codes and dc into the ring's slot (cp.async, one
    commit group)."""
    if EVEN:
        async_copy.async_copy_global_to_shared(ring_w.index(slot), w_at + 128 * sb)
        async_copy.async_copy_global_to_shared(ring_s.index(slot), s_at + s_step * sb)
        async_copy.async_copy_global_to_shared(ring_b.index(slot), b_at + 256 * sb)
        async_copy.async_copy_global_to_shared(ring_d.index(slot), d_at + 32 * sb)
    else:
        async_copy.async_copy_global_to_shared(ring_w.index(slot), w_at + 128 * sb, w_ok)
        async_copy.async_copy_global_to_shared(ring_s.index(slot), s_at + s_step * sb, s_ok)
        async_copy.async_copy_global_to_shared(ring_b.index(slot), b_at + 256 * sb, b_ok)
        async_copy.async_copy_global_to_shared(ring_d.index(slot), d_at + 32 * sb, d_ok)
    async_copy.commit_group()


@gluon.jit
def _q4k_ring_kernel(qp_ptr, dc_ptr, w_ptr, sc_ptr, dm_ptr, dst_ptr, res_ptr, out_ptr,
                     count_ptr, M, N, K, L, s0, s2, s3, stride_rm, stride_om,
                     BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, MMA: gl.constexpr,
                     RAW: gl.constexpr, DC: gl.constexpr, EVEN: gl.constexpr,
                     P: gl.constexpr, HAS_RES: gl.constexpr, FIXUP: gl.constexpr,
                     STAGES: gl.constexpr, CW: gl.constexpr, CS: gl.constexpr,
                     CB: gl.constexpr, CD: gl.constexpr):
    """a8_gluon._q4k_mma_kernel with the ring (the module says how): w_ptr the qs plane as
    bytes, sc_ptr the scale words (int32), dm_ptr the d, dmin pairs as int32 words (s3 the
    plane's row stride in words). CW, CS, CB, CD: the copies' layouts (copy_layouts)."""
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    rows_l: gl.constexpr = gl.SliceLayout(1, MMA)
    cols_l: gl.constexpr = gl.SliceLayout(0, MMA)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])   # no swizzle: row-major
    flat2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    flat1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    part, n0, m0 = _program(BLOCK_N, BLOCK_M)
    ring_w = gl.allocate_shared_memory(gl.int8, [STAGES, 8, BLOCK_N, 16], flat)
    ring_s = gl.allocate_shared_memory(gl.int32, [STAGES, 4, BLOCK_N], flat2)
    ring_b = gl.allocate_shared_memory(gl.int8, [STAGES, 8, BLOCK_M, 32], flat)
    ring_d = gl.allocate_shared_memory(gl.float32, [STAGES, 8, BLOCK_M, 4], flat)
    w_at, w_ok, s_at, s_step, s_ok, b_at, b_ok, d_at, d_ok = _copy_sources(
        qp_ptr, dc_ptr, w_ptr, sc_ptr, dm_ptr, n0, m0, N, M, K, s0, s2, s3, BLOCK_N, BLOCK_M,
        CW, CS, CB, CD)
    # the same rings a group (or a scale word) a row, to read: a shared view indexes once
    group_w = ring_w._reinterpret(gl.int8, [STAGES * 8, BLOCK_N, 16], flat2)
    words = ring_s._reinterpret(gl.int32, [STAGES * 4, BLOCK_N], flat1)
    group_b = ring_b._reinterpret(gl.int8, [STAGES * 8, BLOCK_M, 32], flat2)
    group_d = ring_d._reinterpret(gl.float32, [STAGES * 8, BLOCK_M, 4], flat2)
    n, n_ok, m, m_ok = _tile(n0, m0, N, M, BLOCK_N, BLOCK_M, MMA)
    magic = gl.full([BLOCK_N, BLOCK_M], 0x4B400000, gl.int32, layout=MMA)
    acc = gl.full([BLOCK_N, BLOCK_M], 0.0, gl.float32, layout=MMA)
    first = part * (L // 256)
    last = first + L // 256 - 1
    for s in gl.static_range(STAGES - 1):   # the ring's first super-blocks (the last again
        _copy(ring_w, ring_s, ring_b, ring_d, s, gl.minimum(first + s, last), w_at, w_ok,
              s_at, s_step, s_ok, b_at, b_ok, d_at, d_ok, EVEN)   # where the part is short)
    for sbk in range(first, last + 1):
        i = sbk - first
        async_copy.wait_group(STAGES - 2)   # this thread's copies of sbk have landed
        gl.thread_barrier()                 # everyone's, and slot i - 1 is read: refill it
        _copy(ring_w, ring_s, ring_b, ring_d, (i + STAGES - 1) % STAGES,
              gl.minimum(sbk + STAGES - 1, last), w_at, w_ok, s_at, s_step, s_ok, b_at, b_ok,
              d_at, d_ok, EVEN)
        slot = i % STAGES
        v0 = words.index(4 * slot).load(rows_l)
        v1 = words.index(4 * slot + 1).load(rows_l)
        v2 = words.index(4 * slot + 2).load(rows_l)
        dm = words.index(4 * slot + 3).load(rows_l)
        d = (dm & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        dmin = (dm >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        for j in gl.static_range(8):
            raw = group_w.index(8 * slot + j).load(RAW)
            u = gl.reshape(gl.permute(gl.join(_nibbles(raw, 0), _nibbles(raw, 4)), (0, 2, 1)),
                           (BLOCK_N, 32))
            u = gl.convert_layout(u, a_l, assert_trivial=True)
            q = group_b.index(8 * slot + j).permute((1, 0)).load(b_l)
            isum = mma_v2(u, q, magic)                        # 1.5 * 2^23 + the sums
            a, b = _q4k_terms(v0, v1, v2, d, dmin, j)
            dx, c = gl.split(group_d.index(8 * slot + j).slice(0, 2, dim=1).load(DC))
            dx = gl.convert_layout(dx, cols_l, assert_trivial=True)
            c = gl.convert_layout(c, cols_l, assert_trivial=True)
            f = isum.to(gl.float32, bitcast=True) - 12582912.0  # group_term's magic number
            acc += gl.fma(a[:, None] * dx[None, :], f, b[:, None] * c[None, :])
    async_copy.wait_group(0)                # no copy left in flight at the exit
    _finish(acc, dst_ptr, res_ptr, out_ptr, count_ptr, n, n_ok, m, m_ok, M, N, stride_rm,
            stride_om, P, HAS_RES, FIXUP)


def copy_layouts(warps: int) -> dict:
    """The copies' register layouts: a thread 16 weight bytes (8 threads a row's super-block,
    128 contiguous bytes), 4 bytes of the rows' codes (8 threads a group of a row), 16 bytes
    of their dc plane (8 threads a row's super-block), one scale word."""
    return dict(
        CW=gl.BlockedLayout([1, 1, 16], [8, 4, 1], [1, warps, 1], [2, 0, 1]),
        CS=gl.BlockedLayout([1, 1], [4, 8], [1, warps], [0, 1]),
        CB=gl.BlockedLayout([1, 1, 4], [1, 4, 8], [1, warps, 1], [2, 1, 0]),
        CD=gl.BlockedLayout([1, 1, 4], [8, 4, 1], [1, warps, 1], [2, 0, 1]))


def ring_planes(part) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """The Q4_K part's planes as the ring kernel reads them: qs as bytes, sc as int32 words,
    dm's d, dmin pairs as int32 words; and their row strides (qs in its int32 words)."""
    pl = part.planes
    dm = pl["dm"]
    if dm.stride(0) % 2 or dm.stride(1) != 1:
        raise ValueError("int8-activation ring MMA: Q4_K's d, dmin plane has odd rows")
    return (pl["qs"].view(torch.int8), pl["sc"], dm.view(torch.int32), pl["qs"].stride(0),
            pl["sc"].stride(0), dm.stride(0) // 2)


def ring_mm(x, part, res=None, out=None, *, stages: int = 3, block_n: int = 64,
            block_m: int = 16, warps: int = 4, parts: int = PARTS,
            maxnreg: int | None = None) -> torch.Tensor:
    """a8_gluon.gluon_mm's product (a8_mm's bits) for a Q4_K part by the ring kernel, a ring
    of `stages` super-blocks (2 or more)."""
    if part.qtype != "Q4_K" or stages < 2:
        raise ValueError(f"int8-activation ring MMA: {stages} stages of a {part.qtype} weight "
                         "(it takes Q4_K, with 2 stages or more)")
    out, grid, finish, sizes, blocks, then = plan(x, part, res, out, block_n, block_m, warps,
                                                  parts, maxnreg, "ring MMA")
    qs, sc, dm, s0, s2, s3 = ring_planes(part)
    _q4k_ring_kernel[grid](x.qp, x.dc, qs, sc, dm, *finish, *sizes, s0, s2, s3,
                           finish[1].stride(0), out.stride(0), STAGES=stages,
                           **copy_layouts(warps), **blocks)
    return then()
