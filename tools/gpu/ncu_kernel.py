"""One projection's decode kernel at the llama3-8b shape, launched three times and nothing else:
a program for Nsight Compute to profile (docs/GPU.md says what it found for the int8 MMA).
`a8`: a8_mm at its defaults (the GEMV up to 8 rows, the MMA from 16), on quantize_rows' codes;
`float`: the float quantized kernel with the policy's blocks and splits, as a stage calls it.

    ncu --clock-control none --set full -k regex:'_a8_mm_kernel|_quant_mm_kernel' \\
        --launch-skip 2 --launch-count 1 python tools/gpu/ncu_kernel.py Q4_K down 16 a8
"""
from __future__ import annotations

import argparse

import torch

from bench_a8 import float_call   # this script's folder is on the path
from bench_quant import L8B, weights
from strata.kernels.policy import KernelPolicy
from strata.kernels.quant.a8_triton import a8_mm, quantize_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("qtype", help="the weight's block type, e.g. Q4_K")
    ap.add_argument("projection", choices=sorted(L8B))
    ap.add_argument("rows", type=int, help="the window's rows (1 to 64)")
    ap.add_argument("way", choices=["a8", "float"])
    args = ap.parse_args()
    n, k = L8B[args.projection]
    w = weights(args.qtype, n, k, 1)[0]
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(args.rows, k, **bf)
    norm, res = torch.ones(k, **bf), torch.zeros(args.rows, n, **bf)
    kind = "res" if args.projection == "down" else args.projection
    policy = KernelPolicy.for_device("cuda")
    codes = quantize_rows(x)
    for _ in range(3):
        if args.way == "a8":
            a8_mm(codes, w.parts[0], None if kind in ("qkv", "head") else res)
        else:
            float_call(kind, x, w, norm, res, policy)
    torch.cuda.synchronize()
    print(f"{args.qtype} {args.projection} [{n}, {k}], {args.rows} rows, {args.way}: 3 launches")


if __name__ == "__main__":
    main()
