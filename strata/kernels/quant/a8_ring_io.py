"""The pieces every kernel of the ring (a8_ring.py) shares: where a super-block's operands lie in
global memory, their cp.async copies into a ring of shared memory, the rings and the views that
read them a group at a time, and the copies' register layouts."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy


@gluon.jit
def _rows_sources(qp_ptr, dc_ptr, m0, M, K, BLOCK_M: gl.constexpr, CB: gl.constexpr,
                  CD: gl.constexpr):
    """Where super-block 0's rows' codes [8, BM, 32] (in slot order, CB) and dc [8, BM, 4]
    (CD) lie, with their masks; super-block sb's: + 256 sb and + 32 sb."""
    gb = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, CB)))
    mb = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(2, CB)))
    sb = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, CB)))
    kb = (sb % 16) // 4 * 8 + (sb >= 16).to(gl.int32) * 4 + sb % 4   # a8_gluon._rows_at's
    kb = gl.max_contiguous(gl.multiple_of(kb, 4), 4)
    b_at = qp_ptr + mb[None, :, None] * K + (32 * gb)[:, None, None] + kb[None, None, :]
    gd = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, CD)))
    md = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(2, CD)))
    e = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, CD)))
    d_at = (dc_ptr + md[None, :, None] * (K // 32 * 4) + (4 * gd)[:, None, None]
            + e[None, None, :])                               # K // 32 * 4: 16-byte copies
    return b_at, (mb < M)[None, :, None], d_at, (md < M)[None, :, None]


@gluon.jit
def _bytes_sources(w_ptr, n0, N, row, BLOCK_N: gl.constexpr, CW: gl.constexpr):
    """Where super-block 0's 8 x 16 bytes of a 128-byte plane lie for rows n0 .. [8, BN, 16]
    (CW; row: the plane's bytes a row), with their mask; super-block sb's: + 128 sb."""
    g = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, CW)))
    nw = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, CW)))
    b = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, CW)))
    w_at = w_ptr + nw[None, :, None] * row + (16 * g)[:, None, None] + b[None, None, :]
    return w_at, (nw < N)[None, :, None]


@gluon.jit
def _copy_in(ring, slot, at, ok, EVEN: gl.constexpr):
    """cp.async of the values at `at` into the ring's slot (masked unless EVEN)."""
    if EVEN:
        async_copy.async_copy_global_to_shared(ring.index(slot), at)
    else:
        async_copy.async_copy_global_to_shared(ring.index(slot), at, ok)


@gluon.jit
def _ring(STAGES: gl.constexpr, dtype: gl.constexpr, ROWS: gl.constexpr, WIDTH: gl.constexpr):
    """A ring of STAGES slots of [8 groups, ROWS, WIDTH] in shared memory, row-major with no
    swizzle, and the same memory a group a slot to read ([8 STAGES, ROWS, WIDTH]: a shared
    view is indexed once)."""
    ring = gl.allocate_shared_memory(dtype, [STAGES, 8, ROWS, WIDTH],
                                     gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    return ring, ring._reinterpret(dtype, [STAGES * 8, ROWS, WIDTH],
                                   gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))


@gluon.jit
def _word_ring(STAGES: gl.constexpr, ROWS: gl.constexpr):
    """_ring of 4 int32 words a row, [STAGES, 4, ROWS], read a word a row ([4 STAGES, ROWS])."""
    ring = gl.allocate_shared_memory(gl.int32, [STAGES, 4, ROWS],
                                     gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    return ring, ring._reinterpret(gl.int32, [STAGES * 4, ROWS],
                                   gl.SwizzledSharedLayout(1, 1, 1, [0]))


@gluon.jit
def _half(word, H: gl.constexpr):
    """int32 words' low (H 0) or high (1) fp16 halves, as fp32."""
    return ((word >> (16 * H)) & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)


def copy_layouts(warps: int, qtype: str = "Q4_K") -> dict:
    """The copies' register layouts: a thread 16 weight bytes (8 threads a row's super-block,
    128 contiguous bytes), 4 bytes of the rows' codes (8 threads a group of a row), 16 bytes
    of their dc plane (8 threads a row's super-block), one scale word (not IQ4_XS); Q6_K's and
    Q5_K's 4 bytes of qh (CH)."""
    out = dict(
        CW=gl.BlockedLayout([1, 1, 16], [8, 4, 1], [1, warps, 1], [2, 0, 1]),
        CS=gl.BlockedLayout([1, 1], [4, 8], [1, warps], [0, 1]),
        CB=gl.BlockedLayout([1, 1, 4], [1, 4, 8], [1, warps, 1], [2, 1, 0]),
        CD=gl.BlockedLayout([1, 1, 4], [8, 4, 1], [1, warps, 1], [2, 0, 1]))
    if qtype != "IQ4_XS":   # (the nibble kernel takes it for Q5_K's; Q4_K and Q8_0 leave it)
        out["CH"] = gl.BlockedLayout([1, 1, 4], [8, 1, 4], [1, warps, 1], [2, 0, 1])
    if qtype == "IQ4_XS":   # its scales are loaded into registers
        del out["CS"]
    return out
