"""Time the prompt-chunk attention kernel against the per-row one, on CUDA.

    python tools/gpu/bench_attention_chunk.py [--chunk-rows 512] [--prompt 4096]
        [--shape llama3-8b|smollm2] [--block-m 16,32,64] [--num-warps N] [--num-stages N]

A prompt of --prompt tokens in one slot is read in chunks of --chunk-rows rows (the last chunk
padded with pad rows, as the model pads it); every chunk attends over the slot's keys up to each
row's position (causal), like a layer of a prompt. For each chunk it prints the time of
attend_chunk_triton (for each --block-m) and of attend_rows_triton, in ms, and the effective
TFLOP/s (4 * query heads * head size * keys, summed over the live rows). Then, for the last
chunk: the largest absolute difference to the float64 reference, and whether a few rows computed
alone give the same bits as in the chunk. The KV of one slot (16 MiB at llama3-8b's shape and
4096 tokens) fits in the L2 cache; a model's layers each read their own, so a real layer may
be a little slower.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

SHAPES = {  # query heads, kv heads, head size
    "llama3-8b": (32, 8, 128),
    "smollm2": (9, 3, 64),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def chunk_reference(q, k, v, length):
    """float64 attention of rows of one slot (k, v: [KVH, ctx, hd]) over keys [0, length)."""
    n_rows, n_heads, hd = q.shape
    n_kv, ctx = k.shape[0], k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    masked = torch.arange(ctx, device=q.device)[None, :] >= length[:, None]   # [R, ctx]
    group = n_heads // n_kv
    for h in range(n_kv):   # one kv head at a time: [R, group, ctx] float64 scores
        qg = q[:, h * group:(h + 1) * group].double()
        scores = torch.einsum("rgd,pd->rgp", qg, k[h].double()) / math.sqrt(hd)
        scores = scores.masked_fill(masked[:, None, :], float("-inf"))
        probs = torch.softmax(scores, -1).nan_to_num(0.0)    # pad rows: all masked
        out[:, h * group:(h + 1) * group] = torch.einsum("rgp,pd->rgd", probs, v[h].double())
    return out


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens (default 4096)")
    ap.add_argument("--chunk-rows", type=int, default=512, help="rows a chunk (default 512)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--block-m", default="",
                    help="rows a block of the chunk kernel, comma-separated to compare several "
                         "(default: the kernel's own, 128 query rows a tile)")
    ap.add_argument("--num-warps", type=int, default=None)
    ap.add_argument("--num-stages", type=int, default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-rows", action="store_true", help="skip the per-row kernel")
    ap.add_argument("--every", type=int, default=1, help="time every N-th chunk (and the last)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention_chunk.py: needs a CUDA device", file=sys.stderr)
        return 1
    from strata.kernels.attention.chunk_triton import attend_chunk_triton, chunk_config
    from strata.kernels.attention.decode_triton import attend_rows_triton

    n_heads, n_kv, hd = SHAPES[args.shape]
    dtype, dev, cr = DTYPES[args.dtype], "cuda", args.chunk_rows
    block_ms = [int(b) for b in args.block_m.split(",") if b.strip()] or [None]
    configs = []
    for bm in block_ms:
        try:
            cfg = chunk_config(n_heads, n_kv, hd, bm, args.num_warps, args.num_stages)
        except ValueError as e:
            print(f"block_m {bm}: {e}")
            continue
        configs.append((bm, f"chunk bm{cfg['BLOCK_M']} w{cfg['num_warps']} s{cfg['num_stages']}"))
    n_chunks = -(-args.prompt // cr)
    ctx = n_chunks * cr
    g = torch.Generator(device=dev).manual_seed(0)
    # slot 0 holds the prompt, slot 1 is the trash slot of the pad rows
    k = torch.randn(2, n_kv, ctx, hd, generator=g, device=dev).to(dtype)
    v = torch.randn(2, n_kv, ctx, hd, generator=g, device=dev).to(dtype)
    q = torch.randn(cr, n_heads, hd, generator=g, device=dev).to(dtype)
    print(f"{torch.cuda.get_device_name()}; {args.shape}: {n_heads} heads over {n_kv} kv heads, "
          f"head size {hd}, {args.dtype}; a {args.prompt}-token prompt in {n_chunks} chunks of "
          f"{cr} rows")
    names = [name for _, name in configs] + ([] if args.no_rows else ["rows"])
    print(f"{'chunk':>5} {'keys':>11} " + " ".join(f"{n + ' ms':>22} {'TFLOP/s':>7}"
                                                 for n in names))
    totals = {n: 0.0 for n in names}
    total_flops = 0
    outs = {}
    for c in range(n_chunks):
        positions = torch.arange(c * cr, (c + 1) * cr, device=dev)
        live = positions < args.prompt
        slot = torch.where(live, 0, 1)
        length = torch.where(live, positions + 1, 0)
        flops = 4 * n_heads * hd * int(length.sum())
        total_flops += flops
        if c % args.every and c != n_chunks - 1:
            continue
        cells = []
        for bm, name in configs:
            def run(bm=bm):
                return attend_chunk_triton(q, k, v, slot, length, block_m=bm,
                                           num_warps=args.num_warps, num_stages=args.num_stages)
            try:
                ms = time_ms(run, args.iters)
            except Exception as e:  # e.g. a configuration out of shared memory
                print(f"{name}: {type(e).__name__}: {str(e)[:300]}")
                cells.append(f"{'failed':>22} {'':>7}")
                continue
            totals[name] += ms * (1 if args.every == 1 else 0)
            cells.append(f"{ms:22.3f} {flops / ms / 1e9:7.1f}")
            if c == n_chunks - 1:
                outs[name] = (run(), bm)
        if not args.no_rows:
            ms = time_ms(lambda: attend_rows_triton(q, k, v, slot, length), args.iters)
            totals["rows"] += ms * (1 if args.every == 1 else 0)
            cells.append(f"{ms:22.3f} {flops / ms / 1e9:7.1f}")
            if c == n_chunks - 1:
                outs["rows"] = (attend_rows_triton(q, k, v, slot, length), None)
        first, last = c * cr + 1, min((c + 1) * cr, args.prompt)
        print(f"{c:5d} {first:>5}-{last:<5} " + " ".join(cells))
    if args.every == 1:
        print(f"{'all':>5} {'':>11} " + " ".join(
            f"{totals[n]:22.3f} {total_flops / totals[n] / 1e9:7.1f}" if totals[n] else
            f"{'-':>22} {'':>7}" for n in names))
    ref = chunk_reference(q, k[0], v[0], length)
    for name, (out, bm) in outs.items():
        diff = (out.double() - ref).abs().max().item()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        line = f"last chunk, {name}: max abs diff to float64 {diff:.3e}, relative {err:.2e}"
        if name != "rows":
            live_rows = int(live.sum())
            same = all(torch.equal(attend_chunk_triton(
                q[r:r + 1], k, v, slot[r:r + 1], length[r:r + 1], block_m=bm,
                num_warps=args.num_warps, num_stages=args.num_stages)[0], out[r])
                for r in sorted({0, 1, 17, live_rows // 2, live_rows - 1}) if r < live_rows)
            line += f"; rows alone equal to rows in the chunk: {'yes' if same else 'NO'}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
