"""The quantized decode kernels (kernels/quant/float_triton.py) in several block configurations
against the bf16 skinny kernel and the HBM time of each weight's bytes, at the llama3-8b
shapes (and SmolLM2's), for every block type: us per call from a CUDA graph with the weights
rotating past L2, the best configuration (blocks, splits of K) per (type, projection, window rows), and the
dequantization a prompt chunk's matmul reads (GB/s). An experiment, not a test: what it
prints chose kernels/policy.py's QUANT_BLOCKS.

    python tools/gpu/bench_quant.py [--types Q4_K,Q6_K] [--json-out FILE] [--jobs 16]
"""
from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import time

import torch

from bench_kernels import timed   # this script's folder is on the path
from strata.kernels.quant.weight import KERNEL_TYPES, QuantWeight, random_blocks

L8B = {"qkv": (6144, 4096), "res": (4096, 4096), "down": (4096, 14336),
       "gate_up": (28672, 4096), "head": (128256, 4096)}
SMOL = {"qkv": (960, 576), "res": (576, 576), "down": (576, 1536), "gate_up": (3072, 576),
        "head": (49152, 576)}
CONFIGS = [(16, 256, 4, 2), (32, 256, 4, 2), (32, 128, 4, 2), (64, 128, 4, 2),
           (64, 128, 8, 2), (32, 256, 8, 2), (32, 256, 4, 3), (16, 128, 4, 3)]
SPLITS = (1, 2, 4, 8)   # of K, where they divide its steps (fewer otherwise)
ROWS = (1, 16, 64)
TILES = (16, 64)
def weights(qtype: str, n: int, k: int, copies: int, seed: int = 0) -> list[QuantWeight]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [QuantWeight.from_blocks(qtype, random_blocks(qtype, n, k, gen), k, "cuda")
            for _ in range(copies)]


def call(kind: str, x, w: QuantWeight, norm, res, config, tile, splits=1):
    from strata.kernels.quant.float_triton import quant_gate_up, quant_mm
    bn, block_k, warps, stages = config
    part = w.parts[0]
    while part.cols % block_k:
        block_k //= 2
    while (part.cols // block_k) % splits:
        splits //= 2
    kw = dict(block_m=tile, block_n=bn, block_k=block_k, stages=stages, warps=warps,
              splits=splits)
    if kind == "gate_up":
        return quant_gate_up(x, part, norm, 1e-5, **kw)
    if kind == "head":
        return quant_mm(x, part, norm=norm, eps=1e-5, out_dtype=torch.float32, **kw)
    if kind == "qkv":
        return quant_mm(x, part, norm=norm, eps=1e-5, **kw)
    return quant_mm(x, part, res, **kw)


def _jobs(types, shapes):
    """One job a distinct kernel: o and down share theirs (block_k aside)."""
    seen = set()
    for qtype, (name, (n, k)), config, tile in itertools.product(
            types, shapes.items(), CONFIGS, TILES):
        key = (qtype, "res" if name == "down" else name, k % 256 == 0, config, tile)
        if k % 256 and config[1] == 256 and config[0] != 16:
            continue   # SmolLM2's K: every block_k halves to 64, one of a kind suffices
        if key not in seen:
            seen.add(key)
            yield qtype, name, n, k, config, tile


def _compile(jobs) -> int:
    """Compile a share of the kernels in a child process (Triton's disk cache keeps them)."""
    torch.cuda.set_device(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    made = 0
    for qtype, name, n, k, config, tile in jobs:
        w = weights(qtype, n if name != "head" else 256, k, 1)[0]
        kind = "res" if name == "down" else name
        x = torch.randn(tile, k, **bf)
        out_n = w.shape[0] // 2 if kind == "gate_up" else w.shape[0]
        for splits in (1, 2):   # the unsplit kernel and the split one (with its sum)
            call(kind, x, w, torch.ones(k, **bf), torch.zeros(tile, out_n, **bf), config, tile,
                 splits)
        made += 1
    torch.cuda.synchronize()
    return made


def copy_rate() -> float:
    """bytes/s of a device-to-device copy of 4 GiB (read + write counted)."""
    a = torch.empty(1 << 31, dtype=torch.int16, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 2 * 5 / (time.perf_counter() - t)


def bench(types, shapes, label, rate, out):
    from strata.kernels.policy import KernelPolicy
    from strata.kernels.skinny_triton import gate_up_silu, skinny_mm
    policy = KernelPolicy.for_device("cuda")
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for qtype in types:
        for name, (n, k) in shapes.items():
            kind = "res" if name == "down" else name
            probe = weights(qtype, n, k, 1)[0]
            copies = max(2, -(-200_000_000 // probe.nbytes))
            ws = [probe] + weights(qtype, n, k, copies - 1, seed=1)
            hbm = probe.nbytes / rate * 1e6
            dense = [torch.randn(n, k, **bf) * 0.02 for _ in range(max(2, -(-200_000_000 // (n * k * 2))))]
            for m in ROWS:
                x = torch.randn(m, k, **bf)
                norm = torch.ones(k, **bf)
                res = torch.zeros(m, n // 2 if kind == "gate_up" else n, **bf)
                best = None
                for config, splits in itertools.product(CONFIGS, SPLITS):
                    for t in TILES if m > 1 else TILES[:1]:
                        if t < m and t != TILES[0]:
                            continue
                        us = timed(lambda i: call(kind, x, ws[i % copies], norm, res, config, t,
                                                  splits))
                        if best is None or us < best[0]:
                            best = (us, config + (splits,), t)
                sk = policy.skinny_blocks(n, k, kind)
                bf_us = None
                if sk is not None:
                    sk = {**sk, "block_m": policy.row_tile(m, n * k * 2)}
                    if kind == "gate_up":
                        bf_us = timed(lambda i: gate_up_silu(x, dense[i % len(dense)], norm, 1e-5, **sk))
                    elif kind in ("qkv", "head"):
                        bf_us = timed(lambda i: skinny_mm(x, dense[i % len(dense)], norm=norm, eps=1e-5,
                                                          out_dtype=torch.float32 if kind == "head" else None, **sk))
                    else:
                        bf_us = timed(lambda i: skinny_mm(x, dense[i % len(dense)], res, **sk))
                row = dict(shape=label, type=qtype, proj=name, n=n, k=k, rows=m, us=best[0],
                           config=best[1], tile=best[2], hbm_us=hbm, bf16_us=bf_us,
                           bf16_hbm_us=n * k * 2 / rate * 1e6)
                out.append(row)
                print(f"{label:5} {qtype:5} {name:8} m={m:2}  quant {best[0]:8.1f} us "
                      f"(hbm {hbm:7.1f}, x{best[0] / hbm:4.2f}) cfg {best[1]} tile {best[2]:2}  "
                      f"bf16 {bf_us or float('nan'):8.1f} us (hbm {row['bf16_hbm_us']:7.1f})",
                      flush=True)
            del ws, dense
            torch.cuda.empty_cache()


def bench_dequant(types, rate, out):
    from strata.kernels.quant.float_triton import dequant_rows
    n, k = L8B["gate_up"]
    for qtype in types:
        w = weights(qtype, n, k, 1)[0]
        dst = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
        us = timed(lambda i: dequant_rows(w.parts[0], dst), n=4)
        moved = w.nbytes + dst.numel() * 2
        out.append(dict(shape="l8b", type=qtype, proj="dequant gate_up", us=us,
                        gbps=moved / us / 1e3))
        print(f"dequant {qtype:5} gate_up {us:8.1f} us  {moved / us / 1e3:7.1f} GB/s "
              f"(copy rate {rate / 1e9:.0f})", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default=",".join(KERNEL_TYPES))
    ap.add_argument("--smol-types", default="Q4_1,Q8_0")
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--json-out")
    a = ap.parse_args()
    types, smol = a.types.split(","), [t for t in a.smol_types.split(",") if t]
    jobs = list(_jobs(types, L8B)) + list(_jobs(smol, SMOL))
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(a.jobs) as pool:
        made = sum(pool.map(_compile, [jobs[i::a.jobs] for i in range(a.jobs)]))
    print(f"compiled {made} kernels in {time.perf_counter() - t0:.0f} s", flush=True)
    rate = copy_rate()
    print(f"copy rate {rate / 1e12:.2f} TB/s", flush=True)
    out = []
    bench_dequant(types, rate, out)
    bench(types, L8B, "l8b", rate, out)
    bench(smol, SMOL, "smol", rate, out)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"copy_rate": rate, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
