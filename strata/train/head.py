"""The NextN head being trained, as strata's drafter runs it (strata/stage_worker/drafter.py):

    x = eh_proj([enorm(emb(t_p)); hnorm(h_{p-1})]);  x = block(x);  logits = head(shared_norm(x))

`passes(tokens, h, n)` runs a whole batch of sequences teacher-forced: pass 1 puts a NextN row
at every position p >= 1 (rotated as p - 1, the drafter's cache index), and pass k > 1 chains
from pass k - 1's rows as the drafter chains proposals: the row continuing pass 1's row j
takes the previous pass's output as its h and the true token one place further, and attends
pass 1's rows up to j and its own chain (torch_llama.chain_mask).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels.norms import rms_norm
from strata.train.torch_llama import Target, block_forward, chain_mask


class NextNHead(torch.nn.Module):
    """Trainable tensors (fp32), bound to a frozen target's embedding and output head."""

    def __init__(self, target: Target, init: dict[str, torch.Tensor] | None = None,
                 ffn: int | None = None):
        """From `init` (a head's tensors by short name), else the target's last block with
        eh_proj passing h through; with `ffn`, the block's feed-forward layer widened to
        that many units (widen_ffn: the head computes what it did)."""
        super().__init__()
        self.target, cfg = target, target.cfg
        d = cfg.d_model
        if init is None:
            eh = torch.zeros(d, 2 * d)
            eh[:, d:] = torch.eye(d)
            init = {**target.blocks[-1], "eh_proj": eh, "enorm": torch.ones(d),
                    "hnorm": torch.ones(d), "shared_head_norm": target.norm}
        if ffn is not None:
            init = widen_ffn(init, ffn)
        device = target.embed.device
        self.w = torch.nn.ParameterDict(
            {n: torch.nn.Parameter(t.detach().float().clone().to(device)) for n, t in init.items()})

    def rows(self, tokens: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The block's input for NextN rows of tokens [B, T] on hidden states h [B, T, D]."""
        w, eps = self.w, self.target.cfg.rms_eps
        e = F.embedding(tokens, self.target.embed).to(h.dtype)
        x = torch.cat([rms_norm(e, w["enorm"].to(h.dtype), eps),
                       rms_norm(h, w["hnorm"].to(h.dtype), eps)], -1)
        return F.linear(x, w["eh_proj"].to(h.dtype))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        t = self.target
        return F.linear(rms_norm(x, self.w["shared_head_norm"].to(x.dtype), t.cfg.rms_eps),
                        t.head.to(x.dtype))

    def passes(self, tokens: torch.Tensor, h: torch.Tensor, n: int) -> list[torch.Tensor]:
        """Logits of passes 1..n, each [B, T - 1, V]: pass k's row j predicts the token at
        position j + k + 1 (valid while j + k + 1 < the sequence's length)."""
        t = self.target
        length = tokens.shape[1] - 1
        block = {k: v.to(h.dtype) for k, v in self.w.items()}
        x = self.rows(tokens[:, 1:], h[:, :-1])
        keys, out = [], []
        for k in range(1, n + 1):
            if k > 1:   # row j: the token at j + k, the previous pass's output as h
                nxt = F.pad(tokens[:, k:], (0, k - 1))
                x = self.rows(nxt, x)
            cos, sin = t.cos[k - 1:k - 1 + length], t.sin[k - 1:k - 1 + length]
            mask = chain_mask(length, k, h.device) if k > 1 else None
            x, kv = block_forward(x, block, t.cfg, cos, sin, keys or None, mask)
            keys.append(kv)
            out.append(self.logits(x))
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        """The trained tensors, fp32 on the CPU, by short name."""
        return {n: p.detach().float().cpu() for n, p in self.w.items()}


def widen_ffn(block: dict[str, torch.Tensor], ffn: int) -> dict[str, torch.Tensor]:
    """The block's tensors with `ffn` feed-forward units: the new units' gate and up rows
    random (each tensor's own spread; torch's generator), their ffn_down columns zero, so the
    block computes what it did until training moves them. Refuses to narrow."""
    have = block["ffn_gate"].shape[0]
    if ffn < have:
        raise ValueError(f"--head-ffn {ffn} is narrower than the head it starts from "
                         f"({have} units); give at least {have}")
    if ffn == have:
        return block
    extra = ffn - have
    out = dict(block)
    for name in ("ffn_gate", "ffn_up"):
        w = block[name].float()
        new = torch.randn(extra, w.shape[1], device=w.device) * w.std()
        out[name] = torch.cat([w, new])
    down = block["ffn_down"].float()
    out["ffn_down"] = torch.cat([down, down.new_zeros(down.shape[0], extra)], 1)
    return out
