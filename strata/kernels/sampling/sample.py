"""Sampling tokens from rows of logits, given a uniform number per row drawn by the coordinator.

The coordinator draws u from (seed, position) with a counter-based generator, so a draw never
depends on batching, pipelining or speculation (DESIGN.md, exactness 3). Sampling is pure: the
same logits, parameters and u always give the same token, whatever other rows share the call.
Filters follow transformers' order: temperature, top-k, top-p, min-p. Then the Gumbel-max pick:
the kept token with the largest scaled logit plus Gumbel noise, the noise of each token a hash of
(u, token id) (`gumbel_noise`). Over uniform u this samples the kept tokens' softmax; and two
distributions sampled with the same u (the target's, and a drafter's proposal for the same
position) pick the same token as often as their shapes allow, whatever order they rank tokens
in: the coupling MTP drafts rely on (drafter.py). Inverse CDF, by contrast, shifts every
interval when one token's probability differs.

`sample_row` is the reference: one row, its arithmetic in float64 on the CPU. `sample_rows`
samples a window's rows: on the CPU it is sample_row row by row (the same tokens, bit for
bit); on CUDA `sample_rows_on_device` keeps the logits on the device and copies only the
picks to the host: a row that keeps every token is picked by one Triton kernel
(`pick_unfiltered`, sample_triton.py), the others by a sort and one more
(`_sample_sorted`, sorted_triton.py).
"""
import torch
import torch.nn.functional as F

import numpy as np

from strata.kernels.device import to_device_many
from strata.protocol.rows import SamplingRow   # reads temperature, top_k, top_p, min_p, u


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
    return int(order[_gumbel_pick(scaled[None, :keep], order[None, :keep],
                                  torch.tensor([[row.u]], dtype=torch.float64))[0, 0]])


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
    """logits: [N, V] with N >= len(rows); row i of logits is sampled with rows[i]. On CUDA
    the rows are sampled together on the device (sample_rows_on_device) and their picks
    leave it in one copy; elsewhere each row goes to sample_row."""
    if not rows:
        return []
    if logits.is_cuda:
        return sample_rows_on_device(logits, rows).tolist()
    return [sample_row(logits[i], r) for i, r in enumerate(rows)]


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

    Against sample_row: the same order, filters, noise and pick; only the two sums associate
    differently (sample_row sums sequentially), so the float64 probabilities may differ in
    the last bits. A token differs only where a top-p or min-p threshold falls within those
    few ulps of a cumulative or single probability: the kept set then differs by its last
    token, and the pick only if that token wins. tests/kernels/test_sampling.py compares the tokens
    over many random rows. NaN and +-inf logits give what sample_row gives: where the
    probabilities are NaN (a NaN logit, a +inf one, or all -inf) every comparison fails, so
    top-p keeps the top-k and min-p keeps one token; a NaN scaled logit never wins, a +inf
    one does, and a row with none above -inf takes its first kept token.

    Rows that are greedy or keep every token (no top-k, top-p or min-p) skip the sort and the
    sums: pick_unfiltered gives them the same token. One copy to the device: the rows'
    parameters and which rows take which path (pick_rows)."""
    on = to_device_many(pick_arrays(rows, logits.shape[-1]), logits.device)
    return pick_rows(logits[:len(rows)], on["params"], on["sorts"], on["others"])


def pick_arrays(rows: list[SamplingRow], vocab: int) -> dict[str, np.ndarray]:
    """What pick_rows reads of these rows, on the host: their params [5, n] float64
    (temperature, top_k, top_p, min_p, u) and which rows go through a sort (`sorts`: sampled
    rows with top-k, top-p or min-p) and which do not (`others`)."""
    sorts = [i for i, r in enumerate(rows) if r.temperature > 0.0 and r.filtered(vocab)]
    return {"params": np.asarray([[r.temperature, r.top_k, r.top_p, r.min_p, r.u]
                                  for r in rows], dtype=np.float64).reshape(len(rows), 5).T,
            "sorts": np.asarray(sorts, dtype=np.int64),
            "others": np.asarray(sorted(set(range(len(rows))) - set(sorts)), dtype=np.int64)}


def pick_rows(x: torch.Tensor, params: torch.Tensor, sorts: torch.Tensor,
              others: torch.Tensor) -> torch.Tensor:
    """sample_rows_on_device's picks [n] for rows x [n, V], given pick_arrays' on x's device:
    each row takes its own path, whatever the others take, so its token stays its own. No
    step waits for the host."""
    if not sorts.numel():
        return pick_unfiltered(x, params[0, :, None], params[4, :, None])
    if not others.numel():
        return _sample_sorted(x, params)
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    out[others] = pick_unfiltered(x[others], params[0, others, None], params[4, others, None])
    out[sorts] = _sample_sorted(x[sorts], params[:, sorts])
    return out


def pick_unfiltered(x: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """sample_rows_on_device's picks [n] for rows x [n, V] that are greedy (temperature 0) or
    keep every token, given temperature and u as tensors [n, 1] (float64) on x's device (with
    rows, n indices of any number type on that device: pick i is of row rows[i] of x); no
    step waits for the host, so a CUDA graph may hold it (the drafter's coupled proposals).
    The Gumbel-max pick over the whole row needs no sort, the noise being keyed by token id
    (the sorted path's order only ranks the tokens for the filters). As there, a NaN score
    never wins, a +inf one does (the lowest id among several: the first in the stable sort's
    order too), and a row with no score above -inf takes the first index of its maximum (the
    sort's first column; NaN ranks first in both). On CUDA one Triton kernel computes it
    (sample_triton.py: the same arithmetic, in one launch instead of some twenty);
    elsewhere pick_unfiltered_torch."""
    if not x.is_cuda:
        if rows is not None:
            x = x[rows.long().reshape(-1)]
        return pick_unfiltered_torch(x, temperature.reshape(-1, 1), u.reshape(-1, 1))
    from strata.kernels.sampling.sample_triton import pick_unfiltered_triton
    return pick_unfiltered_triton(x, temperature, u, rows)


def pick_unfiltered_torch(x: torch.Tensor, temperature: torch.Tensor,
                          u: torch.Tensor) -> torch.Tensor:
    """pick_unfiltered in torch operations, on any device (the Triton kernel's reference)."""
    greedy = x.argmax(-1)
    scaled = x.double() / torch.where(temperature > 0, temperature, 1.0)
    score = scaled + gumbel_noise(u, torch.arange(x.shape[-1], device=x.device)[None, :])
    score = score.masked_fill(score.isnan(), float("-inf"))
    best, pick = score.max(-1)
    pick = torch.where(best > float("-inf"), pick, greedy)
    return torch.where(temperature.squeeze(1) > 0, pick, greedy)


def _sample_sorted(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """pick_rows through a sort of each row, for sampled rows (temperature > 0) whose filters
    rank the tokens (params [5, n] on the logits' device). On CUDA the filters and the pick
    after the sort are one Triton kernel (sorted_triton.py: the same arithmetic); elsewhere
    pick_sorted_torch."""
    # ties by token id; + 0.0 makes -0.0 a +0.0, so a radix sort ties them as the CPU's does
    values, order = torch.sort(logits + 0.0, dim=-1, descending=True, stable=True)
    if not logits.is_cuda:
        return pick_sorted_torch(values, order, params)
    from strata.kernels.sampling.sorted_triton import pick_sorted_triton
    return pick_sorted_triton(values, order, params)


def pick_sorted_torch(values: torch.Tensor, order: torch.Tensor,
                      params: torch.Tensor) -> torch.Tensor:
    """_sample_sorted's picks [n] after the sort, in torch operations on any device (the
    Triton kernel's reference): rows sorted by logit descending, ties by token id (values
    [n, V], their token ids order), params [5, n] float64 (temperature, top_k, top_p, min_p,
    u; every temperature above 0)."""
    scaled, keep = kept_columns_torch(values, params)
    col = torch.arange(values.shape[-1], device=values.device)
    # the Gumbel-max pick among the kept columns
    pick = _gumbel_pick(scaled.masked_fill(col >= keep, float("-inf")), order, params[4, :, None])
    return order.gather(1, pick).squeeze(1)


def kept_columns_torch(values: torch.Tensor,
                       params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For sorted rows as pick_sorted_torch takes them: their scaled logits [n, V] (float64,
    -inf past the top-k) and how many first columns the filters keep, [n, 1]."""
    vocab = values.shape[-1]
    temperature, top_k, top_p, min_p, _ = params[:, :, None]          # each [n, 1]
    col = torch.arange(vocab, device=values.device)                   # [V]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).long()   # [n, 1]
    scaled = (values.double() / temperature).masked_fill(col >= k, float("-inf"))
    e = torch.exp(scaled - scaled[:, :1])                             # the max is column 0
    probs = e / _pairwise_sum(e)
    cum = _prefix_sums(probs)
    # Each cut below is a first column (or a count) capped by the cut before it, so columns
    # past that cut never matter. top-p: the smallest prefix whose mass reaches top_p.
    first = torch.where(cum >= top_p, col, vocab).amin(-1, keepdim=True)
    keep = torch.where(top_p < 1.0, torch.minimum(k, first + 1), k)
    # min-p: the tokens of probability >= min_p times the top one's (at least one)
    above = (probs >= min_p * probs[:, :1]).sum(-1, keepdim=True).clamp(min=1)
    return scaled, torch.where(min_p > 0.0, torch.minimum(keep, above), keep)


# splitmix64's constants, as int64 (two's complement)
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9 - 2**64, 0x94D049BB133111EB - 2**64


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def gumbel_noise(u: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise [N, M] (float64) for draws u [N, 1] (float64 in [0, 1)) and token
    ids [N, M]: each value a function of (u, id) alone, through splitmix64 of u's bits and the
    id. Integer arithmetic wraps the same way on every device, so the hash has the same bits on
    the CPU and on CUDA (the float64 log after it may differ in its last bit between them),
    whatever else shares the call."""
    z = u.to(torch.float64).view(torch.int64) ^ ((ids + 1) * _GOLDEN)
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    v = (_shr(z, 12).double() + 0.5) * 2.0**-52       # uniform in (0, 1), exactly: never 1
    return -torch.log(-torch.log(v))


def _gumbel_pick(scaled: torch.Tensor, ids: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N, 1]: the column of the largest scaled logit + gumbel_noise(u, its id), over scaled
    [N, M] float64 (-inf where a column is not kept) and ids [N, M]; NaN counts as -inf, and
    where no column is above -inf, the first column (the most likely token, as ranked)."""
    score = scaled + gumbel_noise(u, ids)
    return score.masked_fill(score.isnan(), float("-inf")).argmax(-1, keepdim=True)


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
