"""The Gumbel noise of a token in Triton, shared by the picks of sample_triton.py
(rows that keep every token) and sorted_triton.py (filtered rows): the same
float64 arithmetic as sample.py's gumbel_noise."""
from __future__ import annotations

import triton
import triton.language as tl

# splitmix64's constants (sample.py), as unsigned 64-bit
GOLDEN = 0x9E3779B97F4A7C15
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


@triton.jit
def gumbel_noise(key, ids, GOLDEN: tl.constexpr, MIX1: tl.constexpr, MIX2: tl.constexpr):
    """sample.py's gumbel_noise (float64) for the draw's bits `key` (uint64) and token ids:
    splitmix64 of the two, its top 52 bits a uniform in (0, 1), then -log(-log(.))."""
    z = key ^ ((ids.to(tl.uint64) + 1) * GOLDEN)
    z = (z ^ (z >> 30)) * MIX1
    z = (z ^ (z >> 27)) * MIX2
    z = z ^ (z >> 31)
    v = ((z >> 12).to(tl.float64) + 0.5) * 2.220446049250313e-16   # 2**-52
    return -tl.log(-tl.log(v))
