"""The ring's kernel for IQ4_XS (a8_ring.py says how the ring works): its 4-bit codes' codebook
values looked up by prmt, 8 entries at a time, its scales loaded a super-block ahead."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from strata.kernels.quant.a8_gluon import _add_term, _finish, _ld, _program, _tile
from strata.kernels.quant.a8_ring_io import _bytes_sources, _copy_in, _ring, _rows_sources
from strata.kernels.quant.blocks import IQ4_VALUES


def _codebook_asm(hi: int) -> str:
    """PTX: a word of 4 IQ4 codes' nibbles (the low, hi 0, or high nibbles of its bytes) ->
    their codebook values as 4 int8 (blocks.IQ4_VALUES): prmt looks 8 entries up at a time
    (selectors of 3 bits, packed 4 bits apart), the entries' fourth bit picks the half."""
    words = [sum((IQ4_VALUES[4 * i + j] & 0xFF) << (8 * j) for j in range(4)) for i in range(4)]
    take = "shr.b32 x, $1, 4; and.b32 x, x, 0x0F0F0F0F;" if hi else "and.b32 x, $1, 0x0F0F0F0F;"
    return ("{ .reg .b32 x, y, p, q, t0, t1, t2, t3, la, lb, ha, hb, m; " + take +
            " and.b32 y, x, 0x07070707; shr.b32 p, y, 4; or.b32 p, p, y; shr.b32 q, p, 16; " +
            " ".join(f"mov.b32 t{i}, {w:#010x};" for i, w in enumerate(words)) +
            " prmt.b32 la, t0, t1, p; prmt.b32 lb, t0, t1, q; prmt.b32 la, la, lb, 0x5410;"
            " prmt.b32 ha, t2, t3, p; prmt.b32 hb, t2, t3, q; prmt.b32 ha, ha, hb, 0x5410;"
            " and.b32 m, x, 0x08080808; shr.b32 m, m, 3; mul.lo.u32 m, m, 255;"
            " and.b32 ha, ha, m; not.b32 m, m; and.b32 la, la, m; or.b32 $0, la, ha; }")


CODEBOOK_LO, CODEBOOK_HI = gl.constexpr(_codebook_asm(0)), gl.constexpr(_codebook_asm(1))


@gluon.jit
def _iq4_codes(raw, ASM: gl.constexpr):
    """int8 [..] IQ4_XS qs bytes -> the codebook values of their low or high nibbles (ASM:
    CODEBOOK_LO or CODEBOOK_HI), a word at a time: the signed codes, u - 128."""
    return gl.inline_asm_elementwise(ASM, "=r,r", [raw], dtype=gl.int8, is_pure=True, pack=4)


@gluon.jit
def _iq4xs_scales(sc_ptr, dm_ptr, n, n_ok, s2, s3, sb, EVEN: gl.constexpr):
    """IQ4_XS super-block sb's scales_h and two scales_l (int16) and d of rows n, as
    reads._term_loads reads them."""
    base = sc_ptr + n * s2 + 3 * sb
    return (_ld(base, n_ok, EVEN), _ld(base + 1, n_ok, EVEN), _ld(base + 2, n_ok, EVEN),
            _ld(dm_ptr + n * s3 + sb, n_ok, EVEN))


@gluon.jit
def _iq4xs_ring_kernel(qp_ptr, dc_ptr, w_ptr, sc_ptr, dm_ptr, dst_ptr, res_ptr, out_ptr,
                       count_ptr, M, N, K, L, s0, s2, s3, stride_rm, stride_om,
                       BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, MMA: gl.constexpr,
                       RAW: gl.constexpr, DC: gl.constexpr, EVEN: gl.constexpr,
                       P: gl.constexpr, HAS_RES: gl.constexpr, FIXUP: gl.constexpr,
                       STAGES: gl.constexpr, CW: gl.constexpr, CB: gl.constexpr,
                       CD: gl.constexpr):
    """The ring's kernel for IQ4_XS: the qs bytes, the rows' codes and dc through the ring,
    the codes' codebook values by prmt (_codebook_asm: signed, as the GEMV takes them, b
    zeroed), each super-block's scales (sc_ptr: int16, s2; dm_ptr: d fp16, s3) loaded into
    registers a super-block ahead. w_ptr: qs as bytes (s0 its row in words)."""
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    part, n0, m0 = _program(BLOCK_N, BLOCK_M)
    ring_w, group_w = _ring(STAGES, gl.int8, BLOCK_N, 16)
    ring_b, group_b = _ring(STAGES, gl.int8, BLOCK_M, 32)
    ring_d, group_d = _ring(STAGES, gl.float32, BLOCK_M, 4)
    w_at, w_ok = _bytes_sources(w_ptr, n0, N, 4 * s0, BLOCK_N, CW)
    b_at, b_ok, d_at, d_ok = _rows_sources(qp_ptr, dc_ptr, m0, M, K, BLOCK_M, CB, CD)
    n, n_ok, m, m_ok = _tile(n0, m0, N, M, BLOCK_N, BLOCK_M, MMA)
    magic = gl.full([BLOCK_N, BLOCK_M], 0x4B400000, gl.int32, layout=MMA)
    acc = gl.full([BLOCK_N, BLOCK_M], 0.0, gl.float32, layout=MMA)
    first = part * (L // 256)
    last = first + L // 256 - 1
    for s in gl.static_range(STAGES - 1):
        sb = gl.minimum(first + s, last)
        _copy_in(ring_w, s, w_at + 128 * sb, w_ok, EVEN)
        _copy_in(ring_b, s, b_at + 256 * sb, b_ok, EVEN)
        _copy_in(ring_d, s, d_at + 32 * sb, d_ok, EVEN)
        async_copy.commit_group()
    ahead = _iq4xs_scales(sc_ptr, dm_ptr, n, n_ok, s2, s3, first, EVEN)
    for sbk in range(first, last + 1):
        i = sbk - first
        async_copy.wait_group(STAGES - 2)   # this thread's copies of sbk have landed
        gl.thread_barrier()                 # everyone's, and slot i - 1 is read: refill it
        nxt = (i + STAGES - 1) % STAGES
        sb = gl.minimum(sbk + STAGES - 1, last)
        _copy_in(ring_w, nxt, w_at + 128 * sb, w_ok, EVEN)
        _copy_in(ring_b, nxt, b_at + 256 * sb, b_ok, EVEN)
        _copy_in(ring_d, nxt, d_at + 32 * sb, d_ok, EVEN)
        async_copy.commit_group()
        h, l0, l1, d16 = ahead
        ahead = _iq4xs_scales(sc_ptr, dm_ptr, n, n_ok, s2, s3, gl.minimum(sbk + 1, last), EVEN)
        high = h.to(gl.int32) & 0xFFFF
        d = d16.to(gl.float32)
        slot = i % STAGES
        for j in gl.static_range(8):
            raw = group_w.index(8 * slot + j).load(RAW)
            u = gl.join(_iq4_codes(raw, CODEBOOK_LO), _iq4_codes(raw, CODEBOOK_HI))
            u = gl.reshape(gl.permute(u, (0, 2, 1)), (BLOCK_N, 32))
            u = gl.convert_layout(u, a_l, assert_trivial=True)
            q = group_b.index(8 * slot + j).permute((1, 0)).load(b_l)
            isum = mma_v2(u, q, magic)                        # 1.5 * 2^23 + the sums
            low = (l0 if j < 4 else l1).to(gl.int32) & 0xFFFF
            ls = ((low >> (4 * (j % 4))) & 15) | (((high >> (2 * j)) & 3) << 4)
            a = d * (ls - 32).to(gl.float32)                  # reads._term_values'
            b = (-128.0 * a) * 0.0                            # the GEMV's zeroed b
            acc = _add_term(acc, isum, a, b,
                            group_d.index(8 * slot + j).slice(0, 2, dim=1).load(DC), MMA)
    async_copy.wait_group(0)                # no copy left in flight at the exit
    _finish(acc, dst_ptr, res_ptr, out_ptr, count_ptr, n, n_ok, m, m_ok, M, N, stride_rm,
            stride_om, P, HAS_RES, FIXUP)
