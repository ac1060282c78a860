"""The trained head as a sidecar GGUF in llama.cpp's NextN layout (strata/model/nextn.py reads
it): `blk.{N}.nextn.{eh_proj,enorm,hnorm,shared_head_norm}` and the block's ordinary tensors at
N = the target's block count, with the target's dimensions (its feed_forward_length the head
block's own, which may be wider), its embedding's fingerprint, and no embedding or output
head of its own (the target's serve)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFWriter
from gguf.quants import quantize

from strata.model.gguf_file import ModelFile
from strata.model.mkmodel import ModelShape, add_llama_config
from strata.model.nextn import NEXTN_TENSORS, TARGET_FINGERPRINT, embedding_fingerprint

WEIGHT_TYPES = ("F16", "Q8_0", "F32")


def shape_of(file: ModelFile, d_ffn: int | None = None) -> ModelShape:
    """The model's shape; with d_ffn, a head's feed-forward width instead of the model's."""
    c = file.config
    return ModelShape(n_layers=c.n_layers, d_model=c.d_model, n_heads=c.n_heads,
                      n_kv_heads=c.n_kv_heads, d_ffn=d_ffn or c.d_ffn, vocab=c.vocab,
                      ctx_len=c.ctx_len, rope_base=c.rope_base, rms_eps=c.rms_eps)


def write_head(path: str | os.PathLike, tensors: dict[str, torch.Tensor], file: ModelFile,
               weight_type: str = "Q8_0", name: str | None = None) -> Path:
    """Write `tensors` (short names: NextNHead.tensors()) as a sidecar for the model `file`.
    Norms stay F32; matrices are stored as weight_type."""
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"--weight-type {weight_type} is not one of {', '.join(WEIGHT_TYPES)}")
    path, block = Path(path), file.config.n_layers
    tmp = path.with_name(path.name + ".partial")
    writer = GGUFWriter(tmp, file.config.arch)
    writer.add_name(name or f"NextN head for {file.path.name}")
    add_llama_config(writer, shape_of(file, tensors["ffn_gate"].shape[0]), nextn=True)
    writer.add_string(TARGET_FINGERPRINT, embedding_fingerprint(file))
    for short, t in tensors.items():
        full = (f"blk.{block}.nextn.{short}.weight" if short in NEXTN_TENSORS
                else f"blk.{block}.{short}.weight")
        data = t.float().numpy()
        if data.ndim == 1 or weight_type == "F32":
            writer.add_tensor(full, data.astype(np.float32))
        elif weight_type == "F16":
            writer.add_tensor(full, data.astype(np.float16))
        else:
            writer.add_tensor(full, quantize(data, QType.Q8_0), raw_dtype=QType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    return path
