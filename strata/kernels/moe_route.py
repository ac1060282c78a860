"""Routing of a window's rows to their experts (qwen3moe, glm4moe) as Triton kernels, with
fixed shapes and no host sync, inside a decode window's CUDA graph (the plain-torch reference:
kernels/moe.py's route; the experts themselves: moe_triton.py).

    _route         one program a row: the row's top-k experts and their weights (softmax or
                   sigmoid + correction bias within the best groups, as moe.route), best first
                   (ties: the lower expert), and a count of each expert's pairs (atomic adds of
                   integers: the same counts in any order)
    _align         one program an expert: the window's (row, rank) pairs sorted by expert and,
                   within an expert, by pair index, each expert's list padded to whole blocks of
                   BLOCK_M slots (pad slots hold the pair count, past every pair) at an offset
                   that sums the padded counts of the experts before it; each block's expert;
                   the number of blocks used. The buffers are sized for the worst case:
                   P // BLOCK_M + min(E, P) blocks of P = rows x k pairs

A row's experts and weights are its own logits' alone, so they do not depend on the window.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.pdl import enter, launch_options


@triton.jit
def _best_groups(choice, e, PER: tl.constexpr, GROUPS: tl.constexpr, CHOSEN: tl.constexpr,
                 BLOCK_G: tl.constexpr):
    """choice [BLOCK_E] with the experts outside the CHOSEN groups (of PER experts) whose best
    two choices sum highest set to -inf."""
    group = e // PER
    g = tl.arange(0, BLOCK_G)
    sums = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for i in tl.static_range(GROUPS):
        mine = tl.where(group == i, choice, float("-inf"))
        top, at = tl.max(mine, 0, return_indices=True, return_indices_tie_break_left=True)
        second = tl.max(tl.where(e == at, float("-inf"), mine), 0)
        sums = tl.where(g == i, top + second, sums)
    keep = group < 0
    for _ in tl.static_range(CHOSEN):
        _best, at = tl.max(sums, 0, return_indices=True, return_indices_tie_break_left=True)
        keep = keep | (group == at)
        sums = tl.where(g == at, float("-inf"), sums)
    return tl.where(keep, choice, float("-inf"))


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, counts_ptr, scale, stride_l,
                  E: tl.constexpr, TOPK: tl.constexpr, SIGMOID: tl.constexpr,
                  HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, CHOSEN: tl.constexpr,
                  COUNT: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_G: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    m = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    score = tl.load(logits_ptr + m * stride_l + e, mask=ok, other=0.0)
    if SIGMOID:
        score = 1.0 / (1.0 + tl.exp(-score))
    choice = score
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
    choice = tl.where(ok, choice, float("-inf"))
    if GROUPS > 1:
        choice = _best_groups(choice, e, E // GROUPS, GROUPS, CHOSEN, BLOCK_G)
    r = tl.arange(0, BLOCK_K)
    picked = tl.zeros([BLOCK_K], tl.float32)     # the chosen experts' scores (logits), in rank
    ids = tl.zeros([BLOCK_K], tl.int32)
    for i in tl.static_range(TOPK):
        _best, at = tl.max(choice, 0, return_indices=True, return_indices_tie_break_left=True)
        picked = tl.where(r == i, tl.sum(tl.where(e == at, score, 0.0), 0), picked)
        ids = tl.where(r == i, at, ids)
        choice = tl.where(e == at, float("-inf"), choice)
    used = r < TOPK
    tl.store(ids_ptr + m * TOPK + r, ids, mask=used)     # one store, one atomic add: not a
    if COUNT:                                            # round trip a rank
        tl.atomic_add(counts_ptr + ids, 1, mask=used, sem="relaxed")
    if SIGMOID:
        weights = picked / (tl.sum(tl.where(used, picked, 0.0), 0) + 1e-20)
    else:   # the renormalised top-k of a softmax: a softmax over the chosen logits
        top = tl.max(tl.where(used, picked, float("-inf")), 0)
        ex = tl.where(used, tl.exp(picked - top), 0.0)
        weights = ex / tl.sum(ex, 0)
    tl.store(w_ptr + m * TOPK + r, weights * scale, mask=used)


@triton.jit
def _align_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, n_blocks_ptr, P,
                  E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_P: tl.constexpr):
    e = tl.program_id(0)
    ee = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + ee, mask=ee < E, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(ee < e, padded, 0), 0)
    count = tl.sum(tl.where(ee == e, counts, 0), 0)
    end = start + tl.sum(tl.where(ee == e, padded, 0), 0)
    if e == 0:
        tl.store(n_blocks_ptr, tl.sum(padded, 0) // BLOCK_M)
    if count > 0:
        seen = tl.full([], 0, tl.int32)
        for p0 in range(0, P, BLOCK_P):                  # the expert's pairs, in pair order
            p = p0 + tl.arange(0, BLOCK_P)
            mine = tl.load(ids_ptr + p, mask=p < P, other=-1) == e
            rank = seen + tl.cumsum(mine.to(tl.int32), 0) - 1
            tl.store(sorted_ptr + start + rank, p, mask=mine)
            seen += tl.sum(mine.to(tl.int32), 0)
        pad = start + count + tl.arange(0, BLOCK_M)      # then pad slots up to a whole block
        tl.store(sorted_ptr + pad, P, mask=pad < end)
        for b in range(start // BLOCK_M, end // BLOCK_M):
            tl.store(block_expert_ptr + b, e)


def route(logits: torch.Tensor, k: int, bias: torch.Tensor | None = None, scale: float = 1.0,
          groups: tuple[int, int] = (1, 1), count: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logits: fp32 [M, E] router logits -> (experts int32 [M, k] best first, weights fp32
    [M, k], counts int32 [E]: each expert's pairs, which align needs; None without count).
    bias [E]: sigmoid scores chosen by score + bias (glm4moe), else a softmax's; groups as
    moe.route's."""
    m, n_experts = logits.shape
    n_groups, chosen = groups
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    assert n_experts % n_groups == 0 and k <= n_experts
    experts = torch.empty(m, k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(m, k, dtype=torch.float32, device=logits.device)
    counts = torch.zeros(n_experts, dtype=torch.int32, device=logits.device) if count else None
    _route_kernel[(m,)](
        logits, bias if bias is not None else logits, experts, weights,
        counts if count else experts, scale,
        logits.stride(0), E=n_experts, TOPK=k, SIGMOID=bias is not None,
        HAS_BIAS=bias is not None, GROUPS=n_groups, CHOSEN=chosen, COUNT=count,
        BLOCK_E=triton.next_power_of_2(n_experts), BLOCK_K=triton.next_power_of_2(k),
        BLOCK_G=triton.next_power_of_2(n_groups),
        num_warps=1 if n_experts <= 256 else 4,   # one warp: its k reductions are shuffles
        **launch_options(logits.device))
    return experts, weights, counts


def align(experts: torch.Tensor, counts: torch.Tensor, block_m: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts int32 [M, k], counts [E] -> (slots int32 [B * block_m]: the pairs (row * k +
    rank) sorted by expert, each expert's padded to whole blocks with the pair count; the
    expert of each block int32 [B]; the blocks used int32 [1]), B the most blocks M * k pairs
    can need."""
    pairs, n_experts = experts.numel(), counts.shape[0]
    max_blocks = pairs // block_m + min(n_experts, pairs)
    slots = torch.empty(max_blocks * block_m, dtype=torch.int32, device=experts.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=experts.device)
    n_blocks = torch.empty(1, dtype=torch.int32, device=experts.device)
    _align_kernel[(n_experts,)](
        experts, counts, slots, block_expert, n_blocks, pairs, E=n_experts,
        BLOCK_E=triton.next_power_of_2(n_experts), BLOCK_M=block_m,
        BLOCK_P=min(1024, triton.next_power_of_2(pairs)), num_warps=4)
    return slots, block_expert, n_blocks
