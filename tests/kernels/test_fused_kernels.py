"""The fused row-wise kernels (strata/kernels/fused.py): the plain-torch versions against the
plain layer arithmetic (norms.py, rope.py), and the Triton versions against the torch ones on
the CPU through Triton's interpreter (TRITON_INTERPRET=1 set before Python starts) and on CUDA
(marked gpu)."""
from __future__ import annotations


import pytest
import torch

from strata.kernels import fused
from strata.kernels.norms import rms_norm
from strata.kernels.rope import apply_rope, rope_table
from conftest import triton_devices

H, KVH, HD, CTX, SLOTS = 6, 2, 24, 64, 3



def _triton():
    triton_kernels = pytest.importorskip("strata.kernels.fused_triton")
    return triton_kernels


def _call(f, *args):
    try:
        return f(*args)
    except Exception as e:  # triton's interpreter vs a numpy it does not support yet
        if "0-dimensional" in str(e):
            pytest.skip(f"triton's interpreter fails with this numpy: {e}")
        raise


def test_torch_versions_match_the_list_path():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 72, generator=g), torch.randn(72, generator=g)
    torch.testing.assert_close(fused.rms_norm_rows_torch(x, w, 1e-5), rms_norm(x, w, 1e-5))
    cos, sin = rope_table(HD, 10000.0, CTX)
    qkv = torch.randn(5, (H + 2 * KVH) * HD, generator=g)
    slot, pos = torch.tensor([0, 1, 2, 3, 0]), torch.tensor([0, 5, 63, 0, 7])
    k, v = torch.zeros(SLOTS + 1, KVH, CTX, HD), torch.zeros(SLOTS + 1, KVH, CTX, HD)
    q = fused.rope_write_kv_torch(qkv, cos, sin, slot, pos, k, v, H)
    heads = qkv.view(5, H + 2 * KVH, HD)
    torch.testing.assert_close(q, apply_rope(heads[:, :H], cos[pos], sin[pos]))
    assert torch.equal(k[slot, :, pos], apply_rope(heads[:, H:H + KVH], cos[pos], sin[pos]))
    assert torch.equal(v[slot, :, pos], heads[:, H + KVH:])
    assert int((k != 0).any(-1).sum()) == 5 * KVH  # nothing else written


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_silu_mul(device, dtype):
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter's bf16 is not the GPU's")
    kernels = _triton()
    g = torch.Generator().manual_seed(1)
    for n_cols in (72, 576, 4096):
        x = torch.randn(8, n_cols, generator=g).to(device, dtype)
        w = (1 + 0.1 * torch.randn(n_cols, generator=g)).to(device, dtype)
        got = _call(kernels.rms_norm_rows, x, w, 1e-5)
        want = fused.rms_norm_rows_torch(x, w, 1e-5)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        # a row alone gives the same bits as among others
        assert torch.equal(_call(kernels.rms_norm_rows, x[3:4], w, 1e-5)[0], got[3])
    gu = torch.randn(8, 2 * 1536, generator=g).to(device, dtype)
    got = _call(kernels.silu_mul, gu)
    torch.testing.assert_close(got, fused.silu_mul_torch(gu), rtol=1e-2, atol=1e-3)
    assert torch.equal(_call(kernels.silu_mul, gu[5:6])[0], got[5])


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("rope_dim", [HD, 16])
def test_rope_write_kv(device, rope_dim):
    kernels = _triton()
    g = torch.Generator().manual_seed(2)
    cos, sin = (t.to(device) for t in rope_table(rope_dim, 10000.0, CTX))
    qkv = torch.randn(5, (H + 2 * KVH) * HD, generator=g).to(device)
    slot = torch.tensor([0, 1, 2, SLOTS, 0], device=device)   # row 3: a pad row (trash slot)
    pos = torch.tensor([0, 5, 63, 0, 7], device=device)
    outs = []
    for f in (kernels.rope_write_kv, fused.rope_write_kv_torch):
        k = torch.zeros(SLOTS + 1, KVH, CTX, HD, device=device)
        v = torch.zeros(SLOTS + 1, KVH, CTX, HD, device=device)
        outs.append((_call(f, qkv, cos, sin, slot, pos, k, v, H), k, v))
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("norm", [False, True])
def test_rope_write_kv_gives_the_same_bits_for_any_heads_a_program(device, norm):
    """A program's heads (1 on CUDA; off CUDA all of a row's, padded to a power of two): q, k
    and v the same bits with 1, 2, 4 or 16 heads a program (more than the row has), with
    halves and a partial rotation, with the heads' norms and without. On CUDA a tile of
    several heads sums each head's squares in another order than a tile of one (which CUDA
    stages run), so there the normed heads agree to rounding, not to the bit."""
    kernels = _triton()
    g = torch.Generator().manual_seed(4)
    cos, sin = (t.to(device) for t in rope_table(16, 10000.0, CTX))
    qkv = (3 * torch.randn(5, (H + 2 * KVH) * HD, generator=g)).to(device)
    norms = ((1 + 0.1 * torch.randn(HD, generator=g)).to(device),
             (1 + 0.1 * torch.randn(HD, generator=g)).to(device), 1e-6) if norm else None
    slot = torch.tensor([0, 1, 2, SLOTS, 0], device=device)
    pos = torch.tensor([0, 5, 63, 0, 7], device=device)
    outs = []
    for heads in (1, 2, 4, 16):
        k = torch.zeros(SLOTS + 1, KVH, CTX, HD, device=device)
        v = torch.zeros(SLOTS + 1, KVH, CTX, HD, device=device)
        q = _call(kernels.rope_write_kv, qkv, cos, sin, slot, pos, k, v, H, True, norms, heads)
        outs.append((q, k, v))
    assert outs[0][1].abs().sum() > 0 and outs[0][2].abs().sum() > 0
    for out in outs[1:]:
        if norm and device == "cuda":
            for a, b in zip(out, outs[0]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        else:
            assert all(torch.equal(a, b) for a, b in zip(out, outs[0]))


@pytest.mark.parametrize("device", triton_devices())
def test_rope_write_kv_norms_the_heads_first(device):
    """head_norms (qwen3, gemma3): the Triton kernel norms each q and k head in the program
    that rotates it, as rms_norm_rows over the heads and then RoPE give (v untouched), and a
    row alone the same bits as among others."""
    kernels = _triton()
    g = torch.Generator().manual_seed(3)
    cos, sin = (t.to(device) for t in rope_table(HD, 10000.0, CTX))
    qkv = (3 * torch.randn(5, (H + 2 * KVH) * HD, generator=g)).to(device)
    norms = ((1 + 0.1 * torch.randn(HD, generator=g)).to(device),
             (1 + 0.1 * torch.randn(HD, generator=g)).to(device), 1e-6)
    slot = torch.tensor([0, 1, 2, SLOTS, 0], device=device)
    pos = torch.tensor([0, 5, 63, 0, 7], device=device)
    outs = []
    for fused_norm in (True, False):
        k = torch.zeros(SLOTS + 1, KVH, CTX, HD, device=device)
        v = torch.zeros(SLOTS + 1, KVH, CTX, HD, device=device)
        if fused_norm:
            q = _call(kernels.rope_write_kv, qkv, cos, sin, slot, pos, k, v, H, False, norms)
        else:
            normed = fused.norm_heads(qkv, H, KVH, norms, None, False)
            q = fused.rope_write_kv_torch(normed, cos, sin, slot, pos, k, v, H)
        outs.append((q, k, v))
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(outs[0][0], fused.rope_write_kv_torch(   # the norm did something
        qkv, cos, sin, slot, pos, torch.zeros_like(outs[0][1]), torch.zeros_like(outs[0][2]), H))
    k = torch.zeros(SLOTS + 1, KVH, CTX, HD, device=device)
    v = torch.zeros_like(k)
    alone = _call(kernels.rope_write_kv, qkv[2:3], cos, sin, slot[2:3], pos[2:3], k, v, H, False,
                  norms)
    assert torch.equal(alone[0], outs[0][0][2])
    assert torch.equal(k[2, :, 63], outs[0][1][2, :, 63])
