"""The Triton kernel of the filters and pick after the sort (strata/kernels/
sampling/sorted_triton.py) against pick_sorted_torch, its torch reference, and sample_row:
the same tokens for top-k, top-p and min-p alone and together, cuts inside a block and
several blocks on, ties, NaN and infinities, and each row's token whatever rows share its
call. On the CPU through Triton's interpreter (see test_triton_interpreter.py) and on CUDA
(marked gpu)."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import triton_devices
from strata.coordinator.sampling_params import draw_uniform
from strata.kernels.sampling.sample import (SamplingRow, kept_columns_torch, pick_sorted_torch,
                                            sample_row, sample_rows)

NAN, INF = float("nan"), float("inf")
# the interpreter computes inf - inf (a row's first logit +-inf) in numpy, which warns
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _kernel():
    return pytest.importorskip("strata.kernels.sampling.sorted_triton").pick_sorted_triton


def _sorted(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.sort(x + 0.0, dim=-1, descending=True, stable=True)


def _params(rows: list[SamplingRow], device) -> torch.Tensor:
    return torch.tensor([[r.temperature, r.top_k, r.top_p, r.min_p, r.u] for r in rows],
                        dtype=torch.float64).T.contiguous().to(device)


def _random_rows(n: int, vocab: int, seed: int) -> list[SamplingRow]:
    """Each filter on or off at random; high temperatures and top-p near 1 put the top-p cut
    blocks away from the first column."""
    rng = random.Random(seed)
    return [SamplingRow(temperature=rng.choice([0.3, 0.7, 1.0, 3.0, 8.0]),
                        top_k=rng.choice([0, 0, 1, 2, 40, 1500, vocab - 1, vocab, vocab + 5]),
                        top_p=rng.choice([1.0, 0.999, 0.95, 0.8, 0.3]),
                        min_p=rng.choice([0.0, 0.0, 1e-5, 0.02, 0.2]),
                        u=draw_uniform(seed, i)) for i in range(n)]


def _picks_and_kept(values, order, params) -> tuple[list[int], list[int]]:
    keep = torch.empty(values.shape[0], dtype=torch.long, device=values.device)
    picks = _kernel()(values, order, params, keep=keep)
    return picks.tolist(), keep.tolist()


def _kept_torch(values, params) -> list[int]:
    return kept_columns_torch(values, params)[1].squeeze(1).tolist()


def _logits(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * 3
    x[1::3] = torch.round(x[1::3] * 2) / 2          # ties, at the cuts too
    return x


@pytest.mark.parametrize("device", triton_devices())
def test_the_kernel_picks_the_torch_and_sample_row_tokens(device):
    vocab = 3001 if device == "cpu" else 49152   # a partial last block; SmolLM2's vocabulary
    n = 24 if device == "cpu" else 200
    x = _logits(n, vocab, seed=1)
    rows = _random_rows(n, vocab, seed=1)
    values, order = _sorted(x.to(device))
    params = _params(rows, device)
    got, kept = _picks_and_kept(values, order, params)
    assert got == pick_sorted_torch(values, order, params).tolist()
    assert kept == _kept_torch(values, params)
    assert got == [sample_row(x[i], r) for i, r in enumerate(rows)]
    # the cuts were far from the first block, and the draws moved picks off the argmax
    assert any(r.top_p > 0.99 and r.temperature >= 3.0 and r.top_k in (0, vocab)
               for r in rows)
    assert sum(t != int(x[i].argmax()) for i, t in enumerate(got)) > n // 4
    if device == "cuda":   # bf16 logits (the drafter's); sample_rows takes the kernel on CUDA
        vb, ob = _sorted(x.to(device, torch.bfloat16))
        assert _kernel()(vb, ob, params).tolist() == pick_sorted_torch(vb, ob, params).tolist()
        assert sample_rows(x.to(device), rows) == got


@pytest.mark.parametrize("device", triton_devices())
def test_nan_and_infinities_pick_as_in_torch(device):
    vocab = 1500
    x = _logits(9, vocab, seed=2)
    x[0, 5] = NAN                       # every probability NaN: top-p keeps the top-k
    x[1, :] = -INF
    x[2, 40] = x[2, 9] = INF            # +inf: the lowest id among them wins
    x[3, :] = -INF
    x[3, 600] = NAN
    x[4, :] = NAN
    x[5, 100:] = -INF                   # only the first 100 are likely at all
    x[6, 1499] = INF                    # in the last block
    x[7, 0] = NAN                       # min-p keeps the first column only
    x[8, 1200:] = -INF
    rows = [SamplingRow(0.7, 3, 0.9, 0.0, 0.3), SamplingRow(0.7, 0, 0.5, 0.0, 0.6),
            SamplingRow(1.0, 0, 0.9, 0.1, 0.2), SamplingRow(0.7, 5, 1.0, 0.05, 0.9),
            SamplingRow(0.7, 0, 0.8, 0.0, 0.1), SamplingRow(0.3, 0, 0.999, 0.0, 0.7),
            SamplingRow(0.7, 10, 0.5, 0.0, 0.5), SamplingRow(1.0, 0, 1.0, 0.3, 0.4),
            SamplingRow(9.0, 0, 0.9999, 0.0, 0.8)]
    values, order = _sorted(x.to(device))
    params = _params(rows, device)
    want = pick_sorted_torch(values, order, params).tolist()
    picks, kept = _picks_and_kept(values, order, params)
    assert picks == want and kept == _kept_torch(values, params)
    assert want == [sample_row(x[i], r) for i, r in enumerate(rows)]
    assert kept[0] == 3 and kept[7] == 1 and want[2] == 9 and want[6] == 1499 and want[7] == 0 and want[1] == 0


@pytest.mark.parametrize("device", triton_devices())
def test_a_rows_pick_does_not_depend_on_the_other_rows(device):
    vocab = 2100 if device == "cpu" else 49152
    x = _logits(9, vocab, seed=3)
    rows = _random_rows(9, vocab, seed=3)
    values, order = _sorted(x.to(device))
    params = _params(rows, device)
    together = _kernel()(values, order, params).tolist()
    alone = [_kernel()(values[i:i + 1], order[i:i + 1], params[:, i:i + 1]).item()
             for i in range(9)]
    assert alone == together
    assert _kernel()(values[2:7], order[2:7], params[:, 2:7]).tolist() == together[2:7]


@pytest.mark.parametrize("device", triton_devices())
def test_cuts_at_exact_boundaries_in_any_block(device):
    """2048 equal logits then lower ones: probabilities 1/2048 and cumulative sums j/2048,
    all exact. top_p reached exactly keeps the prefix that reaches it, wherever it ends (in
    the first block, at a block's end, in the second), min_p exactly at a probability keeps
    every token of it, and the top-k cuts through ties; the kernel keeps what the torch
    reference keeps, and picks within it."""
    vocab = 2600
    x = torch.cat([torch.zeros(2048), torch.full((vocab - 2048,), -60.0)])[None]
    cases = [(dict(top_p=0.25), 512), (dict(top_p=0.5), 1024),
             (dict(top_p=0.5 + 2**-11), 1025), (dict(top_p=0.75), 1536),
             (dict(min_p=1.0), 2048), (dict(min_p=1.0, top_p=0.25), 512),
             (dict(top_k=1030), 1030), (dict(top_k=1024, top_p=0.5), 512),
             (dict(top_k=3, min_p=0.5), 3), (dict(min_p=0.99), 2048)]
    rows = [SamplingRow(temperature=1.0, u=draw_uniform(9, i), **kw)
            for i, (kw, _) in enumerate(cases)]
    values, order = _sorted(x.expand(len(rows), -1).contiguous().to(device))
    params = _params(rows, device)
    picks, kept = _picks_and_kept(values, order, params)
    assert kept == [n for _, n in cases] == _kept_torch(values, params)
    assert picks == pick_sorted_torch(values, order, params).tolist()
    assert all(p < n for p, (_, n) in zip(picks, cases))   # tied tokens rank by id
