"""The filters and the Gumbel-max pick of sorted rows (sample.py `_sample_sorted`)
in Triton: the rows that keep a top-k, a top-p or a min-p share of their tokens.

After the sort, `_sample_sorted` in torch is some hundred kernels over [rows, V] in float64
(the two float64 sums are built from whole-column adds, the noise's hash from int64 ones); on
an H200 they took a last stage about 2.5 ms of GPU time a window for SmolLM2's 49,152 tokens.
Here one program takes a sorted row in blocks, in order:

1. where top-p or min-p is on, the sum Z of e = exp(scaled - scaled[0]) over the top-k;
2. then the running sum of e / Z: the first column where it reaches top-p, and the number of
   columns with e / Z at least min-p times the first's;
3. then, over the kept columns only, the largest scaled logit plus its token's noise, the
   first column among equals, as `_gumbel_pick`.

The arithmetic is `_sample_sorted`'s, in float64; only the two sums associate differently
(in blocks, each in the order Triton reduces it, the blocks in column order: an order fixed by
V, whatever the other rows), so a token can differ from it only where a top-p or min-p cut
falls within a few ulps of a sum, as `_sample_sorted` itself differs from sample_row.
NaN and infinities follow from the same float64 steps: where the first scaled logit is not
finite, every probability is NaN, every comparison fails, and so top-p keeps the top-k and
min-p the first column.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.sampling.gumbel_triton import GOLDEN, MIX1, MIX2, gumbel_noise

BLOCK = 1024   # the columns a program takes at once


@triton.jit(do_not_specialize=["stride_p"], do_not_specialize_on_alignment=["p_ptr"])
def _pick_sorted(v_ptr, o_ptr, stride_v, p_ptr, stride_p, out_ptr, keep_ptr, V,
                 GOLDEN: tl.constexpr, MIX1: tl.constexpr, MIX2: tl.constexpr,
                 WRITE_KEEP: tl.constexpr, BLOCK: tl.constexpr):
    """Program i: row i of the sorted logits v and their token ids o ([n, V], one stride);
    p: [5, n] float64 (temperature > 0, top_k, top_p, min_p, u), field f of row i at
    p_ptr + f * stride_p + i. Writes the picked token id at out_ptr + i (and with WRITE_KEEP
    the number of kept columns at keep_ptr + i)."""
    i = tl.program_id(0)
    row = i.to(tl.int64) * stride_v
    t = tl.load(p_ptr + i)
    top_k = tl.load(p_ptr + stride_p + i)
    top_p = tl.load(p_ptr + 2 * stride_p + i)
    min_p = tl.load(p_ptr + 3 * stride_p + i)
    key = tl.load(p_ptr + 4 * stride_p + i).to(tl.uint64, bitcast=True)
    k = tl.where((top_k > 0) & (top_k < V), top_k, V).to(tl.int64)
    s0 = tl.load(v_ptr + row).to(tl.float32).to(tl.float64) / t
    keep = k
    if (top_p < 1.0) | (min_p > 0.0):
        z = tl.zeros([], tl.float64)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK).to(tl.int64)
            e = _kept_exp(v_ptr, row, cols, V, k, t, s0)
            z += tl.sum(tl.where(cols < V, e, 0.0), 0)
        p0 = tl.exp(s0 - s0) / z           # the first column's probability (NaN with s0)
        carry = tl.zeros([], tl.float64)
        first = tl.zeros([], tl.int64) + V  # the first column whose running sum reaches top_p
        above = tl.zeros([], tl.int64)     # columns of probability >= min_p * p0
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK).to(tl.int64)
            inside = cols < V
            probs = tl.where(inside, _kept_exp(v_ptr, row, cols, V, k, t, s0) / z, 0.0)
            cum = carry + tl.cumsum(probs, 0)
            carry = tl.sum(tl.where(tl.arange(0, BLOCK) == BLOCK - 1, cum, 0.0), 0)
            first = tl.minimum(first, tl.min(tl.where((cum >= top_p) & inside, cols, V), 0))
            above += tl.sum(((probs >= min_p * p0) & inside).to(tl.int64), 0)
        if top_p < 1.0:
            keep = tl.minimum(keep, first + 1)
        if min_p > 0.0:
            keep = tl.minimum(keep, tl.maximum(above, 1))
    best = tl.full([], float("-inf"), tl.float64)
    best_at = tl.full([], -1, tl.int64)    # none yet
    for start in range(0, keep, BLOCK):
        cols = start + tl.arange(0, BLOCK).to(tl.int64)
        kept = cols < keep
        x = tl.load(v_ptr + row + cols, mask=kept, other=float("-inf")).to(tl.float32)
        ids = tl.load(o_ptr + row + cols, mask=kept, other=0)
        score = x.to(tl.float64) / t + gumbel_noise(key, ids, GOLDEN, MIX1, MIX2)
        score = tl.where((score != score) | ~kept, float("-inf"), score)
        s = tl.max(score, 0)
        s_at = tl.min(tl.where((score == s) & kept, cols, V), 0)
        best_at = tl.where((s > best) | (best_at < 0), s_at, best_at)
        best = tl.maximum(best, s)
    tl.store(out_ptr + i, tl.load(o_ptr + row + best_at))
    if WRITE_KEEP:
        tl.store(keep_ptr + i, keep)


@triton.jit
def _kept_exp(v_ptr, row, cols, V, k, t, s0):
    """exp(scaled - s0) of the columns, 0 past the top-k (scaled there is -inf)."""
    x = tl.load(v_ptr + row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    scaled = tl.where(cols < k, x.to(tl.float64) / t, float("-inf"))
    return tl.exp(scaled - s0)


def pick_sorted_triton(values: torch.Tensor, order: torch.Tensor, params: torch.Tensor,
                       keep: torch.Tensor | None = None) -> torch.Tensor:
    """_sample_sorted's picks [n] (int64) for rows sorted by logit descending, ties by token
    id: values [n, V] (fp32, bf16 or fp16) and their token ids order [n, V] (int64, the same
    strides), with params [5, n] float64 (temperature, top_k, top_p, min_p, u; every
    temperature above 0), all on one device. One kernel, no host wait. With keep (int64 [n]),
    each row's number of kept columns is written there too (kept_columns_torch's)."""
    n, vocab = values.shape
    values, order, params = values.contiguous(), order.contiguous(), params.contiguous()
    out = torch.empty(n, dtype=torch.long, device=values.device)
    if n:
        _pick_sorted[(n,)](values, order, values.stride(0), params, params.stride(0), out,
                           out if keep is None else keep, vocab, GOLDEN=GOLDEN, MIX1=MIX1,
                           MIX2=MIX2, WRITE_KEEP=keep is not None, BLOCK=BLOCK, num_warps=4)
    return out
