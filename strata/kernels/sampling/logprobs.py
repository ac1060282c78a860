"""Log-probabilities of a row's tokens in the model's own distribution: log_softmax of the
head's fp32 logits, before temperature, penalties and filters (what vLLM reports by default,
its "raw_logprobs" mode).

logprob(t) = x[t] - (m + log(sum_j exp(x[j] - m))), m the row's largest logit, in float64.
The sum adds in an order fixed by V alone (sample.py's _pairwise_sum: whole-column adds), so
a row's numbers never depend on the other rows of the call nor on their number. On a CPU each
row goes alone (torch's vectorised exp and log may round an element differently by where it
falls in the call's buffer); on CUDA every element is computed alike, so rows go together.
The top tokens come from a stable sort of the logits: most likely first, ties by token id.
"""
from __future__ import annotations

import torch

from strata.kernels.sampling.sample import _pairwise_sum

MAX_TOP = 20   # the most top tokens a row may ask for (OpenAI's top_logprobs limit)


def log_normalizer(x: torch.Tensor) -> torch.Tensor:
    """x [k, V] fp32 -> [k] float64: log(sum_j exp(x[j])) of each row."""
    if x.device.type == "cpu" and x.shape[0] > 1:
        return torch.cat([log_normalizer(row[None]) for row in x])
    m = x.max(-1, keepdim=True).values.double()
    return (m + torch.log(_pairwise_sum(torch.exp(x.double() - m)))).squeeze(1)


def row_logprobs(x: torch.Tensor, targets: torch.Tensor, top: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [k, V] fp32 logits, targets [k] int64 token ids, top: how many most likely tokens
    (0..MAX_TOP). Returns on x's device (logprob of each target [k] float64, the top token ids
    [k, top] int64, their logprobs [k, top] float64)."""
    lse = log_normalizer(x)
    chosen = x.gather(1, targets[:, None]).squeeze(1).double() - lse
    if not top:
        empty = torch.empty(x.shape[0], 0, device=x.device)
        return chosen, empty.long(), empty.double()
    # + 0.0 makes -0.0 a +0.0: a radix sort ties them as the CPU's does (sample.py)
    values, ids = torch.sort(x + 0.0, dim=-1, descending=True, stable=True)
    return chosen, ids[:, :top], values[:, :top].double() - lse[:, None]
