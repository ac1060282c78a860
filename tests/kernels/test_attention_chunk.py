"""The blocked prompt-chunk attention kernel (strata/kernels/attention/chunk_triton.py) against
the float64 reference, and its row independence bit for bit: on the CPU through Triton's
interpreter (run with TRITON_INTERPRET=1 set before Python starts; skipped otherwise, and where
triton is not installed; fp32 only, the interpreter's bf16 tl.dot is wrong), and on CUDA
(marked gpu; fp32 and bf16, llama3-8b's and SmolLM2's head shapes). The plain-torch dispatch
of attend_chunk runs everywhere."""
from __future__ import annotations

import math
import os

import pytest
import torch

from strata.kernels.attention.window import attend_chunk, attend_reference
from conftest import triton_devices

try:
    import triton  # noqa: F401
except ImportError:
    triton = None
needs_triton = pytest.mark.skipif(triton is None, reason="triton is not installed")

N_SLOTS = 5
TRASH = N_SLOTS          # pad rows point at a spare slot
CHUNK_SLOT = 3
SMALL = (6, 2, 24, 640)  # heads, kv heads, head size, context: group 3, head size not 2^k
LLAMA = (32, 8, 128, 4096)
SMOLLM2 = (9, 3, 64, 4096)


def _caches(shape, device, dtype, seed=0):
    n_heads, n_kv, hd, ctx = shape
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(N_SLOTS + 1, n_kv, ctx, hd, generator=g)
    v = torch.randn(N_SLOTS + 1, n_kv, ctx, hd, generator=g)
    return k.to(device, dtype), v.to(device, dtype)


def _queries(shape, n_rows, device, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_rows, shape[0], shape[2], generator=g).to(device, dtype)


def _rows(slots, positions, device):
    """slot and length tensors; slot -1 marks a pad row (it carries TRASH, length 0)."""
    return (torch.tensor([s if s >= 0 else TRASH for s in slots], device=device),
            torch.tensor([p + 1 if s >= 0 else 0 for s, p in zip(slots, positions)],
                         device=device))


def _chunk(n_rows, start, pads=()):
    """A chunk of n_rows rows of CHUNK_SLOT at positions start.., the rows at `pads` padded."""
    slots = [-1 if r in pads else CHUNK_SLOT for r in range(n_rows)]
    return slots, [start + r for r in range(n_rows)]


def _attend(q, k, v, slot, length, **kw):
    from strata.kernels.attention.chunk_triton import attend_chunk_triton
    try:
        return attend_chunk_triton(q, k, v, slot, length, **kw)
    except Exception as e:  # triton's interpreter vs a numpy it does not support yet
        if "0-dimensional" in str(e):
            pytest.skip(f"triton's interpreter fails with this numpy: {e}")
        raise


def _reference(q, k, v, slot, length):
    """float64 softmax(q k^T / sqrt(hd)) v of each row over keys [0, length) of its slot,
    vectorized over the rows (for the long-context shapes); zero for a pad row."""
    n_rows, n_heads, hd = q.shape
    n_kv, ctx = k.shape[1], k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for s in slot[length > 0].unique().tolist():
        rows = ((slot == s) & (length > 0)).nonzero().flatten()
        qg = q[rows].double().view(len(rows), n_kv, n_heads // n_kv, hd)
        scores = torch.einsum("rkgd,kpd->rkgp", qg, k[s].double()) / math.sqrt(hd)
        masked = torch.arange(ctx, device=q.device)[None, :] >= length[rows][:, None]
        scores = scores.masked_fill(masked[:, None, None, :], float("-inf"))
        out[rows] = torch.einsum("rkgp,kpd->rkgd", torch.softmax(scores, -1),
                                 v[s].double()).reshape(len(rows), n_heads, hd)
    return out


@pytest.fixture
def rowwise_interpreter_dot(monkeypatch):
    """On the CPU, Triton's interpreter computes tl.dot with numpy's BLAS matmul, which is
    itself not row-independent: OpenBLAS's sgemm gives a row different last bits at different
    row indices of the same product (its micro-kernel, measured with numpy 2.3). The tensor
    cores compute every element of a tile alike (the GPU tests check the real thing), so for the
    bit-for-bit tests on the CPU the interpreter's dot becomes a broadcast product summed over
    the shared axis, whose order is the same for every row; the kernel's own logic (masks,
    no-op key blocks, the block's slot) is what these tests check there."""
    if os.environ.get("TRITON_INTERPRET") != "1" or triton is None:
        return
    import inspect

    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        dtype = d.data.dtype
        prod = a.data.astype(dtype)[:, :, None] * b.data.astype(dtype)[None, :, :]
        return interpreter.TensorHandle(prod.sum(axis=1, dtype=dtype) + d.data,
                                        d.dtype.scalar)

    # the replacement assumes the signature of triton 3.x's interpreter
    assert list(inspect.signature(interpreter.InterpreterBuilder.create_dot).parameters) == [
        "self", "a", "b", "d", "input_precision", "max_num_imprecise_acc"]
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def _pads(n_rows):
    """A pad row in the middle and up to 3 at the end (none for a single row)."""
    if n_rows < 4:
        return ()
    return (n_rows // 2,) + tuple(range(n_rows - min(3, n_rows // 8 + 1), n_rows))


# --- 1. against the float64 reference -----------------------------------------------------

@needs_triton
@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("n_rows", [1, 7, 32, 100, 512])
@pytest.mark.parametrize("block_m", [None, 4])
def test_chunk_matches_reference_fp32(device, n_rows, block_m):
    """fp32, start 37 (no multiple of 64), so the rows' lengths cross key blocks anywhere."""
    k, v = _caches(SMALL, device, torch.float32)
    q = _queries(SMALL, n_rows, device, torch.float32)
    slots, positions = _chunk(n_rows, 37, _pads(n_rows))
    out = _attend(q, k, v, *_rows(slots, positions, device), block_m=block_m)
    ref = attend_reference(q.cpu(), k.cpu(), v.cpu(), slots, positions)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    for r, s in enumerate(slots):
        if s < 0:
            assert torch.equal(out[r].cpu(), torch.zeros(SMALL[0], SMALL[2])), "pad rows are 0"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", [SMALL, LLAMA, SMOLLM2], ids=["small", "llama", "smollm2"])
@pytest.mark.parametrize("n_rows", [1, 7, 32, 100, 512])
def test_chunk_matches_reference_bf16_on_gpu(shape, n_rows):
    ctx = shape[3]
    k, v = _caches(shape, "cuda", torch.bfloat16)
    q = _queries(shape, n_rows, "cuda", torch.bfloat16)
    slots, positions = _chunk(n_rows, ctx - n_rows - 37, _pads(n_rows))   # up to the end
    slot, length = _rows(slots, positions, "cuda")
    out = _attend(q, k, v, slot, length)
    ref = _reference(q, k, v, slot, length)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-2, err
    torch.testing.assert_close(out.double(), ref, rtol=3e-2, atol=3e-2)
    assert not out[length == 0].any(), "pad rows are zero"


def test_vectorized_reference_matches_the_per_row_one():
    k, v = _caches(SMALL, "cpu", torch.float32)
    q = _queries(SMALL, 20, "cpu", torch.float32)
    slots, positions = [0, 3, -1, 3, 1, -1] + [4] * 14, [0, 64, 9, 300, 639, 0] + list(range(14))
    ref = _reference(q, k, v, *_rows(slots, positions, "cpu"))
    torch.testing.assert_close(ref, attend_reference(q.double(), k.double(), v.double(), slots,
                                                     positions))


# --- 2. a row's bits do not depend on the other rows of its call -------------------------

def _independence_cases():
    cases = []
    if os.environ.get("TRITON_INTERPRET") == "1":
        cases += [pytest.param("cpu", SMALL, torch.float32, None, id="cpu-small-fp32"),
                  pytest.param("cpu", SMALL, torch.float32, 4, id="cpu-small-fp32-bm4")]
    if torch.cuda.is_available():
        for shape, name in ((SMALL, "small"), (LLAMA, "llama"), (SMOLLM2, "smollm2")):
            for dtype in (torch.float32, torch.bfloat16):
                cases.append(pytest.param("cuda", shape, dtype, None, marks=pytest.mark.gpu,
                                          id=f"cuda-{name}-{str(dtype)[6:]}"))
    return cases or [pytest.param("cpu", SMALL, torch.float32, None, marks=pytest.mark.skip(
        reason="needs CUDA, or TRITON_INTERPRET=1 for Triton's interpreter"))]


@needs_triton
@pytest.mark.parametrize("device,shape,dtype,block_m", _independence_cases())
def test_chunk_rows_are_independent(device, shape, dtype, block_m, rowwise_interpreter_dot):
    """A chunk's rows computed in one call equal (torch.equal) the same rows computed in calls
    of other sizes, at other indices, after other numbers of pad rows, in another order."""
    n, start = 64, 101 if shape == SMALL else 3000
    k, v = _caches(shape, device, dtype, seed=2)
    q = _queries(shape, n, device, dtype, seed=3)
    slots, positions = _chunk(n, start)
    attend = lambda q_, slots_, positions_: _attend(  # noqa: E731
        q_, k, v, *_rows(slots_, positions_, device), block_m=block_m)
    together = attend(q, slots, positions)
    for size in (1, 5, 16, 64):
        for i in range(0, n, size):
            part = attend(q[i:i + size], slots[i:i + size], positions[i:i + size])
            assert torch.equal(part, together[i:i + size]), (size, i)
    junk = _queries(shape, 40, device, dtype, seed=4) * 100   # what pad rows may hold
    for before in (1, 3, 13, 31):
        qq = torch.cat([junk[:before], q, junk[before:before + 2]])
        out = attend(qq, [-1] * before + slots + [-1, -1], [0] * before + positions + [0, 0])
        assert torch.equal(out[before:before + n], together), before
        assert not out[:before].any() and not out[before + n:].any()
    order = list(range(n))[::-1]
    rev = attend(q[order], [slots[i] for i in order], [positions[i] for i in order])
    assert torch.equal(rev.flip(0), together)
    # pad rows between the rows, every 7th
    idx, s2, p2, where = [], [], [], []
    for r in range(n):
        if r % 7 == 3:
            idx.append(0), s2.append(-1), p2.append(0)
        where.append(len(idx))
        idx.append(r), s2.append(slots[r]), p2.append(positions[r])
    out = attend(q[idx], s2, p2)
    assert torch.equal(out[where], together)


# --- 3. other slots and later keys are never read ----------------------------------------

@needs_triton
@pytest.mark.parametrize("device", triton_devices())
def test_chunk_ignores_other_slots_and_later_keys(device, rowwise_interpreter_dot):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    n, start = 50, 70
    k, v = _caches(SMALL, device, dtype, seed=5)
    q = _queries(SMALL, n, device, dtype, seed=6)
    slots, positions = _chunk(n, start, pads=(0, 17, 49))
    slot, length = _rows(slots, positions, device)
    slot[17] = 0                 # a pad row may carry any slot
    clean = _attend(q, k, v, slot, length)
    k2, v2 = k.clone(), v.clone()
    for s in range(N_SLOTS + 1):
        if s != CHUNK_SLOT:
            k2[s], v2[s] = float("inf"), float("nan")
    k2[CHUNK_SLOT, :, start + n:] = float("-inf")   # past the chunk's last row: never read
    v2[CHUNK_SLOT, :, start + n:] = float("nan")
    poisoned = _attend(q, k2, v2, slot, length)
    assert torch.equal(poisoned, clean)
    assert not poisoned[[0, 17, 49]].any()
    pads_only = _attend(q[:20], k2, v2, torch.tensor([0, 1, 5, 4] * 5, device=device),
                        torch.zeros(20, dtype=torch.int64, device=device))
    assert not pads_only.isnan().any() and not pads_only.any()


# --- 4. CUDA graphs ------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_chunk_kernel_in_a_cuda_graph():
    """Captured once, replayed over two different chunks: the same bits as eager runs."""
    n = 256
    k, v = _caches(LLAMA, "cuda", torch.bfloat16, seed=7)
    q = _queries(LLAMA, n, "cuda", torch.bfloat16, seed=8)
    slot, length = _rows(*_chunk(n, 1000, pads=(5, n - 1)), "cuda")
    eager = _attend(q, k, v, slot, length)             # compiles before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _attend(q, k, v, slot, length)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)
    q.copy_(_queries(LLAMA, n, "cuda", torch.bfloat16, seed=9))
    s2, l2 = _rows(*_chunk(n, 3700, pads=(0, 100)), "cuda")
    s2[0] = 1
    slot.copy_(s2), length.copy_(l2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, _attend(q, k, v, slot, length))


# --- the dispatch --------------------------------------------------------------------------

def test_attend_chunk_dispatch_matches_reference():
    """attend_chunk on CPU tensors: plain torch, or the Triton kernel under TRITON_INTERPRET=1."""
    if os.environ.get("TRITON_INTERPRET") == "1" and triton is None:
        pytest.skip("TRITON_INTERPRET=1 without triton")
    k, v = _caches(SMALL, "cpu", torch.float32, seed=10)
    q = _queries(SMALL, 40, "cpu", torch.float32, seed=11)
    slots, positions = _chunk(40, 190, pads=(3, 39))
    slot, length = _rows(slots, positions, "cpu")
    try:
        out = attend_chunk(q, k, v, slot, length)
    except Exception as e:  # triton's interpreter vs a numpy it does not support yet
        if "0-dimensional" in str(e):
            pytest.skip(f"triton's interpreter fails with this numpy: {e}")
        raise
    ref = attend_reference(q, k, v, slots, positions)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not out[[3, 39]].any()
