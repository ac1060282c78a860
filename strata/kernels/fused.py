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
run: the same path computes on every device (kernels/policy.py says which runs where).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels.policy import KernelPolicy, policy_or_default


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


def normed_product(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor | None = None,
                   eps: float = 0.0) -> torch.Tensor:
    """fp32 [M, N]: x @ w^T, with the norm folded in as the skinny kernels fold it."""
    if norm is None:
        return x.float() @ w.float().t()
    xf = x.float()
    scaled = (xf * norm.float()).to(x.dtype).float()
    return (scaled @ w.float().t()) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def skinny_mm_torch(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor | None = None,
                    norm: torch.Tensor | None = None, eps: float = 0.0,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """skinny_triton.skinny_mm's arithmetic in fp32, one rounding per output."""
    out = normed_product(x, w, norm, eps)
    if res is not None:
        out += res.float()
    return out.to(out_dtype or x.dtype)


def gate_up_silu_torch(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor | None = None,
                       eps: float = 0.0) -> torch.Tensor:
    """skinny_triton.gate_up_silu's arithmetic: the projection rounded, then silu_mul."""
    return silu_mul_torch(normed_product(x, w, norm, eps).to(x.dtype))


# --- dispatch: the Triton kernels where the policy runs them, else the references ----------

def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  policy: KernelPolicy | None = None) -> torch.Tensor:
    """x: [R, D] -> [R, D]: x * rsqrt(mean(x^2) + eps), rounded to x's dtype, times weight."""
    if not policy_or_default(policy, x).triton:
        return rms_norm_rows_torch(x, weight, eps)
    from strata.kernels import fused_triton
    return fused_triton.rms_norm_rows(x, weight, eps)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot: torch.Tensor,
                  pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  n_heads: int, policy: KernelPolicy | None = None) -> torch.Tensor:
    if not policy_or_default(policy, qkv).triton:
        return rope_write_kv_torch(qkv, cos, sin, slot, pos, k_cache, v_cache, n_heads)
    from strata.kernels import fused_triton
    return fused_triton.rope_write_kv(qkv, cos, sin, slot, pos, k_cache, v_cache, n_heads)


def linear_rows(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor | None = None,
                policy: KernelPolicy | None = None) -> torch.Tensor:
    """x: [R, K], w: [N, K] -> x @ w^T (+ res) [R, N]: the skinny kernel, else cuBLAS (addmm /
    linear)."""
    blocks = policy_or_default(policy, x).skinny(x, w, "plain" if res is None else "res")
    if blocks is None:
        return F.linear(x, w) if res is None else torch.addmm(res, x, w.t())
    from strata.kernels.skinny_triton import skinny_mm
    return skinny_mm(x, w, res, **blocks)


def norm_linear_rows(x: torch.Tensor, norm: torch.Tensor, eps: float, w: torch.Tensor,
                     policy: KernelPolicy | None = None) -> torch.Tensor:
    """rms_norm_rows, then x @ w^T: one skinny kernel with the norm folded in for a decode
    window of a large model (the qkv projection), else those two."""
    policy = policy_or_default(policy, x)
    blocks = policy.skinny(x, w, "qkv")
    if blocks is not None:
        from strata.kernels.skinny_triton import skinny_mm
        return skinny_mm(x, w, norm=norm, eps=eps, **blocks)
    return linear_rows(rms_norm_rows(x, norm, eps, policy), w, policy=policy)


def norm_head_rows(x: torch.Tensor, norm: torch.Tensor, eps: float, w: torch.Tensor,
                   policy: KernelPolicy | None = None) -> torch.Tensor | None:
    """fp32 logits rmsnorm(x) @ w^T of a block of rows, by the skinny kernel with the norm
    folded in where it takes them (a large head on CUDA), else None: the caller's cuBLAS."""
    blocks = policy_or_default(policy, x).skinny(x, w, "head")
    if blocks is None:
        return None
    from strata.kernels.skinny_triton import skinny_mm
    return skinny_mm(x, w, norm=norm, eps=eps, out_dtype=torch.float32, **blocks)


def norm_gate_up_silu(x: torch.Tensor, norm: torch.Tensor, eps: float, w: torch.Tensor,
                      policy: KernelPolicy | None = None) -> torch.Tensor:
    """rms_norm_rows, the [gate; up] projection and silu_mul: one skinny kernel for a decode
    window of a large model (skinny_triton.gate_up_silu), else those three."""
    policy = policy_or_default(policy, x)
    blocks = policy.skinny(x, w, "gate_up")
    if blocks is not None:
        from strata.kernels.skinny_triton import gate_up_silu
        return gate_up_silu(x, w, norm, eps, **blocks)
    return silu_mul(linear_rows(rms_norm_rows(x, norm, eps, policy), w, policy=policy), policy)


def silu_mul(gate_up: torch.Tensor, policy: KernelPolicy | None = None) -> torch.Tensor:
    """gate_up: [R, 2F] = [gate | up] -> [R, F]: silu(gate) * up in fp32, rounded once."""
    if not policy_or_default(policy, gate_up).triton:
        return silu_mul_torch(gate_up)
    from strata.kernels import fused_triton
    return fused_triton.silu_mul(gate_up)
