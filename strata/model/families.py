"""The model families strata runs, as differences on one forward path (stage_worker/model.py),
the way transformers' modeling files differ side by side. llama.cpp's GGUF names and keys
(src/llama-arch.cpp, convert_hf_to_gguf.py) say what each file holds:

    llama   the path itself: RMSNorm, RoPE on adjacent pairs (the converter permutes Q and K
            rows for llama.cpp's rotation), SwiGLU
    qwen2   a bias on q, k and v; RoPE on halves (NEOX: nothing permuted)
    qwen3   RMSNorm on each head of q and k before RoPE; RoPE on halves
    gemma3  the embedding scaled by sqrt(d_model); RMSNorm before and after attention and the
            feed-forward (the file's norm weights hold 1 + w, as Gemma's norm computes);
            RMSNorm on q and k heads; GeGLU (tanh GELU); RoPE on halves; sliding-window
            attention on 5 layers of every 6 with their own RoPE base (10000), the 6th global;
            the attention scale 1/sqrt(head size) (1/sqrt(d_model / heads) for the 62-layer
            27B, as llama.cpp reads Gemma's query_pre_attn_scalar)
    qwen3moe qwen3's attention; the feed-forward is routed: each row's top-k experts of a
            softmax over its router logits, their weights renormalised to sum to 1, each
            expert a SwiGLU of its own (blk.N.ffn_{gate,up,down}_exps, [experts, ...]) summed
            in the order of the row's ranking; no shared expert
    glm4moe  a bias on q, k and v; partial RoPE on halves (the first rope.dimension_count
            dims of a head); the first leading_dense_block_count layers dense, the others
            routed: sigmoid scores, the top-k chosen by score plus a correction bias
            (blk.N.exp_probs_b.bias) within the best-scoring expert groups, weighted by their
            scores renormalised and scaled (expert_weights_scale), beside a shared expert
            (blk.N.ffn_{gate,up,down}_shexp); the feed-forward's norm is the file's
            post_attention_norm; a NextN layer (blk.{n_layers}.nextn.*, itself routed)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    arch: str
    rope_halves: bool = False      # rotate (i, i + d/2) pairs (NEOX); else (2i, 2i + 1)
    qkv_bias: bool = False         # blk.N.attn_{q,k,v}.bias
    qk_norm: bool = False          # blk.N.attn_{q,k}_norm.weight, RMSNorm over each head
    post_norms: bool = False       # blk.N.post_attention_norm, post_ffw_norm
    ffn_act: str = "silu"          # the gate's activation: silu or gelu_tanh
    embed_scale: bool = False      # the embedding times sqrt(d_model)
    sliding_period: int = 0        # layers i with (i + 1) % period != 0 attend in a window
    local_rope_base: float = 0.0   # the sliding layers' RoPE base
    moe: bool = False              # routed experts in place of the feed-forward
    sigmoid_gating: bool = False   # expert scores: sigmoid (else softmax)
    shared_expert: bool = False    # blk.N.ffn_*_shexp beside the routed experts
    ffn_norm: str = "ffn_norm"     # the name of the feed-forward's input norm in the file


FAMILIES = {
    "llama": Family("llama"),
    "qwen2": Family("qwen2", rope_halves=True, qkv_bias=True),
    "qwen3": Family("qwen3", rope_halves=True, qk_norm=True),
    "gemma3": Family("gemma3", rope_halves=True, qk_norm=True, post_norms=True,
                     ffn_act="gelu_tanh", embed_scale=True, sliding_period=6,
                     local_rope_base=10000.0),
    "qwen3moe": Family("qwen3moe", rope_halves=True, qk_norm=True, moe=True),
    "glm4moe": Family("glm4moe", rope_halves=True, qkv_bias=True, moe=True, sigmoid_gating=True,
                      shared_expert=True, ffn_norm="post_attention_norm"),
}


def block_tensor_names(family: Family, routed: bool | None = None) -> list[str]:
    """A block's tensors (blk.N.{name}.weight, or .bias where named so) in the file; routed:
    whether the block's feed-forward is routed (default: the family's)."""
    routed = family.moe if routed is None else routed
    names = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", family.ffn_norm]
    names += (["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"] if routed
              else ["ffn_gate", "ffn_up", "ffn_down"])
    if routed and family.sigmoid_gating:
        names += ["exp_probs_b.bias"]
    if routed and family.shared_expert:
        names += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
    if family.qkv_bias:
        names += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if family.qk_norm:
        names += ["attn_q_norm", "attn_k_norm"]
    if family.post_norms:
        names += ["post_attention_norm", "post_ffw_norm"]
    return names


def tensor_name(block: int, name: str) -> str:
    """blk.{block}.{name}.weight, or blk.{block}.{name} for a name ending in .bias."""
    return f"blk.{block}.{name}" if name.endswith(".bias") else f"blk.{block}.{name}.weight"
