"""What coupled MTP proposals cost on a window's critical path, against argmax proposals: a
decode window of SLOTS sampled slots (one row each) that asks every slot for K proposals.

  python tools/draft_sampling_cost.py [--model smollm2-135m] [--slots 64] [--k 3]
                                      [--temperature 0.7] [--top-k 0] [--iters 5]

Prints the median time of each step the coupling touches:
  coordinator  build_window: the window's draws and, coupled, the K draws per slot of
               propose_u, every draw first made (a position's draw is made once: the window
               that samples it finds it memoised, also shown)
  wire         pack + unpack of the window (the checks of propose_u included)
  last stage   Drafter.run: the NextN rows and the chained proposals, argmax or coupled
               (sample_rows over each step's coupled proposals)
The head is a random sidecar made for the model (strata-mkmodel --nextn-sidecar); its values
change no cost. The stage runs on the CPU with torch's threads as they are.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import click
import torch

from strata.coordinator.sampling_params import SamplingParams, draw_uniform
from strata.coordinator.windows import Row, build_window
from strata.model.gguf_file import ModelFile
from strata.model.mkmodel import get_shape, write_nextn_sidecar
from strata.model.nextn import find_head
from strata.model.registry import DEFAULT_MODEL, resolve_model
from strata.protocol.transport import pack, unpack
from strata.stage_worker.drafter import Drafter
from strata.stage_worker.model import KVCache, Rows, StageModel

PROMPT = 16   # tokens each slot holds before the measured window


def median_ms(f, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        f()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@click.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--shape", default="smollm2-135m", show_default=True,
              help="strata-mkmodel's name of the model's shape, for the sidecar head.")
@click.option("--slots", type=int, default=64, show_default=True)
@click.option("--k", type=int, default=3, show_default=True)
@click.option("--temperature", type=float, default=0.7, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--iters", type=int, default=5, show_default=True)
def main(model, shape, slots, k, temperature, top_k, iters):
    path = resolve_model(model, say=print)
    file = ModelFile(path)
    cfg = file.config
    with tempfile.TemporaryDirectory() as d:
        head = write_nextn_sidecar(Path(d) / "head.gguf", path, get_shape(shape))
        ctx = PROMPT + 2 * k + 4
        stage = StageModel(file, 0, cfg.n_layers, ctx=ctx)
        cache = KVCache(cfg.n_layers, slots, cfg, ctx, stage.device, stage.dtype)
        drafter = Drafter(find_head(file, str(head)), file, stage, slots, ctx)
    sp = [SamplingParams(temperature=temperature, top_k=top_k, seed=s) for s in range(slots)]
    print(f"# {path.name}, {slots} slots x {k} proposals, temperature {temperature}, "
          f"top_k {top_k}, {torch.get_num_threads()} torch threads, median of {iters}")
    with torch.inference_mode():
        # each slot reads PROMPT tokens (its last row samples): the drafter's rows are ready
        for s in range(slots):
            rows = [Row(s, p, (7 * s + p) % cfg.vocab) for p in range(PROMPT)]
            rows[-1] = Row(s, PROMPT - 1, rows[-1].token, sp[s])
            w = build_window(s + 1, rows, PROMPT, propose=[(s, k)])
            hidden = stage(torch.tensor(w.tokens), Rows(w.slots, w.positions), cache)
            drafter.run(w, hidden, [5])
        rows = [Row(s, PROMPT, 5, sp[s]) for s in range(slots)]
        propose = [(s, k) for s in range(slots)]
        shape_rows = -(-slots // 8) * 8
        def build(coupled: bool, memoised: bool):
            if not memoised:
                draw_uniform.cache_clear()
            return build_window(0, rows, shape_rows, propose=propose, coupled=coupled)
        builds = {name: median_ms(lambda: build(*how), iters) for name, how in (
            ("argmax", (False, False)), ("coupled", (True, False)),
            ("memoised", (True, True)))}
        windows = {name: build_window(0, rows, shape_rows, propose=propose, coupled=coupled)
                   for name, coupled in (("argmax", False), ("coupled", True))}
        wire = {name: median_ms(lambda: unpack([bytes(f) for f in pack(w)]), iters)
                for name, w in windows.items()}
        hidden = stage(torch.tensor(windows["argmax"].tokens),
                       Rows(windows["argmax"].slots, windows["argmax"].positions), cache)
        tokens = [5] * slots
        times: dict[str, list[float]] = {name: [] for name in windows}
        for _ in range(iters):   # alternating, so both see the machine's same moments
            for name, w in windows.items():
                times[name].append(median_ms(lambda: drafter.run(w, hidden, tokens), 1))
        drafts = {name: statistics.median(t) for name, t in times.items()}
    print(f"{'step':>12} {'argmax ms':>10} {'coupled ms':>10}")
    print(f"{'coordinator':>12} {builds['argmax']:>10.2f} {builds['coupled']:>10.2f}"
          f"   (draws first made; coupled with every draw memoised: "
          f"{builds['memoised']:.2f})")
    print(f"{'wire':>12} {wire['argmax']:>10.2f} {wire['coupled']:>10.2f}")
    print(f"{'last stage':>12} {drafts['argmax']:>10.2f} {drafts['coupled']:>10.2f}")


if __name__ == "__main__":
    main()
