"""One stage's slice of a llama model: a contiguous layer range, plus the embedding on the first
stage and the final norm and head on the last. It knows nothing of processes or sockets.

Per-window row metadata (slots, positions) travels in a `Rows` object set by the runner,
nano-vllm style, rather than being threaded through every layer's arguments.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strata.kernels.attention import attend
from strata.kernels.norms import rms_norm, swiglu
from strata.kernels.rope import apply_rope, rope_table
from strata.model.gguf_file import ModelConfig, ModelFile


@dataclass
class Rows:
    """The rows of one window. slots[r] == -1 marks a pad row (no KV write, zero attention)."""
    slots: list[int]
    positions: list[int]

    def live(self) -> list[int]:
        return [r for r, s in enumerate(self.slots) if s >= 0]


class KVCache:
    """Keys and values of every slot for this stage's layers: [S, KVH, ctx, hd] per layer."""

    def __init__(self, n_layers: int, n_slots: int, cfg: ModelConfig, ctx: int,
                 device: torch.device, dtype: torch.dtype):
        shape = (n_slots, cfg.n_kv_heads, ctx, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.ctx = ctx
        self.n_slots = n_slots
        self.filled = [0] * n_slots  # positions [0, filled) of each slot hold this conversation

    def trim(self, slot: int, length: int) -> None:
        """Keep positions [0, length) of a slot; zero the rest so nothing stale remains."""
        if length < self.filled[slot]:
            for k, v in zip(self.k, self.v):
                k[slot, :, length:self.filled[slot]] = 0
                v[slot, :, length:self.filled[slot]] = 0
            self.filled[slot] = length

    def write(self, layer: int, rows: Rows, live: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        # k, v: [R, KVH, hd]; only live rows are written
        slots = torch.tensor([rows.slots[r] for r in live.tolist()], dtype=torch.long)
        pos = torch.tensor([rows.positions[r] for r in live.tolist()], dtype=torch.long)
        self.k[layer][slots, :, pos] = k[live]
        self.v[layer][slots, :, pos] = v[live]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class Layer(torch.nn.Module):
    def __init__(self, file: ModelFile, index: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        cfg = file.config
        load = lambda name: file.tensor(f"blk.{index}.{name}.weight", dtype).to(device)  # noqa: E731
        self.attn_norm, self.ffn_norm = load("attn_norm"), load("ffn_norm")
        # one fused [q; k; v] projection: one matmul instead of three
        self.wqkv = torch.cat([load("attn_q"), load("attn_k"), load("attn_v")])
        self.wo = load("attn_output")
        self.w_gate, self.w_up, self.w_down = load("ffn_gate"), load("ffn_up"), load("ffn_down")
        self.cfg = cfg

    def forward(self, x: torch.Tensor, rows: Rows, live: torch.Tensor, cache: KVCache,
                layer: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        n = x.shape[0]
        qkv = F.linear(rms_norm(x, self.attn_norm, cfg.rms_eps), self.wqkv)
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        q = qkv[:, :q_dim].view(n, cfg.n_heads, cfg.head_dim)
        k = qkv[:, q_dim:q_dim + kv_dim].view(n, cfg.n_kv_heads, cfg.head_dim)
        v = qkv[:, q_dim + kv_dim:].view(n, cfg.n_kv_heads, cfg.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(layer, rows, live, k, v)
        attn = attend(q, cache.k[layer], cache.v[layer], rows.slots, rows.positions)
        x = x + F.linear(attn.reshape(n, q_dim), self.wo)
        return x + swiglu(rms_norm(x, self.ffn_norm, cfg.rms_eps), self.w_gate, self.w_up,
                          self.w_down)


class StageModel(torch.nn.Module):
    """Layers [start, end) of the model; `first` embeds tokens, `last` owns norm and head."""

    def __init__(self, file: ModelFile, start: int, end: int, *, ctx: int,
                 device: str = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__()
        cfg = file.config
        self.cfg, self.start, self.end = cfg, start, end
        self.first, self.last = start == 0, end == cfg.n_layers
        self.device, self.dtype = torch.device(device), dtype
        self.layers = torch.nn.ModuleList(Layer(file, i, dtype, self.device)
                                          for i in range(start, end))
        load = lambda name: file.tensor(name, dtype).to(self.device)  # noqa: E731
        if self.first:
            self.embed = load("token_embd.weight")
        if self.last:
            self.norm = load("output_norm.weight")
            self.head = load("token_embd.weight" if cfg.tied_head else "output.weight")
        self.cos, self.sin = (t.to(self.device) for t in rope_table(cfg.rope_dim, cfg.rope_base, ctx))

    def forward(self, inputs: torch.Tensor, rows: Rows, cache: KVCache) -> torch.Tensor:
        """inputs: token ids [R] on the first stage, else hidden states [R, D]. Returns [R, D]."""
        x = F.embedding(inputs, self.embed) if self.first else inputs.to(self.dtype)
        live = torch.tensor(rows.live(), dtype=torch.long)
        pos = torch.tensor([max(p, 0) for p in rows.positions])
        cos, sin = self.cos[pos], self.sin[pos]
        for i, layer in enumerate(self.layers):
            x = layer(x, rows, live, cache, i, cos, sin)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] -> logits [N, V] in fp32 (last stage only)."""
        return F.linear(rms_norm(hidden, self.norm, self.cfg.rms_eps), self.head).float()
