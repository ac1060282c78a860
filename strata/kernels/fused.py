"""Fused row-wise kernels of the CUDA path (Triton), each beside its plain-torch reference.

A decode window is tiny: a stage's time is kernel launches, not arithmetic, even inside a CUDA
graph (each node costs ~1-2 us). These fuse what plain torch runs as many small kernels:

  rms_norm_rows   RMSNorm of each row (1 kernel instead of ~7)
  rope_write_kv   RoPE on q and k read from the fused qkv projection, k and v written into
                  the KV cache at (slot, position) (1 kernel instead of ~25)
  silu_mul        SiLU(gate) * up of the fused [gate; up] projection (1 instead of 3)
  linear_rows     x @ w^T (+ a residual) of a decode window: on CUDA, for a window of at most
                  16 rows and a large weight, the skinny Triton matmul (kernels/skinny_triton.py:
                  nearer the HBM limit than cuBLAS at these shapes, and the residual add in
                  its epilogue without addmm's copy); otherwise cuBLAS (addmm / linear)
  norm_linear_rows, norm_gate_up_silu, norm_head_rows
                  where the skinny kernels take the window, the norm and the projection (and
                  SiLU) as one kernel; otherwise the kernels above one after another (the
                  head: None, and the caller's cuBLAS)

Every program handles one row (and head) and reduces in a fixed order, so results never depend
on the other rows of a window. Off CUDA (and without TRITON_INTERPRET=1) the torch versions
run, so the tensor path can be tested on a CPU.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


# --- plain-torch references -----------------------------------------------------------------

def rms_norm_rows_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y.float() * weight.float()).to(x.dtype)


def rope_write_kv_torch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        slot: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, n_heads: int) -> torch.Tensor:
    """qkv: [R, (H + 2 KVH) hd]; cos, sin: the full tables [ctx, rope_dim / 2] fp32; slot, pos:
    [R] int64. Writes rotated k and v at (slot, :, pos) of the caches; returns rotated q
    [R, H, hd]. Pairs (2i, 2i+1) rotate (llama.cpp's layout of GGUF Q/K weights)."""
    n, n_kv, hd = qkv.shape[0], k_cache.shape[1], k_cache.shape[3]
    heads = qkv.view(n, n_heads + 2 * n_kv, hd)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]                      # [R, 1, rope/2]
    rope = c.shape[-1] * 2
    x = heads[:, :n_heads + n_kv].float()
    x0, x1 = x[..., 0:rope:2], x[..., 1:rope:2]
    rotated = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).flatten(-2)
    qk = torch.cat((rotated, x[..., rope:]), -1).to(qkv.dtype)             # [R, H + KVH, hd]
    k_cache[slot, :, pos] = qk[:, n_heads:]
    v_cache[slot, :, pos] = heads[:, n_heads + n_kv:]
    return qk[:, :n_heads].contiguous()


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


# --- dispatch --------------------------------------------------------------------------------

def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [R, D] -> [R, D]: x * rsqrt(mean(x^2) + eps), rounded to x's dtype, times weight."""
    if not _use_triton(x):
        return rms_norm_rows_torch(x, weight, eps)
    from strata.kernels import fused_triton
    return fused_triton.rms_norm_rows(x, weight, eps)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot: torch.Tensor,
                  pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  n_heads: int) -> torch.Tensor:
    if not _use_triton(qkv):
        return rope_write_kv_torch(qkv, cos, sin, slot, pos, k_cache, v_cache, n_heads)
    from strata.kernels import fused_triton
    return fused_triton.rope_write_kv(qkv, cos, sin, slot, pos, k_cache, v_cache, n_heads)


SKINNY_MIN_BYTES = 16 << 20  # smaller weights (SmolLM2's) are launch-bound: cuBLAS there
SKINNY_MAX_ROWS = 16         # skinny_triton.BLOCK_M: decode windows; prompt chunks use cuBLAS
# The projections whose norm (and SiLU) the skinny kernels fold in. A benchmark's knob:
# tools/gpu/bench_fold.py times each choice side by side; the model always runs all three.
FOLD = {"qkv", "gate_up", "head"}

# (block_n, block_k, stages) by projection, the first that divides the shape; measured on an
# H200 at the llama3-8b shapes (docs/BENCHMARKS.md). gate_up's block_n counts output columns,
# each with a gate and an up row. "plain" and "wide" serve linear_rows without a residual
# (the projections apart, as bench_fold.py times them).
_BLOCKS = {"res": [(32, 256, 5), (32, 128, 5), (32, 64, 5)],         # o and down + residual
           "gate_up": [(64, 64, 4), (32, 64, 4)],
           "qkv": [(64, 256, 4), (64, 128, 5), (32, 64, 5)],   # norm folded in
           "head": [(128, 128, 3), (64, 128, 4), (64, 64, 4)],   # final norm, fp32 logits
           "plain": [(64, 128, 5), (64, 64, 5), (32, 64, 5)],
           "wide": [(128, 128, 3), (64, 128, 3), (64, 64, 3)]}  # plain, n >= 4k


def skinny_blocks(n: int, k: int, kind: str = "plain") -> dict | None:
    """The skinny kernels' blocks for a weight [n, k] used as `kind` ("res", "gate_up", "qkv",
    "head" or "plain", which is "wide" for n >= 4k), or None where cuBLAS stays: a small
    weight, or one the blocks do not divide.
    Depends on the shape only, so a shape always runs the same arithmetic."""
    if n * k * 2 < SKINNY_MIN_BYTES:
        return None
    cols = n // 2 if kind == "gate_up" else n
    if kind == "plain" and n >= 4 * k:
        kind = "wide"
    for bn, bk, stages in _BLOCKS[kind]:
        if cols % bn == 0 and k % bk == 0:
            return {"block_n": bn, "block_k": bk, "stages": stages, "warps": 4}
    return None


def _skinny(x: torch.Tensor, w: torch.Tensor, kind: str) -> dict | None:
    """Blocks if the window takes the skinny kernels (a decode window, a large weight, CUDA
    or the interpreter): fixed by (R <= 16, w's shape, device), never by the rows' values, so
    a row's bits do not depend on its window."""
    if x.shape[0] > SKINNY_MAX_ROWS or not _use_triton(x):
        return None
    return skinny_blocks(*w.shape, kind)


def linear_rows(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor | None = None) -> torch.Tensor:
    """x: [R, K], w: [N, K] -> x @ w^T (+ res) [R, N]: the skinny kernel, else cuBLAS (addmm /
    linear)."""
    blocks = _skinny(x, w, "plain" if res is None else "res")
    if blocks is None:
        return F.linear(x, w) if res is None else torch.addmm(res, x, w.t())
    from strata.kernels.skinny_triton import skinny_mm
    return skinny_mm(x, w, res, **blocks)


def norm_linear_rows(x: torch.Tensor, norm: torch.Tensor, eps: float,
                     w: torch.Tensor) -> torch.Tensor:
    """rms_norm_rows, then x @ w^T: one skinny kernel with the norm folded in for a decode
    window of a large model (the qkv projection), else those two."""
    blocks = _skinny(x, w, "qkv") if "qkv" in FOLD else None
    if blocks is not None:
        from strata.kernels.skinny_triton import skinny_mm
        return skinny_mm(x, w, norm=norm, eps=eps, **blocks)
    return linear_rows(rms_norm_rows(x, norm, eps), w)


def norm_head_rows(x: torch.Tensor, norm: torch.Tensor, eps: float,
                   w: torch.Tensor) -> torch.Tensor | None:
    """fp32 logits rmsnorm(x) @ w^T of a block of rows, by the skinny kernel with the norm
    folded in where it takes them (a large head on CUDA), else None: the caller's cuBLAS."""
    blocks = _skinny(x, w, "head") if "head" in FOLD else None
    if blocks is None:
        return None
    from strata.kernels.skinny_triton import skinny_mm
    return skinny_mm(x, w, norm=norm, eps=eps, out_dtype=torch.float32, **blocks)


def norm_gate_up_silu(x: torch.Tensor, norm: torch.Tensor, eps: float,
                      w: torch.Tensor) -> torch.Tensor:
    """rms_norm_rows, the [gate; up] projection and silu_mul: one skinny kernel for a decode
    window of a large model (skinny_triton.gate_up_silu), else those three."""
    blocks = _skinny(x, w, "gate_up") if "gate_up" in FOLD else None
    if blocks is not None:
        from strata.kernels.skinny_triton import gate_up_silu
        return gate_up_silu(x, w, norm, eps, **blocks)
    return silu_mul(linear_rows(rms_norm_rows(x, norm, eps), w))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [R, 2F] = [gate | up] -> [R, F]: silu(gate) * up in fp32, rounded once."""
    if not _use_triton(gate_up):
        return silu_mul_torch(gate_up)
    from strata.kernels import fused_triton
    return fused_triton.silu_mul(gate_up)
