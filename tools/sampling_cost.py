"""What sampling a window's rows costs on the last stage: N rows of V logits on a device, every
row with a temperature, the filters of --filters on each.

  python tools/sampling_cost.py [--device cuda] [--rows 1,8,64] [--vocab 49152]
                                [--filters none|top-k|top-p|min-p|all] [--iters 5]

Prints the median milliseconds per window of
  sample_row   one row at a time, each row's logits to the host (what head_tokens did)
  sample_rows  the window's rows in one call (what head_tokens does: on CUDA it is the
               device path, on the CPU sample_row per row)
  on_device    sample_rows_on_device, picks copied to the host (on the CPU: its arithmetic
               run by the CPU, for comparison)
and how many rows' tokens differ from sample_row's (0 expected: see sample_rows_on_device).
The logits are random (N(0, 9)), the draws the coordinator's for seed 0.
"""
from __future__ import annotations

import random
import statistics
import time

import click
import torch

from strata.coordinator.sampling_params import draw_uniform
from strata.kernels.sampling.sample import (SamplingRow, sample_row, sample_rows,
                                            sample_rows_on_device)

FILTERS = {"none": dict(top_k=0, top_p=1.0, min_p=0.0),
           "top-k": dict(top_k=20, top_p=1.0, min_p=0.0),
           "top-p": dict(top_k=0, top_p=0.9, min_p=0.0),
           "min-p": dict(top_k=0, top_p=1.0, min_p=0.05),
           "all": dict(top_k=50, top_p=0.9, min_p=0.05)}


def median_ms(f, device: torch.device, iters: int) -> float:
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        f()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@click.command()
@click.option("--device", default="cuda" if torch.cuda.is_available() else "cpu",
              show_default=True)
@click.option("--rows", default="1,8,64", show_default=True, help="Window sizes, comma-separated.")
@click.option("--vocab", type=int, default=49152, show_default=True)
@click.option("--filters", type=click.Choice(sorted(FILTERS)), default="none", show_default=True)
@click.option("--temperature", type=float, default=0.7, show_default=True)
@click.option("--iters", type=int, default=5, show_default=True)
def main(device, rows, vocab, filters, temperature, iters):
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    print(f"# {device}, V {vocab}, temperature {temperature}, filters {FILTERS[filters]}, "
          f"{torch.get_num_threads()} torch threads, median of {iters}")
    print(f"{'rows':>5} {'sample_row ms':>14} {'sample_rows ms':>15} {'on_device ms':>13} "
          f"{'speed-up':>9} {'differ':>7}")
    for n in (int(r) for r in rows.split(",")):
        logits = (torch.randn(n, vocab, generator=g) * 3).to(device)
        params = [SamplingRow(temperature, **FILTERS[filters], u=draw_uniform(0, i))
                  for i in range(n)]
        rng = random.Random(n)
        rng.shuffle(params)
        old = lambda: [sample_row(logits[i], p) for i, p in enumerate(params)]  # noqa: E731
        new = lambda: sample_rows(logits, params)                               # noqa: E731
        dev = lambda: sample_rows_on_device(logits, params).tolist()            # noqa: E731
        want, got = old(), dev()
        new(), dev()   # warm-up
        t_old, t_new, t_dev = (median_ms(f, device, iters) for f in (old, new, dev))
        differ = sum(a != b for a, b in zip(want, got))
        print(f"{n:>5} {t_old:>14.2f} {t_new:>15.2f} {t_dev:>13.2f} {t_old / t_new:>8.1f}x "
              f"{differ:>7}")


if __name__ == "__main__":
    main()
