"""Triton kernels of int8 activations against quantized weights (a8.py says the
arithmetic; its plain-torch reference is a8_mm_reference):

    quantize_rows   each window row alone, a program a chunk of a row: (rmsnorm and) int8
                    codes with a scale per 32 values
    a8_mm           out = rows' codes @ w^T (+ res): per weight group an exact int32 sum,
                    then a dx sum(u q) + b dx sum(q) added group by group along K

a8_mm has two ways to the integer sums, chosen by the window's rows: a GEMV (1 to 8 rows, a row
tile of 1, 2, 4 or 8: a8_gemv.py, four products a dp4a) and an MMA (more rows: tile 16, 32 or
64: a8_mma.py, int8 tl.dots into int32). K is cut into parts that
depend on the weight's shape alone (a8_parts.k_parts): every kernel adds each (row, column)'s
float terms group by group from zero within a part, then the parts in order, so a row gets the
same bits from either and from any tile (tests/kernels/test_quant_a8.py). The GEMV takes a
program a part and so does the MMA (more programs for a narrow weight with long rows), and a
second kernel adds the parts. A group's term is a8_gemv.group_term's explicit
fma(a dx, isum, b qs dx), the same in every kernel; the kernels launch with
enable_fp_fusion=False so that Triton fuses no other product and sum, which it did one way for
tiles of 1 and 2 rows and the other way from 4 rows up on sm_90 (changing a row's bits between
tiles). The codes and scales come from
reads.py's `_codes` and `_terms`, a K step at a time, the codes' sums a group from the
quantizer; the terms are added by `add_in_order`.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import os

import torch
import triton
import triton.language as tl

from strata.kernels.pdl import enter, launch_options
from strata.kernels.quant.a8 import QBLOCK, Codes
from strata.kernels.quant.a8_gated import a8_gate_up
from strata.kernels.quant.a8_gemv import Pairs, a8_gemv, quantize_blocks
from strata.kernels.quant.a8_mma import DOTS, GLUONS, MMA_BLOCKS, a8_mma
from strata.kernels.quant.a8_parts import PARTS, gemv_step, k_parts
from strata.kernels.quant.blocks import BLOCKS, Part, program_width
from strata.kernels.skinny_triton import MAX_ROWS, ROW_TILES

GEMV_TILES = (1, 2, 4, 8)   # row tiles of the GEMV; more rows take the MMA's ROW_TILES


@triton.jit
def _quantize_rows_kernel(x_ptr, g_ptr, q_ptr, qp_ptr, dx_ptr, qs_ptr, dc_ptr, K, eps, stride_xm,
                          NORM: tl.constexpr, BLOCK: tl.constexpr, KP: tl.constexpr,
                          PDL: tl.constexpr):
    """Program (row m, chunk c): the codes q [M, K] int8 (and again in pair order, qp),
    scales dx [M, K / 32] (a8.py) and the codes' sums qs [M, K / 16] int32 of the row's values
    [c BLOCK, (c + 1) BLOCK). With NORM each program reads the whole row (KP: K up to a power
    of two) in one load for its rmsnorm: every program of a row adds the same squares in the
    same order, so they share its scale r bit for bit."""
    enter(PDL)
    m = tl.program_id(0)
    c = tl.program_id(1)
    row = x_ptr + m * stride_xm
    r = 1.0
    if NORM:
        ka = tl.arange(0, KP)
        xa = tl.load(row + ka, mask=ka < K, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(xa * xa, 0) / K + eps)
    NB: tl.constexpr = BLOCK // 32
    k = c * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(row + k).to(tl.float32)
    if NORM:
        y = y * r * tl.load(g_ptr + k).to(tl.float32)
    rows = tl.zeros([1], tl.int32) + m
    quantize_blocks(y[None, :], rows, rows >= 0, rows * 0 + c * NB, K, q_ptr, qp_ptr, dx_ptr,
                    qs_ptr, dc_ptr, 1, NB)


def quantize_rows(x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0
                  ) -> Codes:
    """x [M, K] (K a multiple of 32, rows contiguous) -> its rows' Codes (a8.py)."""
    m, k = x.shape
    if k % QBLOCK:
        raise ValueError(f"int8 activations: a row of {k} values is not whole blocks of "
                         f"{QBLOCK}")
    assert x.stride(1) == 1 and (norm is None or norm.is_contiguous())
    c = Codes.empty(m, k, x.device)
    if m:
        block = gemv_step(k)
        kp = triton.next_power_of_2(k)
        _quantize_rows_kernel[(m, k // block)](
            x, norm if norm is not None else x, c.q, c.qp, c.dx, c.qs, c.dc, k, eps, x.stride(0),
            NORM=norm is not None, BLOCK=block, KP=kp,
            num_warps=8 if norm is not None and kp > 4096 else 4,
            enable_fp_fusion=False,   # as every kernel that quantizes rows (quantize_blocks)
            **launch_options(x.device))
    return c


def a8_row_tile(m: int) -> int:
    """The row tile of a window of m rows: the GEMV's up to 8 rows, then the MMA's."""
    return next(t for t in (*GEMV_TILES, *ROW_TILES) if m <= t or t == ROW_TILES[-1])


@functools.cache
def _has_gluon() -> bool:
    """Whether this Triton has the Gluon parts a8_gluon.py uses."""
    try:
        importlib.import_module("strata.kernels.quant.a8_gluon")
    except (ImportError, AttributeError):
        return False
    return True


@functools.cache
def _sm80(index: int | None) -> bool:
    """Whether CUDA device `index` (None: the current one) has cp.async and int8 mma.sync
    m16n8k32, which the Gluon kernels take (compute capability 8.0 on)."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def _gluon(q: torch.Tensor, part: Part, tile: int, parts: int = PARTS) -> str | None:
    """The Gluon kernels a window of this row tile takes where no way is asked ("gluon",
    a8_gluon.py's, or "ring", a8_ring.py's), or None: on CUDA where they fit, at
    a8_gluon.GLUON_TILES' tiles of the weight's type; with STRATA_A8_DOT=gluon or ring, those at
    every tile from 4 rows (the ring's take Q8_0 too); with STRATA_A8_DOT=triton or a Triton
    way (a8_mma.DOTS), none; nor where this Triton has no Gluon (before 3.6, which the kernels
    are written against) or the GPU is older than sm_80."""
    env = os.environ.get("STRATA_A8_DOT")
    if (q.device.type != "cuda" or env not in (None, *GLUONS) or not _has_gluon()
            or not _sm80(q.device.index)):
        return None
    from strata.kernels.quant.a8_gluon import GLUON_TILES, GLUON_TYPES, gluon_fits
    from strata.kernels.quant.a8_ring import RING_TYPES
    way = (env if tile in (4, 8, *ROW_TILES) else None) if env else (
        GLUON_TILES.get(part.qtype, {}).get(tile))
    types = RING_TYPES if way == "ring" else GLUON_TYPES
    return way if way and gluon_fits(part, q.shape[1], parts, types) else None


def gemv_columns(part: Part, device: torch.device) -> int:
    """Columns a program of a8_mm's and a8_gate_up_silu's GEMV tiles: 16 for Q6_K, else 32
    (tools/gpu/bench_a8.py, H100), at least program_width's off CUDA."""
    return program_width(device, 16 if part.qtype == "Q6_K" else 32)


def a8_mm(x: Codes, part: Part, res: torch.Tensor | None = None, *,
          out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
          block_m: int | None = None, block_n: int | None = None,
          block_k: int | None = None, warps: int = 4, gemv_n: int | None = None,
          stages: int | None = None, dot: str | None = None, parts: int = PARTS,
          ahead: bool | None = None) -> torch.Tensor:
    """x: quantize_rows' [M, K] rows; part: a quantized [N, K] weight; res:
    [M, N] or None -> [M, N] (into `out`, which may be a column slice of a wider tensor).
    block_m: a GEMV tile (1, 2, 4, 8) or an MMA tile (16, 32, 64); default the smallest that
    holds the rows. The GEMV tiles take a8_gemv.py's dp4a kernel (gemv_n columns a program,
    default 16 for Q6_K and 32 for the rest; `stages` K steps in flight, default 2 for 8 rows
    and 3 for fewer); the MMA tiles block_n columns a program and block_k quants a step (at
    most K's step), their groups' sums by `dot`, one of a8_mma.DOTS (Hopper's wgmma from
    block_n 64) or "gluon" (a8_gluon.py: Q4_K and Q6_K on CUDA, its own blocks, a GEMV tile's
    rows in 8-row tiles) or "ring" (a8_ring.py's, as gluon); the same bits any way. The
    defaults: Gluon where _gluon says, else MMA_BLOCKS'; the environment's STRATA_A8_DOT,
    where set, picks for a stage's every tile (an experiment's: tools/gpu/bench_a8.py --mma
    times the ways in a kernel, the variable in a stage): a Triton way, "triton" (the Triton
    defaults), "gluon" or "ring"; ahead: whether the MMA's "groups" way loads each step's
    scales a step ahead (the same bits; default MMA_BLOCKS'). parts: the most parts of K
    (k_parts; a row's bits depend on it, so every call on a weight must pass the same: leave
    it be outside experiments)."""
    q = x.q
    m, k = q.shape
    block_m = block_m or a8_row_tile(m)
    mma = MMA_BLOCKS.get((part.qtype == "Q6_K", block_m, part.cols > part.rows),
                         (None, None, None, None))
    block_k = min(block_k or mma[1] or 128, gemv_step(k))
    env = os.environ.get("STRATA_A8_DOT")
    if env not in (None, "triton", *GLUONS, *DOTS):
        raise ValueError(f"int8-activation MMA: STRATA_A8_DOT={env!r} is no way to the groups' "
                         f"sums (one of {', '.join(DOTS)}, triton, gluon or ring)")
    if dot is None:
        dot = _gluon(q, part, block_m, parts)
    if dot in GLUONS and block_m in GEMV_TILES:   # an m16n8 tile takes 8 rows
        block_m = 8
    dot = dot or (env if env in DOTS else None) or mma[2] or "groups"
    if dot not in (*DOTS, *GLUONS):
        raise ValueError(f"int8-activation MMA: no way {dot!r} to the groups' sums (one of "
                         f"{', '.join(DOTS)}, gluon or ring)")
    if (m > MAX_ROWS or part.cols != k or block_m not in (*GEMV_TILES, *ROW_TILES)
            or (k // k_parts(part.rows, k, parts)) % block_k or block_k % 32):
        raise ValueError(f"int8-activation kernel: {m} rows of {k}, {part.qtype} weight "
                         f"[{part.rows}, {part.cols}] do not fit blocks ({block_m} rows, "
                         f"{block_k} quants a step)")
    if out is None:
        out = torch.empty(m, part.rows, dtype=out_dtype, device=q.device)
    assert out.shape == (m, part.rows) and out.stride(1) == 1 and q.is_contiguous()
    if block_m in GEMV_TILES and dot not in GLUONS:   # blocks from tools/gpu/bench_a8.py (H100)
        return a8_gemv(x, part, res, out, block_m, block_n=gemv_n or gemv_columns(part, q.device),
                       stages=stages or (2 if block_m == 8 else 3), warps=warps,
                       parts=parts)
    return a8_mma(x, part, res, out, block_m, block_n or program_width(q.device, mma[0]),
                  block_k, warps, dot, bool(mma[3] if ahead is None else ahead), parts)


def a8_gate_up_silu(x: Codes, part: Part, act: str, out_dtype: torch.dtype,
                    codes: bool = False) -> torch.Tensor | Codes:
    """act(gate) * up [M, F] of [gate | up] = x's rows @ part^T ([2F, K]), each half rounded
    to out_dtype first: fused_triton's silu_mul of a8_mm's output, the same bits; for the
    GEMV's windows in one or two kernels (a8_gated.py). codes: return those rows quantized
    (quantize_rows' Codes, with the rows), there by the same kernels, where F is whole
    blocks of 32 (else the rows alone)."""
    m = x.q.shape[0]
    f = part.rows // 2
    codes = codes and f % QBLOCK == 0
    tile = a8_row_tile(m)
    if tile in GEMV_TILES and part.rows % 2 == 0 and not _gluon(x.q, part, tile):
        out = torch.empty(m, f, dtype=out_dtype, device=x.q.device)
        c = Codes.empty(m, f, x.q.device) if codes else None
        a8_gate_up(x, part, act, out, tile, block_n=gemv_columns(part, x.q.device),
                   stages=2 if tile == 8 else 3, codes=c)
        return dataclasses.replace(c, rows=out) if codes else out
    from strata.kernels.fused_triton import silu_mul
    out = silu_mul(a8_mm(x, part, out_dtype=out_dtype), act)
    return dataclasses.replace(quantize_rows(out), rows=out) if codes else out


def a8_pairs(x: Codes, part: Part, pairs: Pairs, out: torch.Tensor, *,
             block_n: int | None = None, warps: int = 4) -> torch.Tensor:
    """Routed experts' GEMVs, one a pair: out[p] = row p // pairs.per of x @ rows
    pairs.ids[p] * pairs.erows + pairs.w0 .. + pairs.n - 1 of `part`^T (out [P, n], which may
    be a column slice). Each pair is computed alone by the dp4a GEMV, with a8_mm's
    arithmetic; K in the parts of `part` as a whole (all experts packed: one part for
    qwen3-30b-a3b's, whose programs then walk K in order instead of adding 8 parts)."""
    p, k, n = pairs.ids.shape[0], x.q.shape[1], pairs.n
    if part.cols != k or k % BLOCKS[part.qtype][2] or k % QBLOCK:
        raise ValueError(f"int8-activation expert kernel: rows of {k} against a "
                         f"{part.qtype} weight [{part.rows}, {part.cols}]")
    assert out.shape == (p, n) and out.stride(1) == 1 and x.q.is_contiguous()
    return a8_gemv(x, part, None, out, 1, block_n=block_n, warps=warps, pairs=pairs)
