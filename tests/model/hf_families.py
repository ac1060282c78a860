"""Tiny models of each family built by transformers' own modeling code (random weights,
fp32), and the same tensors written to GGUF as llama.cpp's convert_hf_to_gguf.py names and
transforms them: llama's q and k rows permuted for llama.cpp's rotation of adjacent pairs,
Gemma's norm weights stored as 1 + w. Tests compare strata's stages with the model."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from gguf import GGUFWriter

from strata.model.shapes import ModelShape, add_llama_config
from strata.model.synthetic_vocab import add_tokenizer

VOCAB = 320
LAYERS = 7   # gemma3: 5 sliding, the 6th global, and one more sliding
D, FFN, HEADS, KV, HEAD_DIM = 64, 128, 4, 2, 32   # head size 32: not d_model / heads (16)
WINDOW = 12
EXPERTS, EXPERTS_USED, EXPERT_FFN = 8, 2, 32


def build(arch: str, seed: int = 0, layers: int = LAYERS):
    """(transformers model in fp32 eval mode, its ModelShape) of a tiny random `arch`
    model."""
    import transformers as tf
    common = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN,
                  num_hidden_layers=layers, num_attention_heads=HEADS,
                  num_key_value_heads=KV, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=arch == "gemma3")
    if arch == "qwen2":
        cls, config = tf.Qwen2ForCausalLM, tf.Qwen2Config(**common, rope_theta=10000.0)
        head_dim = D // HEADS   # qwen2 has no head_dim of its own
    elif arch == "qwen3":
        cls, config = tf.Qwen3ForCausalLM, tf.Qwen3Config(**common, head_dim=HEAD_DIM,
                                                          rope_theta=10000.0)
        head_dim = HEAD_DIM
    elif arch == "qwen3moe":
        cls = tf.Qwen3MoeForCausalLM
        config = tf.Qwen3MoeConfig(**common, head_dim=HEAD_DIM, rope_theta=10000.0,
                                   moe_intermediate_size=EXPERT_FFN, num_experts=EXPERTS,
                                   num_experts_per_tok=EXPERTS_USED, norm_topk_prob=True)
        head_dim = HEAD_DIM
    elif arch == "glm4moe":
        cls = tf.Glm4MoeForCausalLM
        config = tf.Glm4MoeConfig(**common, head_dim=HEAD_DIM, rope_theta=10000.0,
                                  moe_intermediate_size=EXPERT_FFN, n_routed_experts=EXPERTS,
                                  num_experts_per_tok=EXPERTS_USED, n_shared_experts=1,
                                  first_k_dense_replace=1, n_group=2, topk_group=1,
                                  norm_topk_prob=True, routed_scaling_factor=2.5,
                                  partial_rotary_factor=0.5, attention_bias=True,
                                  use_qk_norm=False)
        head_dim = HEAD_DIM
    elif arch == "gemma3":
        cls = tf.Gemma3ForCausalLM
        config = tf.Gemma3TextConfig(**common, head_dim=HEAD_DIM, sliding_window=WINDOW,
                                     query_pre_attn_scalar=HEAD_DIM)
        head_dim = HEAD_DIM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():   # norms away from their initial 1 (or 0 for gemma): exercised
        for name, p in model.state_dict().items():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("bias"):   # e_score_correction_bias too: routing exercised
                p.copy_(0.5 * torch.randn_like(p))
    rope = config.rope_parameters
    base = rope["full_attention"]["rope_theta"] if "full_attention" in rope else rope["rope_theta"]
    moe = arch in ("qwen3moe", "glm4moe")
    glm = arch == "glm4moe"
    shape = ModelShape(layers, D, HEADS, KV, FFN, VOCAB, ctx_len=256, rope_base=base,
                       rms_eps=1e-6, arch=arch, key_length=head_dim,
                       sliding_window=WINDOW if arch == "gemma3" else 0,
                       experts=(EXPERTS, EXPERTS_USED, EXPERT_FFN) if moe else (0, 0, 0),
                       rope_dim=head_dim // 2 if glm else 0, dense_first=1 if glm else 0,
                       expert_scale=2.5 if glm else 1.0,
                       expert_groups=(2, 1) if glm else (1, 1))
    return model, shape


_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "input_layernorm": "attn_norm"}
_GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_tensors(arch: str, model) -> dict[str, np.ndarray]:
    """The model's state dict under llama.cpp's GGUF names, transformed as its converter
    does."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if name == "model.embed_tokens.weight":
            key = "token_embd.weight"
        elif name == "model.norm.weight":
            key = "output_norm.weight"
        elif name == "lm_head.weight":
            if arch == "gemma3":
                continue   # tied
            key = "output.weight"
        elif ".mlp.experts." in name or ".mlp.gate." in name or ".shared_experts." in name:
            block = name.split(".")[2]
            out.update(_experts(block, name, t))
            continue
        else:
            _, _, block, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            piece = (_GEMMA_NORMS if arch == "gemma3" else {}).get(module) or _NAMES.get(module)
            if piece is None and module == "post_attention_layernorm":
                # the norm before the feed-forward: llama.cpp names glm4moe's after the HF name
                piece = "post_attention_norm" if arch == "glm4moe" else "ffn_norm"
            key = f"blk.{block}.{piece}.{kind}"
        if arch == "gemma3" and key.endswith("norm.weight"):
            t = t + 1.0   # Gemma's norm computes x * (1 + w); llama.cpp's file holds 1 + w
        out[key] = t.numpy()
    return out


def _experts(block: str, name: str, t: torch.Tensor) -> dict[str, np.ndarray]:
    """An MoE block's router and experts under llama.cpp's names ([E, F, D] gate and up
    apart, as its converter writes them from the per-expert matrices)."""
    b = f"blk.{block}."
    if name.endswith("mlp.gate.weight"):
        return {b + "ffn_gate_inp.weight": t.numpy()}
    if name.endswith("e_score_correction_bias"):
        return {b + "exp_probs_b.bias": t.numpy()}
    if ".shared_experts." in name:
        piece = name.split(".shared_experts.")[1].split("_proj")[0]   # gate, up, down
        return {b + f"ffn_{piece}_shexp.weight": t.numpy()}
    if name.endswith("gate_up_proj"):
        gate, up = t.chunk(2, dim=1)
        return {b + "ffn_gate_exps.weight": gate.numpy(), b + "ffn_up_exps.weight": up.numpy()}
    return {b + "ffn_down_exps.weight": t.numpy()}


def write(arch: str, directory: Path, seed: int = 0, layers: int = LAYERS,
          nextn: bool = False):
    """(transformers model, path of the same tensors as a GGUF). nextn: one more block of the
    model's becomes a NextN layer at blk.{layers} (llama.cpp's layout, with random
    projections and norms), as GLM-4.5's files carry one; the model keeps `layers` blocks."""
    model, shape = build(arch, seed, layers + int(nextn))
    tensors = gguf_tensors(arch, model)
    if nextn:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
        g = torch.Generator().manual_seed(seed + 1)
        n = f"blk.{layers}.nextn."
        tensors[n + "eh_proj.weight"] = (0.1 * torch.randn(D, 2 * D, generator=g)).numpy()
        for name in ("enorm", "hnorm", "shared_head_norm"):
            tensors[n + f"{name}.weight"] = (1 + 0.1 * torch.randn(D, generator=g)).numpy()
    path = Path(directory) / f"{arch}.gguf"
    writer = GGUFWriter(path, arch)
    add_llama_config(writer, dataclasses.replace(shape, n_layers=layers), nextn=nextn)
    add_tokenizer(writer, VOCAB)
    for name, value in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, path
