"""The Triton kernel of the Gumbel-max pick (strata/kernels/sampling/sample_triton.py) against
pick_unfiltered_torch, its torch reference: the same picks for rows that keep every token,
greedy rows, ties, NaN and infinities, and each row's pick whatever rows share its call. On the
CPU through Triton's interpreter (TRITON_INTERPRET=1 set before Python starts: see
test_triton_interpreter.py) and on CUDA (marked gpu)."""
from __future__ import annotations

import pytest
import torch

from conftest import triton_devices
from strata.coordinator.sampling_params import draw_uniform
from strata.kernels.sampling.sample import pick_unfiltered, pick_unfiltered_torch

NAN, INF = float("nan"), float("inf")


def _kernel():
    return pytest.importorskip("strata.kernels.sampling.sample_triton").pick_unfiltered_triton


def _rows(device: str, n: int, vocab: int, seed: int, dtype=torch.float32):
    """Random logits [n, V] (the odd rows rounded: ties), a temperature per row (a quarter
    greedy) and the coordinator's draws, as [n, 1] float64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * 3
    x[1::2] = torch.round(x[1::2] * 2) / 2
    t = torch.tensor([[(0.0, 0.3, 0.7, 1.5)[i % 4]] for i in range(n)], dtype=torch.float64)
    u = torch.tensor([[draw_uniform(seed, i)] for i in range(n)], dtype=torch.float64)
    return x.to(device, dtype), t.to(device), u.to(device)


@pytest.mark.parametrize("device", triton_devices())
def test_the_kernel_picks_the_torch_picks(device):
    vocab = 3001 if device == "cpu" else 49152   # a partial last block; SmolLM2's vocabulary
    x, t, u = _rows(device, 12, vocab, seed=1)
    want = pick_unfiltered_torch(x, t, u)
    assert _kernel()(x, t, u).tolist() == want.tolist()
    assert (want != x.argmax(-1))[t.squeeze(1) > 0].any()   # the draws move picks
    if device == "cuda":   # pick_unfiltered takes the kernel there; bf16 logits (the drafter)
        assert pick_unfiltered(x, t, u).tolist() == want.tolist()
        xb = x.bfloat16()
        assert _kernel()(xb, t, u).tolist() == pick_unfiltered_torch(xb, t, u).tolist()


@pytest.mark.parametrize("device", triton_devices())
def test_nan_and_infinities_pick_as_in_torch(device):
    x, t, u = _rows(device, 8, 700, seed=2)
    x[0, 5] = NAN                       # never sampled; the greedy pick
    x[1, :] = -INF                      # nothing above -inf: the first index
    x[2, 40] = x[2, 9] = INF            # the lowest id of the +inf ones
    x[3, :] = -INF
    x[3, 600] = NAN                     # NaN first in the argmax
    x[4, :] = NAN                       # all NaN
    x[5, 100:] = -INF                   # only the first 100 can win
    x[6, 699] = INF                     # in the last block
    x[7, 0] = NAN
    t[:] = torch.tensor([[0.7], [0.7], [1.0], [0.7], [0.7], [0.3], [0.7], [0.0]],
                        dtype=torch.float64, device=device)
    want = pick_unfiltered_torch(x, t, u).tolist()
    assert _kernel()(x, t, u).tolist() == want
    assert want[1] == 0 and want[2] == 9 and want[3] == 600 and want[6] == 699 and want[7] == 0


@pytest.mark.parametrize("device", triton_devices())
def test_a_rows_pick_does_not_depend_on_the_other_rows(device):
    x, t, u = _rows(device, 9, 1500 if device == "cpu" else 49152, seed=3)
    together = _kernel()(x, t, u).tolist()
    assert [_kernel()(x[i:i + 1], t[i:i + 1], u[i:i + 1]).item() for i in range(9)] == together
    assert _kernel()(x[2:7], t[2:7], u[2:7]).tolist() == together[2:7]


@pytest.mark.parametrize("device", triton_devices())
def test_picks_of_chosen_rows(device):
    """rows: pick i is of row rows[i] (in any order, repeated), the indices given as float64
    beside the temperature and draw (how the last stage sends them: one copy)."""
    x, t, u = _rows(device, 6, 2100, seed=4)
    rows = [4, 0, 4, 5, 2]
    given = torch.tensor([[r, t[r].item(), u[r].item()] for r in rows], dtype=torch.float64,
                         device=device)
    want = pick_unfiltered_torch(x, t, u)[rows].tolist()
    assert _kernel()(x, given[:, 1], given[:, 2], rows=given[:, 0]).tolist() == want
    assert pick_unfiltered_torch(x[rows], given[:, 1:2], given[:, 2:]).tolist() == want
