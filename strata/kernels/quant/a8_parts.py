"""The parts of K an int8 kernel sums a row's float terms in, and how the parts are added.

The parts are a property of the weight's shape (`k_parts`), never of a kernel, tile or
window: every int8 kernel adds a (row, column)'s group terms one by one from zero within each
part, then the parts in order from zero. A program a part writes its sums to a scratch
[P, M, N]; the tile's last program to finish adds them (`finish_parts`, kernels/arrive.py), or
`add_parts` does after the launch where there are no counters: the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.arrive import arrive
from strata.kernels.pdl import enter, launch_options

STEP = 256   # quants a K step where K allows
PARTS = 8    # the most parts of K a row's float terms are summed in (k_parts)
COLUMN_BLOCKS = 768   # k_parts splits K until a weight has this many 32-column blocks a part


def gemv_step(k: int) -> int:
    """The K step of a row of k quants: STEP where it divides k, else the largest of 128, 64,
    32 that does (the GEMV's step, the MMA's longest, the row quantizer's block)."""
    return next(s for s in (STEP, 128, 64, 32) if k % s == 0)


def k_parts(n: int, k: int, most: int = PARTS) -> int:
    """The parts of K the int8 kernels sum an [n, k] weight's rows in: 1, doubled while the
    weight has fewer than COLUMN_BLOCKS blocks of 32 columns a part (a wide weight keeps the
    GPU busy without parts; a narrow one with long rows, as a down projection, needs them)
    and while the parts still cut its gemv_step steps evenly, up to `most`. Every int8 kernel
    adds a (row, column)'s float terms group by group from zero within each part, then the
    parts in order from zero, so the parts are a property of the weight's shape, never of a
    kernel, a tile or a window."""
    steps, p = k // gemv_step(k), 1
    while 2 * p <= most and steps % (2 * p) == 0 and -(-n // 32) * p < COLUMN_BLOCKS:
        p *= 2
    return p


@triton.jit
def tile_index():
    """The program's (row block, column block) tile: its counter's index (kernels/arrive)."""
    return tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)


@triton.jit
def load_parts(part_ptr, m, n, m_ok, n_ok, M, W, P: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """fp32 [BM, BN]: the P parts' sums [P, M, W] of rows m, columns n, added in order from
    zero (as _add_parts_kernel adds them), read from L2 (the other programs wrote them)."""
    s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ok = m_ok[:, None] & n_ok[None, :]
    for p in tl.static_range(P):
        s = s + tl.load(part_ptr + (p * M + m[:, None]) * W + n[None, :], mask=ok, other=0.0,
                        cache_modifier=".cg")
    return s


@triton.jit
def finish_parts(acc, part_ptr, res_ptr, out_ptr, count_ptr, m, n, m_ok, n_ok, M, N,
                 stride_rm, stride_om, part, P: tl.constexpr, HAS_RES: tl.constexpr,
                 FIXUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A part's sums acc [BM, BN] into its scratch rows part_ptr [P, M, N]; with FIXUP the
    tile's last program (kernels/arrive.py) adds the parts in order (+ res) into out, the
    bits _add_parts_kernel would write."""
    store_rows(acc, res_ptr, part_ptr + part * M * N, m, n, m_ok, n_ok, 0, N, False)
    if FIXUP:
        if arrive(count_ptr + tile_index(), P):
            s = load_parts(part_ptr, m, n, m_ok, n_ok, M, N, P, BLOCK_M, BLOCK_N)
            store_rows(s, res_ptr, out_ptr, m, n, m_ok, n_ok, stride_rm, stride_om, HAS_RES)


@triton.jit
def store_rows(out, res_ptr, out_ptr, m, n, m_ok, n_ok, stride_rm, stride_om,
               HAS_RES: tl.constexpr):
    """out [BM, BN] fp32 (+ res's rows m, columns n) into out's rows m, columns n."""
    ok = m_ok[:, None] & n_ok[None, :]
    if HAS_RES:
        out += tl.load(res_ptr + m[:, None] * stride_rm + n[None, :], mask=ok,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=ok)


@triton.jit
def _add_parts_kernel(part_ptr, res_ptr, out_ptr, M, N, stride_rm, stride_om,
                      P: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
    """out row m = the P parts' sums [P, M, N] added in order from zero (+ res)."""
    enter(PDL)
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    s = tl.zeros([BLOCK], tl.float32)
    for p in tl.static_range(P):
        s = s + tl.load(part_ptr + (p * M + m) * N + n, mask=ok, other=0.0)
    if HAS_RES:
        s += tl.load(res_ptr + m * stride_rm + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, s.to(out_ptr.dtype.element_ty), mask=ok)


def add_parts(parts: torch.Tensor, res: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] = the parts' sums [P, M, N] added in order from zero (+ res): how every int8
    kernel with more than one part of K finishes."""
    p, m, n = parts.shape
    r = res if res is not None else out
    block = 256
    _add_parts_kernel[(m, triton.cdiv(n, block))](
        parts, r, out, m, n, r.stride(0), out.stride(0), P=p, HAS_RES=res is not None,
        BLOCK=block, **launch_options(out.device))
