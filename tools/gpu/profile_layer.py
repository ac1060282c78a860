"""Where a decode window's GPU time goes on one stage (an experiment, not a test): for each
window size, the kernels of eager windows under torch.profiler (device time a window, by
kernel: the layers), their sum, on the last stage the head alone (its decode graph computes
every row's logits), and the CUDA graph's replay of the same window: what the replay takes
beyond those is launch gaps (less than nothing with programmatic dependent launch,
kernels/pdl.py: a kernel's time then counts from its programs' start, before the wait for the
one ahead: STRATA_PDL=0 gives each kernel's own time). With bf16 weights, each layer matmul
alone against its HBM time too.

    python3 tools/gpu/profile_layer.py MODEL START:END [--weights quantized]
        [--activations int8] [--rows 1,8,64] [--top 16] [--sequence 40]
"""
import dataclasses
from collections import defaultdict

import click
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from strata.kernels.policy import KernelPolicy
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


def kernel_table(model, cache, inputs, rows, iters: int = 10, top: int = 16) -> float:
    """Print the window's kernels by device time (us a window, launches a window); return
    their sum in us."""
    eager = WindowRunner(model, cache, 0)
    for _ in range(3):
        eager.run(inputs, rows)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            eager.run(inputs, rows)
        torch.cuda.synchronize()
    times, calls = defaultdict(float), defaultdict(int)
    for e in prof.key_averages():
        if e.device_time_total > 0:
            times[e.key] += e.device_time_total / iters
            calls[e.key] += e.count // iters
    total = sum(times.values())
    for name, us in sorted(times.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us:9.1f} us {us / total:6.1%} {calls[name]:5d}x  {name[:90]}")
    print(f"  kernels: {sum(calls.values())} launches, {total:.1f} us a window")
    return total


def kernel_sequence(model, cache, inputs, rows, count: int) -> None:
    """Print the first `count` kernels of one eager window in launch order, with their
    device time: which projection each GEMV is (a layer's kernels repeat)."""
    eager = WindowRunner(model, cache, 0)
    for _ in range(3):
        eager.run(inputs, rows)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eager.run(inputs, rows)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_time_total > 0 and e.device_type
                      == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start)
    print(f"  the first {count} kernels in order:")
    for e in kernels[:count]:
        print(f"  {e.device_time_total:8.1f} us  {e.name[:90]}")


def head_alone(runner: WindowRunner, n: int) -> float:
    """us of the last stage's head over n rows (the window graph's head: logits and argmax of
    every row), replayed from a graph of its own."""
    model = runner.model
    hidden = torch.randn(n, model.cfg.d_model, device=model.device, dtype=model.dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        runner._head_fn(hidden)                 # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        runner._head_fn(hidden)
    return timed(graph.replay, 50)


def matmuls_alone(model, cfg) -> None:
    """Each bf16 layer matmul of 8 rows alone, against the time to read its weight."""
    layer = model.layers[0]
    x8 = torch.randn(8, cfg.d_model, device=model.device, dtype=model.dtype)
    h8 = torch.randn(8, cfg.d_ffn, device=model.device, dtype=model.dtype)
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


@click.command()
@click.argument("model_path")
@click.argument("span")
@click.option("--weights", default="bf16", show_default=True,
              help="bf16, quantized or auto, as strata-launch's --weights.")
@click.option("--activations", type=click.Choice(["float", "int8"]), default="float",
              show_default=True)
@click.option("--rows", "row_counts", default="8", show_default=True,
              help="Window sizes (all rows live), comma-separated.")
@click.option("--context", type=int, default=256, show_default=True,
              help="Each row's position.")
@click.option("--top", type=int, default=16, show_default=True,
              help="Kernels listed a window size, the longest first.")
@click.option("--sequence", type=int, default=0, show_default=True,
              help="Also list this many of a window's first kernels in launch order.")
def main(model_path, span, weights, activations, row_counts, context, top, sequence):
    start, end = (int(x) for x in span.split(":"))
    file = ModelFile(model_path)
    cfg = file.config
    torch.cuda.set_device(0)
    policy = dataclasses.replace(KernelPolicy.for_device("cuda:0"),
                                 int8_activations=activations == "int8")
    model = StageModel(file, start, end, ctx=2 * context, device="cuda:0", weights=weights,
                       policy=policy)
    sizes = [int(r) for r in row_counts.split(",")]
    cache = KVCache(len(model.layers), max(sizes), cfg, 2 * context, model.device, model.dtype)
    print(f"{model_path} layers {start}:{end}, weights {weights}, activations {activations}, "
          f"{torch.cuda.get_device_name()}")
    with torch.inference_mode():
        for n in sizes:
            rows = Rows(list(range(n)), [context] * n)
            inputs = (torch.randint(0, cfg.vocab, (n,)) if model.first
                      else torch.randn(n, cfg.d_model).to(model.dtype))
            print(f"{n} rows:")
            kernels = kernel_table(model, cache, inputs, rows, top=top)
            if sequence:
                kernel_sequence(model, cache, inputs, rows, sequence)
            graphed = WindowRunner(model, cache, 1)
            graphed.run(inputs, rows)
            graph = next(iter(graphed.graphs.values())).graph
            replay = timed(graph.replay, 50)
            head = head_alone(graphed, n) if model.last else 0.0
            if model.last:
                print(f"  the head alone (a graph of its own): {head:.1f} us")
            print(f"  graph replay {replay:.1f} us a window: {replay - kernels - head:.1f} us "
                  f"beyond the kernels{' and the head' if model.last else ''} "
                  "(launch gaps; below 0: kernels overlapped)")
        if weights == "bf16":
            matmuls_alone(model, cfg)


if __name__ == "__main__":
    main()
