"""Quantized weights kept in GGUF's block types on the device: their packed layout, the
`QuantWeight` a stage's layers hold, and the plain-torch dequantization the Triton kernels
(float_triton.py) are checked against.

A GGUF row of a quantized [N, K] matrix is K / block blocks of `type_size` bytes (llama.cpp's
ggml-common.h). The kernels read each row's blocks once and dequantize in registers; to make
those reads wide and the unpacking a few shifts, the blocks are repacked at load into planes,
one tensor [N, X] a field, with exactly the file's bytes (`pack`):

    qs   int32 [N, K/8]   the low 4 bits of every quant, in order: word c holds element 8c + j
                          in bits 4j..4j+3 (Q8_0: the low nibble of q + 128)
    qh   int32            the high bits: Q8_0 the high nibble of q + 128 ([N, K/8], as qs);
                          Q5_0, Q5_1, Q5_K one bit a quant ([N, K/32]), Q6_K two ([N, K/16]),
                          each word one group's: the high bits of qs word a of the group's
                          element j lie in the 4-bit field j of the word, at bit `bits` * a of
                          the field (so the kernels split qs and qh words alike)
    d    fp16 [N, K/32]   Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: each block's scale
    m    fp16 [N, K/32]   Q4_1, Q5_1: each block's offset
    sc   int32 [N, 3K/256] Q4_K, Q5_K: the 12 bytes of 6-bit scales and mins of a super-block
         int8 [N, K/16]   Q6_K: one signed scale per 16 quants
         int16 [N, 3K/256] IQ4_XS: scales_h, then scales_l's 4 bytes, of a super-block
    dm   fp16 [N, K/128]  Q4_K, Q5_K: d and dmin of each super-block; Q6_K, IQ4_XS: [N, K/256] d

Every type then reads as `w = a * u + b` over a group of quants (32, or 16 for Q6_K), with u
an unsigned code (0..15, 31, 63 or 255) and a, b per (row, group); `group_terms` gives a and b.
The codebook types IQ4_NL and IQ4_XS hold 4-bit indices in qs; their u is the index's value
(IQ4_VALUES) + 128, and b = -128 a.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from strata.kernels.quant.blocks import (BLOCKS, IQ4_VALUES,  # noqa: F401 (importable here)
                                          KERNEL_TYPES, PLANES, Part)

# fp16 scale fields of each type's blocks: (byte offset, value) that random_blocks sets
_SCALES = {"Q4_0": ((0, 2e-3),), "Q4_1": ((0, 2e-3), (2, -1e-2)), "Q8_0": ((0, 1.5e-4),),
           "Q5_0": ((0, 2e-3),), "Q5_1": ((0, 1.2e-3), (2, -1.9e-2)),
           "Q4_K": ((0, 1.5e-4), (2, 1e-3)), "Q5_K": ((0, 8e-5), (2, 1e-3)),
           "Q6_K": ((208, 1.5e-5),), "IQ4_NL": ((0, 2e-4),), "IQ4_XS": ((0, 1e-5),)}


def random_blocks(qtype: str, rows: int, cols: int, generator: torch.Generator
                  ) -> torch.Tensor:
    """Random valid blocks uint8 [rows, row bytes] on the generator's device, for kernel tests
    and benchmarks at large shapes: random bytes, fp16 scales that keep the weights' spread
    near 0.02."""
    block, size, _ = BLOCKS[qtype]
    raw = torch.randint(0, 256, (rows, cols // block, size), generator=generator,
                        device=generator.device, dtype=torch.uint8)
    for at, value in _SCALES[qtype]:
        raw[..., at:at + 2] = torch.tensor([value], dtype=torch.float16,
                                           device=generator.device).view(torch.uint8)
    return raw.reshape(rows, -1)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the int32 tensor of the same bits."""
    return torch.where(words >= (1 << 31), words - (1 << 32), words).to(torch.int32)


def _bits_to_words(u: torch.Tensor, bits: int) -> torch.Tensor:
    """u: uint8 codes [N, K] of `bits` bits -> int32 [N, K*bits/32], element (32/bits) c + j
    in bits `bits` j.. (low bits first)."""
    n, k = u.shape
    per = 32 // bits
    shifts = bits * torch.arange(per, device=u.device, dtype=torch.int64)
    return _as_int32((u.view(n, k // per, per).to(torch.int64) << shifts).sum(-1))


def _high_words(h: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """High-bit codes [N, K] -> int32 [N, K / group], one word a group: element 8a + j of the
    group at bit 4j + bits * a (see the module)."""
    n, k = h.shape
    a = torch.arange(group // 8, device=h.device, dtype=torch.int64)[:, None]
    j = torch.arange(8, device=h.device, dtype=torch.int64)[None, :]
    shifts = 4 * j + bits * a                                          # [group / 8, 8]
    return _as_int32((h.view(n, k // group, group // 8, 8).to(torch.int64) << shifts).sum((-1, -2)))


def _high_codes(words: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """The inverse of _high_words: int64 codes [N, K]."""
    a = torch.arange(group // 8, device=words.device, dtype=torch.int64)[:, None]
    j = torch.arange(8, device=words.device, dtype=torch.int64)[None, :]
    w = words.to(torch.int64)[..., None, None] & 0xFFFFFFFF
    return ((w >> (4 * j + bits * a)) & ((1 << bits) - 1)).reshape(words.shape[0], -1)


def _low_high(blocks: torch.Tensor) -> torch.Tensor:
    """[.., B] bytes -> [.., 2B] codes: the low nibbles of the B bytes, then the high ones
    (the order of Q4_0, Q4_1 and each 32-quant half of Q4_K/Q5_K)."""
    return torch.cat([blocks & 15, blocks >> 4], dim=-1)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[.., 2] bytes -> [..] fp16."""
    return b.contiguous().view(torch.float16).squeeze(-1)


PACK_ROWS = 1024   # rows repacked at a time: the int64 steps take ~20 bytes a quant


def pack(qtype: str, raw: torch.Tensor, cols: int) -> dict[str, torch.Tensor]:
    """raw: uint8 [N, K / block * type_size], a GGUF tensor's rows (on any device; the
    repacking runs there, PACK_ROWS rows at a time) -> the planes of PLANES[qtype], with the
    file's bytes."""
    if raw.shape[0] > PACK_ROWS:
        chunks = [_pack(qtype, rows, cols) for rows in raw.split(PACK_ROWS)]
        return {name: torch.cat([c[name] for c in chunks]) for name in chunks[0]}
    return _pack(qtype, raw, cols)


def _pack(qtype: str, raw: torch.Tensor, cols: int) -> dict[str, torch.Tensor]:
    block, size, _ = BLOCKS[qtype]
    n = raw.shape[0]
    b = raw.view(n, cols // block, size)
    if qtype == "IQ4_XS":   # d | scales_h 2 | scales_l 4 | 8 x 16 bytes: Q4_0's halves
        qs = b[..., 8:].reshape(n, cols // 256, 8, 16)
        return {"qs": _bits_to_words(_low_high(qs).reshape(n, cols), 4),
                "sc": b[..., 2:8].contiguous().view(torch.int16).reshape(n, -1),
                "dm": _f16(b[..., 0:2]).reshape(n, -1)}
    if qtype in ("Q4_0", "Q4_1", "IQ4_NL"):
        off = 4 if qtype == "Q4_1" else 2
        out = {"qs": _bits_to_words(_low_high(b[..., off:]).reshape(n, cols), 4),
               "d": _f16(b[..., 0:2]).reshape(n, -1)}
        if qtype == "Q4_1":
            out["m"] = _f16(b[..., 2:4]).reshape(n, -1)
        return out
    if qtype in ("Q5_0", "Q5_1"):   # d (m) | qh: bit j the 5th bit of quant j | qs as Q4_0's
        off = 2 if qtype == "Q5_0" else 4
        qh = b[..., off:off + 4]                                 # [n, blocks, 4] bytes
        bits = (qh[..., None] >> torch.arange(8, device=raw.device)) & 1
        out = {"qs": _bits_to_words(_low_high(b[..., off + 4:]).reshape(n, cols), 4),
               "qh": _high_words(bits.reshape(n, cols), 1, 32),
               "d": _f16(b[..., 0:2]).reshape(n, -1)}
        if qtype == "Q5_1":
            out["m"] = _f16(b[..., 2:4]).reshape(n, -1)
        return out
    if qtype == "Q8_0":
        u = (b[..., 2:].reshape(n, cols) ^ 0x80)              # q + 128: 0..255
        return {"qs": _bits_to_words(u & 15, 4), "qh": _bits_to_words(u >> 4, 4),
                "d": _f16(b[..., 0:2]).reshape(n, -1)}
    if qtype in ("Q4_K", "Q5_K"):
        qs = b[..., -128:].reshape(n, cols // 256, 4, 32)     # 4 x 32 bytes: 64 quants each
        out = {"qs": _bits_to_words(_low_high(qs).reshape(n, cols), 4),
               "sc": b[..., 4:16].contiguous().view(torch.int32).reshape(n, -1),
               "dm": b[..., 0:4].contiguous().view(torch.float16).reshape(n, -1)}
        if qtype == "Q5_K":
            # qh[l] bit i is the 5th bit of quant 32 i + l of the super-block
            qh = b[..., 16:48]                                   # [n, sb, 32]
            bits = (qh[..., None, :] >> torch.arange(8, device=raw.device)[:, None]) & 1
            out["qh"] = _high_words(bits.reshape(n, cols), 1, 32)
        return out
    # Q6_K: ql 128 | qh 64 | scales 16 | d 2; each 128-quant half: ql 64 bytes, qh 32
    ql = b[..., :128].reshape(n, cols // 256, 2, 64)
    lo = torch.cat([ql & 15, ql >> 4], dim=-1).reshape(n, cols)        # quants 0..63, 64..127
    qh = b[..., 128:192].reshape(n, cols // 256, 2, 1, 32)
    hi = (qh >> (2 * torch.arange(4, device=raw.device))[:, None]) & 3  # [n, sb, 2, 4, 32]
    return {"qs": _bits_to_words(lo, 4), "qh": _high_words(hi.reshape(n, cols), 2, 16),
            "sc": b[..., 192:208].contiguous().view(torch.int8).reshape(n, -1),
            "dm": _f16(b[..., 208:210]).reshape(n, -1)}


def _words_to_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of _bits_to_words: int32 [N, W] -> int64 codes [N, W * 32 / bits]."""
    per = 32 // bits
    shifts = bits * torch.arange(per, device=words.device, dtype=torch.int64)
    w = words.to(torch.int64) & 0xFFFFFFFF
    return ((w[..., None] >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1)


def kquant_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: the 12 scale bytes of each super-block as int32 words [N, 3 S] -> the 6-bit
    scales and mins [N, 8 S] (llama.cpp's get_scale_min_k4)."""
    n = sc.shape[0]
    w = sc.to(torch.int64).reshape(n, -1, 3) & 0xFFFFFFFF
    byte = lambda i: (w[..., i // 4] >> (8 * (i % 4))) & 0xFF  # noqa: E731
    scales = [byte(j) & 63 if j < 4 else (byte(j + 4) & 15) | ((byte(j - 4) >> 6) << 4)
              for j in range(8)]
    mins = [byte(j + 4) & 63 if j < 4 else (byte(j + 4) >> 4) | ((byte(j) >> 6) << 4)
            for j in range(8)]
    return torch.stack(scales, -1).reshape(n, -1), torch.stack(mins, -1).reshape(n, -1)


def iq4xs_scales(sc: torch.Tensor) -> torch.Tensor:
    """IQ4_XS: the 6 scale bytes of each super-block as int16 words [N, 3 S] -> the 6-bit
    scales [N, 8 S] (llama.cpp's dequantize_row_iq4_xs)."""
    n = sc.shape[0]
    w = sc.to(torch.int64).reshape(n, -1, 3) & 0xFFFF
    j = torch.arange(8, device=sc.device)
    low = (w[..., 1 + j // 4] >> (4 * (j % 4))) & 15
    return (low | (((w[..., 0:1] >> (2 * j)) & 3) << 4)).reshape(n, -1)


def group_terms(qtype: str, planes: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(a, b) fp32 [N, K / group]: the weights of a group are a * u + b."""
    if qtype in ("Q4_0", "Q5_0", "Q8_0", "IQ4_NL"):
        d = planes["d"].float()
        return d, d * {"Q4_0": -8.0, "Q5_0": -16.0, "Q8_0": -128.0, "IQ4_NL": -128.0}[qtype]
    if qtype == "IQ4_XS":
        a = planes["dm"].float().repeat_interleave(8, 1) * (iq4xs_scales(planes["sc"]) - 32)
        return a, -128.0 * a
    if qtype in ("Q4_1", "Q5_1"):
        return planes["d"].float(), planes["m"].float()
    if qtype in ("Q4_K", "Q5_K"):
        sc, mn = kquant_scales(planes["sc"])
        dm = planes["dm"].float().view(sc.shape[0], -1, 2)
        d, dmin = dm[..., 0].repeat_interleave(8, 1), dm[..., 1].repeat_interleave(8, 1)
        return d * sc.float(), -(dmin * mn.float())
    a = planes["dm"].float().repeat_interleave(16, 1) * planes["sc"].float()   # Q6_K
    return a, -32.0 * a


def codes(qtype: str, planes: dict[str, torch.Tensor]) -> torch.Tensor:
    """The unsigned codes u, int64 [N, K]."""
    u = _words_to_codes(planes["qs"], 4)
    if qtype in ("IQ4_NL", "IQ4_XS"):
        return torch.tensor(IQ4_VALUES, device=u.device)[u] + 128
    if qtype == "Q8_0":
        u = u | (_words_to_codes(planes["qh"], 4) << 4)
    elif qtype in ("Q5_0", "Q5_1", "Q5_K"):
        u = u | (_high_codes(planes["qh"], 1, 32) << 4)
    elif qtype == "Q6_K":
        u = u | (_high_codes(planes["qh"], 2, 16) << 4)
    return u


def dequantize_torch(qtype: str, planes: dict[str, torch.Tensor]) -> torch.Tensor:
    """fp32 [N, K]: a * u + b group by group (the kernels' arithmetic, up to rounding)."""
    a, b = group_terms(qtype, planes)
    u = codes(qtype, planes).float()
    group = BLOCKS[qtype][2]
    n = u.shape[0]
    return (u.view(n, -1, group) * a[..., None] + b[..., None]).reshape(n, -1)


@dataclass
class Scratch:
    """One bf16 buffer a stage's quantized weights dequantize into for prompt chunks (and
    anything else the decode kernels do not take): sized to the largest weight after loading
    (`reserve`, then `allocate`); a weight's dense view is valid until the next one."""
    numel: int = 0
    buffer: torch.Tensor | None = None

    def reserve(self, numel: int) -> None:
        self.numel = max(self.numel, numel)

    def allocate(self, dtype: torch.dtype, device: torch.device) -> None:
        if self.numel and self.buffer is None:
            self.buffer = torch.empty(self.numel, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()


@dataclass
class QuantWeight:
    """A matrix [N, K] kept quantized on its device: parts of rows, each of one block type (a
    fused projection whose pieces the file stores in different types, e.g. q and k in Q4_K
    and v in Q6_K, has several)."""
    parts: tuple[Part, ...]
    scratch: Scratch = field(default_factory=Scratch)

    @classmethod
    def from_blocks(cls, qtype: str, raw: torch.Tensor, cols: int, device: torch.device,
                    scratch: Scratch | None = None) -> "QuantWeight":
        """raw: uint8 [N, row bytes] on the host; repacked on `device`. `scratch`: the buffer
        dense() uses (the stage's; reserve it for the weights prompt chunks read)."""
        planes = pack(qtype, raw.to(device), cols)
        return cls((Part(qtype, raw.shape[0], cols, planes),), scratch or Scratch())

    @classmethod
    def cat(cls, weights: list["QuantWeight"]) -> "QuantWeight":
        """Rows of the weights one after another (sharing the first one's scratch);
        neighbouring parts of one type merge (one kernel for q, k and v when they share a
        type)."""
        parts: list[Part] = []
        for p in (p for w in weights for p in w.parts):
            if parts and parts[-1].qtype == p.qtype:
                last = parts[-1]
                merged = {k: torch.cat([last.planes[k], p.planes[k]]) for k in p.planes}
                parts[-1] = Part(p.qtype, last.rows + p.rows, p.cols, merged)
            else:
                parts.append(p)
        return cls(tuple(parts), weights[0].scratch)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.rows for p in self.parts), self.parts[0].cols

    @property
    def device(self) -> torch.device:
        return self.parts[0].planes["qs"].device

    @property
    def qtype(self) -> str:
        """The block type, or "+"-joined types of a mixed weight."""
        return "+".join(p.qtype for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def dense(self, dtype: torch.dtype, triton: bool) -> torch.Tensor:
        """The weight dequantized to [N, K] in the stage's scratch buffer (a fresh tensor where
        it does not fit): valid until the next weight's dense()."""
        n, k = self.shape
        buf = self.scratch.buffer
        fits = buf is not None and buf.dtype == dtype and buf.numel() >= n * k
        out = buf[:n * k].view(n, k) if fits else torch.empty(n, k, dtype=dtype,
                                                               device=self.device)
        row = 0
        for p in self.parts:
            dequantize_into(p, out[row:row + p.rows], None, triton)
            row += p.rows
        return out

    def gather(self, index: torch.Tensor, dtype: torch.dtype, triton: bool) -> torch.Tensor:
        """Rows `index` [R] dequantized: [R, K] (the token embedding). One part only."""
        assert len(self.parts) == 1, "a token embedding is one tensor of one type"
        out = torch.empty(index.shape[0], self.shape[1], dtype=dtype, device=self.device)
        dequantize_into(self.parts[0], out, index, triton)
        return out


def dequantize_into(part: Part, out: torch.Tensor, index: torch.Tensor | None,
                    triton: bool) -> None:
    """out [R, K] = rows `index` of the part (all rows when None), dequantized."""
    if triton:
        from strata.kernels.quant.float_triton import dequant_rows
        dequant_rows(part, out, index)
        return
    planes = part.planes if index is None else {k: v[index] for k, v in part.planes.items()}
    out.copy_(dequantize_torch(part.qtype, planes))
