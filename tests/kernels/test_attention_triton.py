"""The fixed-order Triton attention kernel (strata/kernels/attention/decode_triton.py) against the
float64 reference: on the CPU through Triton's interpreter (run with TRITON_INTERPRET=1 set
before Python starts; skipped otherwise, and where triton is not installed), and on CUDA
(marked gpu). Row independence is checked bit for bit, with rows of one, two and several
splits of keys, a window across split boundaries, and the splits combined by the last program
to arrive or by a second kernel (no counters): the same bits."""
from __future__ import annotations


import pytest
import torch

from strata.kernels import arrive
from strata.kernels.attention.window import attend_reference

triton = pytest.importorskip("triton")
from strata.kernels.attention.decode_triton import BLOCK_N, attend_rows_triton  # noqa: E402
from conftest import triton_devices

N_SLOTS, N_HEADS, N_KV, HD, CTX = 5, 6, 2, 24, 4 * BLOCK_N   # group 3, head size not a power of 2
SLOTS = [0, 1, -1, 2, 3, 4, 0, -1, 1, 2]
POSITIONS = [0, 1, 5, BLOCK_N - 1, BLOCK_N, BLOCK_N + 1, 2 * BLOCK_N, 0, 3 * BLOCK_N - 2, CTX - 1]
TRASH = N_SLOTS  # pad rows point at a spare slot



def _inputs(device, n_rows, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(N_SLOTS + 1, N_KV, CTX, HD, generator=g)
    v = torch.randn(N_SLOTS + 1, N_KV, CTX, HD, generator=g)
    q = torch.randn(n_rows, N_HEADS, HD, generator=g)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def _rows(slots, positions, device):
    return (torch.tensor([s if s >= 0 else TRASH for s in slots], device=device),
            torch.tensor([p + 1 if s >= 0 else 0 for s, p in zip(slots, positions)],
                         device=device))


def _attend(*args, **kwargs):
    try:
        return attend_rows_triton(*args, **kwargs)
    except Exception as e:  # triton's interpreter vs a numpy it does not support yet
        if "0-dimensional" in str(e):
            pytest.skip(f"triton's interpreter fails with this numpy: {e}")
        raise


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("split", [BLOCK_N, 2 * BLOCK_N])   # rows of 1 to 4 and 1 to 2 splits
def test_kernel_matches_reference(device, split):
    q, k, v = _inputs(device, len(SLOTS))
    out = _attend(q, k, v, *_rows(SLOTS, POSITIONS, device), split=split)
    ref = attend_reference(q.cpu(), k.cpu(), v.cpu(), SLOTS, POSITIONS)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    for r, s in enumerate(SLOTS):
        if s < 0:
            assert torch.equal(out[r].cpu(), torch.zeros(N_HEADS, HD)), "pad rows are zero"


@pytest.mark.parametrize("device", triton_devices())
def test_kernel_ignores_keys_after_the_position_and_other_slots(device):
    q, k, v = _inputs(device, len(SLOTS), seed=1)
    out = _attend(q, k, v, *_rows(SLOTS, POSITIONS, device))
    k2, v2 = k.clone(), v.clone()
    for s, p in zip(SLOTS, POSITIONS):
        if s >= 0:
            k2[s, :, p + 1:] = 1e4   # what a row must never see
            v2[s, :, p + 1:] = float("nan")
    k2[TRASH], v2[TRASH] = float("nan"), float("nan")
    # rows of the same slot at larger positions would see the poison: keep one row per slot
    keep = {}
    for r, (s, p) in enumerate(zip(SLOTS, POSITIONS)):
        if s >= 0 and (s not in keep or p > POSITIONS[keep[s]]):
            keep[s] = r
    for s, r in keep.items():
        k3, v3 = k.clone(), v.clone()
        k3[s, :, POSITIONS[r] + 1:], v3[s, :, POSITIONS[r] + 1:] = 1e4, float("nan")
        one = _attend(q[r:r + 1], k3, v3, *_rows([s], [POSITIONS[r]], device))
        assert torch.equal(one[0], out[r])


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("split", [BLOCK_N, 2 * BLOCK_N])
def test_kernel_is_row_independent(device, split):
    """A row's bits do not depend on its neighbours, its index or the window's row count."""
    n = 16
    q, k, v = _inputs(device, n, seed=2, dtype=torch.bfloat16 if device == "cuda" else
                      torch.float32)
    slots = [i % N_SLOTS for i in range(n)]
    positions = [(41 * i + 3) % CTX for i in range(n)]
    together = _attend(q, k, v, *_rows(slots, positions, device), split=split)
    for r in (0, 7, 15):
        alone = _attend(q[r:r + 1], k, v, *_rows([slots[r]], [positions[r]], device),
                        split=split)
        assert torch.equal(alone[0], together[r])
    order = list(range(n))[::-1]
    rev = _attend(q[order], k, v, *_rows([slots[i] for i in order],
                                          [positions[i] for i in order], device), split=split)
    assert torch.equal(rev.flip(0), together)


# rows of 1 to 4 splits of BLOCK_N keys (boundaries at 128, 256, 384) and a pad row
SPLIT_SLOTS = [0, 1, 2, 3, 4, -1, 0, 1]
SPLIT_POSITIONS = [0, BLOCK_N - 1, BLOCK_N, BLOCK_N + 2, 2 * BLOCK_N + 5, 7, CTX - 1,
                   3 * BLOCK_N]


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("window", [0, 40, BLOCK_N + 22])
def test_window_across_splits_is_row_independent(device, window):
    """Splits by absolute position: with a window, those wholly before a row's first key are
    empty and its first split is partial. Each row matches the reference and gives the same
    bits alone as among the others, in any order; the pad row is zero."""
    n = len(SPLIT_SLOTS)
    q, k, v = _inputs(device, n, seed=5)
    rows = _rows(SPLIT_SLOTS, SPLIT_POSITIONS, device)
    together = _attend(q, k, v, *rows, window=window, split=BLOCK_N)
    ref = attend_reference(q.cpu(), k.cpu(), v.cpu(), SPLIT_SLOTS, SPLIT_POSITIONS,
                           window=window)
    torch.testing.assert_close(together.cpu(), ref, rtol=1e-5, atol=1e-5)
    assert not together[SPLIT_SLOTS.index(-1)].any()
    for r in range(n):
        alone = _attend(q[r:r + 1], k, v, *_rows([SPLIT_SLOTS[r]], [SPLIT_POSITIONS[r]], device),
                        window=window, split=BLOCK_N)
        assert torch.equal(alone[0], together[r]), r
    order = [3, 0, 7, 5, 1, 6, 2, 4]
    moved = _attend(q[order], k, v, *_rows([SPLIT_SLOTS[i] for i in order],
                                           [SPLIT_POSITIONS[i] for i in order], device),
                    window=window, split=BLOCK_N)
    assert torch.equal(moved, together[order])


@pytest.mark.parametrize("device", triton_devices())
def test_pad_rows_are_zero_and_read_nothing(device):
    """A pad row (length 0) has one empty split: zero output, whatever its slot holds."""
    q, k, v = _inputs(device, 4, seed=6)
    k[TRASH], v[TRASH] = float("nan"), float("nan")
    slots, positions = [-1, 2, -1, 4], [0, 3 * BLOCK_N, 0, 10]
    for window in (0, 50):
        out = _attend(q, k, v, *_rows(slots, positions, device), window=window, split=BLOCK_N)
        assert not out[0].any() and not out[2].any() and not out.isnan().any()


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("window", [0, BLOCK_N + 22])
def test_the_last_split_combines_as_the_combine_kernel(device, window, monkeypatch):
    """The splits combined by the last program to arrive, and by a second kernel where no
    counters exist (as in a capture made before any): the same bits, the rows' int8 codes
    too (quantize_rows' bits); the counters end at zero."""
    from strata.kernels.quant.a8 import Codes
    from strata.kernels.quant.a8_triton import quantize_rows
    g = torch.Generator().manual_seed(7)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    k, v = (torch.randn(4, 2, CTX, 64, generator=g).to(device, dtype) for _ in range(2))
    q = torch.randn(6, 4, 64, generator=g).to(device, dtype)
    slot = torch.tensor([0, 1, 2, 3, 0, 1], device=device)
    length = torch.tensor([CTX, 1, 0, 2 * BLOCK_N + 1, BLOCK_N + 1, 300], device=device)

    def attend():
        codes = Codes.empty(6, 4 * 64, q.device)
        out = _attend(q, k, v, slot, length, window=window, codes=codes, split=BLOCK_N)
        return out, codes

    out, codes = attend()
    assert not arrive.counters(q.device, 1).any(), "every counter back at zero"
    monkeypatch.setattr(arrive, "counters", lambda device, tiles: None)
    out2, codes2 = attend()
    assert torch.equal(out, out2) and not out[2].any()
    want = quantize_rows(out.view(6, -1))
    for name in ("q", "qp", "dx", "qs", "dc"):
        assert torch.equal(getattr(codes, name), getattr(codes2, name)), name
        assert torch.equal(getattr(codes, name), getattr(want, name)), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_bf16_long_context_on_gpu():
    """bf16, llama3-8b's heads (32 over 8, head size 128), keys up to 4096 positions."""
    g = torch.Generator().manual_seed(4)
    ctx, slots, positions = 4096, [0, 1, 2, -1, 0], [4095, 1000, 64, 0, 17]
    k = torch.randn(4, 8, ctx, 128, generator=g).bfloat16().cuda()
    v = torch.randn(4, 8, ctx, 128, generator=g).bfloat16().cuda()
    q = torch.randn(5, 32, 128, generator=g).bfloat16().cuda()
    slot = torch.tensor([s if s >= 0 else 3 for s in slots], device="cuda")
    length = torch.tensor([p + 1 if s >= 0 else 0 for s, p in zip(slots, positions)],
                          device="cuda")
    out = attend_rows_triton(q, k, v, slot, length)
    ref = attend_reference(q.cpu().double(), k.cpu().double(), v.cpu().double(), slots,
                           positions)
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("window", [0, 1000])
def test_splits_are_row_independent_on_gpu(window, monkeypatch):
    """bf16, llama3-8b's heads (32 over 8, head size 128), 4096 keys in the default splits:
    rows of one to all splits, pad rows among them, give the same bits alone as among 64 rows,
    in every launch (the programs arrive in any order) and through the combine kernel."""
    g = torch.Generator().manual_seed(8)
    ctx, n = 4096, 64
    k = torch.randn(9, 8, ctx, 128, generator=g).bfloat16().cuda()
    v = torch.randn(9, 8, ctx, 128, generator=g).bfloat16().cuda()
    q = torch.randn(n, 32, 128, generator=g).bfloat16().cuda()
    slots = [-1 if i in (5, 40) else i % 8 for i in range(n)]
    positions = [0, 255, 256, 1000, ctx - 1] + [(997 * i) % ctx for i in range(5, n)]
    slot = torch.tensor([s if s >= 0 else 8 for s in slots], device="cuda")
    length = torch.tensor([p + 1 if s >= 0 else 0 for s, p in zip(slots, positions)],
                          device="cuda")
    together = attend_rows_triton(q, k, v, slot, length, window=window)
    ref = attend_reference(q.cpu().double(), k.cpu().double(), v.cpu().double(), slots,
                           positions, window=window)
    err = (together.cpu().double() - ref).norm() / ref.norm()
    assert err < 1e-2, err
    assert not together[5].any() and not together[40].any()
    for r in (0, 1, 2, 3, 4, 17):
        alone = attend_rows_triton(q[r:r + 1], k, v, slot[r:r + 1], length[r:r + 1],
                                   window=window)
        assert torch.equal(alone[0], together[r]), r
    for _ in range(20):
        assert torch.equal(attend_rows_triton(q, k, v, slot, length, window=window), together)
    monkeypatch.setattr(arrive, "counters", lambda device, tiles: None)
    assert torch.equal(attend_rows_triton(q, k, v, slot, length, window=window), together)
