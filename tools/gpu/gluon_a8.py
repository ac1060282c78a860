"""The int8-activation Gluon MMA (kernels/quant/a8_gluon.py) beside a8_mm at its defaults: on
a GPU, whether its bits are a8_mm's and both kernels' us per call from a CUDA graph with the
weights rotating past L2, for Q4_K and Q6_K at the llama3-8b down and qkv shapes; with `--sass
FILE`, its SASS for sm_90 compiled here without a GPU into FILE, and its main loop's
instructions a weight counted as tools/sass_count.py counts them (the first of --types and
--rows; use the device's Triton, as sass_count says), with the IMMA and FP32 instructions of a
super-block's step: the FP32 ones are the groups' float terms, a thread's outputs times about 5
a group of 32, so their share grows with the rows (Q4_K's ring, Triton 3.6: 56% at 16 rows, 65%
at 32, 72% at 64). The rows' codes (their dc plane with them) are quantized once, before the
timing.

    python tools/gpu/gluon_a8.py [--types Q4_K,Q6_K] [--rows 16,32,64] [--shape 4096x14336]
        [--block-n 64] [--block-m 32] [--warps 4] [--ahead] [--maxnreg 128] [--stages 3]
        [--sass FILE [--parts 4]]

--stages N times kernels/quant/a8_ring.py's kernels (a ring of N super-blocks in shared memory)
instead of the registers' kernels.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton

from strata.kernels.quant.a8_gluon import _q4k_mma_kernel, _q6k_mma_kernel, gluon_mm
from strata.kernels.quant.a8_layouts import dc_layout, mma_layout, raw_layout
from strata.kernels.quant.a8_ring import (_nibble_ring_kernel, _q6k_ring_kernel, copy_layouts,
                                          ring_mm)
from strata.kernels.quant.a8_ring_iq4 import _iq4xs_ring_kernel


def sass(qtype: str, block_n: int, block_m: int, warps: int, parts: int = 4,
         ahead: bool = False, maxnreg: int | None = None, stages: int = 0,
         warps_m: int = 1) -> tuple[str, str]:
    """The kernel's SASS for sm_90, compiled here (no GPU needed): K in `parts` parts, the
    last program adding them (one part: no scratch), a residual, bf16 out; and ptxas's line
    on its registers and spills."""
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    q6 = qtype == "Q6_K"
    fn = (({"Q6_K": _q6k_ring_kernel, "IQ4_XS": _iq4xs_ring_kernel}.get(qtype,
                                                                     _nibble_ring_kernel))
          if stages else (_q6k_mma_kernel if q6 else _q4k_mma_kernel))
    iq4 = qtype == "IQ4_XS"
    types = {"qp_ptr": "*i8", "dc_ptr": "*fp32", "w_ptr": "*i8", "qh_ptr": "*i8",
             "sc_ptr": "*i16" if iq4 else "*i8" if q6 and not stages else "*i32",
             "dm_ptr": "*i32" if stages and not (q6 or iq4) else "*fp16",
             "dst_ptr": "*fp32", "res_ptr": "*bf16", "out_ptr": "*bf16", "count_ptr": "*i32"}
    consts = {"BLOCK_N": block_n, "BLOCK_M": block_m, "MMA": mma_layout(warps, warps_m),
              "RAW": raw_layout(block_n, warps, warps_m),
              "DC": dc_layout(block_m, warps, 4 if qtype == "Q6_K" else 2, warps_m), "EVEN": True,
              "P": parts, "HAS_RES": True, "FIXUP": parts > 1}
    if "AHEAD" in fn.arg_names:
        consts["AHEAD"] = ahead
    if stages:
        consts.update(STAGES=stages, **copy_layouts(warps, qtype))
    if "Q8" in fn.arg_names:
        consts.update(Q8=qtype == "Q8_0", Q5=qtype == "Q5_K")
    signature = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if a != "M" and a not in consts}
    src = GluonASTSource(fn, signature, consts, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "enable_fp_fusion": False,
                                     **({"maxnreg": maxnreg} if maxnreg else {})})
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.cubin"), "wb") as f:
            f.write(kernel.asm["cubin"])
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(kernel.asm["ptx"])
        code = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", f"{d}/k.cubin"],
                              capture_output=True, text=True, check=True).stdout
        ptxas = subprocess.run([os.path.join(tools, "ptxas"), "-arch=sm_90a", "-v",
                                f"{d}/k.ptx", "-o", f"{d}/v.cubin"], capture_output=True,
                               text=True, check=True).stderr
    used = [line.split("info    : ")[-1] for line in ptxas.splitlines() if "Used" in line]
    spills = [line.split("info    : ")[-1].strip() for line in ptxas.splitlines()
              if "spill" in line]
    return code, "; ".join(used + spills)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--rows", default="16")
    ap.add_argument("--shape", default="4096x14336,6144x4096")
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--block-m", type=int, default=None,
                    help="rows a program (default: the window's rows up to a power of two)")
    ap.add_argument("--sass", default=None, help="write the SASS for sm_90 here (no GPU)")
    ap.add_argument("--ahead", action="store_true",
                    help="Q4_K: a super-block's weight words and scales loaded a step ahead")
    ap.add_argument("--maxnreg", type=int, default=None,
                    help="cap a thread's registers (ptxas), e.g. 128: 4 programs an SM")
    ap.add_argument("--stages", type=int, default=0,
                    help="a8_ring.py's kernels, a ring of this many super-blocks")
    ap.add_argument("--warps-m", type=int, default=1,
                    help="--stages: warps along the window's rows (of --warps)")
    ap.add_argument("--parts", type=int, default=4,
                    help="--sass: parts of K the kernel is compiled for (1: no scratch)")
    args = ap.parse_args()
    if not args.stages and set(args.types.split(",")) - {"Q4_K", "Q6_K"}:
        ap.error("the registers' kernels take Q4_K and Q6_K: other types need --stages")
    if args.sass:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
        from sass_count import FP32, histogram, issue_slots, main_loop
        qtype, block_m = args.types.split(",")[0], args.block_m or int(args.rows.split(",")[0])
        code, regs = sass(qtype, args.block_n, block_m, args.warps, args.parts, args.ahead,
                          args.maxnreg, args.stages, args.warps_m)
        with open(args.sass, "w") as f:
            f.write(code)
        body = main_loop(code)             # a super-block a step: block_n x 256 quants
        weights = args.block_n * 256 / (32 * args.warps)
        print(f"{qtype} Gluon MMA, {args.block_n} x {block_m} blocks, {args.warps} warps: "
              f"{len(body) / weights:.2f} instructions a weight, "
              f"{issue_slots(histogram(body)) / weights:.2f} ALU issue slots a weight, "
              f"{sum('BAR.SYNC' in line for line in body)} barriers a step ({regs})")
        ops = histogram(body)
        mma = sum(n for op, n in ops.items() if op.startswith("IMMA"))
        floats = sum(n for op, n in ops.items() if op in FP32)
        print(f"a super-block's step: {len(body)} instructions, {mma} IMMA, {floats} FP32 adds, "
              f"multiplies and fmas ({floats / len(body):.0%}; the groups' terms: "
              f"{floats / (8 * args.block_n * block_m / (32 * args.warps)):.1f} a thread's "
              f"output a group of 32)")
        return
    from bench_kernels import timed   # this script's folder is on the path
    from bench_quant import weights
    from strata.kernels.quant.a8_triton import a8_mm, quantize_rows
    print(f"# {torch.cuda.get_device_name()}")
    for qtype, shape in itertools.product(args.types.split(","), args.shape.split(",")):
        n, k = (int(v) for v in shape.split("x"))
        probe = weights(qtype, n, k, 1)[0]
        copies = max(2, -(-200_000_000 // probe.nbytes))
        ws = [probe] + weights(qtype, n, k, copies - 1, seed=1)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            c = quantize_rows(x)
            part = probe.parts[0]
            bm = args.block_m or max(8, triton.next_power_of_2(rows))
            kw = dict(block_n=args.block_n, block_m=bm, warps=args.warps, maxnreg=args.maxnreg)
            ring = bool(args.stages)
            if ring:
                kw.update(stages=args.stages, warps_m=args.warps_m)
            elif args.ahead:
                kw["ahead"] = True
            mm = ring_mm if ring else gluon_mm
            got = mm(c, part, **kw)
            want = a8_mm(c, part)
            same = torch.equal(got, want)
            err = ((got - want).abs().max() / want.abs().max()).item()
            gl_us = timed(lambda i: mm(c, ws[i % copies].parts[0], **kw))
            a8_us = timed(lambda i: a8_mm(c, ws[i % copies].parts[0]))
            name = "ring" if ring else "gluon"
            print(f"{qtype} [{n}, {k}] {rows} rows: {name} {gl_us:.1f} us, a8_mm {a8_us:.1f} us, "
                  f"bits {'equal' if same else f'DIFFER (max rel {err:.2e})'}")


if __name__ == "__main__":
    main()
