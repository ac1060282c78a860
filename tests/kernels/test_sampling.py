"""The batched sampler (strata/kernels/sampling/sample.py) against sample_row, the one-row
reference: the same tokens for any mix of rows and parameters, and a row's token independent of
the other rows of its call (DESIGN.md, exactness 1 and 3). sample_rows_on_device is what CUDA
stages run; its torch ops run on the CPU too, so the CPU cases check it here and the cases
marked gpu check it on CUDA."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.coordinator.sampling_params import draw_uniform
from strata.kernels.sampling.sample import (SamplingRow, _pairwise_sum, _prefix_sums, sample_row,
                                            sample_rows, sample_rows_on_device)
from strata.protocol.messages import Window
from strata.stage_worker.head import HeadOutput, head_tokens, picked
from strata.stage_worker.history import SlotTokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])
VOCAB = 49152   # SmolLM2's
NAN, INF = float("nan"), float("inf")


def reference(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return [sample_row(logits[i].cpu(), r) for i, r in enumerate(rows)]


def random_logits(g: torch.Generator, n: int, vocab: int, levels: int = 0) -> torch.Tensor:
    """levels > 0 rounds the logits to few values: ties everywhere, at the top-k cut too."""
    logits = torch.randn(n, vocab, generator=g) * 3
    return torch.round(logits * levels / 3) / levels if levels else logits


def random_row(rng: random.Random, vocab: int) -> SamplingRow:
    """A sampled row with each filter on or off at random (top_k up to beyond the vocabulary)."""
    return SamplingRow(temperature=rng.choice([0.3, 0.7, 1.0, 1.6]),
                       top_k=rng.choice([0, 1, 2, 40, vocab - 1, vocab, vocab + 5]),
                       top_p=rng.choice([1.0, 0.95, 0.8, 0.3]),
                       min_p=rng.choice([0.0, 0.02, 0.2]), u=rng.random())


# Draws: 0, or the middle of a 2**-24 grid (u keys the Gumbel noise; the device path and
# sample_row differ only where a top-p or min-p cut falls within a few ulps: see
# sample_rows_on_device's docstring).
DRAWS = st.one_of(st.just(0.0), st.integers(0, 2**24 - 1).map(lambda i: (i + 0.5) / 2**24))


@st.composite
def windows(draw, unfiltered: float = 0.0) -> tuple[torch.Tensor, list[SamplingRow]]:
    """[n, V] logits (some rows with ties, NaN or infinities) and a row of parameters each;
    unfiltered: the share of rows with no top-k, top-p or min-p (sampled without a sort)."""
    n, vocab = draw(st.integers(1, 8)), draw(st.integers(1, 300))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32)))
    logits = random_logits(g, n, vocab, draw(st.sampled_from([0, 0, 2, 8])))
    logits *= draw(st.sampled_from([0.05, 1.0, 20.0]))
    for _ in range(draw(st.integers(0, 2))):   # a NaN or an infinity somewhere
        logits[draw(st.integers(0, n - 1)), draw(st.integers(0, vocab - 1))] = \
            draw(st.sampled_from([NAN, INF, -INF]))
    rows = [SamplingRow(temperature=draw(st.sampled_from([0.0, 0.05, 0.7, 1.0, 3.0])),
                        top_k=draw(st.integers(0, vocab + 3)),
                        top_p=draw(st.sampled_from([1.0, 1.0, 0.99, 0.9, 0.5, 1e-6])),
                        min_p=draw(st.sampled_from([0.0, 0.0, 0.01, 0.1, 0.5, 1.0])),
                        u=draw(DRAWS))
            for _ in range(n)]
    rows = [SamplingRow(r.temperature, draw(st.sampled_from([0, vocab, vocab + 3])), 1.0, 0.0,
                        r.u) if draw(st.floats(0, 1)) < unfiltered else r for r in rows]
    return logits, rows


@pytest.mark.parametrize("device", ["cpu", CUDA])
@settings(max_examples=300, deadline=None)
@given(window=windows())
def test_batched_sampler_picks_sample_rows_tokens(device, window):
    logits, rows = window
    logits = logits.to(device)
    want = reference(logits, rows)
    assert sample_rows(logits, rows) == want
    assert sample_rows_on_device(logits, rows).tolist() == want


@pytest.mark.parametrize("device", ["cpu", CUDA])
@settings(max_examples=300, deadline=None)
@given(window=windows(unfiltered=0.7))
def test_rows_without_filters_sampled_without_a_sort_pick_sample_rows_tokens(device, window):
    """Rows that keep every token skip the sort (alone in a call, or beside rows that take
    it): the same tokens as sample_row, NaN and infinities included."""
    logits, rows = window
    logits = logits.to(device)
    assert sample_rows_on_device(logits, rows).tolist() == reference(logits, rows)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_full_vocabulary_picks_sample_rows_tokens(device):
    """SmolLM2's vocabulary, every filter, the coordinator's draws: the picks of the device
    path equal sample_row's. They could differ only where float64 sums of another order move
    a threshold across a CDF boundary (about 1e-12 of draws): any difference fails here."""
    g, rng = torch.Generator().manual_seed(1), random.Random(1)
    n = 64 if device == "cuda" else 12
    logits = random_logits(g, n, VOCAB)
    for draw in range(8 if device == "cuda" else 2):
        rows = [random_row(rng, VOCAB) for _ in range(n)]
        rows = [SamplingRow(r.temperature, r.top_k, r.top_p, r.min_p, draw_uniform(draw, i))
                for i, r in enumerate(rows)]
        want = reference(logits, rows)
        got = sample_rows_on_device(logits.to(device), rows).tolist()
        differ = [(i, rows[i]) for i in range(n) if got[i] != want[i]]
        assert not differ, f"{len(differ)} of {n} rows differ from sample_row: {differ[:3]}"


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_rows_token_does_not_depend_on_the_other_rows(device):
    """Each row alone, then at a random place among 1, 7 and 63 random rows with other
    parameters (and greedy rows): the same token."""
    vocab = VOCAB if device == "cuda" else 3001   # not a power of two: the sums pad
    g, rng = torch.Generator().manual_seed(2), random.Random(2)
    logits = random_logits(g, 6, vocab).to(device)
    logits[5] = random_logits(g, 1, vocab, levels=4)[0].to(device)   # ties
    mine = [SamplingRow(0.7, 0, 1.0, 0.0, 0.61), SamplingRow(1.0, 40, 1.0, 0.0, 0.33),
            SamplingRow(0.8, 0, 0.9, 0.0, 0.97), SamplingRow(1.3, 0, 1.0, 0.05, 0.12),
            SamplingRow(0.6, 50, 0.95, 0.02, 0.5), SamplingRow(1.0, 7, 0.8, 0.0, 0.71)]
    for samples in (sample_rows_on_device, sample_rows):
        alone = [int(samples(logits[i:i + 1], [r])[0]) for i, r in enumerate(mine)]
        assert alone == reference(logits, mine)
        for others in (1, 7, 63):
            block = random_logits(g, others + 1, vocab).to(device)
            rows = [random_row(rng, vocab) if rng.random() < 0.8 else SamplingRow(u=0.5)
                    for _ in range(others + 1)]
            for i, r in enumerate(mine):
                at = rng.randrange(others + 1)
                block[at], rows[at] = logits[i], r
                assert int(samples(block, rows)[at]) == alone[i], (samples.__name__, others, i)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_sums_of_a_row_have_the_same_bits_among_other_rows(device):
    """The two float64 sums, bit for bit: a row alone and among 1, 7 and 63 others (a library
    reduction may change its order with the row count; these may not)."""
    g = torch.Generator().manual_seed(3)
    for vocab in (1, 5, 3001) + ((VOCAB,) if device == "cuda" else ()):
        probs = torch.softmax(torch.randn(64, vocab, generator=g, dtype=torch.float64) * 3, -1)
        probs = probs.to(device)
        alone = [(_pairwise_sum(probs[i:i + 1]), _prefix_sums(probs[i:i + 1])) for i in (0, 5)]
        for n in (2, 8, 64):
            total, prefix = _pairwise_sum(probs[:n]), _prefix_sums(probs[:n])
            for i, (a_total, a_prefix) in zip((0, 5), alone):
                if i < n:
                    assert torch.equal(total[i], a_total[0])
                    assert torch.equal(prefix[i], a_prefix[0])
        want = probs.cpu().cumsum(-1)
        torch.testing.assert_close(prefix.cpu(), want, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(total.cpu()[:, 0], want[:, -1], rtol=1e-12, atol=1e-15)


def test_greedy_rows_take_the_first_index_of_the_maximum():
    logits = torch.tensor([[1.0, 5.0, 2.0, 5.0], [7.0, 7.0, 0.0, 1.0], [0.0, 1.0, 2.0, 3.0]])
    for u in [i / 16 for i in range(16)]:
        rows = [SamplingRow(u=u), SamplingRow(temperature=1.0, u=u),
                SamplingRow(temperature=0.0, top_k=2, top_p=0.5, min_p=0.5, u=u)]
        assert sample_rows(logits, rows)[0::2] == [1, 3]
        assert sample_rows_on_device(logits, rows).tolist() == reference(logits, rows)
    # the sampled row between them is not greedy: over the draws it takes both of its top two
    assert {sample_row(logits[1], SamplingRow(temperature=1.0, u=i / 16))
            for i in range(16)} == {0, 1}


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_cuts_at_exact_boundaries(device):
    """Four equal logits: probabilities 1/4 and cumulative 1/4, 1/2, 3/4, 1, all exact. top_p
    reached exactly keeps the prefix that reaches it and min_p exactly at a probability keeps
    that token: over 64 draws each row picks every kept token and no other, on the device as
    sample_row does."""
    cases = [(dict(top_p=0.5), {0, 1}), (dict(top_p=0.75), {0, 1, 2}),
             (dict(min_p=1.0), {0, 1, 2, 3}), (dict(min_p=1.0, top_p=0.25), {0}),
             (dict(), {0, 1, 2, 3}), (dict(top_k=2), {0, 1})]
    draws = [(i + 0.5) / 64 for i in range(64)]
    rows = [SamplingRow(temperature=1.0, u=u, **kw) for kw, _ in cases for u in draws]
    block = torch.zeros(len(rows), 4, device=device)
    want = reference(block, rows)
    assert sample_rows_on_device(block, rows).tolist() == want
    for i, (_, kept) in enumerate(cases):
        assert set(want[i * len(draws):(i + 1) * len(draws)]) == kept, cases[i]


def test_top_k_beyond_the_vocabulary_is_no_filter():
    g = torch.Generator().manual_seed(4)
    logits = random_logits(g, 1, 500).expand(4, 500)
    for u in (0.0, 0.42, 0.999):
        rows = [SamplingRow(0.9, k, 0.9, 0.0, u) for k in (0, 500, 501, 10**6)]
        picks = sample_rows_on_device(logits, rows).tolist()
        assert picks == [picks[0]] * 4 == reference(logits, rows)


@pytest.mark.parametrize("values", [
    [1.0, NAN, 2.0, 0.0, -INF, 2.0], [NAN, NAN, NAN], [-INF] * 4, [1.0, INF, INF, 0.0],
    [1.0, 2.0, -INF, 3.0, -INF], [0.0, -0.0, -1.0, 0.0, -0.0]])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_nan_infinite_and_signed_zero_logits_give_sample_rows_tokens(values, device):
    logits = torch.tensor([values], device=device)
    rows = [SamplingRow(t, k, p, m, u) for t in (0.0, 0.8) for k in (0, 1, 2, 3, 9)
            for p in (1.0, 0.5) for m in (0.0, 0.2) for u in (0.0, 0.5, 0.99)]
    block = logits.expand(len(rows), -1)
    assert sample_rows_on_device(block, rows).tolist() == reference(block, rows)
    assert sample_rows(block, rows) == reference(block, rows)


def window_of(params: list[SamplingRow]) -> Window:
    n = len(params)
    return Window(1, list(range(n)), [9] * n, list(range(1, n + 1)), sample_rows=list(range(n)),
                  temperature=[p.temperature for p in params], top_k=[p.top_k for p in params],
                  top_p=[p.top_p for p in params], min_p=[p.min_p for p in params],
                  u=[p.u for p in params])


def test_head_tokens_samples_the_tempered_rows_and_takes_the_argmax_of_the_others():
    g = torch.Generator().manual_seed(5)
    logits = random_logits(g, 6, 700) / 10   # flat: a sampled row rarely picks the argmax
    head = HeadOutput(logits, logits.argmax(-1), rows=[4, 0, 5, 2])   # each sampled row's
    params = [SamplingRow(0.8, 0, 0.9, 0.0, 0.3), SamplingRow(),
              SamplingRow(1.2, 20, 1.0, 0.05, 0.8), SamplingRow(0.0, 5, 1.0, 0.0, 0.9)]
    w = window_of(params)
    want = [sample_row(logits[r], p) for r, p in zip(head.rows, params)]
    assert head_tokens(head, w) == want
    assert want[0] != int(logits[4].argmax()) and want[2] != int(logits[5].argmax())


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_tokens_picked_on_the_device_are_sample_rows_tokens(device):
    """A last stage on CUDA picks a window's tokens on the device behind its kernels
    (picked): the tokens head_tokens gives from the logits, greedy rows and sampled
    ones with and without filters."""
    g = torch.Generator().manual_seed(6)
    logits = (random_logits(g, 7, VOCAB) / 10).to(device)
    head = HeadOutput(logits, logits.argmax(-1), rows=[6, 0, 5, 2, 3, 1])
    params = [SamplingRow(0.8, 0, 0.9, 0.0, 0.3), SamplingRow(),
              SamplingRow(1.2, 1000, 1.0, 0.05, 0.8), SamplingRow(0.0, 5, 1.0, 0.0, 0.9),
              SamplingRow(0.7, 0, 1.0, 0.0, 0.6), SamplingRow(0.7, 20, 1.0, 0.0, 0.1)]
    w = window_of(params)
    want = [sample_row(logits[r].cpu(), p) for r, p in zip(head.rows, params)]
    on_device = picked(head, w, SlotTokens(8, 8), True)
    assert on_device.logits is None and head_tokens(on_device, w) == want == head_tokens(head, w)
    assert want[0] != int(logits[6].argmax()) and want[4] != int(logits[3].argmax())
    # no row with a filter: every row in one pick_unfiltered call, the greedy ones too
    plain = [params[1], params[3], params[4], SamplingRow(1.1, 0, 1.0, 0.0, 0.2)]
    head = HeadOutput(logits, logits.argmax(-1), rows=[5, 0, 3, 5])
    w = window_of(plain)
    want = [sample_row(logits[r].cpu(), p) for r, p in zip(head.rows, plain)]
    assert head_tokens(picked(head, w, SlotTokens(8, 8), True), w) == want == head_tokens(head, w)


def test_gumbel_noise_is_finite_at_the_extremes():
    """The noise's uniform never rounds to 0 or 1: a hash of all ones or all zeros in its top
    bits gives a finite value, so no kept token wins whatever its logit (u 0.6838460427654266
    with token 1966 hashed to the largest value and gave +inf while the uniform took 53 bits)."""
    from strata.kernels.sampling.sample import gumbel_noise
    u = torch.tensor([[0.6838460427654266], [0.0], [1 - 2**-53]], dtype=torch.float64)
    ids = torch.arange(50000).expand(3, -1)
    noise = gumbel_noise(u, ids)
    assert torch.isfinite(noise).all()
    logits = torch.zeros(50000)
    logits[1966] = -1e30
    row = SamplingRow(temperature=1.0, u=0.6838460427654266)
    assert sample_row(logits, row) != 1966
    assert sample_rows_on_device(logits[None], [row]).tolist() != [1966]
