"""Where a decode window's GPU time goes on one stage (an experiment, not a test):
the kernels of an eager 8-row window under torch.profiler, each layer matmul alone against
its HBM time, and the graph replay. Usage: python3 tools/gpu/profile_layer.py MODEL START:END"""
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from strata.model.gguf_file import ModelFile
from strata.stage_worker.model import KVCache, Rows, StageModel
from strata.stage_worker.runner import WindowRunner

HBM = 4.25e12


def timed(fn, n=200) -> float:
    """us per call of fn, back to back on the stream."""
    for _ in range(5):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n * 1e3


def main():
    path, span = sys.argv[1], sys.argv[2]
    start, end = (int(x) for x in span.split(":"))
    file = ModelFile(path)
    cfg = file.config
    torch.cuda.set_device(0)
    model = StageModel(file, start, end, ctx=512, device="cuda:0")
    cache = KVCache(len(model.layers), 8, cfg, 512, model.device, model.dtype)
    rows = Rows(list(range(8)), [256] * 8)
    inputs = (torch.randint(0, cfg.vocab, (8,)) if model.first
              else torch.randn(8, cfg.d_model).to(model.dtype))
    eager, graphed = WindowRunner(model, cache, 0), WindowRunner(model, cache, 8)
    with torch.inference_mode():
        for _ in range(3):
            eager.run(inputs, rows)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                eager.run(inputs, rows)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                        max_name_column_width=70))
        total = sum(e.device_time_total for e in prof.key_averages()) / 10
        print(f"sum of kernel times per window: {total / 1e3:.3f} ms")
        graphed.run(inputs, rows)
        graph = next(iter(graphed.graphs.values())).graph
        print(f"graph replay per window: {timed(graph.replay, 50) / 1e3:.3f} ms")

        layer = model.layers[0]
        x8 = torch.randn(8, cfg.d_model, device="cuda:0", dtype=model.dtype)
        h8 = torch.randn(8, cfg.d_ffn, device="cuda:0", dtype=model.dtype)
        mats = {"qkv": (layer.wqkv, lambda w: F.linear(x8, w)),
                "o (addmm)": (layer.wo, lambda w: torch.addmm(x8, x8, w.t())),
                "gate_up": (layer.w_gate_up, lambda w: F.linear(x8, w)),
                "down (addmm)": (layer.w_down, lambda w: torch.addmm(x8, h8, w.t()))}
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            for name, (w, fn) in mats.items():
                us = timed(lambda: fn(w))
                limit = w.numel() * w.element_size() / HBM * 1e6
                print(f"{lib:>8} {name:>13} {tuple(w.shape)}: {us:7.1f} us, HBM limit "
                      f"{limit:6.1f} us ({limit / us:.0%})")
        torch.backends.cuda.preferred_blas_library("cublas")


if __name__ == "__main__":
    main()
