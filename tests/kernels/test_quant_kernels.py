"""The quantized-weight kernels (kernels/quant/float_triton.py) for every block type with a
kernel: the repacked planes hold the file's bytes and give gguf-py's values, each kernel matches
gguf-py's dequantization followed by a plain matmul at window sizes 1 to 64, and a row alone
gives the same bits as among 7, 15, 31 and 63 others (torch.equal). Under the interpreter
(the "cpu" cases: fp32, whose bf16 is not the GPU's) and on CUDA (bf16, marked gpu)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize, quantize

from strata.kernels import fused
from strata.kernels.policy import KernelPolicy
from strata.kernels.quant.weight import KERNEL_TYPES, QuantWeight, dequantize_torch, random_blocks
from strata.model.kquant_blocks import random_kquant_blocks
from conftest import triton_devices
from test_attention_chunk import rowwise_interpreter_dot  # noqa: F401 (a fixture)

TYPES = KERNEL_TYPES
EPS = 1e-5


def _blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row bytes] of a GGUF tensor of that type: gguf-py's quantization of
    Gaussian weights, or random valid K-quant blocks."""
    rng = np.random.default_rng(seed)
    if qtype.endswith("_K") or qtype.startswith("IQ"):   # gguf-py quantizes neither
        return random_kquant_blocks(qtype, rows, cols, rng)
    return quantize(rng.standard_normal((rows, cols), dtype=np.float32) * 0.02, QType[qtype])


def _weight(qtype: str, rows: int, cols: int, device: str, seed: int = 0):
    raw = _blocks(qtype, rows, cols, seed)
    ref = torch.from_numpy(dequantize(raw, QType[qtype]).reshape(rows, cols)).double()
    return QuantWeight.from_blocks(qtype, torch.from_numpy(raw), cols, device), ref


def _like(device: str) -> dict:
    return {"device": device, "dtype": torch.float32 if device == "cpu" else torch.bfloat16}


def _policy(device: str, **changes) -> KernelPolicy:
    policy = KernelPolicy.for_device(device)
    assert policy.triton
    return dataclasses.replace(policy, **changes)


@pytest.mark.parametrize("qtype", TYPES)
def test_the_planes_hold_the_files_bytes_and_values(qtype):
    raw = _blocks(qtype, 6, 512, seed=1)
    w = QuantWeight.from_blocks(qtype, torch.from_numpy(raw), 512, "cpu")
    assert w.nbytes == raw.nbytes and w.shape == (6, 512) and w.qtype == qtype
    want = torch.from_numpy(dequantize(raw, QType[qtype]).reshape(6, 512))
    assert torch.equal(dequantize_torch(qtype, w.parts[0].planes), want)
    index = torch.tensor([4, 0, 4])
    assert torch.equal(w.gather(index, torch.float32, triton=False), want[index])


def test_fused_parts_of_different_types_stay_apart_and_neighbours_merge():
    a, _ = _weight("Q4_K", 32, 256, "cpu")
    b, _ = _weight("Q4_K", 16, 256, "cpu", seed=1)
    c, _ = _weight("Q6_K", 16, 256, "cpu", seed=2)
    w = QuantWeight.cat([a, b, c])
    assert [(p.qtype, p.rows) for p in w.parts] == [("Q4_K", 48), ("Q6_K", 16)]
    assert w.shape == (64, 256) and w.qtype == "Q4_K+Q6_K" and w.nbytes == a.nbytes + \
        b.nbytes + c.nbytes
    dense = torch.cat([dequantize_torch(p.qtype, p.planes) for p in a.parts + b.parts
                       + c.parts])
    assert torch.equal(w.dense(torch.float32, triton=False), dense)


def _reference(kind: str, x, w_ref, norm, res):
    """float64: rmsnorm folded as the kernels fold it (x * g rounded to x's dtype)."""
    xd = x.double()
    if norm is not None:
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True).double() + EPS)
        xd = (x.float() * norm.float()).to(x.dtype).double() * scale
    out = xd @ w_ref.t()
    if kind == "gate_up":
        f = w_ref.shape[0] // 2
        return F.silu(out[:, :f]) * out[:, f:]
    return out + res.double() if res is not None else out


def _project(kind: str, x, w, norm, res, policy):
    if kind == "qkv":
        return fused.norm_linear_rows(x, norm, EPS, w, policy, decode=True)
    if kind == "gate_up":
        return fused.norm_gate_up_silu(x, norm, EPS, w, policy, decode=True)
    if kind == "head":
        return fused.norm_head_rows(x, norm, EPS, w, policy)
    return fused.linear_rows(x, w, res, policy, decode=True)


KINDS = ("plain", "res", "qkv", "gate_up", "head")


SPLITS = {"split": {}, "whole": {"quant_split_programs": 0}}   # K split by the policy, or not


def _skip_whole_on_cpu(device: str, qtype: str, splits: str) -> None:
    if device == "cpu" and splits == "whole" and qtype != "Q4_K":
        pytest.skip("unsplit K under the interpreter for Q4_K (the same code for every type)")


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("qtype", TYPES)
def test_kernels_match_gguf_dequantization_and_a_matmul(device, splits, qtype):
    """Every projection of a decode window, at window sizes across the row tiles (under the
    interpreter, ~50 ms a program and group: 17 rows over two row blocks), K split into
    ranges added in order (the policy's splits: 2 to 4 at these shapes) or whole."""
    _skip_whole_on_cpu(device, qtype, splits)
    like = _like(device)
    g = torch.Generator().manual_seed(5)
    n, k = (64, 256) if device == "cpu" else (96, 512)
    w, ref = _weight(qtype, n, k, device, seed=3)
    ref = ref.to(device)
    norm = (1 + 0.1 * torch.randn(k, generator=g)).to(**like)
    tol = 1e-5 if like["dtype"] == torch.float32 else 2e-2
    sizes = (17,) if device == "cpu" else (1, 8, 16, 17, 32, 40, 64)
    for kind in KINDS:
        for m in sizes:
            x = torch.randn(m, k, generator=g).to(**like)
            res = torch.randn(m, n, generator=g).to(**like) if kind == "res" else None
            got = _project(kind, x, w, norm if kind in ("qkv", "gate_up", "head") else None,
                           res, _policy(device, **SPLITS[splits]))
            want = _reference(kind, x, ref, norm if kind in ("qkv", "gate_up", "head")
                              else None, res)
            assert got.dtype == (torch.float32 if kind == "head" else like["dtype"])
            err = ((got.double() - want).norm() / want.norm()).item()
            assert err < tol, f"{qtype} {kind} {m} rows: relative error {err:.2e}"


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("qtype", TYPES)
def test_dequantized_rows_are_gguf_pys(device, qtype):
    """The prompt chunk's dense weight and the embedding's gather: gguf-py's values (fp32
    within rounding of the scale product; bf16 as those values rounded)."""
    w, ref = _weight(qtype, 40, 512, device, seed=4)
    like = _like(device)
    dense = w.dense(like["dtype"], triton=True)
    assert dense.shape == (40, 512)
    torch.testing.assert_close(dense.double().cpu(), ref.to(like["dtype"]).double(),
                               rtol=1e-6, atol=1e-9)
    index = torch.tensor([39, 0, 7, 7], device=device)
    assert torch.equal(w.gather(index, like["dtype"], triton=True), dense[index])


def _windows(x: torch.Tensor, g: torch.Generator, sizes=(8, 16, 32, 64)):
    """(window, index of x's row): x alone, then among 7, 15, 31 and 63 random rows (sizes)."""
    yield x, 0
    for n in sizes:
        w = torch.randn(n, x.shape[1], generator=g).to(x.device, x.dtype)
        at = (5 * n) // 7
        w[at] = x[0]
        yield w, at


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("tiles", ["fit", "16"])
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("qtype", TYPES)
def test_a_rows_bits_do_not_depend_on_its_window(device, tiles, splits, qtype,
                                                 rowwise_interpreter_dot):
    """Row tiles that fit the window (one program reads a weight tile for all rows) and
    16-row tiles over row blocks; every projection kind on CUDA. Under the interpreter the
    fitting tiles, and the two kernels' every variant for Q4_K at every size, the residual
    projection and gate/up for the other types (the same group code) alone and among 8 and 64
    rows (the smallest and the largest row tile)."""
    if device == "cpu" and tiles == "16":
        pytest.skip("16-row tiles over row blocks: on CUDA (the interpreter's time)")
    _skip_whole_on_cpu(device, qtype, splits)
    every = device != "cpu" or qtype == "Q4_K"
    kinds = KINDS if every else ("res", "gate_up")
    sizes = (8, 16, 32, 64) if every else (8, 64)
    like = _like(device)
    g = torch.Generator().manual_seed(6)
    w, _ = _weight(qtype, 64, 256, device, seed=5)
    norm = (1 + 0.1 * torch.randn(256, generator=g)).to(**like)
    policy = _policy(device, **SPLITS[splits], **({"row_tiles": (16, 32, 64), "fit_min_bytes": 0}
                                                  if tiles == "fit" else {"row_tiles": (16,)}))
    x = torch.randn(1, 256, generator=g).to(**like)
    for kind in kinds:
        first = None
        for window, at in _windows(x, g, sizes):
            res = torch.randn(window.shape[0], 64, generator=g).to(**like)
            res[at] = 0.5
            out = _project(kind, window, w, norm, res if kind == "res" else None, policy)
            if first is None:
                first = out[at]
            assert torch.equal(out[at], first), f"{qtype} {kind}: {window.shape[0]} rows differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("kind, n, k", [("qkv", 6144, 4096), ("res", 4096, 14336),
                                        ("gate_up", 28672, 4096), ("head", 128256, 4096)])
def test_rows_are_invariant_at_llama3_8b_shapes_on_gpu(qtype, kind, n, k):
    g = torch.Generator().manual_seed(7)
    like = _like("cuda")
    raw = random_blocks(qtype, n, k, torch.Generator(device="cuda").manual_seed(8))
    w = QuantWeight.from_blocks(qtype, raw, k, "cuda")
    norm = (1 + 0.1 * torch.randn(k, generator=g)).to(**like)
    x = torch.randn(1, k, generator=g).to(**like)
    first = None
    for window, at in _windows(x, g):
        res = torch.zeros(window.shape[0], n, **like)
        out = _project(kind, window, w, norm, res if kind == "res" else None,
                       _policy("cuda"))
        first = out[at] if first is None else first
        assert torch.equal(out[at], first), f"{qtype} {kind}: {window.shape[0]} rows differ"


def test_the_policy_splits_k_only_where_column_blocks_are_few():
    """Splits divide K's steps, fill the GPU's programs, and leave a wide weight whole."""
    policy = KernelPolicy(triton=True)
    assert policy.quant_blocks("Q4_K", 4096, 4096, "res")["splits"] == 8      # 64 column blocks
    assert policy.quant_blocks("Q4_K", 28672, 4096, "gate_up")["splits"] == 4  # 224 blocks
    assert policy.quant_blocks("Q6_K", 128256, 4096, "head")["splits"] == 1
    smol = policy.quant_blocks("Q4_1", 576, 576, "res")                        # 9 steps of 64
    assert smol["block_k"] == 64 and smol["splits"] == 3
    assert dataclasses.replace(policy, quant_split_programs=0).quant_blocks(
        "Q4_K", 4096, 4096, "res")["splits"] == 1
