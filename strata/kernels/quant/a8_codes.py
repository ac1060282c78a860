"""The Gluon int8 kernels' codes from a thread's words of a weight's planes (weight.py), a word
(four int8 lanes) at a time by inline PTX: the nibbles of qs words, masks, and the 5- and 6-bit
types' codes with their high bits from a group's qh word. a8_gluon.py's and a8_ring.py's kernels
take them; tests/kernels/test_quant_a8_gluon.py runs the PTX instruction by instruction on
planes packed as weight.py packs them."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _nibbles(raw, SHIFT: gl.constexpr):
    """int8 [..] bytes -> their low (SHIFT 0) or high (4) nibbles, a word at a time."""
    if SHIFT == 0:
        return gl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [raw],
                                         dtype=gl.int8, is_pure=True, pack=4)
    return gl.inline_asm_elementwise("shr.b32 $0, $1, 4;\n\tand.b32 $0, $0, 0x0F0F0F0F;",
                                     "=r,r", [raw], dtype=gl.int8, is_pure=True, pack=4)


@gluon.jit
def _and(x, mask, NOT: gl.constexpr):
    """int8 x & mask (NOT: & ~mask), a word at a time."""
    if NOT:
        return gl.inline_asm_elementwise("not.b32 $0, $2;\n\tand.b32 $0, $1, $0;", "=r,r,r",
                                         [x, mask], dtype=gl.int8, is_pure=True, pack=4)
    return gl.inline_asm_elementwise("and.b32 $0, $1, $2;", "=r,r,r", [x, mask], dtype=gl.int8,
                                     is_pure=True, pack=4)


def _high_asm(mask: int, hi: int) -> str:
    """PTX: a thread's qs word ($1), its group's qh word ($2) and shift ($3, a byte) -> the codes
    of the low (hi 0) or high (hi 1) nibbles with their high bits (qh >> shift, plus 4 for the
    high nibbles, masked by mask a byte) above them, a byte each."""
    take = ("shr.b32 $0, $1, 4; and.b32 $0, $0, 0x0F0F0F0F;" if hi else
            "and.b32 $0, $1, 0x0F0F0F0F;")
    return ("{ .reg .b32 s, h; and.b32 s, $3, 0xFF; " + ("add.u32 s, s, 4; " if hi else "") +
            f"shr.b32 h, $2, s; and.b32 h, h, {mask:#010x}; shl.b32 h, h, 4; " + take +
            " or.b32 $0, $0, h; }")


# Q6_K's two high bits a code and Q5_K's one (weight.py's qh words)
Q6K_LO, Q6K_HI = gl.constexpr(_high_asm(0x03030303, 0)), gl.constexpr(_high_asm(0x03030303, 1))
Q5K_LO, Q5K_HI = gl.constexpr(_high_asm(0x01010101, 0)), gl.constexpr(_high_asm(0x01010101, 1))


@gluon.jit
def _high_codes(raw, qh, shift, LO: gl.constexpr, HI: gl.constexpr):
    """int8 [BN, 16] x3 -> the codes of the low (bits 0..3 of raw) and high nibbles with their
    high bits (_high_asm's LO, HI): raw the thread's qs word, qh its group's qh word, shift
    bits * a (a: the word's index in its group): element j's high bits are at bit 4 j +
    bits * a of qh, so the low nibbles' are qh >> (bits a) and the high ones' qh >> (bits a +
    4), a byte each."""
    lo = gl.inline_asm_elementwise(LO, "=r,r,r,r", [raw, qh, shift], dtype=gl.int8,
                                   is_pure=True, pack=4)
    hi = gl.inline_asm_elementwise(HI, "=r,r,r,r", [raw, qh, shift], dtype=gl.int8,
                                   is_pure=True, pack=4)
    return lo, hi
