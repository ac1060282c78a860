"""`strata-bench`: benchmark commands that print their figures (conditions in docs/BENCHMARKS.md)."""
from __future__ import annotations

import json
import platform
import time
from contextlib import ExitStack

import click
import torch

from strata.coordinator.generate import Sequence, generate_solo
from strata.coordinator.sampling import SamplingParams
from strata.launch.cli import cuda_count, open_model
from strata.launch.plan import parse_devices, plan_stages
from strata.launch.session import launch_stages
from strata.model.registry import DEFAULT_MODEL
from strata.model.tokenizer import Tokenizer

BENCH_PROMPT = "Write a long story about a lighthouse keeper and the sea."


@click.group()
def main():
    """Benchmarks of strata; each prints its figures."""


def machine() -> str:
    return f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


@main.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--splits", default="auto;15", show_default=True,
              help="Layer splits to compare, separated by ';' (auto = 1 stage on one device).")
@click.option("--devices", default="cpu", show_default=True)
@click.option("--tokens", type=int, default=64, show_default=True, help="Tokens decoded per run.")
@click.option("--repeats", type=int, default=2, show_default=True,
              help="Rounds; each round runs every split once, interleaved; the best is kept.")
@click.option("--ctx-size", type=int, default=512, show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
def decode(model, splits, devices, tokens, repeats, ctx_size, json_out):
    """Solo decode tokens/s (one request, greedy) for each layer split, side by side."""
    file = open_model(model, ctx_size)
    tok = Tokenizer.from_gguf(file.reader)
    prompt = tok.encode(BENCH_PROMPT)
    device_list = parse_devices(devices, cuda_count())
    splits = [s.strip() for s in splits.split(";")]
    plans = {s: plan_stages(s, device_list, file.config.n_layers) for s in splits}
    best: dict[str, dict] = {}
    click.echo(f"# model {file.path.name}, {tokens} tokens after a {len(prompt)}-token prompt, "
               f"{machine()}")
    with ExitStack() as stack:
        # every split launched at once, so rounds interleave and share the machine's noise
        runs = {split: stack.enter_context(launch_stages(file, plan, slots=1, ctx=ctx_size,
                                                         say=lambda s: None))
                for split, plan in plans.items()}
        for _ in range(repeats):
            for split, run in runs.items():
                seq = Sequence(prompt, SamplingParams(max_tokens=tokens), frozenset(), ctx_size)
                stamps = []
                seq.on_token = lambda t: stamps.append(time.perf_counter())
                generate_solo(run.pipe, seq)
                # decode rate: tokens after the first, over the time since the first
                rate = (len(stamps) - 1) / (stamps[-1] - stamps[0])
                if rate > best.get(split, {}).get("tok_s", 0):
                    best[split] = {"stages": len(plans[split]), "tok_s": rate,
                                   "ms_per_token": 1e3 / rate}
    click.echo(f"{'split':>10} {'stages':>6} {'tok/s':>8} {'ms/token':>9}")
    for split, r in best.items():
        click.echo(f"{split:>10} {r['stages']:>6} {r['tok_s']:>8.2f} {r['ms_per_token']:>9.1f}")
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"machine": machine(), "tokens": tokens, "results": best}, f, indent=2)


if __name__ == "__main__":
    main()
