"""The GEMV a thread a column (kernels/quant/a8_gemv1.py, a program a row) against a8_mm's
default for windows of 1 to 8 rows, by block type at the llama3-8b shapes: us per call from a
CUDA graph with the weights rotating past L2, for each (columns a program, loads in flight) of
the new kernel, whether its bits are the default's, and the HBM time of the weight's bytes. An
experiment, not a test: it says up to how many rows STRATA_A8_GEMV1 should take by default.

    python tools/gpu/bench_gemv1.py [--types Q4_K,Q6_K] [--projections qkv,res,down,gate_up]
        [--rows 1,2,4] [--configs 128x3,64x3] [--group-major]
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton

from bench_kernels import timed   # this script's folder is on the path
from bench_quant import L8B, copy_rate, weights

CONFIGS = "32x1,64x1,128x1,32x2,64x2,128x2,32x3,64x3,128x3,64x4"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="Q4_K,Q6_K,Q5_K,Q8_0,IQ4_XS")
    ap.add_argument("--projections", default="qkv,res,down,gate_up")
    ap.add_argument("--rows", default="1", help="window sizes, 1 to 8")
    ap.add_argument("--configs", default=CONFIGS,
                    help="columns a program x stages (1: loads as ptxas places them; 2 or "
                         "more: Triton's pipeline, stages - 1 super-blocks ahead), and "
                         "optionally x rows a program (default all of the window's)")
    ap.add_argument("--group-major", action="store_true",
                    help="the new kernel reads the qs planes laid out a group before the next "
                         "(a8_gemv1.group_major; not Q6_K)")
    args = ap.parse_args()
    from strata.kernels.quant.a8_gemv1 import a8_gemv1, group_major
    from strata.kernels.quant.a8_triton import a8_mm, quantize_rows
    rate = copy_rate()
    made = {}
    print(f"# {torch.cuda.get_device_name()}, copy rate {rate / 1e12:.2f} TB/s")
    print(f"{'type':>6} {'proj':>8} {'rows':>4} {'hbm us':>7} {'a8_mm us':>9}  then each config: "
          "us (bits)")
    for qtype, name, rows in itertools.product(args.types.split(","),
                                               args.projections.split(","),
                                               [int(r) for r in args.rows.split(",")]):
        n, k = L8B[name]
        if (qtype, name) not in made:   # the same weights for every window size
            probe = weights(qtype, n, k, 1)[0]
            copies = max(2, -(-200_000_000 // probe.nbytes))
            made.clear()
            ws = [probe] + weights(qtype, n, k, copies - 1, seed=1)
            planes = [group_major(w.parts[0]) if args.group_major else None for w in ws]
            made[qtype, name] = probe, copies, ws, planes
        probe, copies, ws, planes = made[qtype, name]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        codes = quantize_rows(x)
        out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        base = timed(lambda i: a8_mm(codes, ws[i % copies].parts[0], out=out))
        want = a8_mm(codes, probe.parts[0])
        cells = []
        for config in args.configs.split(","):
            cols, stages, *per = (int(v) for v in config.split("x"))
            kw = dict(block_n=cols, warps=cols // 32, stages=stages, rows=per[0] if per else None)
            try:
                us = timed(lambda i: a8_gemv1(codes, ws[i % copies].parts[0], None, out,
                                              qs=planes[i % copies], **kw))
            except triton.runtime.errors.OutOfResources as e:   # shared memory, registers
                cells.append(f"{config} ({e.name} past the limit)")
                continue
            got = a8_gemv1(codes, probe.parts[0], None, torch.empty_like(want), qs=planes[0],
                           **kw)
            cells.append(f"{config} {us:.1f}{'' if torch.equal(got, want) else ' (DIFFER)'}")
        print(f"{qtype:>6} {name:>8} {rows:4d} {probe.nbytes / rate * 1e6:7.1f} {base:9.1f}  "
              + ", ".join(cells))


if __name__ == "__main__":
    main()
