"""Fixed-order attention of window rows over their slots' KV, as one Triton kernel.

One program per (row, kv head): it loads the row's query heads of that kv group and walks the
row's own keys [0, length) in blocks of BLOCK_N positions, in order, with an online softmax
(fp32 running max, sum and accumulator). Nothing in a program depends on another row, on the
window's row count or on how rows are grouped, so the result is row-independent by construction
(DESIGN.md, exactness 1 and 2), and the grid and every shape are fixed by the window's row count,
so the launch can be captured in a CUDA graph: lengths are read from a tensor, not from Python.

With int8 activations the kernel also quantizes the rows it writes for the o projection's
int8 kernels (kernels.quant: their Codes and the row quantizer's arithmetic).

Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from strata.kernels.quant.a8 import Codes
from strata.kernels.quant.a8_gemv import quantize_blocks

BLOCK_N = 128  # key positions per step
NO_WINDOW = 1 << 30   # the window of a row that attends all its keys
STAGES = 3     # loads in flight (H200, llama3-8b heads: 5.1 us at 256 keys and 24 us at 2048,
               # against 6.9 and 53 us with 64 positions and 2 stages; docs/BENCHMARKS.md)


@triton.jit
def _attend_rows_kernel(q_ptr, k_ptr, v_ptr, out_ptr, slot_ptr, len_ptr,
                        cq_ptr, cqp_ptr, cdx_ptr, cqs_ptr, n_out,
                        stride_qr, stride_qh, stride_or, stride_oh,
                        stride_cs, stride_ch, stride_cp,
                        qk_scale, window,
                        GROUP: tl.constexpr, HD: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                        CODES: tl.constexpr):
    """With CODES (HD whole blocks of 32, BLOCK_D = HD) the row's heads are also quantized for
    the int8 kernels, as quantize_rows would quantize the output rows [R, n_out]."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    n_keys = tl.load(len_ptr + row)          # 0 for a pad row
    slot = tl.load(slot_ptr + row).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gd_mask = (g[:, None] < GROUP) & (d[None, :] < HD)
    head = kvh * GROUP + g                   # the query heads that share this kv head
    q = tl.load(q_ptr + row * stride_qr + head[:, None] * stride_qh + d[None, :],
                mask=gd_mask, other=0.0)     # [BLOCK_G, BLOCK_D]
    base = slot * stride_cs + kvh * stride_ch
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)   # running max (log2 units)
    s = tl.zeros([BLOCK_G], tl.float32)                  # running sum of exp2
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # a window: keys [first, n_keys), from the block holding the first (fixed by the row's
    # own position, and never a block of masked keys only: no -inf - -inf)
    first = tl.maximum(n_keys - window, 0)
    for start in range((first // BLOCK_N) * BLOCK_N, n_keys, BLOCK_N):
        p = start + tl.arange(0, BLOCK_N)
        pd_mask = (p[:, None] < n_keys) & (p[:, None] >= first) & (d[None, :] < HD)
        offs = base + p[:, None] * stride_cp + d[None, :]
        k = tl.load(k_ptr + offs, mask=pd_mask, other=0.0)              # [BLOCK_N, BLOCK_D]
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        keep = (p[None, :] < n_keys) & (p[None, :] >= first)
        scores = tl.where(keep, scores, float("-inf"))                  # [BLOCK_G, BLOCK_N]
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        probs = tl.exp2(scores - m_new[:, None])
        s = s * alpha + tl.sum(probs, 1)
        v = tl.load(v_ptr + offs, mask=pd_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.where(s > 0, s, 1.0)[:, None]        # a pad row (no keys) stays zero
    out = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_or + head[:, None] * stride_oh + d[None, :], out,
             mask=gd_mask)
    if CODES:   # head g's HD values are blocks head * HD / 32 .. of the output row
        quantize_blocks(out.to(tl.float32), g * 0 + row, g < GROUP, head * (HD // 32), n_out,
                        cq_ptr, cqp_ptr, cdx_ptr, cqs_ptr, BLOCK_G, HD // 32)


def attend_rows_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot: torch.Tensor, length: torch.Tensor, scale: float | None = None,
                       window: int = 0, codes: Codes | None = None) -> torch.Tensor:
    """q: [R, H, hd] (rotated; last dim contiguous); k_cache, v_cache: [S, KVH, ctx, hd]
    contiguous, already holding every row's own key/value; slot: [R] int64 (any valid slot for
    a pad row); length: [R] int64, keys [0, length) are attended (0 for a pad row, whose output
    is zero); scale: the scores' (default 1/sqrt(hd)); window: keys [length - window,
    length) (0: all). Returns [R, H, hd] in q's dtype. codes: Codes [R, H hd] to fill with
    those rows quantized (a8_triton.quantize_rows' bits), in the kernel where hd is a power
    of two of whole blocks of 32."""
    n_rows, n_heads, hd = q.shape
    n_kv = k_cache.shape[1]
    group = n_heads // n_kv
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.stride() == v_cache.stride()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    # exp2 instead of exp: fold log2(e) into the score scale
    qk_scale = (scale or 1.0 / math.sqrt(hd)) * 1.4426950408889634
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is moot for bf16/fp16
    block_d = max(16, triton.next_power_of_2(hd))
    fused = codes is not None and hd % 32 == 0 and block_d == hd
    c = codes if fused else Codes(out, out, out, out)   # not written
    _attend_rows_kernel[(n_rows, n_kv)](
        q, k_cache, v_cache, out, slot, length, c.q, c.qp, c.dx, c.qs, n_heads * hd,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        qk_scale, window or NO_WINDOW,
        GROUP=group, HD=hd, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, BLOCK_N=BLOCK_N, PRECISION=precision, CODES=fused,
        num_warps=4, num_stages=STAGES)
    if codes is not None and not fused:
        from strata.kernels.quant.a8_triton import quantize_rows
        rows = quantize_rows(out.view(n_rows, -1))
        for plane in ("q", "qp", "dx", "qs"):
            getattr(codes, plane).copy_(getattr(rows, plane))
    return out
