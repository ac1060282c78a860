"""Penalties, biases and log-probabilities on the last stage, without a model: the penalties
against transformers' RepetitionPenaltyLogitsProcessor and a hand computation, the
log-probabilities against torch's log_softmax, each row's numbers alone and among others, and
the head's answer for a window with drafts (a draft row penalised as if the drafts before it
were kept), the same through the device path (picked on the device) as through the host one; a
grammar's mask applied after the penalties, the log-probabilities still the model's own."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from strata.kernels.sampling.logprobs import log_normalizer, row_logprobs
from strata.kernels.sampling.penalties import apply_penalties, history_counts
from strata.kernels.sampling.sample import SamplingRow, sample_row
from strata.protocol.messages import Window
from strata.stage_worker.head import HeadOutput, head_logprobs, head_tokens, picked
from strata.stage_worker.history import SlotTokens

V = 50


def counts_of(history: list[list[int]], output_from: list[int], vocab: int = V):
    width = max(len(h) for h in history)
    tokens = torch.full((len(history), width), vocab, dtype=torch.long)
    output = torch.zeros(len(history), width, dtype=torch.bool)
    for i, (h, start) in enumerate(zip(history, output_from)):
        tokens[i, :len(h)] = torch.tensor(h)
        output[i, start:len(h)] = True
    return history_counts(tokens, output, vocab)


def test_repetition_penalty_is_transformers_processor():
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g) * 3
    ids = torch.randint(0, V, (3, 12), generator=g)
    for p in (1.3, 0.7):
        want = transformers.RepetitionPenaltyLogitsProcessor(p)(ids, logits.clone())
        seen, counts = counts_of(ids.tolist(), [12] * 3)   # the whole history, no output
        got = apply_penalties(logits, seen, counts,
                              torch.tensor([[p, 0.0, 0.0]] * 3, dtype=torch.float32))
        assert torch.equal(got, want), p


def test_frequency_presence_and_bias_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    # prompt [3, 3], output [0, 0, 2, 0]: repetition on 0, 2, 3; frequency and presence on
    # the output's 0 (3 times) and 2 (once)
    seen, counts = counts_of([[3, 3, 0, 0, 2, 0]], [2], vocab=5)
    assert counts.tolist() == [[3, 0, 1, 0, 0]] and seen.tolist() == [[1, 0, 1, 1, 0]]
    bias = (torch.tensor([0, 0]), torch.tensor([1, 4]), torch.tensor([10.0, -math.inf]))
    got = apply_penalties(logits, seen, counts, torch.tensor([[2.0, 0.5, 0.25]]), bias)
    want = [2.0 / 2 - 0.5 * 3 - 0.25, -1.0 + 10.0, 0.5 / 2 - 0.5 - 0.25, 3.0 / 2, -math.inf]
    assert got.tolist() == [want]


def test_neutral_penalties_leave_every_bit():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g)
    logits[0, 3], logits[1, 4] = -0.0, float("-inf")
    seen, counts = counts_of([list(range(30))] * 4, [10] * 4)
    got = apply_penalties(logits, seen, counts, torch.tensor([[1.0, 0.0, 0.0]] * 4))
    assert torch.equal(got.view(torch.int32), logits.view(torch.int32))


def test_logprobs_are_log_softmax_and_top_ranks_ties_by_id():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 1000, generator=g) * 4
    x[2, 10] = x[2, 20] = x[2].max() + 1   # a tie at the top: the lower id first
    targets = torch.tensor([0, 7, 20, 999, 500])
    chosen, ids, values = row_logprobs(x, targets, 5)
    want = torch.log_softmax(x.double(), -1)
    assert torch.allclose(chosen, want.gather(1, targets[:, None]).squeeze(1), atol=1e-12)
    assert ids[2, :2].tolist() == [10, 20]
    assert torch.equal(ids, torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :5])
    assert torch.allclose(values, want.gather(1, ids), atol=1e-12)


def test_a_rows_numbers_do_not_depend_on_the_others():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 4099, generator=g) * 5
    lse = log_normalizer(x)
    targets = torch.randint(0, 4099, (9,), generator=g)
    together = row_logprobs(x, targets, 20)
    seen, counts = counts_of([[1, 2, 2, 3]] * 9, [1] * 9, 4099)
    penalty = torch.tensor([[1.2, 0.3, 0.1]] * 9)
    batch = apply_penalties(x, seen, counts, penalty)
    for i in range(9):
        alone = row_logprobs(x[i:i + 1], targets[i:i + 1], 20)
        assert all(torch.equal(a[0], t[i]) for a, t in zip(alone, together))
        assert torch.equal(log_normalizer(x[i:i + 1])[0], lse[i])
        assert torch.equal(apply_penalties(x[i:i + 1], seen[i:i + 1], counts[i:i + 1],
                                           penalty[i:i + 1])[0], batch[i])


# --- the head ---------------------------------------------------------------------------------

def drafted_window(temperature: float) -> Window:
    """Slot 1 reads its prompt [5, 5, 7] (positions 0..2), then decodes: output [7] at 3, its
    last token 9 at position 4 and drafts 9, 9 at 5, 6 (rows 0..2, all sampled); slot 0 a
    plain row. Penalties on slot 1 (output from position 3), a bias on slot 0."""
    n = 3
    return Window(2, [1, 1, 1, 0], [4, 5, 6, 2], [9, 9, 9, 4], sample_rows=[0, 1, 2, 3],
                  temperature=[temperature] * 4, top_k=[0, 0, 0, 5], top_p=[1.0] * 4,
                  min_p=[0.0] * 4, u=[0.1, 0.5, 0.9, 0.3],
                  penalty=[[1.5, 0.4, 0.2]] * n + [[]], output_start=[3, 3, 3, 0],
                  bias_ids=[[], [], [], [4, 6]], bias=[[], [], [], [-math.inf, 3.0]],
                  logprob_rows=[0, 1, 2, 3], logprob_tokens=[-1, -1, 8, -1],
                  logprob_top=[0, 3, 3, 2])


def history_for(w: Window) -> SlotTokens:
    history = SlotTokens(2, 16)
    history.write(Window(1, [1, 1, 1, 1], [0, 1, 2, 3], [5, 5, 7, 7]))
    history.write(Window(1, [0, 0], [0, 1], [4, 4]))
    history.write(w)
    return history


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_draft_row_is_penalised_as_if_the_drafts_before_it_were_kept(temperature):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, V, generator=g) + torch.arange(V) / 10   # 9, 8 likely
    head = HeadOutput(logits, logits.argmax(-1), rows=[0, 1, 2, 3], scored=[0, 1, 2, 3])
    w = drafted_window(temperature)
    got = picked(head, w, history_for(w), False)
    # by hand: row j of slot 1 has history 5 5 7 7 9 (9 ...) and output 7 9 (9 ...)
    for j, output in enumerate([[7, 9], [7, 9, 9], [7, 9, 9, 9]]):
        x = logits[j].clone()
        for t in {5, 7, 9}:
            x[t] = x[t] * 1.5 if x[t] < 0 else x[t] / 1.5
        for t in set(output):
            x[t] -= 0.4 * output.count(t)
            x[t] -= 0.2
        assert torch.equal(got.logits[j], x), j
    x = logits[3].clone()
    x[4], x[6] = -math.inf, x[6] + 3.0
    assert torch.equal(got.logits[3], x)
    tokens = head_tokens(got, w)
    params = [SamplingRow(temperature, k, 1.0, 0.0, u) for k, u in zip([0, 0, 0, 5],
                                                                      w.u)]
    assert tokens == [sample_row(got.logits[j], p) for j, p in enumerate(params)]
    assert tokens[3] != 4
    # the device path gives the same tokens and logprobs: the model's own distribution
    lp = _raw_logprobs_on_both_paths(head, got, w, tokens, logits)
    assert [len(t) for t in lp[1]] == [0, 3, 3, 2]
    assert lp[1][1] == torch.sort(logits[1], descending=True, stable=True).indices[:3].tolist()


def _raw_logprobs_on_both_paths(head, got, w, tokens, logits):
    """The window's tokens picked on the host (from `got`, steps 1 and 2 taken) equal those
    picked on the device (from `head`), their logprobs too, and are the model's own
    (log_softmax of the raw logits; row 2 scores its token 8): the logprobs."""
    on_device = picked(head, w, history_for(w), True)
    assert on_device.logits is None and head_tokens(on_device, w) == tokens
    lp = head_logprobs(got, w, tokens)
    assert head_logprobs(on_device, w, tokens) == lp
    raw = torch.log_softmax(logits.double(), -1)
    targets = [tokens[0], tokens[1], 8, tokens[3]]
    assert lp[0] == pytest.approx([raw[j, t].item() for j, t in enumerate(targets)], abs=1e-12)
    return lp


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_mask_comes_after_the_penalties_and_leaves_logprobs_raw(temperature):
    """The window above with a grammar's masks on rows 1 and 3: they sample from their
    penalised logits with the forbidden tokens at -inf (row 3's bias of -inf on token 4 still
    holds); every row's log-probabilities stay the model's own, host and device path alike."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, V, generator=g) + torch.arange(V) / 10   # 9, 8 likely
    head = HeadOutput(logits, logits.argmax(-1), rows=[0, 1, 2, 3], scored=[0, 1, 2, 3])
    allowed = np.zeros((2, V), dtype=bool)
    allowed[0, [2, 3, 8]] = allowed[1, [4, 5, 6]] = True
    bits = np.zeros((2, -(-V // 32) * 32), dtype=np.uint8)
    bits[:, :V] = allowed
    w = replace(drafted_window(temperature), mask=[-1, 0, -1, 1],
                masks=np.packbits(bits, axis=1, bitorder="little").view("<i4").tobytes())
    pen = picked(head, drafted_window(temperature), history_for(w), False)   # no masks
    got = picked(head, w, history_for(w), False)
    tokens = head_tokens(got, w)
    params = [SamplingRow(temperature, k, 1.0, 0.0, u) for k, u in zip([0, 0, 0, 5], w.u)]
    expected = []
    for j, p in enumerate(params):
        x = pen.logits[j].clone()
        if j in (1, 3):
            x[~torch.from_numpy(allowed[j // 2])] = -math.inf
        expected.append(sample_row(x, p))
    assert tokens == expected
    assert tokens[1] in (2, 3, 8) and tokens[3] in (5, 6)
    assert tokens[0] == head_tokens(pen, w)[0]   # an unmasked row as the penalties left it
    _raw_logprobs_on_both_paths(head, got, w, tokens, logits)


def test_no_penalty_leaves_the_head_as_it_is():
    logits = torch.randn(2, V)
    head = HeadOutput(logits, logits.argmax(-1), rows=[0, 1])
    w = Window(1, [0, 1], [3, 3], [1, 2], sample_rows=[0, 1], temperature=[0.0] * 2,
               top_k=[0] * 2, top_p=[1.0] * 2, min_p=[0.0] * 2, u=[0.0] * 2)
    assert picked(head, w, SlotTokens(2, 8), False) is head


@pytest.mark.parametrize("extra, words", [
    ({"penalty": [[1.5, 0.0, 0.0]]}, "no output_start"),
    ({"penalty": [[0.0, 0.0, 0.0]], "output_start": [0]}, "repetition penalty above 0"),
    ({"penalty": [[1.0, math.nan, 0.0]], "output_start": [0]}, "not finite"),
    ({"penalty": [[]], "output_start": [5]}, "output_start 5"),
    ({"bias_ids": [[V]], "bias": [[1.0]]}, "bias_ids"),
    ({"bias_ids": [[3, 3]], "bias": [[1.0, 2.0]]}, "distinct"),
    ({"bias_ids": [[3]], "bias": [[math.inf]]}, "finite numbers or -inf"),
    ({"logprob_rows": [1], "logprob_tokens": [-1], "logprob_top": [0]}, "-1 for a sampled"),
    ({"logprob_rows": [0], "logprob_tokens": [-1], "logprob_top": [21]}, "give 0 to 20"),
    ({"logprob_rows": [0, 0], "logprob_tokens": [-1, 2], "logprob_top": [0, 0]}, "twice"),
])
def test_the_last_stage_refuses_what_it_cannot_apply(extra, words):
    from strata.stage_worker.checks import RowError, _check_sampling
    w = Window(1, [0, 0], [3, 4], [1, 2], sample_rows=[0], temperature=[0.0], top_k=[0],
               top_p=[1.0], min_p=[0.0], u=[0.0], **extra)
    with pytest.raises(RowError, match=words):
        _check_sampling(w, V)
