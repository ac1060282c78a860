"""The fixed-order Triton attention kernel (strata/kernels/attention/decode_triton.py) against the
float64 reference: on the CPU through Triton's interpreter (run with TRITON_INTERPRET=1 set
before Python starts; skipped otherwise, and where triton is not installed), and on CUDA
(marked gpu). Row independence is checked bit for bit."""
from __future__ import annotations


import pytest
import torch

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


def _attend(*args):
    try:
        return attend_rows_triton(*args)
    except Exception as e:  # triton's interpreter vs a numpy it does not support yet
        if "0-dimensional" in str(e):
            pytest.skip(f"triton's interpreter fails with this numpy: {e}")
        raise


@pytest.mark.parametrize("device", triton_devices())
def test_kernel_matches_reference(device):
    q, k, v = _inputs(device, len(SLOTS))
    out = _attend(q, k, v, *_rows(SLOTS, POSITIONS, device))
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
def test_kernel_is_row_independent(device):
    """A row's bits do not depend on its neighbours, its index or the window's row count."""
    n = 16
    q, k, v = _inputs(device, n, seed=2, dtype=torch.bfloat16 if device == "cuda" else
                      torch.float32)
    slots = [i % N_SLOTS for i in range(n)]
    positions = [(41 * i + 3) % CTX for i in range(n)]
    together = _attend(q, k, v, *_rows(slots, positions, device))
    for r in (0, 7, 15):
        alone = _attend(q[r:r + 1], k, v, *_rows([slots[r]], [positions[r]], device))
        assert torch.equal(alone[0], together[r])
    order = list(range(n))[::-1]
    rev = _attend(q[order], k, v, *_rows([slots[i] for i in order],
                                          [positions[i] for i in order], device))
    assert torch.equal(rev.flip(0), together)


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
