"""A differentiable llama forward in plain torch, batched over padded sequences, for training:
the frozen target (its final hidden states, its next-token distributions) and the NextN head
being trained. It computes what strata's stages and drafter compute (strata/stage_worker/
model.py and drafter.py: the same norms, RoPE on adjacent pairs, attention and SwiGLU;
tests/train/test_train_mtp.py checks both agree), in whole sequences instead of windows.

Sequences are right-padded, so causal attention never lets a real position see a pad.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels.norms import rms_norm
from strata.kernels.rope import apply_rope, rope_table
from strata.model.gguf_file import ModelConfig, ModelError, ModelFile
from strata.model.nextn import BLOCK_TENSORS


def load_block(file: ModelFile, index: int, dtype, device) -> dict[str, torch.Tensor]:
    """Block `index`'s tensors by short name (attn_q, ...), [out, in]."""
    return {n: file.tensor(f"blk.{index}.{n}.weight", dtype, device) for n in BLOCK_TENSORS}


def block_forward(x: torch.Tensor, w: dict[str, torch.Tensor], cfg: ModelConfig,
                  cos: torch.Tensor, sin: torch.Tensor, keys: list | None = None,
                  mask: torch.Tensor | None = None):
    """One llama block over x [B, T, D] at rotary rows cos/sin [T, rope_dim / 2].

    Plain causal attention when `keys` is None. Otherwise the rows also see earlier passes'
    keys and values (`keys`: [(k, v)] each [B, KVH, T, hd], concatenated before this pass's
    own) through `mask` [T, (len(keys) + 1) T] (True = attend). Returns (x, (k, v))."""
    b, t, _ = x.shape
    hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    h = rms_norm(x, w["attn_norm"], cfg.rms_eps)
    q = F.linear(h, w["attn_q"]).view(b * t, nh, hd)
    k = F.linear(h, w["attn_k"]).view(b * t, nkv, hd)
    v = F.linear(h, w["attn_v"]).view(b, t, nkv, hd).transpose(1, 2)
    c, s = cos.repeat(b, 1), sin.repeat(b, 1)
    q = apply_rope(q, c, s).view(b, t, nh, hd).transpose(1, 2)
    k = apply_rope(k, c, s).view(b, t, nkv, hd).transpose(1, 2)
    if keys:
        kk = torch.cat([p[0] for p in keys] + [k], 2)
        vv = torch.cat([p[1] for p in keys] + [v], 2)
        attn = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=True)
    else:
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    x = x + F.linear(attn.transpose(1, 2).reshape(b, t, nh * hd), w["attn_output"])
    h = rms_norm(x, w["ffn_norm"], cfg.rms_eps)
    x = x + F.linear(F.silu(F.linear(h, w["ffn_gate"])) * F.linear(h, w["ffn_up"]),
                     w["ffn_down"])
    return x, (k, v)


class Target:
    """The frozen target model: `hidden(tokens)` gives its final hidden states before the
    norm (what the drafter takes as h), `logits(h)` its next-token logits."""

    def __init__(self, file: ModelFile, device, dtype, ctx: int):
        cfg = self.cfg = file.config
        if cfg.arch != "llama":
            raise ModelError(f"strata-train-mtp trains heads for llama models; "
                             f"{file.path.name} is a {cfg.arch} model (its differences on the "
                             f"forward path are the runtime's, not yet the trainer's)")
        self.embed = file.tensor("token_embd.weight", dtype, device)
        self.norm = file.tensor("output_norm.weight", dtype, device)
        self.head = (self.embed if cfg.tied_head else file.tensor("output.weight", dtype, device))
        self.blocks = [load_block(file, i, dtype, device) for i in range(cfg.n_layers)]
        self.cos, self.sin = (r.to(device) for r in rope_table(cfg.rope_dim, cfg.rope_base, ctx))

    @torch.no_grad()
    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (right-padded) -> [B, T, D]."""
        t = tokens.shape[1]
        x = F.embedding(tokens, self.embed)
        for w in self.blocks:
            x, _ = block_forward(x, w, self.cfg, self.cos[:t], self.sin[:t])
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(h, self.norm, self.cfg.rms_eps), self.head)


def chain_mask(t: int, passes: int, device) -> torch.Tensor:
    """Attention of pass `passes` (1 = the NextN rows on the target's hidden states, n > 1 the
    (n-1)th chained proposal) over the keys of passes 1..passes: row j of pass n continues
    pass 1's row j, so it sees pass 1's rows 0..j and row j of every pass 2..n (the drafter's
    cache holds exactly these when it chains from a row at that place)."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * (passes - 1), 1)
