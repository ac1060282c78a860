"""One stage holding a whole model, its matrices kept quantized against widened to bf16
(--weights quantized / bf16), side by side: the bytes it holds (weights, KV cache, scratch,
all torch reserved), the graph replay of a decode window of R live rows (context 256) and a
prompt chunk's time and TFLOP/s.

    python tools/gpu/bench_weights.py MODEL.gguf [--rows 8,16,32,64] [--chunk 512]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from strata.model.gguf_file import ModelFile
from strata.stage_worker.model import KVCache, Rows, StageModel
from strata.stage_worker.runner import WindowRunner

CTX = 640


def replay_ms(graph, iters: int = 40) -> float:
    times = []
    for _ in range(5):
        a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        a.record()
        for _ in range(iters // 5):
            graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / (iters // 5))
    return statistics.median(times)


def run(file: ModelFile, weights: str, rows: list[int], chunk: int) -> dict:
    cfg = file.config
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = StageModel(file, 0, cfg.n_layers, ctx=CTX, device="cuda:0", weights=weights)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    cache = KVCache(len(model.layers), max(rows), cfg, CTX, model.device, model.dtype)
    runner = WindowRunner(model, cache, 16)
    out = {"weights": weights, "load_s": load_s, "report": model.weights.report.summary(model.dtype),
           "weight_bytes": model.weights.report.weight_bytes, "kv_bytes": cache.nbytes(),
           "scratch_bytes": model.weights.scratch.nbytes, "decode_ms": {}}
    with torch.inference_mode():
        for r in rows:
            ids = torch.arange(r) % cfg.vocab
            runner.run(ids, Rows(list(range(r)), [256] * r), sample_rows=list(range(r)))
            out["decode_ms"][r] = replay_ms(runner.graphs[("layers+head", r)].graph)
        ids = torch.arange(chunk) % cfg.vocab
        prompt = Rows([0] * chunk, list(range(chunk)))
        runner.run(ids, prompt, chunk=True)
        key = next(k for k in runner.graphs if k[0] != "layers+head")
        ms = replay_ms(runner.graphs[key].graph, iters=10)
    params = sum(t.n_elements for n, t in file.tensors.items() if n.startswith("blk."))
    out["chunk_ms"], out["chunk_tflops"] = ms, 2 * params * chunk / ms / 1e9
    torch.cuda.synchronize()
    out["held_bytes"] = torch.cuda.memory_reserved()
    del runner, cache, model
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rows", default="8,16,32,64")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--modes", default="quantized,bf16")
    a = ap.parse_args()
    from bench_quant import copy_rate   # this script's folder is on the path
    file = ModelFile(a.model)
    rows = [int(r) for r in a.rows.split(",")]
    size = file.path.stat().st_size
    rate = copy_rate()
    print(f"== {file.path.name}: {size / 1e9:.2f} GB, {size / rate * 1e3:.3f} ms to read at the "
          f"copy rate ({rate / 1e12:.2f} TB/s); one stage, graph replay ms per decode window of "
          f"R live rows (context 256), a {a.chunk}-row prompt chunk")
    results = [run(file, mode, rows, a.chunk) for mode in a.modes.split(",")]
    gib = 2 ** 30
    for r in results:
        print(f"{r['weights']:>9}: loaded in {r['load_s']:.1f} s; {r['report']}")
        print(f"{'':>9}  weights {r['weight_bytes'] / gib:.2f} GiB ({r['weight_bytes'] / size:.2f}x "
              f"the file), KV {r['kv_bytes'] / gib:.2f} GiB, scratch {r['scratch_bytes'] / gib:.2f} "
              f"GiB, held {r['held_bytes'] / gib:.2f} GiB = {r['held_bytes'] / (r['weight_bytes'] + r['kv_bytes']):.3f}x "
              f"weights + KV")
        print(f"{'':>9}  decode ms " + "  ".join(f"{k} rows {v:.3f}" for k, v in r["decode_ms"].items())
              + f"; chunk {r['chunk_ms']:.2f} ms, {r['chunk_tflops']:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
