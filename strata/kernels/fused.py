"""Fused row-wise kernels of the CUDA path (Triton), each beside its plain-torch reference.

A decode window is tiny: a stage's time is kernel launches, not arithmetic, even inside a CUDA
graph (each node costs ~1-2 us). These fuse what plain torch runs as many small kernels:

  rms_norm_rows   RMSNorm of each row (1 kernel instead of ~7)
  rope_write_kv   RoPE on q and k read from the fused qkv projection, k and v written into
                  the KV cache at (slot, position) (1 kernel instead of ~25)
  silu_mul        SiLU(gate) * up of the fused [gate; up] projection (1 instead of 3)
  linear_rows     x @ w^T (+ a residual): for a decode window (up to 64 rows) the skinny
                  Triton matmul (kernels/skinny_triton.py: nearer the HBM limit than cuBLAS at
                  these shapes, the residual add in its epilogue, and one order along K for
                  every row count); a prompt chunk's rows go to cuBLAS / torch whole (addmm /
                  linear: a chunk has a fixed shape)
  norm_linear_rows, norm_gate_up_silu, norm_head_rows
                  where the skinny kernels take the window, the norm and the projection (and
                  SiLU) as one kernel; otherwise the kernels above one after another (the
                  head: None, and the caller's matmul)

Every program handles one row (and head) and reduces in a fixed order, so results never depend
on the other rows of a window. Off CUDA (and without TRITON_INTERPRET=1) the torch versions
run: the same path computes on every device (kernels/policy.py says which runs where). A
decode window's matmul that no skinny kernel takes (the plain-torch path, or a weight shape
the kernel's blocks do not divide) runs in calls of ROW_BLOCK (8) rows, each the same shape,
and so do the torch norms of a decode window: a row's bits then do not depend on how many rows
share its window on the CPU either (a torch matmul's blocking changes with its row count).
May import: kernels.quant, kernels
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels.policy import ROW_BLOCK, KernelPolicy, policy_or_default
from strata.kernels.quant import ops as quant_ops
from strata.kernels.quant.a8 import Codes
from strata.kernels.quant.weight import QuantWeight


def by_row_blocks(fn, x: torch.Tensor, *row_args: torch.Tensor) -> torch.Tensor:
    """fn(x_block, *row_arg_blocks) over blocks of ROW_BLOCK rows of x (and of each row_arg),
    the last block padded with zero rows, the results joined and cut to x's rows: every call
    has the same shape whatever x's row count."""
    n = x.shape[0]
    if n == ROW_BLOCK:
        return fn(x, *row_args)
    pad = -n % ROW_BLOCK
    tensors = [F.pad(t, (0, 0, 0, pad)) if pad else t for t in (x, *row_args)]
    outs = [fn(*blocks) for blocks in zip(*(t.split(ROW_BLOCK) for t in tensors))]
    return torch.cat(outs)[:n]


# --- plain-torch references -----------------------------------------------------------------

def rms_norm_rows_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y.float() * weight.float()).to(x.dtype)


def rope_write_kv_torch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        slot: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, n_heads: int, halves: bool = False
                        ) -> torch.Tensor:
    """qkv: [R, (H + 2 KVH) hd]; cos, sin: the full tables [ctx, rope_dim / 2] fp32; slot, pos:
    [R] int64. Writes rotated k and v at (slot, :, pos) of the caches; returns rotated q
    [R, H, hd]. Pairs (2i, 2i+1) rotate (llama.cpp's layout of GGUF llama Q/K weights), or
    with halves (i, i + rope_dim / 2) (NEOX: the other families)."""
    n, n_kv, hd = qkv.shape[0], k_cache.shape[1], k_cache.shape[3]
    heads = qkv.view(n, n_heads + 2 * n_kv, hd)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]                      # [R, 1, rope/2]
    rope = c.shape[-1] * 2
    x = heads[:, :n_heads + n_kv].float()
    if halves:
        x0, x1 = x[..., :rope // 2], x[..., rope // 2:rope]
        rotated = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), -1)
    else:
        x0, x1 = x[..., 0:rope:2], x[..., 1:rope:2]
        rotated = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).flatten(-2)
    qk = torch.cat((rotated, x[..., rope:]), -1).to(qkv.dtype)             # [R, H + KVH, hd]
    k_cache[slot, :, pos] = qk[:, n_heads:]
    v_cache[slot, :, pos] = heads[:, n_heads + n_kv:]
    return qk[:, :n_heads].contiguous()


def silu_mul_torch(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """[gate | up] -> act(gate) * up in fp32, rounded once (act: silu, or gelu_tanh)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gated = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    return (gated * up).to(gate_up.dtype)


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
                       eps: float = 0.0, act: str = "silu") -> torch.Tensor:
    """skinny_triton.gate_up_silu's arithmetic: the projection rounded, then silu_mul."""
    return silu_mul_torch(normed_product(x, w, norm, eps).to(x.dtype), act)


# --- dispatch: the Triton kernels where the policy runs them, else the references ----------

def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  policy: KernelPolicy | None = None, decode: bool = False) -> torch.Tensor:
    """x: [R, D] -> [R, D]: x * rsqrt(mean(x^2) + eps), rounded to x's dtype, times weight.
    The Triton kernel is one program per row; the torch version takes a decode window in
    blocks of ROW_BLOCK rows."""
    if not policy_or_default(policy, x).triton:
        if decode:
            return by_row_blocks(lambda b: rms_norm_rows_torch(b, weight, eps), x)
        return rms_norm_rows_torch(x, weight, eps)
    from strata.kernels import fused_triton
    return fused_triton.rms_norm_rows(x, weight, eps)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot: torch.Tensor,
                  pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  n_heads: int, policy: KernelPolicy | None = None,
                  halves: bool = False,
                  head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                  decode: bool = False) -> torch.Tensor:
    """RoPE on q and k, k and v into the caches, q returned (rope_write_kv_torch). head_norms
    (q's norm weight, k's, eps; qwen3, gemma3): each q and k head RMS-normed first, as
    rms_norm_rows norms it (the Triton kernel does it in the same program)."""
    if not policy_or_default(policy, qkv).triton:
        if head_norms is not None:
            qkv = norm_heads(qkv, n_heads, k_cache.shape[1], head_norms, policy, decode)
        return rope_write_kv_torch(qkv, cos, sin, slot, pos, k_cache, v_cache, n_heads, halves)
    from strata.kernels import fused_triton
    return fused_triton.rope_write_kv(qkv, cos, sin, slot, pos, k_cache, v_cache, n_heads,
                                      halves, head_norms)


def norm_heads(qkv: torch.Tensor, n_heads: int, n_kv: int,
               head_norms: tuple[torch.Tensor, torch.Tensor, float],
               policy: KernelPolicy | None, decode: bool) -> torch.Tensor:
    """qkv [R, (H + 2 KVH) hd] with each q and k head RMS-normed (rms_norm_rows), v as it
    is."""
    qn, kn, eps = head_norms
    hd, n = qn.shape[0], qkv.shape[0]
    q, k, v = qkv.split([n_heads * hd, n_kv * hd, n_kv * hd], -1)
    q = rms_norm_rows(q.reshape(-1, hd), qn, eps, policy, decode)
    k = rms_norm_rows(k.reshape(-1, hd), kn, eps, policy, decode)
    return torch.cat([q.view(n, -1), k.view(n, -1), v], -1)


def linear_rows(x: torch.Tensor | Codes, w: torch.Tensor | QuantWeight,
                res: torch.Tensor | None = None, policy: KernelPolicy | None = None,
                decode: bool = False) -> torch.Tensor:
    """x: [R, K], w: [N, K] -> x @ w^T (+ res) [R, N]. decode: x is a decode window's rows
    (the skinny kernel, else the matmul in blocks of ROW_BLOCK rows); otherwise a prompt
    chunk's (addmm / linear whole). A quantized w: its kernels for a decode window, else its
    dense weight on the same path. x may come as Codes with their rows (what
    norm_gate_up_silu returns with int8 activations): the int8 kernels take the codes, any
    other path the rows."""
    codes = None
    if isinstance(x, Codes):
        codes, x = x, x.rows
    policy = policy_or_default(policy, x)
    kind = "plain" if res is None else "res"
    if isinstance(w, QuantWeight):
        out = quant_ops.project(x, w, policy, decode, kind=kind, res=res, codes=codes)
        if out is not None:
            return out
        w = quant_ops.dense_weight(w, x.dtype, policy)
    blocks = policy.skinny(x, w, kind, decode)
    if blocks is not None:
        from strata.kernels.skinny_triton import skinny_mm
        return skinny_mm(x, w, res, **blocks)
    if res is None:
        return by_row_blocks(lambda b: F.linear(b, w), x) if decode else F.linear(x, w)
    if decode:
        return by_row_blocks(lambda b, r: torch.addmm(r, b, w.t()), x, res)
    return torch.addmm(res, x, w.t())


def norm_linear_rows(x: torch.Tensor, norm: torch.Tensor, eps: float,
                     w: torch.Tensor | QuantWeight, policy: KernelPolicy | None = None,
                     decode: bool = False) -> torch.Tensor:
    """rms_norm_rows, then x @ w^T: one skinny (or quantized) kernel with the norm folded in
    for a decode window (the qkv projection), else those two."""
    policy = policy_or_default(policy, x)
    if isinstance(w, QuantWeight):
        if "qkv" in policy.fold:
            out = quant_ops.project(x, w, policy, decode, kind="qkv", norm=norm, eps=eps)
            if out is not None:
                return out
        blocks = None
    else:
        blocks = policy.skinny(x, w, "qkv", decode)
    if blocks is not None:
        from strata.kernels.skinny_triton import skinny_mm
        return skinny_mm(x, w, norm=norm, eps=eps, **blocks)
    return linear_rows(rms_norm_rows(x, norm, eps, policy, decode), w, policy=policy,
                       decode=decode)


def norm_head_rows(x: torch.Tensor, norm: torch.Tensor, eps: float,
                   w: torch.Tensor | QuantWeight,
                   policy: KernelPolicy | None = None) -> torch.Tensor | None:
    """fp32 logits rmsnorm(x) @ w^T of rows to sample (at most a decode window's), by the
    skinny (or quantized) kernel with the norm folded in where it takes them, else None: the
    caller's matmul."""
    policy = policy_or_default(policy, x)
    if isinstance(w, QuantWeight):
        return (quant_ops.project(x, w, policy, True, kind="head", norm=norm, eps=eps,
                                  out_dtype=torch.float32) if "head" in policy.fold else None)
    blocks = policy.skinny(x, w, "head", decode=True)
    if blocks is None:
        return None
    from strata.kernels.skinny_triton import skinny_mm
    return skinny_mm(x, w, norm=norm, eps=eps, out_dtype=torch.float32, **blocks)


def norm_gate_up_silu(x: torch.Tensor, norm: torch.Tensor, eps: float,
                      w: torch.Tensor | QuantWeight,
                      policy: KernelPolicy | None = None, decode: bool = False,
                      act: str = "silu") -> torch.Tensor | Codes:
    """rms_norm_rows, the [gate; up] projection and silu_mul (act: silu, or gelu_tanh for
    GeGLU): one skinny (or quantized) kernel for a decode window (skinny_triton.gate_up_silu),
    else those three. With int8 activations the rows come as Codes for linear_rows (the
    down projection), quantized in the same kernel where it can."""
    policy = policy_or_default(policy, x)
    if isinstance(w, QuantWeight):
        if "gate_up" in policy.fold:
            out = quant_ops.gate_up_silu(x, w, norm, eps, policy, decode, act)
            if out is not None:
                return out
        blocks = None
    else:
        blocks = policy.skinny(x, w, "gate_up", decode)
    if blocks is not None:
        from strata.kernels.skinny_triton import gate_up_silu
        return gate_up_silu(x, w, norm, eps, act=act, **blocks)
    h = rms_norm_rows(x, norm, eps, policy, decode)
    return silu_mul(linear_rows(h, w, policy=policy, decode=decode), policy, act)


def silu_mul(gate_up: torch.Tensor, policy: KernelPolicy | None = None,
             act: str = "silu") -> torch.Tensor:
    """gate_up: [R, 2F] = [gate | up] -> [R, F]: silu(gate) * up (act gelu_tanh: the tanh
    GELU) in fp32, rounded once."""
    if not policy_or_default(policy, gate_up).triton:
        return silu_mul_torch(gate_up, act)
    from strata.kernels import fused_triton
    return fused_triton.silu_mul(gate_up, act)
