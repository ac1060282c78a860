"""Which kernel computes what: one frozen object a stage's model owns and passes to the kernels.

The choices depend on the device and on shapes only, never on a window's values, so a shape
always runs the same arithmetic (DESIGN.md, exactness 1 and 2). Tests and benchmarks build a
policy of their own (`dataclasses.replace(KernelPolicy.for_device(d), fold=frozenset())`)
rather than switching module state.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import torch

# (block_n, block_k, stages) by projection, the first that divides the weight's shape: the
# tiles along K (and N) are fixed by the weight, never by the window's rows. Measured on an
# H200 at the llama3-8b shapes (docs/BENCHMARKS.md); the last entries (block_k 64) divide
# SmolLM2's (K = 576) and the tiny test model's. gate_up's block_n counts output columns, each
# with a gate and an up row. "plain" and "wide" serve linear_rows without a residual.
SKINNY_BLOCKS = MappingProxyType({
    "res": ((32, 256, 5), (32, 128, 5), (32, 64, 5), (16, 64, 5)),   # o and down + residual
    "gate_up": ((64, 64, 4), (32, 64, 4), (16, 64, 4)),
    "qkv": ((64, 256, 4), (64, 128, 5), (32, 64, 5), (16, 64, 5)),   # norm folded in
    "head": ((128, 128, 3), (64, 128, 4), (64, 64, 4), (16, 64, 4)),  # final norm, fp32 logits
    "plain": ((64, 128, 5), (64, 64, 5), (32, 64, 5), (16, 64, 5)),
    "wide": ((128, 128, 3), (64, 128, 3), (64, 64, 3), (16, 64, 3)),  # plain, n >= 4k
})
# The quantized kernels' (block_n, block_k, stages, warps) by projection, and by block type
# where one differs ("*": the rest), chosen on an H200 at the llama3-8b shapes
# (tools/gpu/bench_quant.py). block_k is halved until it divides K (SmolLM2's 576: 64). A weight
# of few column blocks is split along K until its programs fill the GPU (a 4096-row projection
# has 64 column blocks for 132 SMs, and each program's dequantization is a long chain of
# dependent instructions). Fixed by the weight's type and shape.
QUANT_BLOCKS = MappingProxyType({
    "res": {"*": (64, 128, 2, 4)}, "qkv": {"*": (64, 128, 2, 4)},
    "gate_up": {"*": (64, 128, 2, 4)}, "head": {"*": (64, 128, 2, 4)},
    "plain": {"*": (64, 128, 2, 4)},
})
# The routed experts' grouped kernels (kernels/moe_triton.py): (block_n, block_k, stages, warps)
# of the [gate; up] and down kernels, block_k halved until it divides the experts' K (and holds
# whole scale groups of a packed type); block_n is masked. MOE_BLOCK_M slots a block: each
# expert's (row, rank) pairs padded to whole blocks, the same for decode windows and prompt
# chunks (a decode row's expert rarely has more than a few pairs).
MOE_BLOCKS = MappingProxyType({"gate_up": (64, 128, 2, 4), "down": (64, 128, 2, 4)})
MOE_BLOCK_M = 16
QUANT_SPLIT_PROGRAMS = 1024   # split K while column blocks x splits stay within this
QUANT_MAX_SPLITS = 8
FOLD_ALL = frozenset({"qkv", "gate_up", "head"})
MAX_DECODE_ROWS = 64   # a decode window's rows at most (the largest row tile)
ROW_BLOCK = 8          # rows per call where a decode window's matmul is not a skinny kernel


@dataclass(frozen=True)
class KernelPolicy:
    """triton: the Triton kernels run (a CUDA device, or TRITON_INTERPRET=1 on the CPU);
    otherwise their plain-torch fallbacks do. Every matmul of a decode window (at most
    MAX_DECODE_ROWS rows) takes the skinny kernel where its blocks divide the weight, with the
    norm (and SiLU) folded into the projections named in `fold`; `row_tiles` are the kernel's
    BLOCK_M choices: the smallest that holds the window (each weight tile read once for all
    rows), else the largest with a grid over row blocks. A weight under `fit_min_bytes`
    (SmolLM2's layers) takes the first tile over row blocks instead: its few column blocks
    leave most SMs idle, and its re-reads hit L2 (an H200, 64 rows, 16-row tiles against one
    64-row tile: SmolLM2's qkv 5 us against 8, llama3-8b's 40 against 29;
    tools/gpu/bench_tiles.py). Every tile gives a row the same bits
    (tests/kernels/test_batch_invariance.py). A decode window's matmul the skinny
    kernel does not take (no Triton, or a shape its blocks do not divide) runs in calls of
    ROW_BLOCK rows, each of the same shape. Prompt chunks (fixed shapes) take cuBLAS / torch
    whole. mm_fp32_out: bf16 head logits come straight from torch.mm(out_dtype=float32) (else
    the head is upcast). int8_activations: a decode window's projections over quantized
    weights quantize each row to int8 and sum integer products (kernels/quant/a8.py) instead of
    dequantizing the weights to the rows' dtype; a different arithmetic, the same for every
    window size."""
    triton: bool
    fold: frozenset[str] = FOLD_ALL
    blocks: Mapping[str, tuple[tuple[int, int, int], ...]] = field(
        default_factory=lambda: SKINNY_BLOCKS)
    row_tiles: tuple[int, ...] = (16, 32, 64)
    fit_min_bytes: int = 16 << 20
    mm_fp32_out: bool = True
    quant_blocks_by_kind: Mapping[str, Mapping[str, tuple[int, int, int, int]]] = field(
        default_factory=lambda: QUANT_BLOCKS)
    quant_split_programs: int = QUANT_SPLIT_PROGRAMS   # 0: never split K
    moe_blocks_by_kind: Mapping[str, tuple[int, int, int, int]] = field(
        default_factory=lambda: MOE_BLOCKS)
    moe_block_m: int = MOE_BLOCK_M
    int8_activations: bool = False

    @classmethod
    def for_device(cls, device: torch.device | str) -> "KernelPolicy":
        device = torch.device(device)
        triton = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
        return cls(triton=triton, mm_fp32_out=device.type == "cuda" and _mm_fp32_out(device))

    def skinny_blocks(self, n: int, k: int, kind: str = "plain") -> dict | None:
        """The skinny kernels' blocks along N and K for a weight [n, k] used as `kind` ("res",
        "gate_up", "qkv", "head" or "plain", which is "wide" for n >= 4k): the weight's shape
        alone picks them. None where no block divides the shape."""
        cols = n // 2 if kind == "gate_up" else n
        if kind == "plain" and n >= 4 * k:
            kind = "wide"
        for bn, bk, stages in self.blocks[kind]:
            if cols % bn == 0 and k % bk == 0:
                return {"block_n": bn, "block_k": bk, "stages": stages, "warps": 4}
        return None

    def quant_blocks(self, qtype: str, n: int, k: int, kind: str = "plain") -> dict:
        """The quantized kernels' blocks for a [n, k] weight of block type `qtype` used as
        `kind` (as skinny_blocks; N is masked, so every shape takes them) and its splits of K:
        the most, up to QUANT_MAX_SPLITS and dividing K's steps, whose programs (column blocks
        x splits) stay within quant_split_programs. The row tile is row_tile's."""
        table = self.quant_blocks_by_kind[kind]
        block_n, block_k, stages, warps = table.get(qtype, table["*"])
        while k % block_k and block_k > 32:   # every GGUF row is whole 32-quant blocks
            block_k //= 2
        columns = -(-(n // 2 if kind == "gate_up" else n) // block_n)
        splits = max(s for s in range(1, QUANT_MAX_SPLITS + 1)
                     if (k // block_k) % s == 0
                     and (s == 1 or columns * s <= self.quant_split_programs))
        return {"block_n": block_n, "block_k": block_k, "stages": stages, "warps": warps,
                "splits": splits}

    def moe_blocks(self) -> dict:
        """The grouped expert kernels' blocks (kernels/moe_triton.py): block_m, and for
        "gate_up" and "down" block_n, block_k (a ceiling: halved to fit K), stages and warps.
        Fixed by the policy, never by a window's rows or their experts."""
        out: dict = {"block_m": self.moe_block_m}
        for kind, (block_n, block_k, stages, warps) in self.moe_blocks_by_kind.items():
            out[kind] = {"block_n": block_n, "block_k": block_k, "stages": stages,
                         "warps": warps}
        return out

    def row_tile(self, m: int, weight_bytes: int) -> int:
        """BLOCK_M for a window of m rows and a weight of that many bytes (see the class)."""
        tiles = self.row_tiles if weight_bytes >= self.fit_min_bytes else self.row_tiles[:1]
        return next((t for t in tiles if m <= t), tiles[-1])

    def skinny(self, x: torch.Tensor, w: torch.Tensor, kind: str, decode: bool) -> dict | None:
        """Blocks (with the row tile) if x's rows take the skinny kernel: a decode window, the
        Triton kernels on, a weight the blocks divide; else None. Fixed by (x's rows, w's
        shape, the policy), never by values; the tiles along K by w's shape alone."""
        if not decode or not self.triton:
            return None
        assert x.shape[0] <= MAX_DECODE_ROWS, "checks.py refuses larger decode windows"
        if kind in ("qkv", "gate_up", "head") and kind not in self.fold:
            return None
        blocks = self.skinny_blocks(*w.shape, kind)
        if blocks is None:
            return None
        return {**blocks, "block_m": self.row_tile(x.shape[0], w.numel() * 2)}


@functools.cache
def _mm_fp32_out(device: torch.device) -> bool:
    """Whether this torch's mm takes out_dtype (bf16 x bf16 -> fp32) on the device (probed
    once a device: never inside a CUDA graph's capture, which builds its model's policy first)."""
    a = torch.zeros(1, 8, dtype=torch.bfloat16, device=device)
    try:
        torch.mm(a, a.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError):
        return False
    return True


def policy_or_default(policy: KernelPolicy | None, t: torch.Tensor) -> KernelPolicy:
    """The caller's policy, or the default one of t's device (callers outside a model)."""
    return policy if policy is not None else KernelPolicy.for_device(t.device)
