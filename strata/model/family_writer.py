"""Write a GGUF file of any family (model/families.py) from named arrays, with the metadata
llama.cpp's converter writes for it and strata's small tokenizer: how tests put a
transformers model's weights into a file, and how strata-mkmodel writes random ones."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from strata.model.synthetic_vocab import add_tokenizer


@dataclass(frozen=True)
class Dims:
    """A model's sizes and the family's numbers, as the file's metadata states them."""
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ffn: int
    vocab: int
    ctx_len: int = 2048
    rope_base: float = 10000.0
    rms_eps: float = 1e-6
    sliding_window: int = 0    # gemma3: the sliding layers' window
    experts: tuple[int, int, int] | None = None   # MoE: (experts, used a row, expert width)
    rope_dim: int = 0          # partial rotary (glm4moe): the rotated dims of a head
    dense_first: int = 0       # glm4moe: leading dense layers
    expert_scale: float = 1.0  # glm4moe: the routed weights' scale
    expert_groups: tuple[int, int] = (1, 1)


def add_family_config(writer: GGUFWriter, dims: Dims, nextn: int = 0) -> None:
    """The {arch}.* keys strata's ModelFile (and llama.cpp) read; nextn: NextN layers after
    the blocks (counted in block_count, as llama.cpp's files count them)."""
    writer.add_block_count(dims.n_layers)
    if nextn:
        writer.add_nextn_predict_layers(nextn)
    writer.add_context_length(dims.ctx_len)
    writer.add_embedding_length(dims.d_model)
    writer.add_feed_forward_length(dims.d_ffn)
    writer.add_head_count(dims.n_heads)
    writer.add_head_count_kv(dims.n_kv_heads)
    writer.add_key_length(dims.head_dim)
    writer.add_value_length(dims.head_dim)
    writer.add_rope_dimension_count(dims.rope_dim or dims.head_dim)
    writer.add_rope_freq_base(float(dims.rope_base))
    writer.add_layer_norm_rms_eps(float(dims.rms_eps))
    writer.add_vocab_size(dims.vocab)
    if dims.sliding_window:
        writer.add_sliding_window(dims.sliding_window)
    if dims.experts:
        count, used, width = dims.experts
        writer.add_expert_count(count)
        writer.add_expert_used_count(used)
        writer.add_expert_feed_forward_length(width)
        if dims.dense_first:
            writer.add_leading_dense_block_count(dims.dense_first)
        if dims.expert_scale != 1.0:
            writer.add_expert_weights_scale(dims.expert_scale)
        if dims.expert_groups != (1, 1):
            writer.add_expert_group_count(dims.expert_groups[0])
            writer.add_expert_group_used_count(dims.expert_groups[1])


def write_family_gguf(path: str | os.PathLike, arch: str, dims: Dims,
                      tensors: dict[str, np.ndarray], name: str | None = None,
                      nextn: int = 0) -> Path:
    """A GGUF of `arch` holding `tensors` (GGUF names -> float32 arrays in torch's [out, in]
    order, written as F32) and a byte-level tokenizer of dims.vocab tokens."""
    path = Path(path)
    writer = GGUFWriter(path, arch)
    writer.add_name(name or f"strata {arch} {dims.n_layers}x{dims.d_model}")
    add_family_config(writer, dims, nextn)
    add_tokenizer(writer, dims.vocab)
    for tensor_name, value in tensors.items():
        writer.add_tensor(tensor_name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
