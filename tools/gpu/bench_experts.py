"""The int8 routed experts (moe_triton.experts_a8: each (row, rank) pair's gate/up GEMV with its
activation and codes, then its down GEMV) at an MoE shape, by window rows: us per call from a
CUDA graph, the routing drawn anew for each of 16 calls so that the experts' weights come from
HBM as in a stage; each kernel's time apart (torch.profiler, eager calls); the bytes of the
experts a call reads and their rate. An experiment, not a test: the ground for the experts'
GEMV blocks (docs/GPU.md, "Where the time goes").

    python tools/gpu/bench_experts.py [--shape qwen3-30b-a3b] [--rows 1,2,4,8]
        [--gate-up Q4_K] [--down Q6_K] [--json-out F]

On a CPU under TRITON_INTERPRET=1 with --shape tiny it runs each call once (no times): a
check that the script still runs.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from strata.kernels.quant.weight import QuantWeight, random_blocks

# (experts, experts a row, model width D, an expert's feed-forward width F)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "glm4.5-air": (128, 8, 4096, 1408),
          "tiny": (8, 2, 256, 64)}
CALLS = 16   # routings a graph cycles through


def packed(qtype: str, rows: int, cols: int, device: str, seed: int) -> QuantWeight:
    gen = torch.Generator(device=device).manual_seed(seed)
    return QuantWeight.from_blocks(qtype, random_blocks(qtype, rows, cols, gen), cols, device)


def kernel_times(fn, iters: int = 10) -> dict[str, float]:
    """us a call of each kernel fn launches, from eager calls under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            fn(i)
        torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.device_time_total > 0:
            times[e.key[:60]] += e.device_time_total / iters
    return dict(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--gate-up", default="Q4_K", help="the packed gate/up weight's block type")
    ap.add_argument("--down", default="Q6_K", help="the packed down weight's block type")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    from strata.kernels.moe_triton import experts_a8
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n_experts, k, d, f = SHAPES[args.shape]
    gate_up = packed(args.gate_up, n_experts * 2 * f, d, device, 1)   # every gate, every up
    down = packed(args.down, n_experts * d, f, device, 2)
    per_expert = (gate_up.nbytes + down.nbytes) / n_experts
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    print(f"{args.shape}: {n_experts} experts, {k} a row, D {d}, F {f}; gate/up "
          f"{args.gate_up}, down {args.down}; {per_expert / 1e6:.2f} MB an expert; {device}")
    out = []
    for m in (int(r) for r in args.rows.split(",")):
        gen = torch.Generator().manual_seed(m)
        h = torch.randn(m, d, generator=gen).to(device, dtype)
        routes = [torch.stack([torch.randperm(n_experts, generator=gen)[:k] for _ in range(m)])
                  .to(device, torch.int32) for _ in range(CALLS)]
        read = sum(len(r.unique()) for r in routes) / CALLS * per_expert   # bytes a call

        def call(i: int) -> torch.Tensor:
            return experts_a8(h, routes[i % CALLS], gate_up, down, n_experts)
        if device != "cuda":
            call(0)
            print(f"{m} rows: ran")
            continue
        from bench_kernels import timed   # this script's folder is on the path
        us = timed(call, CALLS)
        kernels = kernel_times(call)
        parts = ", ".join(f"{name} {t:.1f}" for name, t in sorted(kernels.items(),
                                                                   key=lambda kv: -kv[1]))
        print(f"{m} rows: {us:.1f} us a call, {read / 1e6:.1f} MB read, "
              f"{read / us / 1e6:.2f} TB/s; kernels (us): {parts}")
        out.append({"rows": m, "us": us, "bytes": read, "kernels": kernels})
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"shape": args.shape, "gate_up": args.gate_up, "down": args.down,
                       "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "rows": out}, fh, indent=1)


if __name__ == "__main__":
    main()
