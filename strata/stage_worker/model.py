"""One stage's slice of a llama model: a contiguous layer range, plus the embedding on the first
stage and the final norm and head on the last. It knows nothing of processes or sockets.

Per-window row metadata travels in one `WindowMeta` object built by the runner, nano-vllm
style, rather than being threaded through every layer's arguments. Rows come in two forms:

- `Rows` (Python lists): the CPU path, fp32, attention by `attend` (batched per key span).
- `RowTensors` (device tensors): the CUDA path, bf16, fused row-wise kernels (kernels/fused.py)
  and the fixed-order Triton attention; the layer loop makes no host sync and has static
  shapes, so it can be captured in a CUDA graph (graphs.py). Pad rows write their KV into the
  cache's spare (trash) slot.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from strata.kernels.attention import attend, attend_chunk, attend_rows
from strata.kernels.fused import (linear_rows, norm_gate_up_silu, norm_head_rows,
                                  norm_linear_rows, rope_write_kv)
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


@dataclass
class RowTensors:
    """The rows of one window as int64 device tensors [R] (views of one packed [3, R] tensor, so
    one copy moves them and a graph can read them from a static buffer; the first stage's
    [4, R] holds its token ids too)."""
    slot: torch.Tensor    # pad rows: the cache's trash slot
    pos: torch.Tensor     # pad rows: 0
    length: torch.Tensor  # keys a row attends to: position + 1; pad rows: 0

    @staticmethod
    def pack(rows: Rows, trash: int, tokens: list[int] | None = None) -> torch.Tensor:
        """[3, R] int64 on the host: slot, position, length per row; with tokens, [4, R] with
        the token ids last (the first stage's whole input in one tensor: one copy)."""
        out = np.empty((3 if tokens is None else 4, len(rows.slots)), dtype=np.int64)
        RowTensors.fill(out, rows, trash, tokens)
        return torch.from_numpy(out)

    @staticmethod
    def fill(out: np.ndarray, rows: Rows, trash: int, tokens: list[int] | None = None) -> None:
        """Write pack's values into an int64 array [3, R] or [4, R] (a staging buffer)."""
        out[0] = [s if s >= 0 else trash for s in rows.slots]
        out[1] = [p if s >= 0 else 0 for s, p in zip(rows.slots, rows.positions)]
        out[2] = [p + 1 if s >= 0 else 0 for s, p in zip(rows.slots, rows.positions)]
        if tokens is not None:
            out[3] = tokens

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> "RowTensors":
        return cls(packed[0], packed[1], packed[2])


@dataclass
class WindowMeta:
    """What every layer reads about the window: its rows in list form (with `live`, and the
    rotary tables indexed by row) or in tensor form (with the whole tables)."""
    cos: torch.Tensor   # fp32: Rows [R, rope_dim / 2]; RowTensors [ctx, rope_dim / 2]
    sin: torch.Tensor
    rows: Rows | None = None
    live: torch.Tensor | None = None         # Rows: indices of live rows
    tensors: RowTensors | None = None
    chunk: bool = False  # RowTensors of one slot's prompt: the blocked chunk attention


class KVCache:
    """Keys and values of every slot for this stage's layers: [S, KVH, ctx, hd] per layer.

    With `trash_slot`, one more slot is allocated (index n_slots) where pad rows of the tensor
    path write their KV: the writes need no mask, so no host sync. It is never read."""

    def __init__(self, n_layers: int, n_slots: int, cfg: ModelConfig, ctx: int,
                 device: torch.device, dtype: torch.dtype, trash_slot: bool = False):
        shape = (n_slots + int(trash_slot), cfg.n_kv_heads, ctx, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.ctx = ctx
        self.n_slots = n_slots
        self.trash = n_slots if trash_slot else None
        self.filled = [0] * n_slots  # positions [0, filled) of each slot hold this conversation

    def trim(self, slot: int, length: int) -> None:
        """Keep positions [0, length) of a slot. What lies past them stays in memory but is
        never read: a row at position p reads keys [0, p] of its slot, p <= filled (the
        worker refuses gaps), and every position below p is held or written by the same
        window before attention. Zeroing it cost two kernels per layer on a GPU, ~0.3 ms a
        commit on SmolLM2, paid by every rejected draft."""
        self.filled[slot] = min(self.filled[slot], length)

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
    def __init__(self, file: ModelFile, index: int, dtype: torch.dtype, device: torch.device,
                 fused: bool = False):
        super().__init__()
        cfg = file.config
        load = lambda name: file.tensor(f"blk.{index}.{name}.weight", dtype, device)  # noqa: E731
        self.attn_norm, self.ffn_norm = load("attn_norm"), load("ffn_norm")
        # one fused [q; k; v] projection: one matmul instead of three
        self.wqkv = torch.cat([load("attn_q"), load("attn_k"), load("attn_v")])
        self.wo = load("attn_output")
        # the tensor path makes one [gate; up] matmul too (the list path keeps its arithmetic)
        self.fused = fused
        if fused:
            self.w_gate_up = torch.cat([load("ffn_gate"), load("ffn_up")])
        else:
            self.w_gate, self.w_up = load("ffn_gate"), load("ffn_up")
        self.w_down = load("ffn_down")
        self.cfg = cfg

    def forward(self, x: torch.Tensor, meta: WindowMeta, cache: KVCache,
                layer: int) -> torch.Tensor:
        if meta.tensors is not None:
            return self._forward_rows(x, meta, cache, layer)
        cfg = self.cfg
        n = x.shape[0]
        qkv = F.linear(rms_norm(x, self.attn_norm, cfg.rms_eps), self.wqkv)
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        q = qkv[:, :q_dim].view(n, cfg.n_heads, cfg.head_dim)
        k = qkv[:, q_dim:q_dim + kv_dim].view(n, cfg.n_kv_heads, cfg.head_dim)
        v = qkv[:, q_dim + kv_dim:].view(n, cfg.n_kv_heads, cfg.head_dim)
        q, k = apply_rope(q, meta.cos, meta.sin), apply_rope(k, meta.cos, meta.sin)
        cache.write(layer, meta.rows, meta.live, k, v)
        attn = attend(q, cache.k[layer], cache.v[layer], meta.rows.slots, meta.rows.positions)
        x = x + F.linear(attn.reshape(n, q_dim), self.wo)
        return x + swiglu(rms_norm(x, self.ffn_norm, cfg.rms_eps), self.w_gate, self.w_up,
                          self.w_down)

    def _forward_rows(self, x: torch.Tensor, meta: WindowMeta, cache: KVCache,
                      layer: int) -> torch.Tensor:
        """The tensor path, no host sync (x: [R, D]). A decode window of a large model runs 6
        kernels a layer: norm + qkv, RoPE + KV write, attention, o + residual, norm + gate_up +
        SiLU, down + residual (kernels/skinny_triton.py); other windows 9 (kernels/fused.py)."""
        cfg, rows = self.cfg, meta.tensors
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        qkv = norm_linear_rows(x, self.attn_norm, cfg.rms_eps, self.wqkv)
        q = rope_write_kv(qkv, meta.cos, meta.sin, rows.slot, rows.pos, k_cache, v_cache,
                          cfg.n_heads)                                    # [R, H, hd]
        attend_fn = attend_chunk if meta.chunk else attend_rows
        attn = attend_fn(q, k_cache, v_cache, rows.slot, rows.length)
        x = linear_rows(attn.view(x.shape[0], -1), self.wo, res=x)         # x + attn wo^T
        h = norm_gate_up_silu(x, self.ffn_norm, cfg.rms_eps, self.w_gate_up)
        return linear_rows(h, self.w_down, res=x)


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 weights, KV and activations on CUDA; fp32 on the CPU."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


class StageModel(torch.nn.Module):
    """Layers [start, end) of the model; `first` embeds tokens, `last` owns norm and head.

    `row_tensors` (default: on CUDA) runs windows in the tensor form; a `Rows` window given to
    such a model is converted once. Its KV cache needs a trash slot (`KVCache(trash_slot=True)`).
    """

    def __init__(self, file: ModelFile, start: int, end: int, *, ctx: int,
                 device: str = "cpu", dtype: torch.dtype | None = None,
                 row_tensors: bool | None = None):
        super().__init__()
        cfg = file.config
        self.cfg, self.start, self.end = cfg, start, end
        self.first, self.last = start == 0, end == cfg.n_layers
        self.device = torch.device(device)
        self.dtype = dtype or default_dtype(self.device)
        self.row_tensors = self.device.type == "cuda" if row_tensors is None else row_tensors
        self.layers = torch.nn.ModuleList(Layer(file, i, self.dtype, self.device,
                                                fused=self.row_tensors)
                                          for i in range(start, end))
        load = lambda name: file.tensor(name, self.dtype, self.device)  # noqa: E731
        if self.first:
            self.embed = load("token_embd.weight")
        if self.last:
            self.norm = load("output_norm.weight")
            self.head = (self.embed if cfg.tied_head and self.first  # one copy when tied
                         else load("token_embd.weight" if cfg.tied_head else "output.weight"))
        self.cos, self.sin = (t.to(self.device) for t in rope_table(cfg.rope_dim, cfg.rope_base, ctx))

    def forward(self, inputs: torch.Tensor, rows: Rows | RowTensors, cache: KVCache,
                chunk: bool = False) -> torch.Tensor:
        """inputs: token ids [R] on the first stage, else hidden states [R, D]. Returns [R, D].
        chunk: the rows are one slot's prompt rows (the tensor path's chunk attention; the
        list path computes every window alike)."""
        if isinstance(rows, Rows) and self.row_tensors:
            rows = RowTensors.unpack(RowTensors.pack(rows, cache.trash).to(self.device))
        x = F.embedding(inputs, self.embed) if self.first else inputs.to(self.dtype)
        if isinstance(rows, RowTensors):
            meta = WindowMeta(self.cos, self.sin, tensors=rows, chunk=chunk)
        else:
            pos = torch.tensor([max(p, 0) for p in rows.positions])
            meta = WindowMeta(self.cos[pos], self.sin[pos], rows=rows,
                              live=torch.tensor(rows.live(), dtype=torch.long))
        for i, layer in enumerate(self.layers):
            x = layer(x, meta, cache, i)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] -> logits [N, V] in fp32 (last stage only). bf16 hidden states and
        head give fp32 logits straight from the matmul's fp32 accumulator (no bf16 rounding):
        the skinny kernel with the norm folded in for a large head (fused.norm_head_rows), else
        the norm, then cuBLAS."""
        if hidden.dtype != torch.float32:
            out = norm_head_rows(hidden, self.norm, self.cfg.rms_eps, self.head)
            if out is not None:
                return out
        h = rms_norm(hidden, self.norm, self.cfg.rms_eps)
        if h.dtype == torch.float32:
            return F.linear(h, self.head).float()
        global _MM_FP32_OUT
        if h.is_cuda and _MM_FP32_OUT:
            try:
                return torch.mm(h, self.head.t(), out_dtype=torch.float32)
            except (TypeError, RuntimeError):  # a torch without mm's out_dtype
                _MM_FP32_OUT = False
        return F.linear(h.float(), self.head.float())


_MM_FP32_OUT = True  # torch.mm(bf16, bf16, out_dtype=float32) works here (else upcast the head)
