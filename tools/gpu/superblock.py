"""A prototype, not used by stages: the int8 MMA over whole Q4_K super-blocks, with activation
codes of 12 bits a scale per 256 (docs/GPU.md: finer than today's int8 rows), so that every
float operation comes once a super-block instead of once a group of 32.

A row's 256 values get one scale D = max|x| / 2047 and codes q = round(x / D) in -2047..2047,
kept as two int8 planes, q = 128 hi + lo (lo 0..127, hi -16..15). A Q4_K row's super-block is
d sc_g u - dmin m_g over its 8 groups g (6-bit sc, m; 4-bit u). Then

    sum over the super-block of w * x  ~=  D (d A - dmin Mn),
    A = sum_k sc_g(k) u_k q_k,   Mn = sum_k m_g(k) q_k,

both integers, exact in int32 (|A| < 256 * 945 * 2047 < 2^31). The weight side sc u (up to 945)
is split as 128 wh + wl too, so A comes from four int8 dots of K 256 into one int32 chain
(((wh qh) 128 + wh ql + wl qh) 128 + wl ql) and Mn from two (m broadcast over its group); a
(row, column) then takes two conversions, three products and an fma a super-block, where
a8_triton's MMA takes five float operations a group. K is cut into parts summed by atomic adds
(the order of the parts' sums is not fixed: a timing prototype, not an exact kernel).

Counted for sm_90 with Triton 3.6 (`tools/sass_count.py --kernel sb-mma --rows 16|64`, 64 x 256
blocks): 23.0 and 26.5 instructions a weight at 16 and 64 rows, against a8_triton's MMA at 13.0
(64 x 128 blocks) and 21.3 (128 x 32: its blocks for a down projection). The float terms shrink
to 1.5 a weight at 64 rows as designed, but the weight side grows: sc u, its split, the
broadcast mins (LOP3, SHF, IMAD, PRMT: about 11 a weight) and the int8 operands' way through
shared memory a byte a store (STS 3.0, LDS 2.3), with registers spilled. It needs the operands
built four bytes a register in the dots' layout before it can pay; not timed on a GPU yet.

    python tools/gpu/superblock.py [--rows 16,32,64] [--projections qkv,down] [--block-n 64]
    TRITON_INTERPRET=1 python tools/gpu/superblock.py --check     (on a CPU: against float64)
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from strata.kernels.quant.a8 import quantize_rows_torch
from strata.kernels.quant.reads import Q4_K, _codes, _planes, _term_loads

TOP = 2047    # the codes' largest magnitude: 12 bits


def quantize_rows12(x: torch.Tensor, block: int = 256):
    """x [M, K] -> (lo, hi int8 [M, K], D fp32 [M, K / block]): q = 128 hi + lo, q = round(x / D)
    half away from zero, D = max|x| / 2047 over each block of a row."""
    q, d = quantize_rows_torch(x, block=block, top=TOP)
    return (q & 127).to(torch.int8), (q >> 7).to(torch.int8), d


@triton.jit
def _sb_mm_kernel(lo_ptr, hi_ptr, d_ptr, p0, p1, p2, p3, s0, s1, s2, s3, out_ptr, M, N, K,
                  L, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (row block, column block, part of K): the part's L super-blocks' terms, atomically
    added into out [M, N] (fp32, zeroed)."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    kk = tl.arange(0, 256)
    j = tl.arange(0, 8)[None, :]                          # the group in its super-block
    sh = 8 * (j % 4)
    low = j < 4
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for sb in range(tl.program_id(2) * L, tl.program_id(2) * L + L):
        u = _codes(p0, p1, s0, s1, n, n_ok, sb * 8, Q4_K, 32, 8, BLOCK_N)     # [BN, 8, 32]
        v0, v1, v2, v3, v4 = _term_loads(p2, p3, s2, s3, n, n_ok, sb * 8, Q4_K, 8)
        sc = tl.where(low, (v0 >> sh) & 63, ((v2 >> sh) & 15) | (((v0 >> (sh + 6)) & 3) << 4))
        mn = tl.where(low, (v1 >> sh) & 63, ((v2 >> (sh + 4)) & 15) | (((v1 >> (sh + 6)) & 3) << 4))
        w = u * sc[:, :, None]                                                 # up to 945
        wh = tl.reshape(w >> 7, (BLOCK_N, 256)).to(tl.int8)
        wl = tl.reshape(w & 127, (BLOCK_N, 256)).to(tl.int8)
        mb = tl.reshape(tl.broadcast_to(mn[:, :, None], (BLOCK_N, 8, 32)),
                        (BLOCK_N, 256)).to(tl.int8)
        at = m[:, None] * K + sb * 256 + kk[None, :]
        ql = tl.trans(tl.load(lo_ptr + at, mask=m_ok[:, None], other=0))       # [256, BM]
        qh = tl.trans(tl.load(hi_ptr + at, mask=m_ok[:, None], other=0))
        a = tl.dot(wh, qh, out_dtype=tl.int32) * 128
        a = tl.dot(wl, qh, tl.dot(wh, ql, a, out_dtype=tl.int32), out_dtype=tl.int32) * 128
        a = tl.dot(wl, ql, a, out_dtype=tl.int32)
        mins = tl.dot(mb, ql, tl.dot(mb, qh, out_dtype=tl.int32) * 128, out_dtype=tl.int32)
        dx = tl.load(d_ptr + m * (K // 256) + sb, mask=m_ok, other=0.0)
        dd = v3.to(tl.float32)[:, None] * dx[None, :]
        dm = v4.to(tl.float32)[:, None] * dx[None, :]
        acc += tl.fma(dd, a.to(tl.float32), -(dm * mins.to(tl.float32)))
    tl.atomic_add(out_ptr + m[None, :] * N + n[:, None], acc, mask=n_ok[:, None] & m_ok[None, :])


def sb_mm(lo, hi, d, part, parts: int = 1, block_m: int = 16, block_n: int = 64,
          warps: int = 4) -> torch.Tensor:
    """fp32 [M, N]: quantize_rows12's rows against a Q4_K part [N, K], K in `parts` parts."""
    m, k = lo.shape
    assert part.qtype == "Q4_K" and part.cols == k and (k // 256) % parts == 0
    out = torch.zeros(m, part.rows, dtype=torch.float32, device=lo.device)
    planes, strides = _planes(part)
    grid = (triton.cdiv(m, block_m), triton.cdiv(part.rows, block_n), parts)
    _sb_mm_kernel[grid](lo, hi, d, *planes, *strides, out, m, part.rows, k, k // 256 // parts,
                        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return out


def reference(lo, hi, d, part) -> torch.Tensor:
    """float64 [M, N]: the dequantized weights times the rows' codes times their scales."""
    from strata.kernels.quant.weight import codes, group_terms
    u = codes(part.qtype, part.planes).double()
    a, b = group_terms(part.qtype, part.planes)
    w = (u.view(part.rows, -1, 32) * a.double()[..., None] + b.double()[..., None])
    q = 128 * hi.double() + lo.double()
    x = (q.view(q.shape[0], -1, 256) * d.double()[..., None]).view(q.shape)
    return x @ w.view(part.rows, -1).T


def check() -> None:
    """The kernel against float64 on small shapes (run under TRITON_INTERPRET=1 on a CPU)."""
    from strata.kernels.quant.weight import QuantWeight, random_blocks
    gen = torch.Generator().manual_seed(0)
    w = QuantWeight.from_blocks("Q4_K", random_blocks("Q4_K", 64, 512, gen), 512, "cpu")
    x = torch.randn(20, 512, generator=gen)
    lo, hi, d = quantize_rows12(x)
    q = 128 * hi.int() + lo.int()
    assert int(q.abs().max()) <= TOP and torch.equal(q.view(20, 2, 256).abs().amax(-1),
                                                     torch.full((20, 2), TOP, dtype=torch.int32))
    want = reference(lo, hi, d, w.parts[0])
    for block_m, parts in ((16, 1), (32, 2)):
        got = sb_mm(lo, hi, d, w.parts[0], parts=parts, block_m=block_m, block_n=32)
        err = float((got.double() - want).abs().max() / want.abs().max())
        print(f"{block_m}-row tile, {parts} part(s): largest difference {err:.2e} of the largest "
              f"output")
        assert err < 1e-5, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--projections", default="qkv,down")
    ap.add_argument("--block-n", default="64,128")
    args = ap.parse_args()
    if args.check:
        return check()
    from bench_kernels import timed   # this script's folder is on the path
    from bench_quant import L8B, weights
    from strata.kernels.quant.a8_parts import k_parts
    from strata.kernels.quant.a8_triton import a8_mm, quantize_rows
    from strata.kernels.quant.blocks import Part
    print(f"# {torch.cuda.get_device_name()}: us a call, weights rotating past L2")
    for name in args.projections.split(","):
        n, k = L8B[name]
        probe = weights("Q4_K", n, k, 1)[0]
        copies = max(2, -(-200_000_000 // probe.nbytes))
        ws = [probe] + weights("Q4_K", n, k, copies - 1, seed=1)
        parts = k_parts(n, k)
        while (k // 256) % parts:
            parts //= 2
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            lo, hi, d = quantize_rows12(x)
            codes = quantize_rows(x)
            today = timed(lambda i: a8_mm(codes, ws[i % copies].parts[0]))
            pc = probe.parts[0]
            want = reference(lo.cpu(), hi.cpu(), d.cpu(), Part(
                pc.qtype, pc.rows, pc.cols, {k: v.cpu() for k, v in pc.planes.items()}))
            for bn in (int(b) for b in args.block_n.split(",")):
                bm = min(m, 64)
                try:
                    us = timed(lambda i: sb_mm(lo, hi, d, ws[i % copies].parts[0], parts=parts,
                                               block_m=bm, block_n=bn))
                    got = sb_mm(lo, hi, d, probe.parts[0], parts=parts, block_m=bm, block_n=bn)
                    err = float((got.double().cpu() - want.cpu()).abs().max()
                                / want.abs().max())
                except Exception as e:   # resources the GPU cannot hold
                    print(f"# {name} {m} rows, block_n {bn}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:100]}")
                    continue
                print(f"Q4_K {name} [{n}, {k}] {m} rows: a8_mm {today:.1f} us, super-blocks "
                      f"(block_n {bn}, {parts} parts) {us:.1f} us, error {err:.1e}")


if __name__ == "__main__":
    main()
