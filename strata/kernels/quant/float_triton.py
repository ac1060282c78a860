"""Triton kernels over quantized weights in their packed GGUF blocks (weight.py says
the layout; the plain-torch references are quant.dequantize_torch and fused's):

    quant_mm        out = x @ w^T (+ res), or rmsnorm(x) @ w^T, for a decode window (up to 64
                    rows): the skinny kernel's structure (kernels/skinny_triton.py) with the
                    weight tile dequantized in registers
    quant_gate_up   silu(g) * u of [g | u] = rmsnorm(x) @ [w_gate; w_up]^T
    dequant_rows    rows of a weight dequantized to x's dtype: a token embedding's gather, and
                    the dense weight a prompt chunk's matmul reads

Each program owns BLOCK_N weight rows and BLOCK_M window rows and walks K in order, BLOCK_K
quants a step: it loads the step's packed words (16-byte loads along each row), splits them
into codes with shifts whose results stay in the loading thread (tl.join), scales each scale
group's codes (w = a * u + b, a and b per row and group), and feeds the tile in x's dtype to
one MMA, as the skinny kernel feeds its bf16 tile: a weight is read once and never widened in
memory. The dequantized weight is rounded to bf16 as a bf16 file's weight is.

A weight of few column blocks (a 4096-row projection: 64 programs for 132 SMs) leaves most SMs
idle, and a program's dequantization is a long chain of dependent instructions: such weights
are split along K into `splits` ranges (kernels/policy.py picks them from the shape), each
program writes its range's fp32 partial sums (and the rows' partial sums of squares) to a
scratch tensor, and `_split_sum_kernel` adds the ranges in order and finishes as the unsplit
kernel does (norm scale, residual, activation).

Batch invariance as in the skinny kernels: BLOCK_N, BLOCK_K and the group order come from the
weight's type and shape (kernels/policy.py), so does the split along K, every window row is computed alone with the same
order of sums whatever the window's size and the row tile, and rows past M are never stored.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.fused_triton import ACTS, gate_act
from strata.kernels.pdl import enter, launch_options
from strata.kernels.quant.blocks import BLOCKS, Part, program_width
from strata.kernels.quant.reads import TYPE_IDS, _planes, _weights
from strata.kernels.skinny_triton import MAX_ROWS, ROW_TILES, _row_scale, _x_tile

@triton.jit
def _quant_mm_kernel(x_ptr, g_ptr, p0, p1, p2, p3, s0, s1, s2, s3, res_ptr, out_ptr, sq_ptr,
                     M, N, K, KS, eps, stride_xm, stride_rm, stride_om,
                     QTYPE: tl.constexpr, S: tl.constexpr, NORM: tl.constexpr,
                     HAS_RES: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                     PDL: tl.constexpr):
    """Quants KS * program_id(2) .. + KS of each row; with SPLIT, the fp32 partial sums to
    out [splits, M, N] and the rows' partial sums of squares to sq [splits, M]."""
    enter(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)            # out^T: the weight is the MMA's M
    sq = tl.zeros([BLOCK_M], tl.float32)
    first = tl.program_id(2) * KS
    for k0 in tl.range(first, first + KS, BLOCK_K, num_stages=STAGES):
        w = _weights(p0, p1, p2, p3, s0, s1, s2, s3, n, n_ok, k0, QTYPE, S, BLOCK_N, BLOCK_K)
        x, s = _x_tile(x_ptr, g_ptr, m, k0 + kk, M, stride_xm, NORM, BLOCK_M)
        sq += s
        acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    ok = (m[:, None] < M) & n_ok[None, :]
    if SPLIT:
        _store_partial(out_ptr, sq_ptr, acc, sq, m, n, ok, M, N, NORM)
    else:
        out = _row_scale(acc, sq, K, eps, NORM)               # [BM, BN]
        if HAS_RES:
            out += tl.load(res_ptr + m[:, None] * stride_rm + n[None, :], mask=ok,
                           other=0.0).to(tl.float32)
        tl.store(out_ptr + m[:, None] * stride_om + n[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _store_partial(part_ptr, sq_ptr, acc, sq, m, n, ok, M, N, NORM: tl.constexpr):
    """A split's partial sums acc^T to part [splits, M, N] (N: the kernel's output columns),
    its rows' sums of squares to sq [splits, M] (from the first column block)."""
    split = tl.program_id(2)
    tl.store(part_ptr + (split * M + m[:, None]) * N + n[None, :], tl.trans(acc), mask=ok)
    if NORM:
        if tl.program_id(1) == 0:
            tl.store(sq_ptr + split * M + m, sq, mask=m < M)


@triton.jit
def _split_sum_kernel(part_ptr, sq_ptr, res_ptr, out_ptr, M, N, K, eps, stride_rm, stride_om,
                      SPLITS: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                      GATE_UP: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr,
                      PDL: tl.constexpr):
    """Row program_id(0), columns BLOCK_N * program_id(1) ..: the splits' partial sums added in
    order, then the unsplit kernels' finish (part: [SPLITS, M, N]; with GATE_UP, N = 2F and
    the output act(g) * u has F columns)."""
    enter(PDL)
    m = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols: tl.constexpr = 2 if GATE_UP else 1
    width = N // cols
    ok = j < width
    acc = tl.zeros([BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_N], tl.float32)
    sq = 0.0
    for s in tl.static_range(SPLITS):
        row = part_ptr + (s * M + m) * N
        acc += tl.load(row + j, mask=ok, other=0.0)
        if GATE_UP:
            up += tl.load(row + width + j, mask=ok, other=0.0)
        if NORM:
            sq += tl.load(sq_ptr + s * M + m)
    scale = 1.0
    if NORM:
        scale = tl.rsqrt(sq / K + eps)
    dtype = out_ptr.dtype.element_ty
    if GATE_UP:   # rounded as the projection's output would be, then the activation in fp32
        gate = (acc * scale).to(dtype).to(tl.float32)
        out = gate_act(gate, ACT) * (up * scale).to(dtype).to(tl.float32)
    else:
        out = acc * scale
        if HAS_RES:
            out += tl.load(res_ptr + m * stride_rm + j, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + j, out.to(dtype), mask=ok)


@triton.jit
def _quant_gate_up_kernel(x_ptr, g_ptr, p0, p1, p2, p3, s0, s1, s2, s3, out_ptr, sq_ptr,
                          M, F, K, KS, eps, stride_xm, stride_om,
                          QTYPE: tl.constexpr, S: tl.constexpr, NORM: tl.constexpr,
                          SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, STAGES: tl.constexpr, ACT: tl.constexpr,
                          PDL: tl.constexpr):
    enter(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    jn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)   # columns: gate jn, up F + jn
    ok_n = jn < F
    kk = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    sq = tl.zeros([BLOCK_M], tl.float32)
    first = tl.program_id(2) * KS
    for k0 in tl.range(first, first + KS, BLOCK_K, num_stages=STAGES):
        x, s = _x_tile(x_ptr, g_ptr, m, k0 + kk, M, stride_xm, NORM, BLOCK_M)
        sq += s
        xt = tl.trans(x)
        wg = _weights(p0, p1, p2, p3, s0, s1, s2, s3, jn, ok_n, k0, QTYPE, S, BLOCK_N, BLOCK_K)
        acc_g = tl.dot(wg.to(x.dtype), xt, acc_g)
        wu = _weights(p0, p1, p2, p3, s0, s1, s2, s3, F + jn, ok_n, k0, QTYPE, S, BLOCK_N,
                      BLOCK_K)
        acc_u = tl.dot(wu.to(x.dtype), xt, acc_u)
    ok = (m[:, None] < M) & ok_n[None, :]
    if SPLIT:   # partial sums of gate in columns jn and of up in F + jn of [splits, M, 2F]
        _store_partial(out_ptr, sq_ptr, acc_g, sq, m, jn, ok, M, 2 * F, NORM)
        _store_partial(out_ptr + F, sq_ptr, acc_u, sq, m, jn, ok, M, 2 * F, False)
    else:
        # rounded as the projection's output would be, then the activation in fp32 (silu_mul)
        gate = _row_scale(acc_g, sq, K, eps, NORM).to(out_ptr.dtype.element_ty).to(tl.float32)
        up = _row_scale(acc_u, sq, K, eps, NORM).to(out_ptr.dtype.element_ty).to(tl.float32)
        h = gate_act(gate, ACT) * up
        tl.store(out_ptr + m[:, None] * stride_om + jn[None, :], h.to(out_ptr.dtype.element_ty),
                 mask=ok)


@triton.jit
def _dequant_rows_kernel(p0, p1, p2, p3, s0, s1, s2, s3, idx_ptr, out_ptr, R, stride_o,
                         QTYPE: tl.constexpr, S: tl.constexpr, HAS_INDEX: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    n = tl.load(idx_ptr + r, mask=r_ok, other=0) if HAS_INDEX else r
    k0 = tl.program_id(1) * BLOCK_K
    w = _weights(p0, p1, p2, p3, s0, s1, s2, s3, n, r_ok, k0, QTYPE, S, BLOCK_R, BLOCK_K)
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + r[:, None] * stride_o + k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None])


def _check(x: torch.Tensor, part: Part, block_m: int, block_k: int, splits: int) -> None:
    m, k = x.shape
    if (m > MAX_ROWS or block_m not in ROW_TILES or part.cols != k or not fits_k(part, block_k)
            or splits < 1 or (k // block_k) % splits):
        raise ValueError(f"quantized kernel: x {tuple(x.shape)}, {part.qtype} weight "
                         f"[{part.rows}, {part.cols}] do not fit blocks ({block_m} rows, "
                         f"{block_k} quants a step, {splits} splits of K; at most {MAX_ROWS} "
                         f"rows)")


def fits_k(part: Part, block_k: int) -> bool:
    """A step of block_k quants divides K, holds whole scale groups and stays within one
    super-block of a K-quant."""
    block, _, group = BLOCKS[part.qtype]
    return (part.cols % block_k == 0 and block_k % max(group, 32) == 0
            and (block == 32 or 256 % block_k == 0))


def _default_tile(x: torch.Tensor) -> int:
    return next(t for t in ROW_TILES if x.shape[0] <= t or t == ROW_TILES[-1])


def _partials(x: torch.Tensor, splits: int, cols: int, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernels' scratch: fp32 partial sums [splits, M, cols] and sums of squares."""
    m = x.shape[0]
    part = torch.empty(splits, m, cols, dtype=torch.float32, device=x.device)
    sq = torch.empty(splits, m, dtype=torch.float32, device=x.device) if norm is not None else part
    return part, sq


def _finish(part, sq, res, out, k: int, eps: float, splits: int, norm, gate_up: bool = False,
            act: str = "silu") -> None:
    """out = the splits' partial sums added in order, finished (_split_sum_kernel)."""
    m, cols = part.shape[1], part.shape[2]
    r = res if res is not None else out
    block_n = 256
    _split_sum_kernel[(m, triton.cdiv(out.shape[1], block_n))](
        part, sq, r, out, m, cols, k, eps, r.stride(0), out.stride(0), SPLITS=splits,
        NORM=norm is not None, HAS_RES=res is not None, GATE_UP=gate_up, ACT=ACTS[act],
        BLOCK_N=block_n, num_warps=4, **launch_options(out.device))


def quant_mm(x: torch.Tensor, part: Part, res: torch.Tensor | None = None,
             norm: torch.Tensor | None = None, eps: float = 0.0, *, out: torch.Tensor | None = None,
             block_m: int | None = None, block_n: int = 32, block_k: int = 256,
             stages: int = 2, warps: int = 4, splits: int = 1,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [M, K] (M <= 64), part: a quantized [N, K] weight, res: [M, N] or None, norm: [K]
    or None -> [M, N] (into `out`, which may be a column slice of a wider tensor), in out_dtype
    (default x's). block_k: a multiple of the type's super-block (K-quants: 256) or of 32;
    splits: ranges of K computed by separate programs (dividing K's steps), added in order."""
    block_m = block_m or _default_tile(x)
    _check(x, part, block_m, block_k, splits)
    assert x.stride(1) == 1 and (norm is None or norm.is_contiguous())
    if out is None:
        out = torch.empty(x.shape[0], part.rows, dtype=out_dtype or x.dtype, device=x.device)
    assert out.shape == (x.shape[0], part.rows) and out.stride(1) == 1
    r = res if res is not None else out
    dest, sq = _partials(x, splits, part.rows, norm) if splits > 1 else (out, out)
    planes, strides = _planes(part)
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(part.rows, block_n), splits)
    _quant_mm_kernel[grid](
        x, norm if norm is not None else x, *planes, *strides, r, dest, sq,
        x.shape[0], part.rows, x.shape[1], x.shape[1] // splits, eps, x.stride(0), r.stride(0),
        dest.stride(-2), QTYPE=TYPE_IDS[part.qtype], S=BLOCKS[part.qtype][2],
        NORM=norm is not None, HAS_RES=res is not None, SPLIT=splits > 1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, num_warps=warps,
        **launch_options(x.device))
    if splits > 1:
        _finish(dest, sq, res, out, x.shape[1], eps, splits, norm)
    return out


def quant_gate_up(x: torch.Tensor, part: Part, norm: torch.Tensor | None = None,
                  eps: float = 0.0, *, block_m: int | None = None, block_n: int = 32,
                  block_k: int = 256, stages: int = 2, warps: int = 4, splits: int = 1,
                  act: str = "silu") -> torch.Tensor:
    """x: [M, K], part: [2F, K] = [w_gate; w_up] of one type -> act(g) * u [M, F] (act:
    silu, or gelu_tanh); splits as quant_mm's."""
    block_m = block_m or _default_tile(x)
    _check(x, part, block_m, block_k, splits)
    f = part.rows // 2
    out = torch.empty(x.shape[0], f, dtype=x.dtype, device=x.device)
    dest, sq = _partials(x, splits, 2 * f, norm) if splits > 1 else (out, out)
    planes, strides = _planes(part)
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(f, block_n), splits)
    _quant_gate_up_kernel[grid](
        x, norm if norm is not None else x, *planes, *strides, dest, sq, x.shape[0], f,
        x.shape[1], x.shape[1] // splits, eps, x.stride(0), out.stride(0),
        QTYPE=TYPE_IDS[part.qtype], S=BLOCKS[part.qtype][2], NORM=norm is not None,
        SPLIT=splits > 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        STAGES=stages, ACT=ACTS[act], num_warps=warps, **launch_options(x.device))
    if splits > 1:
        _finish(dest, sq, None, out, x.shape[1], eps, splits, norm, gate_up=True, act=act)
    return out


def dequant_rows(part: Part, out: torch.Tensor, index: torch.Tensor | None = None) -> None:
    """out [R, K] = rows `index` [R] of the part (rows 0..R-1 when None), dequantized."""
    rows, k = out.shape
    assert k == part.cols and out.stride(1) == 1
    block_k = next(b for b in (256, 128, 64, 32) if fits_k(part, b))   # rows are whole blocks
    planes, strides = _planes(part)
    block_r = program_width(out.device, 16)
    grid = (triton.cdiv(rows, block_r), k // block_k)
    _dequant_rows_kernel[grid](
        *planes, *strides, index if index is not None else out, out, rows, out.stride(0),
        QTYPE=TYPE_IDS[part.qtype], S=BLOCKS[part.qtype][2], HAS_INDEX=index is not None,
        BLOCK_R=block_r,
        BLOCK_K=block_k, num_warps=4)
