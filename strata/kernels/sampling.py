"""Sampling a token from one row of logits, given a uniform number drawn by the coordinator.

The coordinator draws u from (seed, position) with a counter-based generator, so a draw never
depends on batching, pipelining or speculation (DESIGN.md, exactness 3). This function is
pure: the same logits, parameters and u always give the same token. Filters follow
transformers' order: temperature, top-k, top-p, min-p; then inverse-CDF over the kept tokens
in a fixed order (probability descending, ties by token id).
"""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingRow:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = off
    top_p: float = 1.0        # 1 = off
    min_p: float = 0.0        # 0 = off
    u: float = 0.0            # uniform in [0, 1), drawn by the coordinator


def sample_row(logits: torch.Tensor, row: SamplingRow) -> int:
    """logits: [V] (any float dtype, any device: with top_k only the k candidates leave it;
    the arithmetic is done on the CPU in float64). Returns the token id."""
    if row.temperature <= 0.0:
        return int(torch.argmax(logits))  # first index of the maximum
    order, kept = _descending(logits, row.top_k)
    scaled = kept.double() / row.temperature
    probs = torch.softmax(scaled, dim=0)
    keep = probs.numel()
    if row.top_p < 1.0:
        # smallest prefix whose mass reaches top_p (at least one token)
        cum = torch.cumsum(probs, dim=0)
        keep = min(keep, int(torch.searchsorted(cum, torch.tensor(row.top_p, dtype=cum.dtype))) + 1)
    if row.min_p > 0.0:
        keep = min(keep, max(1, int((probs >= row.min_p * probs[0]).sum())))
    probs = probs[:keep]
    cdf = torch.cumsum(probs, dim=0)
    target = torch.tensor(row.u, dtype=cdf.dtype) * cdf[-1]
    pick = min(int(torch.searchsorted(cdf, target, right=True)), keep - 1)
    return int(order[pick])


def _descending(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, their logits) on the CPU, by logit descending, ties by token id (a stable
    sort: the CDF order is fixed); only the first top_k when 0 < top_k < V. Those are found
    without sorting the vocabulary: every token at or above the k-th largest logit (ties
    included), in id order, then a stable sort of just these, cut to k: the same ids as the
    first k of the full stable sort. Dividing by a temperature > 0 keeps this order (float
    logits map to distinct float64 values), so it is the order of the scaled logits too."""
    if not 0 < top_k < logits.numel():
        logits = logits.cpu()
        order = torch.argsort(logits, descending=True, stable=True)
        return order, logits[order]
    kth = torch.topk(logits, top_k, sorted=False).values.min()
    if torch.isnan(kth):  # NaN in the top k: take the full sort's order, as it stands
        order, values = _descending(logits, 0)
        return order[:top_k], values[:top_k]
    candidates = torch.nonzero(logits >= kth).squeeze(1).cpu()   # ascending token ids
    values = logits[candidates.to(logits.device)].cpu()
    order = torch.argsort(values, descending=True, stable=True)[:top_k]
    return candidates[order], values[order]


def sample_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """logits: [N, V] with N >= len(rows); row i of logits is sampled with rows[i]."""
    return [sample_row(logits[i], r) for i, r in enumerate(rows)]
