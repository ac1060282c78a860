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

# (block_n, block_k, stages) by projection, the first that divides the shape; measured on an
# H200 at the llama3-8b shapes (docs/BENCHMARKS.md). gate_up's block_n counts output columns,
# each with a gate and an up row. "plain" and "wide" serve linear_rows without a residual.
SKINNY_BLOCKS = MappingProxyType({
    "res": ((32, 256, 5), (32, 128, 5), (32, 64, 5)),        # o and down + residual
    "gate_up": ((64, 64, 4), (32, 64, 4)),
    "qkv": ((64, 256, 4), (64, 128, 5), (32, 64, 5)),        # norm folded in
    "head": ((128, 128, 3), (64, 128, 4), (64, 64, 4)),      # final norm, fp32 logits
    "plain": ((64, 128, 5), (64, 64, 5), (32, 64, 5)),
    "wide": ((128, 128, 3), (64, 128, 3), (64, 64, 3)),      # plain, n >= 4k
})
FOLD_ALL = frozenset({"qkv", "gate_up", "head"})


@dataclass(frozen=True)
class KernelPolicy:
    """triton: the Triton kernels run (a CUDA device, or TRITON_INTERPRET=1 on the CPU);
    otherwise their plain-torch fallbacks do. A decode window of at most `skinny_max_rows`
    rows takes the skinny matmul for a weight of `skinny_min_bytes` or more (smaller weights,
    SmolLM2's, are launch-bound: cuBLAS there), with the norm (and SiLU) folded into the
    projections named in `fold`. mm_fp32_out: bf16 head logits come straight from
    torch.mm(out_dtype=float32) (else the head is upcast)."""
    triton: bool
    skinny_min_bytes: int = 16 << 20
    skinny_max_rows: int = 16          # skinny_triton.BLOCK_M: decode windows
    fold: frozenset[str] = FOLD_ALL
    blocks: Mapping[str, tuple[tuple[int, int, int], ...]] = field(
        default_factory=lambda: SKINNY_BLOCKS)
    mm_fp32_out: bool = True

    @classmethod
    def for_device(cls, device: torch.device | str) -> "KernelPolicy":
        device = torch.device(device)
        triton = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
        return cls(triton=triton, mm_fp32_out=device.type == "cuda" and _mm_fp32_out(device))

    def skinny_blocks(self, n: int, k: int, kind: str = "plain") -> dict | None:
        """The skinny kernels' blocks for a weight [n, k] used as `kind` ("res", "gate_up",
        "qkv", "head" or "plain", which is "wide" for n >= 4k), or None where cuBLAS stays: a
        small weight, or one the blocks do not divide."""
        if n * k * 2 < self.skinny_min_bytes:
            return None
        cols = n // 2 if kind == "gate_up" else n
        if kind == "plain" and n >= 4 * k:
            kind = "wide"
        for bn, bk, stages in self.blocks[kind]:
            if cols % bn == 0 and k % bk == 0:
                return {"block_n": bn, "block_k": bk, "stages": stages, "warps": 4}
        return None

    def skinny(self, x: torch.Tensor, w: torch.Tensor, kind: str) -> dict | None:
        """Blocks if x's window takes the skinny kernels (a decode window, a large weight, the
        Triton kernels on), else None; fixed by (R, w's shape, the policy), never by values."""
        if x.shape[0] > self.skinny_max_rows or not self.triton:
            return None
        if kind in ("qkv", "gate_up", "head") and kind not in self.fold:
            return None
        return self.skinny_blocks(*w.shape, kind)


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
