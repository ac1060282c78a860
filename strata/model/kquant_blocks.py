"""Random but valid K-quant blocks (Q4_K, Q5_K, Q6_K), which gguf-py cannot quantize to:
strata-mkmodel writes K-quant models with them, and tests read them back through gguf-py."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES


def random_kquant_blocks(qtype: str | QType, rows: int, cols: int,
                         rng: np.random.Generator | int = 0, scale: float = 1.0) -> np.ndarray:
    """Random but valid Q4_K/Q5_K/Q6_K blocks: uint8 array of shape (rows, bytes_per_row).

    All bytes are random except the f16 super-block scales, which are set to small positive
    finite values, so dequantization is finite. ``scale`` = 1 gives a dequantized standard
    deviation of about 0.02 (it multiplies the f16 scales).
    """
    qtype = QType[qtype.upper()] if isinstance(qtype, str) else qtype
    if qtype not in (QType.Q4_K, QType.Q5_K, QType.Q6_K):
        raise ValueError(f"random_kquant_blocks makes Q4_K, Q5_K or Q6_K blocks, not {qtype.name}")
    if not isinstance(rng, np.random.Generator):
        rng = np.random.default_rng(rng)
    block, type_size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block} values, got {cols}")
    n_blocks = rows * cols // block
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)

    def f16(lo: float, hi: float) -> np.ndarray:
        vals = rng.uniform(lo * scale, hi * scale, size=n_blocks).astype(np.float16)
        return vals.view(np.uint8).reshape(n_blocks, 2)

    if qtype in (QType.Q4_K, QType.Q5_K):
        # layout: d (f16) | dmin (f16) | 12 bytes of 6-bit scales/mins | [qh 32] | qs 128
        # value = d * sc * q - dmin * m, sc, m in [0, 63]; q in [0, 15] (Q4_K) or [0, 31] (Q5_K)
        qmax = 15 if qtype == QType.Q4_K else 31
        d_hi = 0.1 / (63 * qmax)
        blocks[:, 0:2] = f16(0.25 * d_hi, d_hi)
        # dmin centres the distribution: mean of d*sc*q is ~d*31.5*qmax/2, of dmin*m ~dmin*31.5
        blocks[:, 2:4] = f16(0.25 * d_hi * qmax / 2, d_hi * qmax / 2)
    else:
        # layout: ql 128 | qh 64 | 16 int8 scales | d (f16); value = d * scale * (q - 32)
        # scale ~U[-128, 127] (sd 74), q - 32 ~U[-32, 31] (sd 18.5): sd ~ 1370 * mean(d)
        blocks[:, type_size - 2:] = f16(0.5 * 1.46e-5, 1.5 * 1.46e-5)
    return blocks.reshape(rows, cols // block * type_size)


def write_raw_blocks_gguf(path: str | os.PathLike, name: str = "blk.0.ffn_down.weight",
                          qtype: str | QType = "Q4_K", rows: int = 8, cols: int = 512,
                          seed: int = 0, scale: float = 1.0) -> Path:
    """Write a GGUF with one tensor ``name`` of ``rows`` x ``cols`` random K-quant blocks.

    Read back, ``t.shape == [cols, rows]`` and ``gguf.quants.dequantize(t.data, t.tensor_type)``
    has shape (rows, cols). Returns the path.
    """
    qtype = QType[qtype.upper()] if isinstance(qtype, str) else qtype
    data = random_kquant_blocks(qtype, rows, cols, np.random.default_rng(seed), scale)
    path = Path(path)
    writer = GGUFWriter(path, "llama")
    writer.add_name(f"random {qtype.name} blocks")
    writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
