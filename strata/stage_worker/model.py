"""One stage's slice of a llama model: a contiguous layer range, plus the embedding on the first
stage and the final norm and head on the last. It knows nothing of processes or sockets.

Per-window row metadata travels in one `WindowMeta` object built by the model, nano-vllm
style, rather than being threaded through every layer's arguments. A window's rows are given as
`Rows` (Python lists) and computed as `RowTensors` (device tensors): one path on every device,
with fused row-wise kernels (kernels/fused.py) and row-independent attention; the layer loop
makes no host sync on a CUDA device and has static shapes, so it can be captured in a CUDA
graph (graphs.py). Pad rows write their KV into the cache's spare (trash) slot. Which kernel
computes what (Triton or its torch fallback, cuBLAS or the skinny matmul) is the model's
`KernelPolicy`. CPU stages compute in fp32, CUDA stages in bf16. A decode window (up to 64
rows) gives each row the same bits whatever its row count (tests/kernels/test_batch_invariance.py);
a prompt chunk, of a fixed shape, takes cuBLAS / torch whole.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from strata.kernels.attention.window import attend_chunk, attend_rows
from strata.kernels.fused import (by_row_blocks, linear_rows, norm_gate_up_silu,
                                  norm_head_rows, norm_linear_rows, rms_norm_rows,
                                  rope_write_kv)
from strata.kernels.moe import moe_window
from strata.kernels.norms import rms_norm
from strata.kernels.policy import MAX_DECODE_ROWS, KernelPolicy
from strata.kernels.quant import ops as quant_ops
from strata.kernels.quant.ops import dense_weight, embed_rows
from strata.kernels.quant.weight import QuantWeight
from strata.kernels.rope import rope_table
from strata.model.families import tensor_name
from strata.model.gguf_file import ATTENTION_MATRICES, FUSED_MATRICES, ModelConfig, ModelFile
from strata.stage_worker.weights import WeightLoader


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
    """What every layer reads about the window."""
    cos: torch.Tensor   # fp32 rotary tables [ctx, rope_dim / 2]
    sin: torch.Tensor
    rows: RowTensors
    chunk: bool = False  # one slot's prompt rows: the blocked chunk attention
    local: tuple[torch.Tensor, torch.Tensor] | None = None  # sliding layers' (cos, sin)


class KVCache:
    """Keys and values of every slot for this stage's layers: [S + 1, KVH, ctx, hd] per layer.

    Slot S (`trash`) is where pad rows write their KV: the writes need no mask, so no host
    sync. It is never read."""

    def __init__(self, n_layers: int, n_slots: int, cfg: ModelConfig, ctx: int,
                 device: torch.device, dtype: torch.dtype):
        shape = (n_slots + 1, cfg.n_kv_heads, ctx, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.ctx = ctx
        self.n_slots = n_slots
        self.trash = n_slots
        self.filled = [0] * n_slots  # positions [0, filled) of each slot hold this conversation

    def trim(self, slot: int, length: int) -> None:
        """Keep positions [0, length) of a slot. What lies past them stays in memory but is
        never read: a row at position p reads keys [0, p] of its slot, p <= filled (the
        worker refuses gaps), and every position below p is held or written by the same
        window before attention. Zeroing it cost two kernels per layer on a GPU, ~0.3 ms a
        commit on SmolLM2, paid by every rejected draft."""
        self.filled[slot] = min(self.filled[slot], length)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class Layer(torch.nn.Module):
    """Block `index` of the loader's file, with its family's differences (model/families.py):
    a bias on q, k and v; RMSNorm on each q and k head; norms after attention and the
    feed-forward; GeGLU; a sliding window with its own RoPE table; routed experts in place of
    the feed-forward (`Experts`, kernels/moe.py). Its matrices are dense
    tensors or QuantWeights (the loader decides); the kernels take either. chunks: whether
    prompt chunks run it (a quantized matrix then has room in the stage's scratch buffer)."""

    def __init__(self, weights: WeightLoader, index: int, policy: KernelPolicy,
                 chunks: bool = True):
        super().__init__()
        cfg = weights.file.config
        family = cfg.family
        name = lambda n: tensor_name(index, n)  # noqa: E731
        optional = lambda n, on: weights.vector(name(n)) if on else None  # noqa: E731
        self.attn_norm = weights.vector(name("attn_norm"))
        self.ffn_norm = weights.vector(name(family.ffn_norm))
        # fused [q; k; v] and [gate; up] projections: one matmul each instead of three and two
        routed = cfg.routed(index)
        groups = ATTENTION_MATRICES if routed else FUSED_MATRICES
        matrices = [weights.matrices([name(n) for n in group], for_chunks=chunks)
                    for group in groups]
        self.wqkv, self.wo = matrices[:2]
        self.w_gate_up, self.w_down = matrices[2:] or (None, None)
        self.experts = Experts.load(weights, index, family, chunks) if routed else None
        self.bqkv = (torch.cat([weights.vector(name(f"attn_{p}.bias")) for p in "qkv"])
                     if family.qkv_bias else None)
        self.q_norm = optional("attn_q_norm", family.qk_norm)
        self.k_norm = optional("attn_k_norm", family.qk_norm)
        self.post_attn_norm = optional("post_attention_norm", family.post_norms)
        self.post_ffn_norm = optional("post_ffw_norm", family.post_norms)
        self.sliding = cfg.sliding(index)
        self.cfg, self.policy = cfg, policy

    def forward(self, x: torch.Tensor, meta: WindowMeta, cache: KVCache,
                layer: int) -> torch.Tensor:
        """x: [R, D] -> [R, D]. A llama decode window on CUDA runs 6 kernels a layer: norm +
        qkv, RoPE + KV write, attention, o + residual, norm + gate_up + SiLU, down + residual
        (kernels/skinny_triton.py), each row's bits the same whatever R is; a prompt chunk 9
        (kernels/fused.py, cuBLAS for its fixed shape). The other families add row-wise
        steps between them."""
        cfg, rows, policy, decode = self.cfg, meta.rows, self.policy, not meta.chunk
        eps, family = cfg.rms_eps, cfg.family
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        qkv = norm_linear_rows(x, self.attn_norm, eps, self.wqkv, policy, decode)
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        cos, sin = meta.local if self.sliding else (meta.cos, meta.sin)
        norms = (self.q_norm, self.k_norm, eps) if self.q_norm is not None else None
        q = rope_write_kv(qkv, cos, sin, rows.slot, rows.pos, k_cache, v_cache,
                          cfg.n_heads, policy, family.rope_halves, norms,
                          decode)                                        # [R, H, hd]
        window = cfg.window if self.sliding else 0
        # with int8 activations the attention kernel also quantizes its rows for wo's kernels
        codes = quant_ops.rows_codes(self.wo, policy, decode, x.shape[0],
                                     q.shape[1] * q.shape[2], x.device)
        if meta.chunk:
            attn = attend_chunk(q, k_cache, v_cache, rows.slot, rows.length, policy, cfg.scale,
                                window)
        else:
            attn = attend_rows(q, k_cache, v_cache, rows.slot, rows.length, policy, cfg.scale,
                               window, codes)
        attn = attn.view(x.shape[0], -1)
        if codes is not None:   # linear_rows takes the codes, any other path the rows
            attn = dataclasses.replace(codes, rows=attn)
        x = self._residual(x, attn, self.wo, self.post_attn_norm, decode)
        if self.experts is not None:
            return self.experts(x, self.ffn_norm, cfg, policy, decode)
        h = norm_gate_up_silu(x, self.ffn_norm, eps, self.w_gate_up, policy, decode,
                              family.ffn_act)
        return self._residual(x, h, self.w_down, self.post_ffn_norm, decode)

    def _residual(self, x: torch.Tensor, h: torch.Tensor, w, post_norm: torch.Tensor | None,
                  decode: bool) -> torch.Tensor:
        """x + h @ w^T, the residual in the projection's epilogue; with a post-norm (gemma3)
        x + rmsnorm(h @ w^T)."""
        if post_norm is None:
            return linear_rows(h, w, res=x, policy=self.policy, decode=decode)
        out = linear_rows(h, w, policy=self.policy, decode=decode)
        return x + rms_norm_rows(out, post_norm, self.cfg.rms_eps, self.policy, decode)


@dataclass
class Experts:
    """A routed feed-forward (kernels/moe.py): router [E, D]; each expert's [gate; up] and
    down, dense ([E, 2F, D], [E, D, F]) or packed (weights.py's `experts`); glm4moe's
    correction bias [E] (fp32, as llama.cpp keeps it) and shared expert ([gate; up] and down
    matrices, on the dense feed-forward's path)."""
    router: torch.Tensor
    gate_up: torch.Tensor | QuantWeight
    down: torch.Tensor | QuantWeight
    bias: torch.Tensor | None = None
    shared: tuple | None = None   # ([gate; up], down), each a tensor or a QuantWeight

    @classmethod
    def load(cls, weights: WeightLoader, index: int, family, chunks: bool) -> "Experts":
        name = lambda n: tensor_name(index, n)  # noqa: E731
        shared = None
        if family.shared_expert:
            shared = (weights.matrices([name("ffn_gate_shexp"), name("ffn_up_shexp")],
                                       for_chunks=chunks),
                      weights.matrices([name("ffn_down_shexp")], for_chunks=chunks))
        bias = (weights.vector(name("exp_probs_b.bias"), torch.float32)
                if family.sigmoid_gating else None)
        return cls(weights.vector(name("ffn_gate_inp")),
                   weights.experts([name("ffn_gate_exps"), name("ffn_up_exps")]),
                   weights.experts([name("ffn_down_exps")]), bias, shared)

    def __call__(self, x: torch.Tensor, norm: torch.Tensor, cfg: ModelConfig,
                 policy: KernelPolicy, decode: bool) -> torch.Tensor:
        """x [R, D] -> x + the routed experts' sum of rmsnorm(x) (+ the shared expert's)."""
        eps, act = cfg.rms_eps, cfg.family.ffn_act
        h = rms_norm_rows(x, norm, eps, policy, decode)
        out = moe_window(x, h, self.router, self.gate_up, self.down, cfg.n_experts_used,
                         bias=self.bias, scale=cfg.expert_scale, groups=cfg.expert_groups,
                         policy=policy, decode=decode, act=act)
        if self.shared is not None:
            gate_up, down = self.shared
            hs = norm_gate_up_silu(x, norm, eps, gate_up, policy, decode, act)
            out = linear_rows(hs, down, res=out, policy=policy, decode=decode)
        return out


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 weights, KV and activations on CUDA; fp32 on the CPU."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


class StageModel(torch.nn.Module):
    """Layers [start, end) of the model; `first` embeds tokens, `last` owns norm and head.
    `policy` (default: the device's) chooses the kernels; its KV cache is a `KVCache`.
    `weights`: "quantized" keeps the file's block types packed on a CUDA device where a
    kernel reads them, "bf16" widens every matrix, "packed" packs on any device (tests of the
    kernels under Triton's interpreter); `self.weights.report` says what was loaded
    (stage_worker/weights.py)."""

    def __init__(self, file: ModelFile, start: int, end: int, *, ctx: int,
                 device: str = "cpu", dtype: torch.dtype | None = None,
                 policy: KernelPolicy | None = None, weights: str = "bf16"):
        super().__init__()
        cfg = file.config
        self.cfg, self.start, self.end = cfg, start, end
        self.first, self.last = start == 0, end == cfg.n_layers
        self.device = torch.device(device)
        self.dtype = dtype or default_dtype(self.device)
        self.policy = policy or KernelPolicy.for_device(self.device)
        self.weights = WeightLoader(file, self.device, self.dtype, weights)
        self.layers = torch.nn.ModuleList(Layer(self.weights, i, self.policy)
                                          for i in range(start, end))
        if self.first:
            self.embed = self.weights.matrix("token_embd.weight")
        if self.last:
            self.norm = self.weights.vector("output_norm.weight")
            self.head = (self.embed if cfg.tied_head and self.first  # one copy when tied
                         else self.weights.matrix("token_embd.weight" if cfg.tied_head
                                                  else "output.weight"))
        self.weights.finish()
        # gemma: the embedding times sqrt(d_model), rounded to the model's dtype as Gemma does
        self.embed_scale = (torch.tensor(cfg.d_model ** 0.5, dtype=self.dtype)
                            if cfg.family.embed_scale else None)
        table = rope_table(cfg.rope_dim, cfg.rope_base, ctx, cfg.rope_scale)
        self.cos, self.sin = (t.to(self.device) for t in table)
        self.local = None   # the sliding layers' table, with the family's own base
        if any(cfg.sliding(i) for i in range(start, end)):
            local = rope_table(cfg.rope_dim, cfg.family.local_rope_base, ctx)
            self.local = tuple(t.to(self.device) for t in local)

    def forward(self, inputs: torch.Tensor, rows: Rows | RowTensors, cache: KVCache,
                chunk: bool = False) -> torch.Tensor:
        """inputs: token ids [R] on the first stage, else hidden states [R, D]. Returns [R, D].
        chunk: the rows are one slot's prompt rows (the chunk attention)."""
        if isinstance(rows, Rows):
            rows = RowTensors.unpack(RowTensors.pack(rows, cache.trash).to(self.device))
        if self.first:
            x = embed_rows(inputs, self.embed, self.dtype, self.policy)
            if self.embed_scale is not None:
                x = x * self.embed_scale
        else:
            x = inputs.to(self.dtype)
        meta = WindowMeta(self.cos, self.sin, rows, chunk, self.local)
        for i, layer in enumerate(self.layers):
            x = layer(x, meta, cache, i)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] rows to sample -> logits [N, V] in fp32 (last stage only), a row's
        bits the same whatever N is. bf16 hidden states and head give fp32 logits straight from
        the matmul's fp32 accumulator (no bf16 rounding): the skinny kernel with the norm
        folded in (fused.norm_head_rows), else the norm, then the matmul in blocks of 8 rows."""
        if hidden.shape[0] > MAX_DECODE_ROWS:
            return torch.cat([self.logits(h) for h in hidden.split(MAX_DECODE_ROWS)])
        if hidden.dtype != torch.float32:
            out = norm_head_rows(hidden, self.norm, self.cfg.rms_eps, self.head, self.policy)
            if out is not None:
                return out
        head = dense_weight(self.head, hidden.dtype, self.policy)   # a quantized head: once
        return by_row_blocks(lambda h: self._head_block(h, head), hidden)

    def _head_block(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        h = rms_norm(hidden, self.norm, self.cfg.rms_eps)
        if h.dtype == torch.float32:
            return F.linear(h, head)
        if self.policy.mm_fp32_out:
            return torch.mm(h, head.t(), out_dtype=torch.float32)
        return F.linear(h.float(), head.float())
