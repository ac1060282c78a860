"""The MTP drafter's pick for a proposal of a request with top-k, top-p or min-p: the
sampler's filters and Gumbel-max pick (sample.py) over only the row's WIDTH most likely
tokens, in torch operations that never wait for the host, so the head's CUDA graph holds them.

A proposal need not be the target's sampler bit for bit: the target samples the position
again and keeps the proposal only if it picks the same token (drafts.py), so a proposal
changes how many drafts are kept, never a token. What it should be is the pick the target's
sampler would make over the head's distribution, with the target's draw: then the two agree
wherever the distributions do. This gives that pick wherever the filters keep at most WIDTH
tokens and any top-k is at most WIDTH (the probabilities are those of the top k, or of the
whole row without one, so the cuts fall where the full sort puts them, up to float rounding
and ties with the WIDTH-th token); otherwise it picks among the first WIDTH, with the top-p
cut from the whole row's probabilities. It costs a top-k of the row, one float32 pass over it
for the normaliser, and some thirty kernels on [n, WIDTH], where the full sort the target pays for exactness (_sample_sorted) costs a sort
of every row at each proposal step.
"""
import torch

from strata.kernels.sampling.sample import _gumbel_pick

WIDTH = 128


def pick_proposals(logits: torch.Tensor, params: torch.Tensor, width: int = WIDTH
                   ) -> torch.Tensor:
    """Proposals [n] (int64) for rows logits [n, V], params [n, 5] float64 (temperature, top_k,
    top_p, min_p, u; a temperature of 0 takes the argmax), on the logits' device."""
    vocab = logits.shape[-1]
    values, ids = torch.topk(logits, min(width, vocab), dim=-1)      # [n, C]
    # ranked as the sampler ranks: logit descending, ties by token id (topk leaves ties in
    # no set order; + 0.0 makes -0.0 a +0.0)
    by_id = ids.argsort(-1)
    values, ids = values.gather(1, by_id) + 0.0, ids.gather(1, by_id)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    values, ids = values.gather(1, order), ids.gather(1, order)
    temperature, top_k, top_p, min_p, u = params.T[:, :, None]       # each [n, 1]
    t = torch.where(temperature > 0, temperature, 1.0)
    scaled = values.double() / t
    col = torch.arange(values.shape[-1], device=logits.device)
    keep = (col < top_k) | (top_k <= 0)
    # the probabilities after top-k, as the sampler's: over the top k where they are among
    # the first WIDTH, else over the whole row (its normaliser in float32: one [n, V] pass)
    log_z = torch.where((top_k > 0) & (top_k <= values.shape[-1]),
                        torch.logsumexp(scaled.masked_fill(~keep, float("-inf")), -1, True),
                        torch.logsumexp(logits.float() / t.float(), -1, keepdim=True).double())
    probs = torch.exp(scaled - log_z)
    # top-p: a column is kept while the mass before it is below top_p (column 0 always; where
    # the probabilities are NaN every comparison fails, and the sampler keeps the top k)
    before = torch.cumsum(probs.masked_fill(~keep, 0.0), -1) - probs
    nan = probs.isnan().any(-1, keepdim=True)
    keep &= (before < top_p) | (top_p >= 1.0) | (col == 0) | nan
    keep &= (probs >= min_p * probs[:, :1]) | (min_p <= 0.0) | (col == 0)
    pick = _gumbel_pick(scaled.masked_fill(~keep, float("-inf")), ids, u)
    return torch.where(temperature[:, 0] > 0, ids.gather(1, pick)[:, 0], logits.argmax(-1))
