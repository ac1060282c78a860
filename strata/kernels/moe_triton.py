"""Routed experts of a window (qwen3moe, glm4moe) as Triton kernels, with fixed shapes and no
host sync, so a decode window's experts run inside its CUDA graph (the plain-torch reference:
kernels/moe.py's moe_rows, which the CPU path runs).

    router logits  skinny_mm(h, router, out_dtype=float32) for a decode window (its blocks
                   from the router's shape: a row's logits the same whatever the window), a
                   fixed-shape matmul for a prompt chunk (moe.router_logits)
    routing        moe_route.py: each row's top-k experts and weights (route), and the
                   window's pairs sorted into blocks of one expert (align)
    _gate_up       one program a (block of slots, block of F columns): act(x @ gate^T) *
                   (x @ up^T) of the block's pairs' rows against the block's expert, into the
                   slot's row of h [slots, F]
    _down          h @ down^T of the block's slots, into each pair's row of o [P, D]
    _sum           one program a (row, block of D): the row's k outputs times their weights,
                   added in the row's ranking order in fp32 (+ the residual), rounded once

The two expert kernels run on a fixed grid of the most blocks a window of its rows can need;
the programs past the blocks used exit at once (vLLM's moe_align_block_size and fused_moe are
the design this follows). A program walks K in BLOCK_K steps in order with fp32 accumulators,
the weight tile as the MMA's M and the slots as its N (the skinny kernels' swap-AB), and
BLOCK_N, BLOCK_K and BLOCK_M come from the weight's shape and type and the policy alone
(policy.moe_blocks). So a pair's output is computed alone, with the same arithmetic whatever
slot, block or neighbours it has: a row's routing and result do not depend on which rows share
its window, which experts they chose, nor on its position (DESIGN.md, exactness 1 and 2).

Quantized experts: a GGUF expert tensor [E, N, K] in a block type is a 2-D packed weight of
E * N rows (kernels/quant/weight.py), expert e's rows e * N .. e * N + N - 1, dequantized tile by
tile in registers by reads.py's `_weights`, as the dense quantized kernels do.
May import: kernels.quant, kernels
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.fused_triton import ACTS, gate_act
from strata.kernels.pdl import enter, launch_options
from strata.kernels.quant.float_triton import fits_k
from strata.kernels.quant.reads import TYPE_IDS, _planes, _weights
from strata.kernels.quant.weight import BLOCKS, QuantWeight

DENSE = -1   # the QTYPE of a dense (bf16 / fp32) weight


@triton.jit
def _tile(w0, w1, w2, w3, s0, s1, s2, s3, n, n_ok, k0, QTYPE: tl.constexpr, S: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight rows n, columns k0 .. k0 + BLOCK_K - 1: loaded (QTYPE -1: dense, w0 the matrix
    and s0 its row stride) or dequantized from the packed planes (fp32)."""
    if QTYPE == -1:                                            # DENSE
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w0 + n[:, None] * s0 + k[None, :], mask=n_ok[:, None], other=0.0)
    else:
        w = _weights(w0, w1, w2, w3, s0, s1, s2, s3, n, n_ok, k0, QTYPE, S, BLOCK_N, BLOCK_K)
    return w


@triton.jit
def _block(sorted_ptr, block_expert_ptr, P, BLOCK_M: tl.constexpr):
    """The program's block: its expert, slots [BLOCK_M], their pairs and whether each is one."""
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b)
    slot = b * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + slot)
    return e, slot, pair, pair < P


@triton.jit
def _gate_up_kernel(x_ptr, sorted_ptr, block_expert_ptr, n_blocks_ptr, h_ptr,
                    g0, g1, g2, g3, gs0, gs1, gs2, gs3, gate_e, gate_off,
                    u0, u1, u2, u3, us0, us1, us2, us3, up_e, up_off,
                    P, F, K, stride_xm, stride_hm,
                    QG: tl.constexpr, SG: tl.constexpr, QU: tl.constexpr, SU: tl.constexpr,
                    TOPK: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """h[slot] = act(x[row] @ gate_e^T) * (x[row] @ up_e^T); expert e's gate rows are
    e * gate_e + gate_off + j, its up rows e * up_e + up_off + j."""
    if tl.program_id(0) < tl.load(n_blocks_ptr):
        e, slot, pair, live = _block(sorted_ptr, block_expert_ptr, P, BLOCK_M)
        row = tl.where(live, pair // TOPK, 0)
        j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        j_ok = j < F
        gate_n = (e * gate_e + gate_off + j).to(tl.int64)
        up_n = (e * up_e + up_off + j).to(tl.int64)
        kk = tl.arange(0, BLOCK_K)
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)    # out^T: the weight is the MMA's M
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            x = tl.load(x_ptr + row[:, None] * stride_xm + (k0 + kk)[None, :],
                        mask=live[:, None], other=0.0)
            xt = tl.trans(x)
            wg = _tile(g0, g1, g2, g3, gs0, gs1, gs2, gs3, gate_n, j_ok, k0, QG, SG, BLOCK_N,
                       BLOCK_K)
            acc_g = tl.dot(wg.to(x.dtype), xt, acc_g)
            wu = _tile(u0, u1, u2, u3, us0, us1, us2, us3, up_n, j_ok, k0, QU, SU, BLOCK_N,
                       BLOCK_K)
            acc_u = tl.dot(wu.to(x.dtype), xt, acc_u)
        dtype = h_ptr.dtype.element_ty
        # rounded as the projection's output would be, then the activation in fp32 (silu_mul)
        gate = tl.trans(acc_g).to(dtype).to(tl.float32)
        up = tl.trans(acc_u).to(dtype).to(tl.float32)
        h = gate_act(gate, ACT) * up
        tl.store(h_ptr + slot[:, None] * stride_hm + j[None, :], h.to(dtype), mask=j_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, sorted_ptr, block_expert_ptr, n_blocks_ptr, o_ptr,
                 d0, d1, d2, d3, ds0, ds1, ds2, ds3, down_e,
                 P, N, K, stride_hm, stride_om,
                 QD: tl.constexpr, SD: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """o[pair] = h[slot] @ down_e^T (expert e's rows e * down_e + n)."""
    if tl.program_id(0) < tl.load(n_blocks_ptr):
        e, slot, pair, live = _block(sorted_ptr, block_expert_ptr, P, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        rows = (e * down_e + n).to(tl.int64)
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            h = tl.load(h_ptr + slot[:, None] * stride_hm + (k0 + kk)[None, :])
            w = _tile(d0, d1, d2, d3, ds0, ds1, ds2, ds3, rows, n_ok, k0, QD, SD, BLOCK_N,
                      BLOCK_K)
            acc = tl.dot(w.to(h.dtype), tl.trans(h), acc)
        out = tl.trans(acc).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + tl.where(live, pair, 0)[:, None] * stride_om + n[None, :], out,
                 mask=live[:, None] & n_ok[None, :])


@triton.jit
def _sum_kernel(o_ptr, w_ptr, res_ptr, out_ptr, N, stride_om, stride_rm, stride_outm,
                TOPK: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr,
                PDL: tl.constexpr):
    enter(PDL)
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for r in tl.static_range(TOPK):   # the row's ranking order, the same for every row
        w = tl.load(w_ptr + m * TOPK + r)
        acc += tl.load(o_ptr + (m * TOPK + r) * stride_om + n, mask=ok, other=0.0).to(
            tl.float32) * w
    if HAS_RES:
        acc = tl.load(res_ptr + m * stride_rm + n, mask=ok, other=0.0).to(tl.float32) + acc
    tl.store(out_ptr + m * stride_outm + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


# --- launchers -------------------------------------------------------------------------------

def _source(w: torch.Tensor | QuantWeight, part: int, per_expert: int, offset: int):
    """The kernels' arguments for one expert matrix: 4 planes (a dense matrix: itself 4 times),
    their row strides, expert e's first row e * per_expert + offset, and (QTYPE, S)."""
    if isinstance(w, QuantWeight):
        p = w.parts[part]
        planes, strides = _planes(p)
        return planes, strides, (per_expert, offset), (TYPE_IDS[p.qtype], BLOCKS[p.qtype][2])
    flat = w.reshape(-1, w.shape[-1])
    assert flat.stride(1) == 1
    return [flat] * 4, [flat.stride(0)] * 4, (per_expert, offset), (DENSE, 32)


def _gate_up_sources(w: torch.Tensor | QuantWeight, n_experts: int, f: int) -> tuple:
    """(gate, up) of a [gate; up] weight: dense [E, 2F, K], or packed as all experts' gate
    rows then all their up rows (one part, or two of different types)."""
    if not isinstance(w, QuantWeight):
        return _source(w, 0, 2 * f, 0), _source(w, 0, 2 * f, f)
    if len(w.parts) == 1:
        return _source(w, 0, f, 0), _source(w, 0, f, n_experts * f)
    assert len(w.parts) == 2, "gate and up: one part each at most"
    return _source(w, 0, f, 0), _source(w, 1, f, 0)


def _block_k(w: torch.Tensor | QuantWeight, k: int, block_k: int) -> int:
    """block_k halved until it divides K and, for a packed weight, holds whole scale groups of
    each part (float_triton.fits_k)."""
    parts = w.parts if isinstance(w, QuantWeight) else ()
    floor = 32 if parts else 16
    while block_k > floor and not (k % block_k == 0 and all(fits_k(p, block_k) for p in parts)):
        block_k //= 2
    if k % block_k or not all(fits_k(p, block_k) for p in parts):
        raise ValueError(f"expert kernels: K {k} takes no step of {block_k} quants or fewer")
    return block_k


def experts(h: torch.Tensor, slots: torch.Tensor, block_expert: torch.Tensor,
            n_blocks: torch.Tensor, k: int, gate_up: torch.Tensor | QuantWeight,
            down: torch.Tensor | QuantWeight, n_experts: int, blocks: dict,
            act: str = "silu") -> torch.Tensor:
    """h [M, D] and an align()ed window -> each pair's expert output o [M * k, D] in h's
    dtype. gate_up: [E, 2F, D] or packed (gate rows of every expert, then up rows); down:
    [E, D, F] or packed [E * D, F]. blocks: block_m and each kernel's block_n, block_k,
    stages, warps (policy.moe_blocks)."""
    m, d = h.shape
    f = down.shape[-1]
    block_m = blocks["block_m"]
    max_blocks = block_expert.shape[0]
    assert h.stride(1) == 1 and slots.shape[0] == max_blocks * block_m
    gate, up = _gate_up_sources(gate_up, n_experts, f)
    g = blocks["gate_up"]
    bk = _block_k(gate_up, d, g["block_k"])
    hidden = torch.empty(max_blocks * block_m, f, dtype=h.dtype, device=h.device)
    _gate_up_kernel[(max_blocks, triton.cdiv(f, g["block_n"]))](
        h, slots, block_expert, n_blocks, hidden, *gate[0], *gate[1], *gate[2],
        *up[0], *up[1], *up[2], m * k, f, d, h.stride(0), hidden.stride(0),
        QG=gate[3][0], SG=gate[3][1], QU=up[3][0], SU=up[3][1], TOPK=k, ACT=ACTS[act],
        BLOCK_M=block_m, BLOCK_N=g["block_n"], BLOCK_K=bk, STAGES=g["stages"],
        num_warps=g["warps"])
    src = _source(down, 0, d, 0)
    dn = blocks["down"]
    bk = _block_k(down, f, dn["block_k"])
    out = torch.empty(m * k, d, dtype=h.dtype, device=h.device)
    _down_kernel[(max_blocks, triton.cdiv(d, dn["block_n"]))](
        hidden, slots, block_expert, n_blocks, out, *src[0], *src[1], src[2][0],
        m * k, d, f, hidden.stride(0), out.stride(0), QD=src[3][0], SD=src[3][1],
        BLOCK_M=block_m, BLOCK_N=dn["block_n"], BLOCK_K=bk, STAGES=dn["stages"],
        num_warps=dn["warps"])
    return out


def experts_a8(h: torch.Tensor, experts: torch.Tensor, gate_up: QuantWeight,
               down: QuantWeight, n_experts: int, act: str = "silu") -> torch.Tensor:
    """With int8 activations (a decode window): each (row, rank) pair as GEMVs of its own,
    h's rows quantized once (kernels/quant/a8_triton.py): act(gate) * up of the pair's
    expert, its rows quantized, then down -> o [M * k, D] in h's dtype, as experts() returns.
    experts: int32 [M, k] (route); gate_up and down packed as experts() takes them. Gate and
    up in one part take a8_gated.py's kernels (act and the quantized rows in them too); in
    two, a8_pairs each, silu_mul and quantize_rows: the same bits either way. The kernels
    find a pair's rows from the experts alone (a8_gemv.Pairs): no index arrays are built."""
    from strata.kernels.fused_triton import silu_mul
    from strata.kernels.quant.a8 import QBLOCK, Codes
    from strata.kernels.quant.a8_gated import a8_gate_up
    from strata.kernels.quant.a8_gemv import Pairs
    from strata.kernels.quant.a8_triton import a8_pairs, quantize_rows
    m, d = h.shape
    k, f = experts.shape[1], down.shape[1]
    ids = experts.reshape(-1)                                 # pair p: row p // k, rank p % k
    x = quantize_rows(h)
    if len(gate_up.parts) == 1 and f % QBLOCK == 0:
        # every expert's gate rows, then every expert's up rows
        codes = Codes.empty(m * k, f, h.device)
        a8_gate_up(x, gate_up.parts[0], act,
                   torch.empty(m * k, f, dtype=h.dtype, device=h.device), 1, codes=codes,
                   pairs=Pairs(ids, k, f, 0, f), up=n_experts * f)
        x = codes
    else:
        if len(gate_up.parts) == 1:
            (gate, g0), (up, u0) = (gate_up.parts[0], 0), (gate_up.parts[0], n_experts * f)
        else:
            (gate, g0), (up, u0) = (gate_up.parts[0], 0), (gate_up.parts[1], 0)
        gu = torch.empty(m * k, 2 * f, dtype=h.dtype, device=h.device)
        a8_pairs(x, gate, Pairs(ids, k, f, g0, f), gu[:, :f])
        a8_pairs(x, up, Pairs(ids, k, f, u0, f), gu[:, f:])
        x = quantize_rows(silu_mul(gu, act))
    out = torch.empty(m * k, d, dtype=h.dtype, device=h.device)
    return a8_pairs(x, down.parts[0], Pairs(ids, 1, d, 0, d), out)


def weighted_sum(outs: torch.Tensor, weights: torch.Tensor,
                 res: torch.Tensor | None = None) -> torch.Tensor:
    """outs [M * k, D], weights fp32 [M, k] -> [M, D]: (res +) each row's k outputs times
    their weights, added in ranking order in fp32 and rounded once."""
    m, k = weights.shape
    d = outs.shape[1]
    out = torch.empty(m, d, dtype=outs.dtype, device=outs.device)
    r = res if res is not None else out
    assert r.stride(1) == 1
    block_n = min(1024, triton.next_power_of_2(d))
    _sum_kernel[(m, triton.cdiv(d, block_n))](
        outs, weights, r, out, d, outs.stride(0), r.stride(0), out.stride(0), TOPK=k,
        HAS_RES=res is not None, BLOCK_N=block_n, num_warps=4, **launch_options(outs.device))
    return out
