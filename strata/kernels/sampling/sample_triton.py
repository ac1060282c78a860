"""The Gumbel-max pick of rows that keep every token (sample.py `pick_unfiltered`)
in Triton.

pick_unfiltered in torch is some twenty kernels over [rows, V] in float64 (the hash of each
token's noise is a chain of int64 operations); on an H200 they took a last stage about 0.3 ms
of GPU time a window for SmolLM2's 49,152 tokens, most of it launches. Here a program walks
a chunk of a row's vocabulary in blocks, in order, computing each token's scaled logit plus its
noise in float64 exactly as pick_unfiltered does (the same splitmix64 hash of (u, id), the
same float64 division and logs), and keeps the largest score with the first index among
equals; the maximum and its first index do not depend on the order blocks are combined in, so
the pick is pick_unfiltered's wherever the float64 log gives the same bits. A second kernel
joins each row's chunks (chunks, not one program a row: that left most of the GPU idle for a
window of a few rows).

NaN and infinities as there: a NaN score never wins, +inf does (the lowest id among several),
a row with no score above -inf (or a temperature of 0) takes the first index of its maximum
logit, NaN ranking first as in torch.argmax.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.sampling.gumbel_triton import GOLDEN, MIX1, MIX2, gumbel_noise
from strata.kernels.sampling.sorted_triton import pick_sorted_triton

CHUNK = 4096   # a program's share of a row: SmolLM2's 49,152 tokens make 12 programs a row
BLOCK = 1024   # the columns a program takes at once
# Strides and the temperature, draw and row pointers are not specialised on: each caller's
# layout (a row of (index, temperature, draw), a [2, n] or an [n, 2] block) would otherwise
# compile a kernel of its own, some only for an odd n. So one kernel per logits dtype, with
# rows and without, serves them all, and compile_picks compiles those before serving.
@triton.jit(do_not_specialize=["stride_r", "stride_t", "stride_u"],
            do_not_specialize_on_alignment=["rows_ptr", "t_ptr", "u_ptr"])
def _pick_part(x_ptr, stride_x, rows_ptr, stride_r, t_ptr, stride_t, u_ptr, stride_u, best_ptr,
               at_ptr, V, CHUNKS, GOLDEN: tl.constexpr, MIX1: tl.constexpr, MIX2: tl.constexpr,
               HAS_ROWS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, c): pick i's columns [c * CHUNK, (c + 1) * CHUNK), in blocks, in order.
    Writes, at [i, c]: the best score and its first column, the largest logit (NaN aside) and
    its first column, and the first NaN logit's column (V + CHUNK where none)."""
    i = tl.program_id(0)
    c = tl.program_id(1)
    row = i.to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + i * stride_r).to(tl.int64)
    t = tl.load(t_ptr + i * stride_t)
    key = tl.load(u_ptr + i * stride_u).to(tl.uint64, bitcast=True)
    divisor = tl.where(t > 0, t, 1.0)
    big = V + CHUNK                                  # past every column: "none"
    best = tl.full([], float("-inf"), tl.float64)
    best_at = tl.full([], big, tl.int64)
    top = tl.full([], float("-inf"), tl.float32)     # the largest logit (not NaN)
    top_at = tl.full([], big, tl.int64)
    nan_at = tl.full([], big, tl.int64)              # the first NaN logit
    for start in range(0, CHUNK, BLOCK):
        cols = c * CHUNK + start + tl.arange(0, BLOCK).to(tl.int64)
        inside = cols < V
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside,
                    other=float("-inf")).to(tl.float32)   # exact from bf16 and fp16
        # greedy: the first index of the maximum, NaN first
        nan_at = tl.minimum(nan_at, tl.min(tl.where((x != x) & inside, cols, big), 0))
        finite = tl.where(x != x, float("-inf"), x)
        m = tl.max(finite, 0)
        m_at = tl.min(tl.where((finite == m) & inside, cols, big), 0)
        top_at = tl.where((m > top) | (top_at == big), m_at, top_at)
        top = tl.maximum(top, m)
        score = x.to(tl.float64) / divisor + gumbel_noise(key, cols, GOLDEN, MIX1, MIX2)
        score = tl.where((score != score) | ~inside, float("-inf"), score)
        s = tl.max(score, 0)
        s_at = tl.min(tl.where((score == s) & inside, cols, big), 0)
        best_at = tl.where((s > best) | (best_at == big), s_at, best_at)
        best = tl.maximum(best, s)
    out = i * CHUNKS + c
    tl.store(best_ptr + 2 * out, best)
    tl.store(best_ptr + 2 * out + 1, top.to(tl.float64))
    tl.store(at_ptr + 3 * out, best_at)
    tl.store(at_ptr + 3 * out + 1, top_at)
    tl.store(at_ptr + 3 * out + 2, nan_at)


@triton.jit(do_not_specialize=["stride_t"], do_not_specialize_on_alignment=["t_ptr"])
def _pick_join(t_ptr, stride_t, best_ptr, at_ptr, out_ptr, CHUNKS, BIG,
               CHUNKS_BLOCK: tl.constexpr):
    """Program i: pick i from its chunks' results. Each chunk's column is the first of its
    value there and chunks come in column order, so among equal values the least column is
    the row's first."""
    i = tl.program_id(0)
    c = tl.arange(0, CHUNKS_BLOCK)
    part = i * CHUNKS + c
    inside = c < CHUNKS
    best = tl.load(best_ptr + 2 * part, mask=inside, other=float("-inf"))
    top = tl.load(best_ptr + 2 * part + 1, mask=inside, other=float("-inf"))
    best_at = tl.load(at_ptr + 3 * part, mask=inside, other=BIG)
    top_at = tl.load(at_ptr + 3 * part + 1, mask=inside, other=BIG)
    nan_at = tl.min(tl.load(at_ptr + 3 * part + 2, mask=inside, other=BIG), 0)
    b = tl.max(best, 0)
    b_at = tl.min(tl.where(best == b, best_at, BIG), 0)
    m = tl.max(top, 0)
    m_at = tl.min(tl.where(top == m, top_at, BIG), 0)
    greedy = tl.where(nan_at < BIG, nan_at, m_at)
    t = tl.load(t_ptr + i * stride_t)
    tl.store(out_ptr + i, tl.where((t > 0) & (b > float("-inf")), b_at, greedy))


def pick_unfiltered_triton(x: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                           rows: torch.Tensor | None = None) -> torch.Tensor:
    """pick_unfiltered's picks [n] (int64) for logits x [N, V] (fp32, bf16 or fp16): pick i
    is row rows[i] of x (rows: n indices, any number type; without rows, row i), with
    temperature[i] and u[i] (float64; each [n] or [n, 1], any stride), all on one device. Two
    kernels (a grid over rows and chunks of the vocabulary, then a join per row), no host
    wait: a CUDA graph may hold them."""
    vocab = x.shape[-1]
    n = temperature.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(n, dtype=torch.long, device=x.device)
    if not n:
        return out
    temperature, u = temperature.reshape(n), u.reshape(n)
    chunks = triton.cdiv(vocab, CHUNK)
    best = torch.empty(n, chunks, 2, dtype=torch.float64, device=x.device)
    at = torch.empty(n, chunks, 3, dtype=torch.long, device=x.device)
    has_rows = rows is not None
    rows = rows.reshape(n) if has_rows else out   # out: never read without rows
    _pick_part[(n, chunks)](x, x.stride(0), rows, rows.stride(0), temperature,
                            temperature.stride(0), u, u.stride(0), best, at, vocab, chunks,
                            GOLDEN=GOLDEN, MIX1=MIX1, MIX2=MIX2, HAS_ROWS=has_rows,
                            CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)
    _pick_join[(n,)](temperature, temperature.stride(0), best, at, out, chunks, vocab + CHUNK,
                     CHUNKS_BLOCK=triton.next_power_of_2(chunks), num_warps=1)
    return out


def compile_picks(vocab: int, device: torch.device, dtypes: tuple[torch.dtype, ...]) -> None:
    """Compile the kernels for logits of each dtype (these, with and without rows, and the
    pick of sorted rows: sorted_triton.py), so that no request waits for a
    compilation (a last stage's warm-up: fp32 head logits, the drafter's in the model's
    dtype)."""
    t = torch.full((1,), 0.7, dtype=torch.float64, device=device)
    u = torch.full((1,), 0.5, dtype=torch.float64, device=device)
    params = torch.tensor([[0.7], [0.0], [0.9], [0.0], [0.5]], dtype=torch.float64,
                          device=device)
    for dtype in dtypes:
        x = torch.zeros(1, vocab, dtype=dtype, device=device)
        pick_unfiltered_triton(x, t, u)
        pick_unfiltered_triton(x, t, u, rows=torch.zeros(1, dtype=torch.float64, device=device))
        pick_sorted_triton(x, torch.arange(vocab, device=device)[None], params)
