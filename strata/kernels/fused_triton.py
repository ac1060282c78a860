"""Triton versions of strata.kernels.fused (see there; these are imported only when used).

One program per row (rms_norm_rows), per (row, head) (rope_write_kv, with qwen3's and gemma3's
head norms in it; off CUDA a row's heads in one) or per (row, block of columns) (silu_mul, SiLU
or the tanh GELU as the gate's activation); fixed block sizes and warps for a given shape, no
autotuning: the same inputs give the same bits, and a row never reads another row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.pdl import enter, launch_options


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps,
                     BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    mask = d < n_cols
    x = tl.load(x_ptr + row * stride_x + d, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    y = (x * r).to(out_ptr.dtype.element_ty).to(tl.float32)   # rounded before the weight
    w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + d, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n_rows, n_cols = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(n_rows,)](x, weight, out, x.stride(0), out.stride(0), n_cols, eps,
                                BLOCK_D=block, num_warps=8 if block >= 4096 else 4,
                                **launch_options(x.device))
    return out


@triton.jit
def _rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, pos_ptr, q_ptr, k_ptr, v_ptr,
                    qn_ptr, kn_ptr, eps, stride_qkv, stride_table, stride_cs, stride_ch,
                    stride_cp, N_HEADS: tl.constexpr, N_KV: tl.constexpr, HD: tl.constexpr,
                    HALF_ROPE: tl.constexpr, BLOCK_HALF: tl.constexpr, HALVES: tl.constexpr,
                    NORM: tl.constexpr, HEADS: tl.constexpr, PDL: tl.constexpr):
    """HEADS heads of a row a program (rope_write_kv: 1 on CUDA), a head a row of the tile:
    [0, H) query heads, [H, H + KVH) kv heads, past them none. NORM (qwen3, gemma3): each q
    and k head RMS-normed first (weights qn, kn [HD]), as _rms_norm_kernel norms a row of HD."""
    enter(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]     # [HEADS, 1]
    is_q = head < N_HEADS
    is_kv = (head >= N_HEADS) & (head < N_HEADS + N_KV)
    pos = tl.load(pos_ptr + row)
    i = tl.arange(0, BLOCK_HALF)[None, :]    # pair index: elements 2i, 2i + 1 (HALVES: the
    pair = i < HD // 2                       # rotated i, i + HALF_ROPE, then the rest as
    rot = i < HALF_ROPE                      # pairs past the rotated dims)
    c = tl.load(cos_ptr + pos * stride_table + i, mask=rot, other=1.0)
    s = tl.load(sin_ptr + pos * stride_table + i, mask=rot, other=0.0)
    if HALVES:   # element a of pair i; past the rotated dims, pairs of the unrotated rest
        a0 = tl.where(rot, i, 2 * i)
        a1 = tl.where(rot, i + HALF_ROPE, 2 * i + 1)
    else:
        a0 = 2 * i
        a1 = 2 * i + 1
    src = qkv_ptr + row * stride_qkv + head * HD
    ok = pair & (is_q | is_kv)
    x0 = tl.load(src + a0, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(src + a1, mask=ok, other=0.0).to(tl.float32)
    d = tl.arange(0, 2 * BLOCK_HALF)[None, :]
    if NORM:   # the head's sum of squares over the head in order, as the norm kernel takes it
        x = tl.load(src + d, mask=(d < HD) & (is_q | is_kv), other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=1)[:, None] / HD + eps)
        dtype = q_ptr.dtype.element_ty
        w_ptr = tl.where(is_q, qn_ptr, kn_ptr)            # [HEADS, 1]: the head's weights
        w0 = tl.load(w_ptr + a0, mask=ok, other=0.0).to(tl.float32)
        w1 = tl.load(w_ptr + a1, mask=ok, other=0.0).to(tl.float32)
        x0 = ((x0 * r).to(dtype).to(tl.float32) * w0).to(dtype).to(tl.float32)
        x1 = ((x1 * r).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    y0 = (x0 * c - x1 * s).to(q_ptr.dtype.element_ty)
    y1 = (x0 * s + x1 * c).to(q_ptr.dtype.element_ty)
    dst = q_ptr + (row * N_HEADS + head) * HD
    tl.store(dst + a0, y0, mask=pair & is_q)
    tl.store(dst + a1, y1, mask=pair & is_q)
    kvh = tl.maximum(head - N_HEADS, 0)
    at = tl.load(slot_ptr + row) * stride_cs + kvh * stride_ch + pos * stride_cp
    tl.store(k_ptr + at + a0, y0, mask=pair & is_kv)
    tl.store(k_ptr + at + a1, y1, mask=pair & is_kv)
    v = tl.load(qkv_ptr + row * stride_qkv + (N_HEADS + N_KV + kvh) * HD + d,
                mask=(d < HD) & is_kv)
    tl.store(v_ptr + at + d, v, mask=(d < HD) & is_kv)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot: torch.Tensor,
                  pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  n_heads: int, halves: bool = False,
                  head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                  heads: int | None = None) -> torch.Tensor:
    """head_norms (q's weight, k's, eps): each q and k head RMS-normed before its RoPE, in
    the same program (no norm kernels, no copies). heads: a program's heads, a power of two;
    default one on CUDA, and off CUDA all of a row's (Triton's interpreter runs a program at a
    time in Python, so its time goes with the programs); the same bits any way, but on CUDA
    with head_norms a tile of several heads sums a head's squares in another order."""
    n_rows = qkv.shape[0]
    n_kv, hd = k_cache.shape[1], k_cache.shape[3]
    assert qkv.stride(1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert cos.is_contiguous() and sin.is_contiguous() and cos.dtype == torch.float32
    q = torch.empty(n_rows, n_heads, hd, dtype=qkv.dtype, device=qkv.device)
    qn, kn, eps = head_norms if head_norms is not None else (qkv, qkv, 0.0)
    assert head_norms is None or (qn.is_contiguous() and kn.is_contiguous())
    if heads is None:
        heads = 1 if qkv.device.type == "cuda" else triton.next_power_of_2(n_heads + n_kv)
    _rope_kv_kernel[(n_rows, triton.cdiv(n_heads + n_kv, heads))](
        qkv, cos, sin, slot, pos, q, k_cache, v_cache, qn, kn, eps,
        qkv.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        N_HEADS=n_heads, N_KV=n_kv, HD=hd, HALF_ROPE=cos.shape[1],
        BLOCK_HALF=triton.next_power_of_2(hd // 2), HALVES=halves,
        NORM=head_norms is not None, HEADS=heads, num_warps=1, **launch_options(qkv.device))
    return q


ACTS = {"silu": 0, "gelu_tanh": 1}   # the ACT constexpr of the gated feed-forward kernels


@triton.jit
def gate_act(g, ACT: tl.constexpr):
    """fp32: silu(g) (ACT 0), or tanh-approximated GELU (ACT 1: gemma's GeGLU), tanh as
    1 - 2 / (exp(2z) + 1) (no tanh in every Triton version). Its one fused product and sum is
    written out (tl.fma), so kernels compiled with and without FP fusion agree."""
    if ACT == 1:
        z = 0.7978845608028654 * tl.fma(0.044715 * g * g, g, g)
        return 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    return g / (1.0 + tl.exp(-g))


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, stride_gu, stride_o, BLOCK: tl.constexpr,
                     ACT: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    row = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = j < n_cols
    g = tl.load(gu_ptr + row * stride_gu + j, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + j, mask=mask, other=0.0).to(tl.float32)
    y = gate_act(g, ACT) * u
    tl.store(out_ptr + row * stride_o + j, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    n_rows, n_cols = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(1) == 1
    out = torch.empty(n_rows, n_cols, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](
        gate_up, out, n_cols, gate_up.stride(0), out.stride(0), BLOCK=block, ACT=ACTS[act],
        num_warps=4, **launch_options(out.device))
    return out
