"""The Gumbel-max pick of rows that keep every token (kernels/sampling.py `pick_unfiltered`)
as one Triton kernel.

pick_unfiltered in torch is some twenty kernels over [rows, V] in float64 (the hash of each
token's noise is a chain of int64 operations); on an H200 they took a last stage about 0.3 ms
of GPU time a window for SmolLM2's 49,152 tokens, most of it launches. Here one program per
row walks the vocabulary in blocks, in order, computing each token's scaled logit plus its
noise in float64 exactly as pick_unfiltered does (the same splitmix64 hash of (u, id), the
same float64 division and logs), and keeps the largest score with the first index among
equals; the maximum and its first index do not depend on the order blocks are combined in, so
the pick is pick_unfiltered's wherever the float64 log gives the same bits.

NaN and infinities as there: a NaN score never wins, +inf does (the lowest id among several),
a row with no score above -inf (or a temperature of 0) takes the first index of its maximum
logit, NaN ranking first as in torch.argmax.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
# splitmix64's constants (sampling.py), as unsigned 64-bit
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


@triton.jit
def _pick_kernel(x_ptr, t_ptr, u_ptr, out_ptr, V, stride_x,
                 GOLDEN: tl.constexpr, MIX1: tl.constexpr, MIX2: tl.constexpr,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(t_ptr + row)
    key = tl.load(u_ptr + row).to(tl.uint64, bitcast=True)
    divisor = tl.where(t > 0, t, 1.0)
    big = V + BLOCK                        # past every column: "none" for the min below
    best = tl.full([], float("-inf"), tl.float64)
    best_at = tl.full([], 0, tl.int64)
    top = tl.full([], float("-inf"), tl.float32)   # the largest logit (not NaN)
    top_at = tl.full([], 0, tl.int64)
    nan_at = tl.full([], big, tl.int64)            # the first NaN logit
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK).to(tl.int64)
        inside = cols < V
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside,
                    other=float("-inf")).to(tl.float32)   # exact from bf16 and fp16
        # greedy: the first index of the maximum, NaN first
        nan_at = tl.minimum(nan_at, tl.min(tl.where((x != x) & inside, cols, big), 0))
        finite = tl.where(x != x, float("-inf"), x)
        m = tl.max(finite, 0)
        m_at = tl.min(tl.where((finite == m) & inside, cols, big), 0)
        top_at = tl.where(m > top, m_at, top_at)
        top = tl.maximum(top, m)
        # the noise: splitmix64 of the draw's bits and the token id (gumbel_noise)
        z = key ^ ((cols.to(tl.uint64) + 1) * GOLDEN)
        z = (z ^ (z >> 30)) * MIX1
        z = (z ^ (z >> 27)) * MIX2
        z = z ^ (z >> 31)
        v = ((z >> 12).to(tl.float64) + 0.5) * 2.220446049250313e-16   # 2**-52
        score = x.to(tl.float64) / divisor - tl.log(-tl.log(v))
        score = tl.where((score != score) | (cols >= V), float("-inf"), score)
        s = tl.max(score, 0)
        s_at = tl.min(tl.where(score == s, cols, big), 0)
        best_at = tl.where(s > best, s_at, best_at)
        best = tl.maximum(best, s)
    greedy = tl.where(nan_at < big, nan_at, top_at)
    pick = tl.where((t > 0) & (best > float("-inf")), best_at, greedy)
    tl.store(out_ptr + row, pick)


def pick_unfiltered_triton(x: torch.Tensor, temperature: torch.Tensor,
                           u: torch.Tensor) -> torch.Tensor:
    """pick_unfiltered's picks [n] (int64) for logits x [n, V] (fp32, bf16 or fp16),
    temperature and u [n, 1] (float64), all on one device: one kernel, no host wait (a CUDA
    graph may hold it)."""
    n, vocab = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(n, dtype=torch.long, device=x.device)
    if n:
        _pick_kernel[(n,)](x, temperature.reshape(n).contiguous(), u.reshape(n).contiguous(),
                           out, vocab, x.stride(0), GOLDEN=_GOLDEN, MIX1=_MIX1, MIX2=_MIX2,
                           BLOCK=BLOCK, num_warps=8)
    return out
