"""The GEMV a thread a column (Q4_K, Q5_K, Q6_K, Q8_0 and IQ4_XS; behind STRATA_A8_GEMV1=N,
windows of up to N rows, up to 8 a program): a8_gemv.py's arithmetic for each row, laid out so
that nothing crosses threads; a8_mm's projections and a8_gate_up_silu's [gate | up]
(a8_gemv1_gated: a thread the same column of both halves, act(gate) * up and its rows
quantized for the down projection, as a8_gated.py writes them).

a8_gemv.py's programs spread a column's K step over several threads: each group's integer sum
is theirs to add, and the group terms, which must be added one by one in K's order, then move
between threads (shuffles) to the one that adds them. Here a thread holds one column: for each
group it takes the column's code words ([BLOCK_N, 4] words 4 to a thread, so Triton keeps a
column in one thread) and, for each of the program's rows, the row's code words, dx and c
(each thread loads its own copy, [BLOCK_N, R, 4] and [BLOCK_N, R, 2], so no layout moves them
between threads), sums the group by chains of dp4a, a column's codes decoded once for all its
rows, and adds each row's term to that row's accumulator, group after group along the part: a
super-block a loop step, its scales loaded once and its groups unrolled. Counted for sm_90
with Triton 3.6, instructions a weight for 1 row (`tools/sass_count.py --kernel a8-gemv1
--block-n 128 --warps 4 --stages 1`, against `--kernel a8-gemv --block-n 32 --stages 3`, 16
for Q6_K, a8_mm's 1-row GEMV): Q4_K 1.42 against 5.14, Q5_K 2.00 against 5.92, Q6_K 2.11
against 7.03, Q8_0 1.91 against 3.67, IQ4_XS 3.18 against 6.33; with --stages 3 (the loads
pipelined through shared memory) about 0.3 more. Q4_K at 2, 4 and 8 rows a program: 2.18,
3.33 and 6.57 against a8_gemv's 6.25, 10.36 and 15.16.

Fewer instructions did not make it faster. On one H100 (`python tools/gpu/bench_gemv1.py
--types Q4_K,IQ4_XS --projections qkv,down --rows 1,4 --configs 64x1,128x1,128x3`, us, a8_mm's
default first): Q4_K qkv at 1 row 14.5 against 14.5 (64 columns) and 15.0 (128), down 22.6
against 28.2; at 4 rows qkv 15.7 against 16.8, down 28.5 against 37.1; IQ4_XS slower by
35-50%. A warp's load takes 16 bytes from each of 32 columns' rows, 32 sectors half used, where
a8_gemv's threads read a column's bytes side by side. With Triton's pipeline (stages 3) a
thread's own copy of the rows' words passes through shared memory: 128 to 194 us, and past
the limit from 2 rows of the gated kernel; so stages 1 is the default. End to end at 1 client
(llama3-8b Q4_K_M, stages 3) it ran at 33.7 tok/s against 280.9. It stays behind
STRATA_A8_GEMV1. group_major lays a qs plane out a group before the next, so that a warp's
columns read side by side (1.51 instructions a weight for Q4_K): an experiment for
bench_gemv1.py --group-major, not yet timed; a stage would have to keep that layout for every
kernel on the weight.

The bits are a8_mm's (tests/kernels/test_quant_a8_gemv1.py): the same group terms
(a8_gemv.group_term of reads._term_values' a and b, dx and c = qs dx from the quantizer's dc
plane; Q8_0's and IQ4_XS's codes taken signed as a8_gemv takes them), added from zero in K's
order within each part, the parts as a8_parts adds them.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from strata.kernels.arrive import counters
from strata.kernels.fused_triton import ACTS
from strata.kernels.pdl import enter, launch_options
from strata.kernels.quant.a8 import Codes
from strata.kernels.quant.a8_gemv import gated_rows
from strata.kernels.quant.a8_gemv1_sums import _sb
from strata.kernels.quant.a8_parts import (PARTS, add_parts, finish_parts, gemv_step, k_parts,
                                           store_rows)
from strata.kernels.quant.blocks import Part
from strata.kernels.quant.reads import TYPE_IDS, _planes

TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_XS")
COLUMNS = 128   # columns a program by default (4 warps, a thread a column)


def asked_rows() -> int:
    """The most rows of a window a8_mm gives this kernel: STRATA_A8_GEMV1=N (0 or unset:
    none)."""
    value = os.environ.get("STRATA_A8_GEMV1", "0")
    if not value.isdigit() or int(value) > 8:
        raise ValueError(f"STRATA_A8_GEMV1={value!r} is not a count of rows from 0 to 8 (the "
                         "most rows of a window this GEMV takes)")
    return int(value)


def gemv1_fits(part: Part, m: int, k: int) -> bool:
    """Whether a8_mm takes this kernel: asked for (STRATA_A8_GEMV1=N, m at most N), a
    weight of TYPES (K whole super-blocks)."""
    return (m <= asked_rows() and part.qtype in TYPES and gemv_step(k) == 256)


def gated_fits(part: Part, m: int, k: int, codes: bool) -> bool:
    """Whether a8_gate_up_silu takes a8_gemv1_gated: as gemv1_fits, K in one part, and with
    codes the halves whole blocks of COLUMNS (a program's)."""
    f = part.rows // 2
    return (gemv1_fits(part, m, k) and part.rows % 2 == 0 and k_parts(part.rows, k) == 1
            and (not codes or f % COLUMNS == 0))


@triton.jit
def _a8_gemv1_kernel(qw_ptr, dc_ptr, qs_ptr, p0, p1, p2, p3, s0, s1, s2, s3, res_ptr, out_ptr,
                     fin_ptr, count_ptr, cq_ptr, cqp_ptr, cdx_ptr, cqs_ptr, cdc_ptr, M, N, K, UP,
                     NW,
                     stride_rm, stride_om, HAS_RES: tl.constexpr, FIXUP: tl.constexpr,
                     ASM: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr, L,
                     STAGES: tl.constexpr, ACT: tl.constexpr, CODES: tl.constexpr,
                     QT: tl.constexpr, ROWS: tl.constexpr, QMAJOR: tl.constexpr,
                     PDL: tl.constexpr):
    """Program (row, column block, part of K): the part's L quants of row m against columns
    n, a thread a column; into out, or with P > 1 its part's rows of out (a8_gemv's). ACT >= 0
    (P 1): gate columns n and up columns n + UP, act(gate) * up into out as a8_gemv's
    gated_rows writes it (with CODES those rows quantized into the planes cq .. cdc). Triton
    pipelines the loads STAGES - 1 super-blocks ahead of their sums."""
    ms = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m = tl.minimum(ms, M - 1)[:, None]   # rows past M read the last one, and are not stored
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    enter(PDL)
    part = tl.program_id(2)
    acc = tl.zeros([BLOCK_N, ROWS], tl.float32)
    acc_up = tl.zeros([BLOCK_N, ROWS], tl.float32)
    first = part * (L // 256)
    last = first + L // 256 - 1
    nc = tl.minimum(n, N - 1)   # columns past N read the last one (no masks: no registers to
    #                             clear before each load), and are not stored
    ap = qw_ptr + m * (K // 4) + tl.arange(0, 4)[None, :]   # the rows' words: [R, 4]
    dp = dc_ptr + m * (K // 8) + tl.arange(0, 2)[None, :]   # dx, c (groups of 32): [R, 2]
    dp4 = dc_ptr + m * (K // 8) + tl.arange(0, 4)[None, :]  # dx, c, c0, c1 (Q6_K's 16s)
    qsp = qs_ptr + m * (K // 16)   # the rows' codes' sums a 16 (Q8_0, IQ4_XS): [R, 1]
    for sb in tl.range(first, last + 1, num_stages=STAGES):   # loads STAGES - 1 ahead
        acc = _sb(acc, p0, p1, p2, p3, s0, s1, s2, s3, nc, sb, ap + 64 * sb, dp + 32 * sb,
                  dp4 + 32 * sb, qsp, NW, QT, ASM, QMAJOR)
        if ACT >= 0:   # the up half's same columns
            acc_up = _sb(acc_up, p0, p1, p2, p3, s0, s1, s2, s3, nc + UP, sb, ap + 64 * sb,
                         dp + 32 * sb, dp4 + 32 * sb, qsp, NW, QT, ASM, QMAJOR)
    if ACT >= 0:   # silu_mul's arithmetic on the projection's rounded outputs (one part)
        gated_rows(0.0 + tl.trans(acc), 0.0 + tl.trans(acc_up), out_ptr, ms, n, ms < M, n_ok,
                   N, stride_om, cq_ptr, cqp_ptr, cdx_ptr, cqs_ptr, cdc_ptr, ACT, CODES, ROWS,
                   BLOCK_N // 32)
    elif P == 1:   # the parts' sum from zero, as every kernel adds them
        store_rows(0.0 + tl.trans(acc), res_ptr, out_ptr, ms, n, ms < M, n_ok, stride_rm,
                   stride_om, HAS_RES)
    else:
        finish_parts(tl.trans(acc), out_ptr, res_ptr, fin_ptr, count_ptr, ms, n, ms < M, n_ok,
                     M, N, stride_rm, stride_om, part, P, HAS_RES, FIXUP, ROWS, BLOCK_N)


def group_major(part: Part) -> torch.Tensor:
    """The qs plane of a Q4_K, Q5_K, Q8_0 or IQ4_XS weight [N, K] laid out a group before the
    next: [K / 32, N, 4] words, so a warp's 32 columns read a group's 512 bytes side by side
    where the row-major plane gives each thread its own 16 bytes of a row (an experiment:
    a8_gemv1(qs=...), tools/gpu/bench_gemv1.py --group-major; no stage keeps it)."""
    assert part.qtype in TYPES and part.qtype != "Q6_K"
    qs = part.planes["qs"]
    return qs.view(qs.shape[0], -1, 4).transpose(0, 1).contiguous()


def a8_gemv1(x: Codes, part: Part, res: torch.Tensor | None, out: torch.Tensor,
             block_n: int = COLUMNS, warps: int = COLUMNS // 32, stages: int = 1,
             parts: int = PARTS, rows: int | None = None,
             qs: torch.Tensor | None = None) -> torch.Tensor:
    """out [M, N] = the rows x (their codes in pair order, sums and dc plane) @ part^T
    (+ res), part a weight [N, K] of TYPES: a8_gemv's bits for each row (the module says
    how). block_n: columns a program, a thread each (32 x warps); rows: a program's rows
    (1, 2, 4 or 8; default all of M's, rounded up to one of those); qs: the weight's qs plane
    as group_major lays it out, read in its place (the same bits)."""
    return _launch(x, part, res, out, -1, None, block_n, warps, stages, parts, rows, qs)


def a8_gemv1_gated(x: Codes, part: Part, act: str, out: torch.Tensor, codes: Codes | None,
                   block_n: int = COLUMNS, warps: int = COLUMNS // 32, stages: int = 1,
                   rows: int | None = None) -> torch.Tensor:
    """out [M, F] = act(gate) * up of [gate | up] = the rows x @ part^T (part [2F, K] of TYPES,
    K in one part), as a8_gated.a8_gate_up writes it, and with codes (F whole blocks of
    block_n) those rows quantized into codes' planes: its bits (the module says how)."""
    assert k_parts(part.rows, part.cols) == 1 and part.rows == 2 * out.shape[1]
    assert codes is None or out.shape[1] % block_n == 0
    return _launch(x, part, None, out, ACTS[act], codes, block_n, warps, stages, PARTS, rows,
                   None)


def _launch(x: Codes, part: Part, res: torch.Tensor | None, out: torch.Tensor, act: int,
            codes: Codes | None, block_n: int, warps: int, stages: int, parts: int,
            rows: int | None, qs: torch.Tensor | None) -> torch.Tensor:
    assert part.qtype in TYPES and block_n == 32 * warps
    q = x.qp
    m, k = q.shape
    rows = rows or min(triton.next_power_of_2(m), 8)
    assert rows in (1, 2, 4, 8)
    assert k % 256 == 0 and part.cols == k
    r = res if res is not None else out
    planes, strides = _planes(part)
    if qs is not None:
        assert part.qtype != "Q6_K" and qs.shape == (k // 32, part.rows, 4)
        planes[0] = qs
    cols = out.shape[1]
    p = k_parts(part.rows, k, parts)
    dst = out if p == 1 else torch.empty(p, m, cols, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(m, rows), triton.cdiv(cols, block_n), p)
    count = counters(q.device, grid[0] * grid[1]) if p > 1 else None
    c = codes if codes is not None else x
    _a8_gemv1_kernel[grid](q.view(torch.int32), x.dc, x.qs, *planes, *strides, r, dst, out,
                           q if count is None else count, c.q, c.qp, c.dx, c.qs, c.dc, m, cols,
                           k, cols, part.rows, r.stride(0), out.stride(0),
                           HAS_RES=res is not None,
                           FIXUP=count is not None, ASM=q.device.type == "cuda",
                           BLOCK_N=block_n, P=p, L=k // p, STAGES=stages, ACT=act,
                           CODES=codes is not None, QT=TYPE_IDS[part.qtype], ROWS=rows,
                           QMAJOR=qs is not None,
                           num_warps=warps,
                           **launch_options(q.device),
                           enable_fp_fusion=False)   # as every int8 kernel
    if p > 1 and count is None:
        add_parts(dst, res, out)
    return out
