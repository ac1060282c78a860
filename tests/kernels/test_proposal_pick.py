"""The drafter's pick for proposals with filters (strata/kernels/sampling/proposal_pick.py)
against sample_row, the target's sampler: the same token wherever the filters keep at most WIDTH
tokens and any top-k is at most WIDTH; otherwise one of the row's WIDTH most likely tokens;
the argmax at temperature 0; and a row's pick whatever rows share its call; ties, NaN and
infinities included. On the CPU, and on CUDA (marked gpu)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.kernels.sampling.proposal_pick import pick_proposals
from strata.kernels.sampling.sample import SamplingRow, kept_columns_torch, sample_row

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])
WIDTH = 16   # small, so that random rows fall on both sides of it
NAN, INF = float("nan"), float("inf")
DRAWS = st.integers(0, 2**24 - 1).map(lambda i: (i + 0.5) / 2**24)


def _params(rows: list[SamplingRow], device) -> torch.Tensor:
    return torch.tensor([[r.temperature, r.top_k, r.top_p, r.min_p, r.u] for r in rows],
                        dtype=torch.float64, device=device)


def _sampler_cut(logits: torch.Tensor, row: SamplingRow) -> tuple[torch.Tensor, int]:
    """The row's scaled logits [V] as the target's sampler ranks them, and how many it keeps."""
    values, _ = torch.sort(logits[None].double(), descending=True, stable=True)
    scaled, kept = kept_columns_torch(values, _params([row], "cpu").T)
    return scaled[0], int(kept)


def _kept(logits: torch.Tensor, row: SamplingRow) -> int:
    """How many tokens the target's sampler keeps for the row."""
    return _sampler_cut(logits, row)[1]


@st.composite
def windows(draw) -> tuple[torch.Tensor, list[SamplingRow]]:
    """[n, V] logits (some rows rounded to few values: ties; some with a NaN or an infinity)
    and a sampled row of parameters each, every filter on or off."""
    n, vocab = draw(st.integers(1, 6)), draw(st.integers(2, 400))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32)))
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64).float()
    levels = draw(st.sampled_from([0, 0, 2, 8]))
    if levels:
        logits = torch.round(logits * levels) / levels
    logits *= draw(st.sampled_from([0.3, 2.0, 8.0]))
    for _ in range(draw(st.integers(0, 2))):
        logits[draw(st.integers(0, n - 1)), draw(st.integers(0, vocab - 1))] = \
            draw(st.sampled_from([NAN, INF, -INF]))
    rows = [SamplingRow(temperature=draw(st.sampled_from([0.3, 0.7, 1.0, 2.0])),
                        top_k=draw(st.sampled_from([0, 1, 5, WIDTH, WIDTH + 1, vocab])),
                        top_p=draw(st.sampled_from([1.0, 0.99, 0.9, 0.5])),
                        min_p=draw(st.sampled_from([0.0, 0.05, 0.3])), u=draw(DRAWS))
            for _ in range(n)]
    return logits, rows


def _on_a_cut(logits: torch.Tensor, row: SamplingRow, rounding: float = 1e-6) -> bool:
    """Whether a top-p or min-p cut of the row falls within float rounding of a cumulative or
    single probability (the pick's normaliser is float32: a cut there may keep one token more
    or less than the sampler's)."""
    probs = torch.softmax(_sampler_cut(logits, row)[0], -1)
    if row.top_p < 1.0 and ((probs.cumsum(-1) - row.top_p).abs() <= rounding).any():
        return True
    return row.min_p > 0.0 and bool(
        ((probs - row.min_p * probs[0]).abs() <= rounding * probs[0]).any())


def _claimed(logits: torch.Tensor, row: SamplingRow) -> bool:
    """Whether the pick is claimed to be the sampler's: it keeps at most WIDTH tokens, any
    top-k is at most WIDTH, no cut falls within float rounding of a probability (_on_a_cut),
    and none of the kept tokens ties with a token past the first WIDTH (which of those a
    top-k of the row takes is not set)."""
    vocab, kept = logits.shape[-1], _kept(logits, row)
    if kept > WIDTH or WIDTH < row.top_k < vocab or _on_a_cut(logits, row):
        return False
    ranked = torch.sort(logits + 0.0, descending=True, stable=True).values
    if vocab <= WIDTH or not ranked[WIDTH - 1] == ranked[WIDTH]:
        return True
    return not bool((ranked[:kept] == ranked[WIDTH]).any())


@pytest.mark.parametrize("device", ["cpu", CUDA])
@settings(max_examples=300, deadline=None)
@given(window=windows())
def test_a_proposal_is_the_samplers_pick_where_the_filters_keep_few_tokens(device, window):
    logits, rows = window
    vocab = logits.shape[-1]
    got = pick_proposals(logits.to(device), _params(rows, device), WIDTH).tolist()
    # the WIDTH-th largest logit (NaN ranks first; which of tied logits a top-k takes is not
    # set, and differs between devices)
    least = torch.sort(logits, dim=-1, descending=True).values[:, min(WIDTH, vocab) - 1]
    for i, row in enumerate(rows):
        if _claimed(logits[i], row):
            assert got[i] == sample_row(logits[i], row), (i, row)
        else:
            picked = logits[i, got[i]]
            assert picked.isnan() or picked >= least[i], (i, row)
        # alone in its call, the same pick
        alone = pick_proposals(logits[i:i + 1].to(device), _params([row], device), WIDTH)
        assert int(alone) == got[i]


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_greedy_rows_take_the_argmax_and_wide_rows_a_likely_token(device):
    """Temperature 0: the argmax (its first index), whatever the filters and draw. Top-p 0.99
    at a high temperature keeps most of a flat row: the pick is among the WIDTH most likely,
    and over many draws it takes many of them, not only the first."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 500, generator=g)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1.0
    rows = [SamplingRow(0.0, 5, 0.9, 0.1, 0.4), SamplingRow(0.0, 0, 1.0, 0.0, 0.0)]
    got = pick_proposals(logits.to(device), _params(rows, device), WIDTH).tolist()
    assert got == [7, int(logits[1].argmax())]
    top = set(torch.topk(logits[1], WIDTH).indices.tolist())
    picks = {int(pick_proposals(logits[1:].to(device),
                                _params([SamplingRow(3.0, 0, 0.99, 0.0, (d + 0.5) / 64)], device),
                                WIDTH)) for d in range(64)}
    assert picks <= top and len(picks) > WIDTH // 2, picks


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_ties_at_the_cuts_keep_what_the_sampler_keeps(device):
    """min-p 1 keeps every token tied with the top one; top-k cuts after its k-th token: over
    many draws, the sampler's picks."""
    logits = torch.zeros(1, 64)
    logits[0, [3, 40]] = 2.0
    logits[0, 10] = 1.0
    for row in (SamplingRow(1.0, 0, 1.0, 1.0, 0.0), SamplingRow(1.0, 3, 1.0, 0.0, 0.0)):
        for d in range(32):
            r = SamplingRow(row.temperature, row.top_k, row.top_p, row.min_p, (d + 0.5) / 32)
            assert int(pick_proposals(logits.to(device), _params([r], device), WIDTH)) == \
                sample_row(logits[0], r), r
