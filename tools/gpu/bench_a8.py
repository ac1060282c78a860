"""The int8-activation kernels (kernels/quant/a8_triton.py) against today's quantized decode
kernels (kernels/quant/float_triton.py, the policy's blocks and splits) at the llama3-8b shapes,
by block type and window rows: us per call from a CUDA graph with the weights rotating past L2,
the row quantizer's us apart, a8_mm at its defaults (what a stage runs), the best a8_mm
configuration of a few (the dp4a GEMV's columns, stages and warps up to 8 rows, an 8-row tile
past 4; the MMA's block_n, block_k, warps and dot, --mma, past 4, 8 rows in its 16-row tile,
where groups-ahead also times the default blocks with and without the scales loaded a step
ahead; with --every each one's time, whether its bits are the defaults', and the best of each
way; for gate_up up to 8 rows, a stage's fused a8_gate_up_silu against a8_mm then silu_mul),
whether a row's bits equal the 16-row MMA tile's, and the HBM time of the weight's bytes. An
experiment, not a test: what it prints is the ground for choosing a8_mm's blocks per shape and
for making int8 activations the default.

    python tools/gpu/bench_a8.py [--types Q4_K,Q6_K,Q8_0] [--rows 1,2,4,8,16,64]
        [--mma diagonal,batched,groups,groups-ahead] [--blocks 64x64x4,128x32x4] [--parts 8]
        [--every] [--json-out F]
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from bench_kernels import timed   # this script's folder is on the path
from bench_quant import L8B, copy_rate, weights
from strata.kernels.policy import KernelPolicy

CONFIGS = [(32, 128, 4), (64, 128, 4), (64, 256, 4), (128, 128, 8), (32, 64, 4), (16, 256, 4),
           (32, 32, 4), (64, 32, 4), (128, 32, 4), (64, 64, 4), (128, 32, 8), (128, 64, 8),
           (64, 64, 8), (64, 128, 8)]
# the dp4a GEMV's (columns a program, K steps in flight, warps), for windows of 1 to 4 rows
GEMV_CONFIGS = [(8, 3, 4), (16, 3, 4), (32, 3, 4), (16, 2, 4), (32, 2, 4), (16, 4, 8), (64, 3, 4),
                (128, 3, 4), (128, 2, 4)]


def float_call(kind, x, w, norm, res, policy):
    from strata.kernels.quant.float_triton import quant_mm
    part = w.parts[0]
    blocks = policy.quant_blocks(part.qtype, part.rows, part.cols, kind)
    tile = policy.row_tile(x.shape[0], w.nbytes)
    if kind in ("qkv", "head"):
        return quant_mm(x, part, norm=norm, eps=1e-5, block_m=tile, **blocks)
    return quant_mm(x, part, res, block_m=tile, **blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--projections", default="qkv,res,down,head")
    ap.add_argument("--mma", default="diagonal,batched,groups",
                    help="the MMA tiles' dots to time (a8_mm's dot; groups-ahead: groups "
                         "with the scales loaded a step ahead, a8_mm's ahead)")
    ap.add_argument("--blocks", default=None,
                    help="the MMA blocks to time, as block_nxblock_kxwarps (default: CONFIGS)")
    ap.add_argument("--parts", default="8",
                    help="the most parts of K to time (a8_mm's parts; each gives other bits)")
    ap.add_argument("--every", action="store_true",
                    help="print every configuration's time, not only the best")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    from strata.kernels.quant.a8_triton import a8_mm, a8_row_tile, quantize_rows
    policy = KernelPolicy.for_device("cuda")
    rate = copy_rate()
    bf = dict(device="cuda", dtype=torch.bfloat16)
    shapes = {k: L8B[k] for k in args.projections.split(",")}   # gate_up: as one projection
    rows_out = []
    print(f"# {torch.cuda.get_device_name()}, copy rate {rate / 1e12:.2f} TB/s")
    print(f"{'type':>5} {'proj':>5} {'rows':>4} {'hbm us':>7} {'float us':>9} {'quantize':>9} "
          f"{'a8 us':>7} {'default':>8} {'a8 config':>14} {'bits':>5}")
    for qtype, (name, (n, k)) in itertools.product(args.types.split(","), shapes.items()):
        kind = "res" if name == "down" else name
        probe = weights(qtype, n, k, 1)[0]
        copies = max(2, -(-200_000_000 // probe.nbytes))
        ws = [probe] + weights(qtype, n, k, copies - 1, seed=1)
        hbm = probe.nbytes / rate * 1e6
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, **bf)
            norm = torch.ones(k, **bf)
            res = torch.zeros(m, n, **bf)
            fl = timed(lambda i: float_call(kind, x, ws[i % copies], norm, res, policy))
            nm = norm if kind in ("qkv", "head") else None
            qu = timed(lambda i: quantize_rows(x, nm, 1e-5))
            codes = quantize_rows(x, nm, 1e-5)
            best, by_way = None, {}
            r = None if kind in ("qkv", "head") else res
            out = torch.empty(m, n, **bf)
            default = timed(lambda i: a8_mm(codes, ws[i % copies].parts[0], r, out=out))
            if "groups-ahead" in args.mma and m > 8:   # the scales a step ahead and not
                on, off = (timed(lambda i: a8_mm(codes, ws[i % copies].parts[0], r, out=out,
                                                 ahead=a)) for a in (True, False))
                same = torch.equal(a8_mm(codes, probe.parts[0], r, ahead=True),
                                   a8_mm(codes, probe.parts[0], r, ahead=False))
                print(f"# {qtype} {name} {m} rows, the default blocks: the scales a step ahead "
                      f"{on:.1f} us, not {off:.1f} us (bits {'equal' if same else 'DIFFER'})")
            # the GEMV up to 4 rows, and as an 8-row tile (block_m 8) beside the MMA's
            gemv = [(*c, "gemv") for c in GEMV_CONFIGS] if m <= 8 else []
            configs = ([tuple(int(v) for v in b.split("x")) for b in args.blocks.split(",")]
                       if args.blocks else CONFIGS)
            mma = [(*c, d) for c in configs for d in args.mma.split(",")] if m > 4 else []
            parts = [int(p) for p in args.parts.split(",")]
            for config in ((*c, p) for c in gemv + mma for p in parts):
                out = torch.empty(m, n, **bf)
                kw = (dict(gemv_n=config[0], stages=config[1], warps=config[2],
                           block_m=8 if m > 4 else None) if config[3] == "gemv" else
                      dict(block_n=config[0], block_k=config[1], warps=config[2],
                           block_m=max(16, a8_row_tile(m)), dot=config[3].removesuffix("-ahead"),
                           ahead=config[3].endswith("-ahead")))
                kw["parts"] = config[4]
                try:
                    us = timed(lambda i: a8_mm(codes, ws[i % copies].parts[0], r, out=out, **kw))
                except Exception as e:   # a configuration the GPU cannot hold (resources)
                    print(f"# {qtype} {name} {m} rows, {config}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120]}")
                    continue
                if args.every:   # and whether its bits are a8_mm's at its defaults
                    same = torch.equal(a8_mm(codes, probe.parts[0], r, **kw),
                                       a8_mm(codes, probe.parts[0], r, parts=config[4]))
                    print(f"#   {qtype} {name} {m} rows {config}: {us:.1f} us"
                          f"{'' if same else ' (bits DIFFER from the defaults)'}")
                if best is None or us < best[0]:
                    best = (us, config)
                if config[3] not in by_way or us < by_way[config[3]][0]:
                    by_way[config[3]] = (us, config)
            if best is None:
                continue
            if name == "gate_up" and m <= 8:   # a stage's int8 gate/up: a8_gate_up_silu
                from strata.kernels.fused_triton import silu_mul
                from strata.kernels.quant.a8_triton import a8_gate_up_silu
                fused = timed(lambda i: a8_gate_up_silu(codes, ws[i % copies].parts[0], "silu",
                                                        torch.bfloat16))
                apart = timed(lambda i: silu_mul(a8_mm(codes, ws[i % copies].parts[0],
                                                       out_dtype=torch.bfloat16)))
                print(f"# {qtype} gate_up {m} rows and silu: one kernel {fused:.1f} us, a8_mm "
                      f"then silu_mul {apart:.1f} us")
            if args.every:   # the best configuration of each way (the GEMV, each dot)
                print(f"#   {qtype} {name} {m} rows, best of each: " + ", ".join(
                    f"{way} {us:.1f} us {config[:3]}" for way, (us, config) in by_way.items()))
            # a row's bits in this tile against the 16-row MMA tile's
            same = torch.equal(a8_mm(codes, probe.parts[0], r, out_dtype=torch.bfloat16),
                               a8_mm(codes, probe.parts[0], r, out_dtype=torch.bfloat16,
                                     block_m=16))
            print(f"{qtype:>5} {name:>5} {m:>4} {hbm:>7.1f} {fl:>9.1f} {qu:>9.1f} "
                  f"{best[0]:>7.1f} {default:>8.1f} {str(best[1]):>14} "
                  f"{'yes' if same else 'NO':>5}")
            rows_out.append(dict(type=qtype, proj=name, n=n, k=k, rows=m, hbm_us=hbm,
                                 float_us=fl, quantize_us=qu, a8_us=best[0], a8_config=best[1],
                                 a8_default_us=default, same_bits_as_mma=same))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
