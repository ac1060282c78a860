"""Fixed-order attention of window rows over their slots' KV, split over keys (flash-decoding).

A row's keys are cut by absolute position into splits of SPLIT positions (a multiple of
BLOCK_N, one constant for every call of a stage, never chosen from the rows): split j holds
keys [j SPLIT, (j + 1) SPLIT).
With a window a row attends keys [first, length), first = max(length - window, 0), so its
splits are lo = first // SPLIT .. hi - 1, hi = cdiv(length, SPLIT) (a pad row, length 0, has
the one empty split 0, whose output is zero). The grid is (rows, kv heads, cdiv(ctx, SPLIT)),
fixed by the cache's shape, and lengths are read from a tensor, so the launch can be captured
in a CUDA graph; a program whose split is not one of its row's returns at once.

A split's program loads the row's query heads of its kv head and walks the split's keys in
blocks of BLOCK_N, in order, with an online softmax (fp32 running max m, sum s and
accumulator acc). A row of one split writes acc / s itself. Otherwise each split writes
(m, s, acc) to a scratch buffer and arrives at the (row, kv head) tile's counter with the
row's split count (kernels.arrive); the last program to arrive combines the splits in split
order, never arrival order: M = max_i m_i, out = sum_i acc_i 2^(m_i - M) / sum_i s_i
2^(m_i - M), each sum an fma chain from zero. Where no counters exist (kernels.arrive) a
second kernel combines them with the same helper, so the bits are the same. The scratch,
R cdiv(ctx, SPLIT) H (hd + 2) fp32, is about GROUP / SPLIT of a bf16 slot's cache of one
layer a row.

Every program reads only its own row, the split rule and the combine order depend only on
the row's length, so a row's bits depend on its q, keys and length alone, never on the
window's row count, other rows or arrival order (DESIGN.md, exactness 1 and 2).

With int8 activations whichever program writes a row's output also quantizes it for the o
projection's int8 kernels (kernels.quant: their Codes and the row quantizer's arithmetic).

Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from strata.kernels import arrive as arrival
from strata.kernels.arrive import arrive
from strata.kernels.pdl import enter, launch_options
from strata.kernels.quant.a8 import Codes
from strata.kernels.quant.a8_gemv import quantize_blocks

BLOCK_N = 128  # key positions per step
SPLIT = 256    # key positions per split: 2048 keys on 8 kv heads are 64 programs a row
NO_WINDOW = 1 << 30   # the window of a row that attends all its keys
STAGES = 3     # loads in flight (H200, llama3-8b heads, one split a row: 5.1 us at 256 keys
               # and 24 us at 2048, against 6.9 and 53 us with 64 positions and 2 stages)


@triton.jit
def _splits(len_ptr, row, window, SPLIT: tl.constexpr):
    """The row's length, its first key and its splits [lo, hi) (a pad row: [0, 1))."""
    n_keys = tl.load(len_ptr + row)          # 0 for a pad row
    first = tl.maximum(n_keys - window, 0)
    lo = first // SPLIT
    return n_keys, first, lo, tl.maximum((n_keys + SPLIT - 1) // SPLIT, lo + 1)


@triton.jit
def _write_rows(out, row, g, head, d, gd_mask, out_ptr, stride_or, stride_oh,
                cq_ptr, cqp_ptr, cdx_ptr, cqs_ptr, cdc_ptr, n_out,
                GROUP: tl.constexpr, HD: tl.constexpr, BLOCK_G: tl.constexpr,
                CODES: tl.constexpr):
    """Stores the row's heads out [BLOCK_G, BLOCK_D] (fp32) in out's dtype; with CODES (HD
    whole blocks of 32, BLOCK_D = HD) also quantized as quantize_rows quantizes [R, n_out]."""
    out = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_or + head[:, None] * stride_oh + d[None, :], out,
             mask=gd_mask)
    if CODES:   # head g's HD values are blocks head * HD / 32 .. of the output row
        quantize_blocks(out.to(tl.float32), g * 0 + row, g < GROUP, head * (HD // 32), n_out,
                        cq_ptr, cqp_ptr, cdx_ptr, cqs_ptr, cdc_ptr, BLOCK_G, HD // 32)


@triton.jit
def _combine(acc_ptr, ms_ptr, row, head, g_ok, d, gd_mask, lo, hi, n_parts, n_heads,
             HD: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """The row's heads [BLOCK_G, BLOCK_D] from its splits lo .. hi - 1, taken in that order.
    acc: [R, n_parts, H, HD], ms: [R, n_parts, 2, H] (m, s) fp32."""
    part = row.to(tl.int64) * n_parts
    big = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for i in range(lo, hi):
        m_i = tl.load(ms_ptr + (part + i) * 2 * n_heads + head, mask=g_ok, other=0.0,
                      cache_modifier=".cg")
        big = tl.maximum(big, m_i)
    num = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_G], tl.float32)
    for i in range(lo, hi):
        at = (part + i) * 2 * n_heads + head
        w = tl.exp2(tl.load(ms_ptr + at, mask=g_ok, other=0.0, cache_modifier=".cg") - big)
        s_i = tl.load(ms_ptr + at + n_heads, mask=g_ok, other=0.0, cache_modifier=".cg")
        acc_i = tl.load(acc_ptr + ((part + i) * n_heads + head[:, None]) * HD + d[None, :],
                        mask=gd_mask, other=0.0, cache_modifier=".cg")
        den = tl.fma(s_i, w, den)
        num = tl.fma(acc_i, w[:, None], num)
    return num / tl.where(den > 0, den, 1.0)[:, None]     # padding heads: 0 / 1


@triton.jit
def _attend_split_kernel(q_ptr, k_ptr, v_ptr, out_ptr, slot_ptr, len_ptr, acc_ptr, ms_ptr,
                         count_ptr, cq_ptr, cqp_ptr, cdx_ptr, cqs_ptr, cdc_ptr, n_out, n_heads,
                         stride_qr, stride_qh, stride_or, stride_oh,
                         stride_cs, stride_ch, stride_cp,
                         qk_scale, window,
                         GROUP: tl.constexpr, HD: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                         PRECISION: tl.constexpr, COUNTED: tl.constexpr,
                         CODES: tl.constexpr, PDL: tl.constexpr):
    """Split j of a (row, kv head): see the module. COUNTED: count_ptr holds the tiles'
    counters and the last split to arrive combines; otherwise _combine_kernel does."""
    enter(PDL)
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    j = tl.program_id(2)
    n_parts = tl.num_programs(2)
    n_keys, first, lo, hi = _splits(len_ptr, row, window, SPLIT)
    if (j < lo) | (j >= hi):
        return
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
    # keys [first, n_keys) of the split, from the block holding its first key: never a block
    # of masked keys only (no -inf - -inf); a pad row's split has no block
    begin = tl.maximum(j * SPLIT, (first // BLOCK_N) * BLOCK_N)
    for start in range(begin, tl.minimum((j + 1) * SPLIT, n_keys), BLOCK_N):
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
    if hi - lo == 1:    # the row's one split: its output (a pad row's stays zero)
        _write_rows(acc / tl.where(s > 0, s, 1.0)[:, None], row, g, head, d, gd_mask,
                    out_ptr, stride_or, stride_oh, cq_ptr, cqp_ptr, cdx_ptr, cqs_ptr, cdc_ptr,
                    n_out, GROUP, HD, BLOCK_G, CODES)
    else:
        part = row.to(tl.int64) * n_parts + j
        tl.store(acc_ptr + (part * n_heads + head[:, None]) * HD + d[None, :], acc,
                 mask=gd_mask)
        tl.store(ms_ptr + part * 2 * n_heads + head, m, mask=g < GROUP)
        tl.store(ms_ptr + part * 2 * n_heads + n_heads + head, s, mask=g < GROUP)
        if COUNTED:
            if arrive(count_ptr + row * tl.num_programs(1) + kvh, hi - lo):
                out = _combine(acc_ptr, ms_ptr, row, head, g < GROUP, d, gd_mask, lo, hi,
                               n_parts, n_heads, HD, BLOCK_G, BLOCK_D)
                _write_rows(out, row, g, head, d, gd_mask, out_ptr, stride_or, stride_oh,
                            cq_ptr, cqp_ptr, cdx_ptr, cqs_ptr, cdc_ptr, n_out, GROUP, HD,
                            BLOCK_G, CODES)


@triton.jit
def _combine_kernel(out_ptr, len_ptr, acc_ptr, ms_ptr, cq_ptr, cqp_ptr, cdx_ptr, cqs_ptr,
                    cdc_ptr, n_out, n_heads, n_parts, stride_or, stride_oh, window,
                    GROUP: tl.constexpr, HD: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, CODES: tl.constexpr,
                    PDL: tl.constexpr):
    """The output of a (row, kv head) of several splits, where no counters exist."""
    enter(PDL)
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    _, _, lo, hi = _splits(len_ptr, row, window, SPLIT)
    if hi - lo == 1:    # written by its one split
        return
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gd_mask = (g[:, None] < GROUP) & (d[None, :] < HD)
    head = kvh * GROUP + g
    out = _combine(acc_ptr, ms_ptr, row, head, g < GROUP, d, gd_mask, lo, hi, n_parts,
                   n_heads, HD, BLOCK_G, BLOCK_D)
    _write_rows(out, row, g, head, d, gd_mask, out_ptr, stride_or, stride_oh,
                cq_ptr, cqp_ptr, cdx_ptr, cqs_ptr, cdc_ptr, n_out, GROUP, HD, BLOCK_G, CODES)


def attend_rows_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot: torch.Tensor, length: torch.Tensor, scale: float | None = None,
                       window: int = 0, codes: Codes | None = None,
                       split: int = SPLIT) -> torch.Tensor:
    """q: [R, H, hd] (rotated; last dim contiguous); k_cache, v_cache: [S, KVH, ctx, hd]
    contiguous, already holding every row's own key/value; slot: [R] int64 (any valid slot for
    a pad row); length: [R] int64, keys [0, length) are attended (0 for a pad row, whose output
    is zero); scale: the scores' (default 1/sqrt(hd)); window: keys [length - window,
    length) (0: all). Returns [R, H, hd] in q's dtype. codes: Codes [R, H hd] to fill with
    those rows quantized (a8_triton.quantize_rows' bits), in the kernel where hd is a power
    of two of whole blocks of 32. split: key positions per split, a multiple of BLOCK_N (the
    bits depend on it: one value for a stage)."""
    n_rows, n_heads, hd = q.shape
    n_kv, ctx = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.stride() == v_cache.stride()
    assert split % BLOCK_N == 0, f"split {split} is not a multiple of {BLOCK_N}"
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    n_parts = triton.cdiv(ctx, split)
    # scratch of the rows of several splits: acc [R, n_parts, H, hd], (m, s) [R, n_parts, 2, H]
    scratch = torch.empty(n_rows * n_parts * n_heads * (hd + 2), dtype=torch.float32,
                          device=q.device)
    acc, ms = scratch.split([n_rows * n_parts * n_heads * hd, n_rows * n_parts * n_heads * 2])
    count = arrival.counters(q.device, n_rows * n_kv) if n_parts > 1 else None
    # exp2 instead of exp: fold log2(e) into the score scale
    qk_scale = (scale or 1.0 / math.sqrt(hd)) * 1.4426950408889634
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is moot for bf16/fp16
    block_g = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(hd))
    fused = codes is not None and hd % 32 == 0 and block_d == hd
    c = codes if fused else Codes(out, out, out, out, out)   # not written
    window = window or NO_WINDOW
    _attend_split_kernel[(n_rows, n_kv, n_parts)](
        q, k_cache, v_cache, out, slot, length, acc, ms, out if count is None else count,
        c.q, c.qp, c.dx, c.qs, c.dc, n_heads * hd, n_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        qk_scale, window,
        GROUP=group, HD=hd, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=BLOCK_N, SPLIT=split,
        PRECISION=precision, COUNTED=count is not None, CODES=fused,
        num_warps=4, num_stages=STAGES, **launch_options(q.device))
    if count is None and n_parts > 1:
        _combine_kernel[(n_rows, n_kv)](
            out, length, acc, ms, c.q, c.qp, c.dx, c.qs, c.dc, n_heads * hd, n_heads, n_parts,
            out.stride(0), out.stride(1), window,
            GROUP=group, HD=hd, BLOCK_G=block_g, BLOCK_D=block_d, SPLIT=split, CODES=fused,
            num_warps=4, **launch_options(q.device))
    if codes is not None and not fused:
        from strata.kernels.quant.a8_triton import quantize_rows
        rows = quantize_rows(out.view(n_rows, -1))
        for plane in ("q", "qp", "dx", "qs", "dc"):
            getattr(codes, plane).copy_(getattr(rows, plane))
    return out
