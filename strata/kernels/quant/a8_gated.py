"""The gated feed-forward's first half with int8 activations, for the GEMV's windows (1 to 8
rows) and for routed experts' (row, rank) pairs: gate and up in one launch of a8_gemv.py's
kernel (a program takes the same columns of both), then act(gate) * up, rounded as
fused_triton's silu_mul rounds it, and optionally those rows quantized for the down projection
as quantize_rows would (a8_gemv.quantize_blocks). Where K is cut into parts, the kernel writes
each part's gate and up sums and the tile's last program adds them in order (kernels/arrive.py;
add_gated_parts after the launch where there are no counters), as _add_parts_kernel would,
before the same epilogue. So the result is, bit for bit, what a8_mm (or a8_pairs) of gate and
of up, silu_mul and quantize_rows give, in one launch instead of up to six
(tests/kernels/test_quant_a8.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.arrive import counters
from strata.kernels.fused_triton import ACTS, gate_act
from strata.kernels.pdl import enter, launch_options
from strata.kernels.quant.a8 import QBLOCK, Codes
from strata.kernels.quant.a8_gemv import Pairs, _a8_gemv_kernel, quantize_blocks
from strata.kernels.quant.a8_parts import gemv_step, k_parts
from strata.kernels.quant.blocks import BLOCKS, Part, program_width
from strata.kernels.quant.reads import TYPE_IDS, _planes


@triton.jit
def _add_gated_parts_kernel(part_ptr, out_ptr, cq_ptr, cqp_ptr, cdx_ptr, cqs_ptr, cdc_ptr, M, N,
                            stride_om, P: tl.constexpr, ACT: tl.constexpr,
                            CODES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row m, block of columns): the P parts' gate and up sums [P, M, 2N] added in
    order from zero, each rounded to out's dtype, act(gate) * up into out [M, N] (and with
    CODES its blocks quantized into Codes [M, N])."""
    enter(PDL)
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    g = tl.zeros([BLOCK], tl.float32)
    u = tl.zeros([BLOCK], tl.float32)
    for p in tl.static_range(P):
        at = part_ptr + (p * M + m) * 2 * N + n
        g = g + tl.load(at, mask=ok, other=0.0)
        u = u + tl.load(at + N, mask=ok, other=0.0)
    dtype = out_ptr.dtype.element_ty
    h = (gate_act(g.to(dtype).to(tl.float32), ACT) * u.to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + m * stride_om + n, h, mask=ok)
    if CODES:   # BLOCK divides N: whole blocks of 32
        rows = tl.zeros([1], tl.int32) + m
        quantize_blocks(h.to(tl.float32)[None, :], rows, rows >= 0,
                        rows * 0 + tl.program_id(1) * (BLOCK // 32), N, cq_ptr, cqp_ptr,
                        cdx_ptr, cqs_ptr, cdc_ptr, 1, BLOCK // 32)


def a8_gate_up(x: Codes, part: Part, act: str, out: torch.Tensor, block_m: int,
               block_n: int | None = None, stages: int = 3, warps: int = 4,
               codes: Codes | None = None, pairs: Pairs | None = None,
               up: int | None = None) -> torch.Tensor:
    """out [M, F] = act(gate) * up, both rounded to out's dtype first. Without pairs, of
    [gate | up] = rows x @ part^T (part [2F, K]; up = F). With pairs (n = F), block_m 1: out
    row p from codes row p // pairs.per against gate rows pairs.ids[p] * pairs.erows +
    pairs.w0 .. + F - 1 and the up rows `up` further on (a8_pairs' pairs; K's parts those of
    the packed weight as a whole, [E 2F, K], as a8_pairs takes them). codes (F whole blocks of
    32): Codes [M, F] to fill with out's rows quantized, as quantize_rows(out) would."""
    q = x.qp   # the rows' codes in pair order (a8_gemv)
    block_n = block_n or program_width(q.device, 32)   # columns a program
    k = q.shape[1]
    f = out.shape[1]
    if pairs is None:
        m, up, p = q.shape[0], f, k_parts(part.rows, k)
        assert part.rows == 2 * f
    else:
        m, p = pairs.ids.shape[0], k_parts(part.rows, k)   # the packed experts' parts
        assert block_m == 1 and up is not None and pairs.n == f
    assert part.cols == k and out.shape == (m, f) and out.stride(1) == 1
    assert codes is None or (f % QBLOCK == 0 and codes.q.shape == (m, f))
    # with parts, the tile's last program adds them (kernels/arrive.py), else add_gated_parts;
    # the kernel quantizes the rows it writes (in blocks of 32 columns a program) where it
    # writes them
    tiles = triton.cdiv(m, block_m) * triton.cdiv(f, 32 if codes is not None else block_n)
    count = counters(q.device, tiles) if p > 1 else None
    fused = codes is not None and (p == 1 or count is not None)
    c = codes if fused else x
    n = 32 if fused else block_n
    grid = (triton.cdiv(m, block_m), triton.cdiv(f, n), p)
    dst = out if p == 1 else torch.empty(p, m, 2 * f, dtype=torch.float32, device=q.device)
    planes, strides = _planes(part)
    _a8_gemv_kernel[grid](q.view(torch.int32), x.dx, *Pairs.args(pairs, q), *planes, *strides,
                          dst, dst, out, q if count is None else count,
                          c.q, c.qp, c.dx, c.qs, c.dc, m, f, k, up, out.stride(0), out.stride(0),
                          QTYPE=TYPE_IDS[part.qtype], S=BLOCKS[part.qtype][2], HAS_RES=False,
                          FIXUP=count is not None,
                          ASM=q.device.type == "cuda", PAIRS=pairs is not None,
                          BLOCK_M=block_m, BLOCK_N=n, STEP=gemv_step(k), STAGES=stages, P=p,
                          L=k // p, L4=k // p // 4, L8=k // p // 8, L32=k // p // 32,
                          ACT=ACTS[act], CODES=fused, num_warps=warps,
                          **launch_options(q.device),
                          enable_fp_fusion=False)   # as every int8 kernel
    if p > 1 and count is None:
        add_gated_parts(dst, out, act, codes)
    return out


def add_gated_parts(parts: torch.Tensor, out: torch.Tensor, act: str,
                    codes: Codes | None = None) -> None:
    """out [M, F] = act(gate) * up of the parts' gate and up sums [P, M, 2F], each added in
    order from zero and rounded to out's dtype (and codes filled with out's rows quantized)."""
    p, m, f2 = parts.shape
    f = f2 // 2
    block = (next(b for b in (256, 128, 64, 32) if f % b == 0) if codes is not None
             else 256)
    c = codes if codes is not None else Codes(parts, parts, parts, parts, parts)   # not written
    _add_gated_parts_kernel[(m, triton.cdiv(f, block))](
        parts, out, c.q, c.qp, c.dx, c.qs, c.dc, m, f, out.stride(0), P=p, ACT=ACTS[act],
        CODES=codes is not None, BLOCK=block, enable_fp_fusion=False, **launch_options(out.device))
