"""Sampling tokens from rows of logits, given a uniform number per row drawn by the coordinator.

The coordinator draws u from (seed, position) with a counter-based generator, so a draw never
depends on batching, pipelining or speculation (DESIGN.md, exactness 3). Sampling is pure: the
same logits, parameters and u always give the same token, whatever other rows share the call.
Filters follow transformers' order: temperature, top-k, top-p, min-p; then inverse-CDF over the
kept tokens in a fixed order (probability descending, ties by token id).

`sample_row` is the reference: one row, its arithmetic in float64 on the CPU. `sample_rows`
samples a window's rows: on the CPU it is sample_row row by row (the same tokens, bit for
bit); on CUDA `sample_rows_on_device` keeps the logits on the device and copies only the
picks to the host.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


# On CUDA, a row with top_k in 1..HOST_TOP_K goes to sample_row (only its k candidates leave
# the device: ~0.4 ms a row on an H200 host) and the others are sampled together on the device
# (~1.4 ms for 1 to 64 rows): a row's path follows its own parameters, never the window's.
HOST_TOP_K = 256


def sample_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """logits: [N, V] with N >= len(rows); row i of logits is sampled with rows[i]. On CUDA
    the rows without a small top_k are sampled together on the device (sample_rows_on_device)
    and their picks leave it in one copy; elsewhere, and for rows with 0 < top_k <=
    HOST_TOP_K, each row goes to sample_row."""
    if not rows:
        return []
    if not logits.is_cuda:
        return [sample_row(logits[i], r) for i, r in enumerate(rows)]
    host = [i for i, r in enumerate(rows) if 0 < r.top_k <= HOST_TOP_K]
    if not host:
        return sample_rows_on_device(logits, rows).tolist()
    on_host = set(host)
    picks = [sample_row(logits[i], rows[i]) if i in on_host else None
             for i in range(len(rows))]
    rest = [i for i, p in enumerate(picks) if p is None]
    if rest:
        index = torch.tensor(rest, device=logits.device)
        for i, token in zip(rest, sample_rows_on_device(logits[index],
                                                        [rows[i] for i in rest]).tolist()):
            picks[i] = token
    return picks


def sample_rows_on_device(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """sample_row's sampling for rows[i] over logits[i], for all rows at once on the logits'
    device (any device; sample_rows uses it on CUDA). Returns the picks [len(rows)] (int64,
    on that device).

    Batch invariance, by construction: a row's token depends only on its logits, parameters
    and u, never on the other rows nor their number. Each step is either per element (scaling,
    exp, division, comparisons: the same operation on each element whatever the shape), a
    sort along the row (exact: a stable sort has one answer), an exact reduction (max, min,
    integer counts) or one of the two float64 sums below, which add in an order fixed by V
    alone (_pairwise_sum, _prefix_sums): built from elementwise adds of whole columns, they
    never hand the reduction order to a library kernel, whose order can follow the row count
    (torch.cumsum on CUDA scans one row with CUB, and several with a kernel whose threads per
    row depend on the number of rows).

    Against sample_row: the same order, filters and comparisons; only the two sums associate
    differently (sample_row sums sequentially), so the float64 probabilities may differ in
    the last bits. A token differs only where u * (kept mass), or a top-p or min-p threshold,
    falls within those few ulps of a CDF value (u = 1 - 2**-53 over a row whose tail holds
    almost no mass, say): for u uniform in steps of 2**-53, at most about V * 2**-51 of draws
    (1e-11 for V = 49152). tests/test_sampling.py compares the tokens over many random rows.
    NaN and +-inf logits give what sample_row gives: where the probabilities are NaN (a NaN
    logit, a +inf one, or all -inf) every comparison fails, so top-p keeps the top-k, min-p
    keeps one token and the pick is the last kept one."""
    n, vocab = len(rows), logits.shape[-1]
    device = logits.device
    params = torch.tensor([[r.temperature, r.top_k, r.top_p, r.min_p, r.u] for r in rows],
                          dtype=torch.float64).reshape(n, 5).T.to(device)   # [5, n]: one copy
    temperature, top_k, top_p, min_p, u = params[:, :, None]          # each [n, 1]
    x = logits[:n]
    greedy = x.argmax(-1)                                             # first index of the max
    # ties by token id; + 0.0 makes -0.0 a +0.0, so a radix sort ties them as the CPU's does
    values, order = torch.sort(x + 0.0, dim=-1, descending=True, stable=True)
    col = torch.arange(vocab, device=device)                          # [V]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).long()   # [n, 1]
    scaled = values.double() / torch.where(temperature > 0, temperature, 1.0)
    scaled = scaled.masked_fill(col >= k, float("-inf"))              # past the top-k
    e = torch.exp(scaled - scaled[:, :1])                             # the max is column 0
    probs = e / _pairwise_sum(e)
    cum = _prefix_sums(probs)
    # Each cut below is a first column (or a count) capped by the cut before it, so columns
    # past that cut never matter. top-p: the smallest prefix whose mass reaches top_p.
    first = torch.where(cum >= top_p, col, vocab).amin(-1, keepdim=True)
    keep = torch.where(top_p < 1.0, torch.minimum(k, first + 1), k)
    # min-p: the tokens of probability >= min_p times the top one's (at least one)
    above = (probs >= min_p * probs[:, :1]).sum(-1, keepdim=True).clamp(min=1)
    keep = torch.where(min_p > 0.0, torch.minimum(keep, above), keep)
    # inverse CDF: the first kept token whose cumulative mass passes u * (the kept mass)
    target = u * cum.gather(1, keep - 1)
    pick = torch.where(cum > target, col, vocab).amin(-1, keepdim=True)
    pick = torch.minimum(pick, keep - 1)
    sampled = order.gather(1, pick).squeeze(1)
    return torch.where(temperature.squeeze(1) > 0, sampled, greedy)


def _pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N, 1]: each row's sum, added pairwise (halves of the row padded with zeros
    to a power of two), in an order fixed by V."""
    width = 1 << max(x.shape[-1] - 1, 0).bit_length()
    x = F.pad(x, (0, width - x.shape[-1]))
    while width > 1:
        width //= 2
        x = x[:, :width] + x[:, width:]
    return x


def _prefix_sums(x: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N, V]: inclusive prefix sums along each row (Hillis-Steele: after the step
    of shift d, column i holds the sum of columns max(0, i - 2d + 1) .. i), in an order fixed
    by V."""
    shift = 1
    while shift < x.shape[-1]:
        x = torch.cat([x[:, :shift], x[:, shift:] + x[:, :-shift]], dim=1)
        shift *= 2
    return x
