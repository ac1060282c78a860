"""Valid blocks of every quantized type gguf-py can dequantize, for files of random weights:
strata-mkmodel writes them, and tests read them back through gguf-py. Also the pools that
``strata-mkmodel --fast`` repeats.

Types gguf-py can quantize to (QUANTIZED_TYPES) are Gaussian values quantized. The others
(RANDOM_BLOCK_TYPES: K-quants, IQ types, NVFP4) are random bytes except the per-block scales,
which are set so that every dequantized value is finite and the spread is about the one asked.
"""
from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import NVFP4, dequantize, quantize

DEFAULT_STD = 0.02  # spread of the values at scale 1

# Types gguf-py quantizes: blocks of N(0, std) values.
QUANTIZED_TYPES = (QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.TQ1_0,
                   QType.TQ2_0, QType.MXFP4)


class _Fp16Scale(NamedTuple):
    """Where a block keeps its fp16 scale d (every value is d times a bounded integer expression)
    and, for types whose values are d*sc*q - dmin*m with q >= 0, its fp16 dmin: set to
    mean(q) * d, so that the values are centred on 0."""
    d_at: int
    dmin_at: int | None = None
    mean_q: float = 0.0


# Block layouts as gguf.quants' dequantizers read them (byte counts; "d" is the fp16 scale).
_FP16_SCALES = {
    QType.Q2_K: _Fp16Scale(80, 82, 1.5),   # scales 16 | qs 64 | d | dmin; q in [0, 3]
    QType.Q3_K: _Fp16Scale(108),           # hmask 32 | qs 64 | scales 12 | d
    QType.Q4_K: _Fp16Scale(0, 2, 7.5),     # d | dmin | scales 12 | qs 128; q in [0, 15]
    QType.Q5_K: _Fp16Scale(0, 2, 15.5),    # d | dmin | scales 12 | qh 32 | qs 128; q in [0, 31]
    QType.Q6_K: _Fp16Scale(208),           # ql 128 | qh 64 | scales 16 | d
    QType.IQ4_NL: _Fp16Scale(0),           # d | qs 16 (32 values)
    QType.IQ4_XS: _Fp16Scale(0),           # d | scales_h 2 | scales_l 4 | qs 128
    QType.IQ3_S: _Fp16Scale(0),            # d | qs 64 | qh 8 | signs 32 | scales 4
    QType.IQ3_XXS: _Fp16Scale(0),          # d | qs 64 | scales and signs 32
    QType.IQ2_XXS: _Fp16Scale(0),          # d | qs 64 (grid indices, scales and signs)
    QType.IQ2_XS: _Fp16Scale(0),           # d | qs 64 | scales 8
    QType.IQ2_S: _Fp16Scale(0),            # d | qs 32 | signs 32 | qh 8 | scales 8
    QType.IQ1_S: _Fp16Scale(0),            # d | qs 32 | qh 16
}
# Every grid index a random byte can hold is in its grid, so only the scales need setting.
# IQ1_M spreads its fp16 d over the scales; NVFP4 has four E4M3 scales: see _set_scales.
RANDOM_BLOCK_TYPES = tuple(_FP16_SCALES) + (QType.IQ1_M, QType.NVFP4)
BLOCK_TYPES = QUANTIZED_TYPES + RANDOM_BLOCK_TYPES


def block_type(qtype: str | QType) -> QType:
    """The QType of a block type's name (or the QType itself); a ValueError naming the block
    types otherwise."""
    name = qtype.name if isinstance(qtype, QType) else str(qtype).upper()
    if name not in QType.__members__ or QType[name] not in BLOCK_TYPES:
        raise ValueError(f"{qtype!r} is not a block type gguf-py can dequantize; choose one "
                         f"of {', '.join(t.name for t in BLOCK_TYPES)}")
    return QType[name]


def random_blocks(qtype: str | QType, rows: int, cols: int,
                  rng: np.random.Generator | int = 0, scale: float = 1.0) -> np.ndarray:
    """Valid ``qtype`` blocks of a (rows, cols) matrix: uint8 array (rows, bytes per row).

    The dequantized values are finite with a spread of about ``scale`` * 0.02: N(0, std)
    values quantized for QUANTIZED_TYPES, random blocks with set scales for the others.
    ``cols`` must be a multiple of the type's block size.
    """
    qtype = block_type(qtype)
    if not isinstance(rng, np.random.Generator):
        rng = np.random.default_rng(rng)
    block, _ = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block} values, got {cols}")
    std = DEFAULT_STD * scale
    if qtype in QUANTIZED_TYPES:
        return quantize(rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std),
                        qtype)
    blocks = _scaled_blocks(qtype, rows * cols // block, rng, std / _unit_std(qtype))
    return blocks.reshape(rows, -1)


# Tests and tools of the K-quant era import it under this name.
random_kquant_blocks = random_blocks

POOL_VALUES = 1 << 24  # values in a random_pool, about


def random_pool(qtype: QType, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """About POOL_VALUES random values of ``qtype`` for a file's matrices to repeat: uint8
    (n, bytes per unit), a unit being a value for F32/F16/BF16 and a block (random_blocks)
    otherwise, spread about ``scale`` * 0.02. n is a prime, larger than any row's count of
    units, so a matrix that repeats the pool row after row has no two rows alike (short of n
    rows apart)."""
    block = GGML_QUANT_SIZES[qtype][0]
    n = _prime_at_least(POOL_VALUES // block)
    if block > 1:
        return random_blocks(qtype, n, block, rng, scale)
    values = rng.standard_normal(n, dtype=np.float32) * np.float32(DEFAULT_STD * scale)
    return quantize(values, qtype).view(np.uint8).reshape(n, -1)  # (not rows of 1: 30x slower)


def _prime_at_least(n: int) -> int:
    while any(n % k == 0 for k in range(2, math.isqrt(n) + 1)):
        n += 1
    return n


def _scaled_blocks(qtype: QType, n_blocks: int, rng: np.random.Generator,
                   d: float) -> np.ndarray:
    """(n_blocks, type size) random blocks whose scales are d * U(0.5, 1.5)."""
    blocks = rng.integers(0, 256, size=(n_blocks, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    _set_scales(blocks, qtype, d * rng.uniform(0.5, 1.5, n_blocks))
    return blocks


@functools.cache
def _unit_std(qtype: QType) -> float:
    """The spread of blocks made with d = 1: what d multiplies, measured with gguf-py's
    dequantizer (the reference for every layout) rather than derived type by type."""
    blocks = _scaled_blocks(qtype, 1024, np.random.default_rng(0), 1.0)
    return float(dequantize(blocks, qtype).std())


def _set_scales(blocks: np.ndarray, qtype: QType, d: np.ndarray) -> None:
    """Write one scale per block (``d``, float, (n_blocks,)) into ``blocks`` in place."""
    if qtype == QType.IQ1_M:
        # qs 32 | qh 16 | scales 8: four uint16 whose top nibbles hold d's bits, low ones first
        scales = np.ascontiguousarray(blocks[:, 48:56]).view(np.uint16)
        bits = d.astype(np.float16).view(np.uint16)[:, None]
        nibbles = (bits >> np.array([0, 4, 8, 12], dtype=np.uint16)) & np.uint16(0xF)
        scales[:] = (scales & np.uint16(0x0FFF)) | (nibbles << np.uint16(12))
        blocks[:, 48:56] = scales.view(np.uint8)
    elif qtype == QType.NVFP4:
        # 4 E4M3 scales (one per 16 values) | qs 32
        blocks[:, :4] = _nearest_ue4m3(d)[:, None]
    else:
        s = _FP16_SCALES[qtype]
        blocks[:, s.d_at:s.d_at + 2] = _fp16_bytes(d)
        if s.dmin_at is not None:
            blocks[:, s.dmin_at:s.dmin_at + 2] = _fp16_bytes(s.mean_q * d)


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(len(values), 2)


def _nearest_ue4m3(d: np.ndarray) -> np.ndarray:
    """The NVFP4 scale bytes whose values (as gguf-py decodes them) are nearest to ``d``."""
    codes = np.arange(1, 127, dtype=np.uint8)  # 0 and 0x7F decode to 0
    values = NVFP4.ue4m3_to_fp32(codes)        # increasing with the code
    i = np.clip(np.searchsorted(values, d), 1, len(codes) - 1)
    i -= (d - values[i - 1]) < (values[i] - d)
    return codes[i]


def write_raw_blocks_gguf(path: str | os.PathLike, name: str = "blk.0.ffn_down.weight",
                          qtype: str | QType = "Q4_K", rows: int = 8, cols: int = 512,
                          seed: int = 0, scale: float = 1.0) -> Path:
    """Write a GGUF with one tensor ``name`` of ``rows`` x ``cols`` blocks (random_blocks).

    Read back, ``t.shape == [cols, rows]`` and ``gguf.quants.dequantize(t.data, t.tensor_type)``
    has shape (rows, cols). Returns the path.
    """
    qtype = block_type(qtype)
    data = random_blocks(qtype, rows, cols, np.random.default_rng(seed), scale)
    path = Path(path)
    writer = GGUFWriter(path, "llama")
    writer.add_name(f"random {qtype.name} blocks")
    writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
