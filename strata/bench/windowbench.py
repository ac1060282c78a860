"""`python -m strata.bench.windowbench`: the cost of one decode window, in two ways.

  step      in-process, per stage: a window of R rows through the stage's layers (and head on
            the last stage), eager and replayed from a CUDA graph, as the worker runs it
            (host work and copies included, synchronized), and the graph replay alone (device
            time), beside the HBM limit: the stage's weight and KV bytes / --hbm-tbs.
  pipeline  launched stage processes: wall time per decode window at the coordinator, each
            stage's stage_ms (from the Result) and the messaging overhead = wall - sum(stage_ms);
            then, from the processes' traces (strata/trace.py), the window's time as a chain
            (hops, each stage's GPU time, what lies between) and each stage's overhead: its
            wall time on the window minus its GPU time.
  zmq       the floor of that overhead: a round trip (8x576 bf16 frame, our framing) to an
            echo process over ZeroMQ ipc:// and over unix:// (protocol/unixsock.py), blocking
            receives vs spinning ones.

Layouts are device lists separated by ';', each split evenly over its devices: "cuda:0" is one
stage on one GPU, "cuda:0,cuda:1" two stages. docs/BENCHMARKS.md (GPU section) has figures.
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import time
from pathlib import Path
from statistics import median

import multiprocessing
import tempfile

import click
import numpy as np
import torch

from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.windows import Row, build_window
from strata.bench import tracereport
from strata.launch.plan import parse_devices, plan_stages
from strata.launch.session import launch_stages
from strata.model.gguf_file import ModelFile
from strata.model.registry import DEFAULT_MODEL, resolve_model
from strata.protocol import transport
from strata.stage_worker.model import KVCache, Rows, StageModel
from strata.stage_worker.runner import WindowRunner

GREEDY = SamplingParams()


def _echo(inbox: str, outbox: str, spin_s: float, n: int) -> None:
    sockets = transport.Sockets()
    pull, push = sockets.pull(inbox), sockets.push(outbox)
    for _ in range(n):
        msg, tensors = transport.recv(pull, spin_s)
        transport.send(push, msg, tensors)
    sockets.close(linger_ms=1000)


def round_trip(spin_s: float, n: int = 2000, scheme: str = "ipc") -> float:
    """Median microseconds of a send + echo + receive of a Window header and a 9 KB frame,
    over ZeroMQ (ipc://) or the Unix sockets of protocol/unixsock.py (unix://)."""
    run = tempfile.mkdtemp(prefix="zrt-")
    sockets = transport.Sockets()
    pull = sockets.pull(f"{scheme}://{run}/back")
    echo = multiprocessing.get_context("spawn").Process(
        target=_echo, args=(f"{scheme}://{run}/fwd", f"{scheme}://{run}/back", spin_s, n + 100))
    echo.start()
    push = sockets.push(f"{scheme}://{run}/fwd")
    msg = build_window(1, [Row(s, 100, 7, GREEDY) for s in range(8)], 8)
    frame = np.zeros((8, 576), np.uint16)
    times = []
    for i in range(n + 100):
        t0 = time.perf_counter()
        transport.send(push, msg, [frame])
        transport.recv(pull, spin_s)
        if i >= 100:
            times.append((time.perf_counter() - t0) * 1e6)
    echo.join(10)
    sockets.close(linger_ms=0)
    return median(times)


def _weight_bytes(model: StageModel) -> int:
    """Bytes a decode window reads of this stage's weights (the embedding: R rows only)."""
    seen, total = set(), 0
    tensors = [t for layer in model.layers for t in vars(layer).values()
               if isinstance(t, torch.Tensor)]
    if model.last:
        tensors += [model.norm, model.head]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _sync(devices) -> None:
    for d in devices:
        torch.cuda.synchronize(d)


def step_times(file: ModelFile, devices: list[str], rows: int, lives: list[int], context: int,
               iters: int) -> list[dict]:
    """Per stage and live-row count: eager and graph window times (ms), graph replay time,
    and the bytes a window must read (weights, KV) for the HBM limit."""
    cfg = file.config
    plan = plan_stages("auto", devices, cfg.n_layers)
    out = []
    for p in plan:
        cuda = torch.device(p.device).type == "cuda"
        if cuda:
            torch.cuda.set_device(p.device)
        model = StageModel(file, p.layer_start, p.layer_end, ctx=context + 64, device=p.device)
        g = torch.Generator(device=p.device).manual_seed(0)
        if model.first:
            inputs = torch.randint(0, cfg.vocab, (rows,))
        else:
            inputs = torch.randn(rows, cfg.d_model, generator=g, device=p.device)
            inputs = inputs.to(model.dtype).cpu()
        is_last, caches = model.last, {}
        for mode, capacity in (("eager", 0), ("graph", 8)) if cuda else (("eager", 0),):
            cache = KVCache(len(model.layers), rows, cfg, context + 64, model.device,
                            model.dtype)
            for t in cache.k + cache.v:  # keys [0, context) of every slot hold something
                t[:, :, :context].normal_(generator=g)
            caches[mode] = WindowRunner(model, cache, capacity)
        for live in lives:
            slots = list(range(live)) + [-1] * (rows - live)
            window = Rows(slots, [context if s >= 0 else 0 for s in slots])
            row = {"stage": p.index, "layers": f"{p.layer_start}:{p.layer_end}",
                   "device": p.device, "live": live}
            for mode, runner in caches.items():
                def window_step():
                    with torch.inference_mode():
                        # as the worker samples: the window's head, or blocks
                        h, head = runner.run(inputs, window,
                                             sample_rows=list(range(live)) if is_last else [])
                        if head is not None:
                            head.argmax.tolist()
                        elif not is_last:
                            transport.tensor_frame(h)

                for _ in range(5):
                    window_step()
                times = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    window_step()
                    times.append((time.perf_counter() - t0) * 1e3)
                row[f"{mode}_ms"] = median(times)
                if runner.capacity:
                    graph = next(g for k, g in runner.graphs.items() if k[0] != "head").graph
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(iters):
                        graph.replay()
                    end.record()
                    end.synchronize()
                    row["replay_ms"] = start.elapsed_time(end) / iters
            row["weight_gb"] = _weight_bytes(model) / 1e9
            row["kv_read_gb"] = (2 * len(model.layers) * cfg.n_kv_heads * cfg.head_dim
                                 * (context + 1) * live * 2) / 1e9
            out.append(row)
        del model, caches
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return out


def pipeline_times(file: ModelFile, devices: list[str], rows: int, lives: list[int],
                   context: int, steps: int, graph_cache: int,
                   keep_trace: Path | None = None, via: str = "unix") -> list[dict]:
    """Per live-row count: wall ms per decode window at the coordinator, stage_ms per stage
    and the overhead (medians over `steps` windows, after a few warm-up windows)."""
    cfg = file.config
    plan = plan_stages("auto", devices, cfg.n_layers)
    os.environ["STRATA_GRAPH_CACHE"] = str(graph_cache)   # the workers read it
    chunk, warm = 32, 10
    out, measured = [], []
    trace_dir = keep_trace or Path(tempfile.mkdtemp(prefix="strata-trace-"))
    with launch_stages(file, plan, slots=rows, ctx=context + len(lives) * (steps + warm) + 64,
                       trace_dir=trace_dir, transport=via, say=lambda s: None) as run:
        pipe = run.pipe
        g = torch.Generator().manual_seed(1)
        last = {}
        for s in range(max(lives)):   # prompts of `context` random tokens, in 32-row chunks
            prompt = torch.randint(0, cfg.vocab, (context,), generator=g).tolist()
            for a in range(0, context, chunk):
                b = min(a + chunk, context)
                rws = [Row(s, q, prompt[q]) for q in range(a, b)]
                if b == context:
                    rws[-1] = Row(s, b - 1, prompt[b - 1], GREEDY)
                pipe.submit(build_window(pipe.new_window_id(), rws, chunk, chunk=True))
                result, _ = pipe.receive(timeout=600)
            last[s] = result.tokens[0]
        pos = {s: context for s in last}
        for live in lives:
            walls, stage_ms, ids = [], [], set()
            for step in range(warm + steps):
                rws = [Row(s, pos[s], last[s], GREEDY) for s in range(live)]
                t0 = time.perf_counter()
                w = build_window(pipe.new_window_id(), rws, rows)
                if step >= warm:
                    ids.add(w.id)
                pipe.submit(w)
                result, _ = pipe.receive(timeout=600)
                wall = (time.perf_counter() - t0) * 1e3
                for s, t in enumerate(result.tokens):
                    last[s], pos[s] = t, pos[s] + 1
                if step >= warm:  # the first windows capture graphs
                    walls.append(wall)
                    stage_ms.append(result.stage_ms)
            over = [w - sum(s) for w, s in zip(walls, stage_ms)]
            out.append({"stages": len(plan), "graph_cache": graph_cache, "live": live,
                        "transport": via,
                        "wall_ms": median(walls),
                        "stage_ms": [median(s[i] for s in stage_ms) for i in range(len(plan))],
                        "overhead_ms": median(over), "tok_s": live * 1e3 / median(walls)})
            measured.append(ids)
    for r, ids in zip(out, measured):   # the processes wrote their traces when they stopped
        r["trace"] = tracereport.summarize(trace_dir, ids=ids)
    if keep_trace is None:
        shutil.rmtree(trace_dir, ignore_errors=True)
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--layouts", default="cuda:0;cuda:0,cuda:1", show_default=True,
              help="Device lists separated by ';', each split evenly (one stage per device).")
@click.option("--rows", type=int, default=8, show_default=True, help="Rows of a decode window.")
@click.option("--live", default="1,8", show_default=True,
              help="Live rows (clients) per window to measure, comma-separated.")
@click.option("--context", type=int, default=256, show_default=True,
              help="Positions each live slot holds before the measured windows.")
@click.option("--iters", type=int, default=100, show_default=True)
@click.option("--what", type=click.Choice(["step", "pipeline", "both", "zmq"]), default="both",
              show_default=True)
@click.option("--graph-caches", default="0,8", show_default=True,
              help="Pipeline runs: worker --graph-cache values to compare.")
@click.option("--hbm-tbs", type=float, default=4.25, show_default=True,
              help="HBM bandwidth (TB/s) for the limit (measured copy rate of an H200).")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
@click.option("--trace-dir", type=click.Path(file_okay=False), default=None,
              help="Keep the pipeline runs' traces here (one folder per layout and graph "
                   "cache; python -m strata.bench.tracereport reads them).")
@click.option("--transports", default="unix", show_default=True,
              help="Pipeline runs: the transports to compare (unix, zmq), comma-separated.")
def main(model, layouts, rows, live, context, iters, what, graph_caches, hbm_tbs, json_out,
         trace_dir, transports):
    file = None if what == "zmq" else ModelFile(resolve_model(model))
    n_cuda = torch.cuda.device_count()
    report = {"model": file and file.path.name, "rows": rows, "context": context,
              "torch": torch.__version__, "step": [], "pipeline": [],
              "gpu": torch.cuda.get_device_name(0) if n_cuda else "none"}

    def save():
        if json_out:
            with open(json_out, "w") as f:
                json.dump(report, f, indent=2)

    if what == "zmq":
        for scheme, name in (("ipc", "ZeroMQ"), ("unix", "Unix sockets")):
            for spin in (0.0, 0.005):
                us = round_trip(spin, scheme=scheme)
                report[f"{scheme}_round_trip_us_spin_{spin}"] = us
                click.echo(f"round trip over {scheme}:// ({name}, 9 KB frame), spin "
                           f"{spin * 1e3:.0f} ms: {us:.0f} us")
        layouts = ""
    lives = [int(x) for x in live.split(",")]
    for layout in filter(None, layouts.split(";")):
        devices = parse_devices(layout, n_cuda)
        replay: dict[int, list[float]] = {}   # live rows -> each stage's graph replay (GPU) ms
        if what in ("step", "both"):
            for s in step_times(file, devices, rows, lives, context, iters):
                if "replay_ms" in s:
                    replay.setdefault(s["live"], []).append(s["replay_ms"])
                s["hbm_limit_ms"] = (s["weight_gb"] + s["kv_read_gb"]) / hbm_tbs
                s["layout"] = layout
                click.echo(f"step {layout:>14} live {s['live']} stage {s['stage']} "
                           f"[{s['layers']}]: eager {s['eager_ms']:.3f} ms, graph "
                           f"{s.get('graph_ms', 0):.3f} ms, replay {s.get('replay_ms', 0):.3f} "
                           f"ms, HBM limit "
                           f"{s['hbm_limit_ms']:.3f} ms ({s['weight_gb']:.2f} GB weights)")
                report["step"].append(s)
        if what in ("pipeline", "both"):
            runs = [(int(g), t) for g in graph_caches.split(",") for t in transports.split(",")]
            for gc_n, tr in runs:
                keep = trace_dir and Path(trace_dir) / f"{layout.replace(',', '+')}-g{gc_n}-{tr}"
                for r in pipeline_times(file, devices, rows, lives, context, iters, gc_n, keep,
                                        tr):
                    r["layout"] = layout
                    click.echo(f"pipe {layout:>14} live {r['live']} graph-cache {gc_n} {tr}: "
                               f"window {r['wall_ms']:.3f} ms = stages "
                               f"{' + '.join(f'{x:.3f}' for x in r['stage_ms'])} ms + "
                               f"overhead {r['overhead_ms']:.3f} ms; {r['tok_s']:.1f} tok/s")
                    for line in tracereport.format_summary(r["trace"]):
                        click.echo(f"     {line}")
                    gpu = replay.get(r["live"], [])
                    if gc_n and len(gpu) == len(r["stage_ms"]):
                        # stage_ms is host time where a stage does not wait for its device (the
                        # NCCL link): wall minus the stages' GPU time says what is not compute
                        r["gpu_ms"], r["wall_minus_gpu_ms"] = gpu, r["wall_ms"] - sum(gpu)
                        click.echo(f"     GPU (graph replay, measured in-process above) "
                                   f"{' + '.join(f'{x:.3f}' for x in gpu)} ms: wall - GPU = "
                                   f"{r['wall_minus_gpu_ms']:.3f} ms per window")
                    report["pipeline"].append(r)
        save()
    save()


if __name__ == "__main__":
    main()
