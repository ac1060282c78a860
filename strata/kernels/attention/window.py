"""Attention of window rows over their slots' KV, row-independent by construction.

A row at position p of slot s attends over keys [0, p] of slot s. Its arithmetic must not
depend on which other rows share the window (DESIGN.md, exactness 1 and 2), so every row is
computed in a shape fixed by its own position alone: keys are taken in a span of
L = round_up(p + 1, SPAN) positions (those past p masked), and each (row, kv head) pair is its
own matrix product in a batched matmul. Rows with the same L share one batched call; the
batch count varies with the window, the per-element shape never does.
"""
import math

import torch

from strata.kernels.policy import KernelPolicy, policy_or_default

SPAN = 64  # key positions are read in multiples of this


def span_of(position: int, ctx: int) -> int:
    return min(ctx, (position // SPAN + 1) * SPAN)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slots: list[int], positions: list[int], scale: float | None = None,
           window: int = 0) -> torch.Tensor:
    """q: [R, H, hd] (rotated); k_cache, v_cache: [S, KVH, ctx, hd] already holding every
    row's own key/value. slots[r] == -1 marks a pad row (its output is zero). scale: the
    scores' (default 1/sqrt(hd)); window: a row at p attends keys (p - window, p] (0: all).
    Returns [R, H, hd]."""
    n_rows, n_heads, hd = q.shape
    n_kv, ctx = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv
    out = torch.zeros_like(q)
    by_span: dict[int, list[int]] = {}
    for r, (s, p) in enumerate(zip(slots, positions)):
        if s >= 0:
            by_span.setdefault(span_of(p, ctx), []).append(r)
    scale = scale or 1.0 / math.sqrt(hd)
    for span, rows in by_span.items():
        idx = torch.tensor(rows)
        slot_idx = torch.tensor([slots[r] for r in rows])
        pos = torch.tensor([positions[r] for r in rows])
        keys = k_cache[slot_idx, :, :span]                      # [n, KVH, L, hd]
        values = v_cache[slot_idx, :, :span]                    # [n, KVH, L, hd]
        qg = q[idx].view(len(rows), n_kv, group, hd)            # [n, KVH, g, hd]
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [n, KVH, g, L]
        keys_at = torch.arange(span)[None, :]
        masked = keys_at > pos[:, None]                         # [n, L]
        if window:
            masked |= keys_at <= pos[:, None] - window
        scores = scores.masked_fill(masked[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out[idx] = torch.matmul(probs, values).view(len(rows), n_heads, hd)
    return out


def attend_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot: torch.Tensor, length: torch.Tensor,
                policy: KernelPolicy | None = None, scale: float | None = None,
                window: int = 0, codes=None) -> torch.Tensor:
    """The same attention with the rows given as tensors (no host sync, graph-capturable):
    slot [R] int64, length [R] int64 = position + 1 (0 for a pad row, whose output is zero).
    With the policy's Triton kernels, the fixed-order kernel of decode_triton.py;
    otherwise `attend` (plain torch, key spans of the rows' own positions). scale, window:
    as `attend`'s. codes (the Triton path only): Codes [R, H hd] that the kernel fills with
    the output rows quantized for the int8 kernels (quant/ops.rows_codes)."""
    if policy_or_default(policy, q).triton:
        from strata.kernels.attention.decode_triton import attend_rows_triton
        return attend_rows_triton(q, k_cache, v_cache, slot, length, scale, window, codes)
    assert codes is None, "only the Triton attention quantizes its rows"
    return attend_row_tensors(q, k_cache, v_cache, slot, length, scale, window)


def attend_chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot: torch.Tensor, length: torch.Tensor,
                 policy: KernelPolicy | None = None, scale: float | None = None,
                 window: int = 0) -> torch.Tensor:
    """attend_rows for the rows of a prompt chunk: every live row (length > 0) belongs to the
    same slot; pad rows (length 0) may carry any slot and give zeros. With the policy's Triton
    kernels, the blocked kernel of chunk_triton.py, which reads each key tile once
    for a block of rows and keeps every row's bits independent of the others; otherwise
    `attend` (plain torch), as for any window."""
    if policy_or_default(policy, q).triton:
        from strata.kernels.attention.chunk_triton import attend_chunk_triton
        return attend_chunk_triton(q, k_cache, v_cache, slot, length, scale=scale,
                                   window=window)
    return attend_row_tensors(q, k_cache, v_cache, slot, length, scale, window)


def attend_row_tensors(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot: torch.Tensor, length: torch.Tensor, scale: float | None = None,
                       window: int = 0) -> torch.Tensor:
    """`attend` on rows given as tensors (a host sync: the torch fallback is never graphed).
    Reading only each row's span of keys, not the whole context, keeps a CPU decode step's
    attention proportional to the positions held."""
    lengths = length.tolist()
    slots = [s if n > 0 else -1 for s, n in zip(slot.tolist(), lengths)]
    return attend(q, k_cache, v_cache, slots, [max(n - 1, 0) for n in lengths], scale, window)


def attend_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: list[int], positions: list[int], scale: float | None = None,
                     window: int = 0) -> torch.Tensor:
    """Plain per-row softmax(q k^T * scale) v over keys [0, p] (with a window: (p - window,
    p]), in float64."""
    n_rows, n_heads, hd = q.shape
    group = n_heads // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r, (s, p) in enumerate(zip(slots, positions)):
        if s < 0:
            continue
        lo = max(0, p - window + 1) if window else 0
        keys = k_cache[s, :, lo: p + 1].double().repeat_interleave(group, dim=0)  # [H, n, hd]
        values = v_cache[s, :, lo: p + 1].double().repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hkd->hk", q[r].double(), keys) * (scale or hd ** -0.5)
        out[r] = torch.einsum("hk,hkd->hd", torch.softmax(scores, -1), values)
    return out.to(q.dtype)
