"""kernels/arrive.py: the last program of a tile adds its parts in order, the same bits as a
second kernel, and leaves the counters at zero (under the interpreter, and on CUDA many
launches in a row, where the programs arrive in any order)."""
from __future__ import annotations

import pytest
import torch

from conftest import triton_devices

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from strata.kernels.arrive import arrive, counters  # noqa: E402


@triton.jit
def _kernel(x_ptr, scratch_ptr, out_ptr, count_ptr, P: tl.constexpr, L: tl.constexpr):
    tile, part = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, L)
    s = tl.sum(tl.load(x_ptr + tile * P * L + part * L + i), 0)
    tl.store(scratch_ptr + tile * P + part, s)
    if arrive(count_ptr + tile, P):
        total = tl.zeros([], tl.float32)
        for p in tl.static_range(P):
            total += tl.load(scratch_ptr + tile * P + p, cache_modifier=".cg")
        tl.store(out_ptr + tile, total)


def _parts_sum(x: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, P * L] -> (each tile's parts' sums added in order by the last program [T],
    the counters)."""
    tiles, length = x.shape[0], x.shape[1] // parts
    scratch = torch.empty(tiles, parts, dtype=torch.float32, device=x.device)
    out = torch.empty(tiles, dtype=torch.float32, device=x.device)
    count = counters(x.device, tiles)
    _kernel[(tiles, parts)](x, scratch, out, count, P=parts, L=length)
    return out, count


@pytest.mark.parametrize("device", triton_devices())
def test_the_last_program_adds_the_parts_in_order(device):
    g = torch.Generator().manual_seed(0)
    parts, length = 8, 64
    tiles = 300 if device == "cuda" else 24
    x = torch.randn(tiles, parts * length, generator=g).to(device)
    want = torch.zeros(tiles, device=device)
    for p in range(parts):   # each part's sum, then the parts in order from zero
        want = want + x[:, p * length:(p + 1) * length].sum(1)
    for _ in range(50 if device == "cuda" else 1):
        got, count = _parts_sum(x, parts)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not count.any(), "every counter back at zero"
    first = got.clone()
    for _ in range(50 if device == "cuda" else 1):
        assert torch.equal(_parts_sum(x, parts)[0], first)


def test_no_counters_while_a_capture_is_made_without_them(monkeypatch):
    from strata.kernels import arrive
    monkeypatch.setattr(arrive, "_COUNTERS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert arrive.counters(torch.device("cuda", 0), 8) is None
    assert arrive.counters(torch.device("cpu"), arrive.SIZE + 1) is None
    made = arrive.counters(torch.device("cpu"), 8)
    assert made.shape == (arrive.SIZE,) and not made.any()
