"""`strata-bench prompt`: how fast a long prompt is read, serial chunks vs pipelined chunks.

One launch, one slot; each round reads a fresh random prompt of --prompt-tokens tokens (a new
first token each time, so nothing is reused from the slot's cache) and samples one token, once
with one chunk in flight at a time (serial: a chunk passes every stage before the next starts)
and once with stages + 1 chunks in flight (pipelined: chunk k+1 on stage 0 while chunk k is on
stage 1, and the next one already waiting at stage 0). The two arms alternate, so they share
the machine's noise; the best round of each is reported.

FLOP rates are given two ways: the issue's convention, 2 x the model's parameters per token
(embedding and head included), and what the stages execute: the layers' matmuls for every row
plus causal attention (4 x heads x head_dim x keys per row), with the head for one row.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import replace

import click

from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.launch.options import clean_errors, launch_options, prepare
from strata.model.gguf_file import ModelConfig


def model_flops(cfg: ModelConfig, tokens: int) -> tuple[float, float]:
    """(2 x parameters x tokens, FLOPs the stages execute for a prompt of `tokens`)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    layer = cfg.d_model * (q + 2 * kv) + q * cfg.d_model + 3 * cfg.d_model * cfg.d_ffn
    embed = cfg.vocab * cfg.d_model
    params = cfg.n_layers * layer + embed * (1 if cfg.tied_head else 2)
    attention = 4 * q * tokens * (tokens + 1) / 2 * cfg.n_layers   # keys 1..tokens per row
    executed = 2 * cfg.n_layers * layer * tokens + attention + 2 * embed
    return 2.0 * params * tokens, executed


def read_once(run, cfg: SchedulerConfig, prompt: list[int]) -> float:
    """Seconds from submitting the prompt to its first sampled token."""
    sched = Scheduler(run.pipe, cfg, frozenset())
    t0 = time.perf_counter()
    req = sched.submit(prompt, SamplingParams(max_tokens=1))
    sched.run()
    seconds = time.perf_counter() - t0
    if req.error:
        raise RuntimeError(f"the prompt failed: {req.error}")
    assert req.reused == 0, "a benchmark prompt must be read whole"
    return seconds


@click.command()
@launch_options
@click.option("--prompt-tokens", type=int, default=4096, show_default=True)
@click.option("--repeats", type=int, default=3, show_default=True,
              help="Rounds; each reads a fresh prompt in both arms; the best round is kept.")
@click.option("--peak-tflops", type=float, default=790.0, show_default=True,
              help="Peak bf16 TFLOP/s of one device (790: measured on an H200).")
@click.option("--depth", type=int, default=None,
              help="Chunks in flight in the pipelined arm (default: stages + 1).")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
@clean_errors("strata-bench prompt")
def prompt(prompt_tokens, repeats, peak_tflops, depth, json_out, **launch):
    """Prompt reading: tok/s and TFLOP/s, serial vs pipelined chunks, in one launch."""
    if prompt_tokens < 1 or repeats < 1 or (depth is not None and depth < 1):
        raise ValueError("--prompt-tokens, --repeats and --depth must be at least 1")
    if launch["ctx_size"] <= prompt_tokens:
        raise ValueError(f"--ctx-size {launch['ctx_size']} cannot hold a prompt of "
                         f"{prompt_tokens} tokens and its answer; use --ctx-size "
                         f"{prompt_tokens + 1} or more")
    prep = prepare(**{**launch, "batch": 1, "batch_groups": "1"})
    cfg = prep.file.config
    arms = {"serial": replace(prep.sched, prompt_depth=1),
            "pipelined": replace(prep.sched, prompt_depth=depth or prep.sched.prompt_depth)}
    devices = sorted({p.device for p in prep.plan})
    nominal, executed = model_flops(cfg, prompt_tokens)
    peak = peak_tflops * len(devices) * 1e12
    rng = random.Random(0)
    best: dict[str, float] = {}
    click.echo(f"# {prep.file.path.name}, a {prompt_tokens}-token prompt in {prep.sched.chunk_rows}"
               f"-row chunks, {len(prep.plan)} stage(s) on {','.join(p.device for p in prep.plan)}"
               f", link {prep.link}; {nominal / prompt_tokens / 1e9:.2f} GFLOP/token (2 x params), "
               f"peak {peak / 1e12:.0f} TFLOP/s ({len(devices)} x {peak_tflops:.0f})")
    with prep.launch(say=lambda s: None) as run:
        # warm-up (graph captures of the chunk shape); then each prompt starts with a token of
        # its own, so the slot's cache shares no prefix with it
        read_once(run, arms["serial"], [0] * min(prompt_tokens, 2 * prep.sched.chunk_rows))
        first = iter(range(1, cfg.vocab))
        for _ in range(repeats):
            for arm, sched_cfg in arms.items():
                tokens = [next(first)] + [rng.randrange(cfg.vocab) for _ in range(prompt_tokens - 1)]
                best[arm] = min(best.get(arm, float("inf")), read_once(run, sched_cfg, tokens))
    rows = []
    click.echo(f"{'arm':>9} {'depth':>5} {'seconds':>8} {'tok/s':>9} {'TFLOP/s':>8} "
               f"{'% peak':>6} {'exec TFLOP/s':>12} {'vs serial':>9}")
    for arm, seconds in best.items():
        row = {"arm": arm, "prompt_depth": arms[arm].prompt_depth, "seconds": seconds,
               "tok_s": prompt_tokens / seconds, "tflops": nominal / seconds / 1e12,
               "percent_of_peak": 100 * nominal / seconds / peak,
               "executed_tflops": executed / seconds / 1e12,
               "speedup_vs_serial": best["serial"] / seconds}
        rows.append(row)
        click.echo(f"{arm:>9} {row['prompt_depth']:>5} {seconds:>8.3f} {row['tok_s']:>9.0f} "
                   f"{row['tflops']:>8.1f} {row['percent_of_peak']:>6.1f} "
                   f"{row['executed_tflops']:>12.1f} {row['speedup_vs_serial']:>8.2f}x")
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"model": prep.file.path.name, "prompt_tokens": prompt_tokens,
                       "chunk_rows": prep.sched.chunk_rows, "stages": len(prep.plan),
                       "devices": [p.device for p in prep.plan], "link": prep.link,
                       "peak_tflops_per_device": peak_tflops, "results": rows}, f, indent=2)
