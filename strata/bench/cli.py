"""`strata-bench`: commands that print their figures (conditions in docs/BENCHMARKS.md).

  decode      solo decode tokens/s for several layer splits, side by side
  exact       the exactness harness: N prompts alone, then together; any mismatch fails
  throughput  C concurrent clients x T tokens: serial vs pipelined groups in one run
  loadtest    C concurrent HTTP clients for a bounded time against strata-launch serving
  soak        loadtest with stages killed and stopped: no request lost, every answer as its
              solo run's, memory back to its start
  sweep       total tok/s against concurrent clients: 1gpu, serial, pipelined (and with MTP
              drafts: serial-mtp, pipelined-mtp) side by side
  prompt      a long prompt's reading rate: serial vs pipelined chunks, FLOP/s and % of peak
  drafts      decoding with draft tokens (mtp or lookup) against without, side by side;
              tokens compared, drafts kept per draft position (held-out prompts: --prompts)
  peer        the arms compared with: HF transformers `generate`, llama.cpp's batched bench
  grammar     structured output's cost per window: S slots' token masks for a JSON schema
              (with drafts), packed and applied

`python -m strata.bench` runs the same command.
"""
from __future__ import annotations

import json
import sys
import time
from contextlib import ExitStack
from dataclasses import replace
from statistics import mean, median

import click

from strata.coordinator.engine.generate import generate_solo
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import auto_groups
from strata.coordinator.sequence import Sequence
from strata.bench import exactness, harness
from strata.bench.draftbench import drafts
from strata.bench.grammarbench import grammar
from strata.bench.harness import machine
from strata.bench.loadtest import loadtest
from strata.bench.peer import peer
from strata.bench.promptbench import prompt
from strata.bench.soak import soak
from strata.bench.sweep import sweep
from strata.launch.options import (clean_errors, launch_options, open_model, parse_devices_for,
                                   prepare)
from strata.launch.plan import plan_stages
from strata.launch.session import launch_stages
from strata.model.registry import DEFAULT_MODEL
from strata.model.tokenizer import Tokenizer

BENCH_PROMPT = "Write a long story about a lighthouse keeper and the sea."


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="strata", prog_name="strata-bench")
def main():
    """Benchmarks and harnesses of strata; each prints its figures."""


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
@clean_errors("strata-bench decode")
def decode(model, splits, devices, tokens, repeats, ctx_size, json_out):
    """Solo decode tokens/s (one request, greedy) for each layer split, side by side."""
    file = open_model(model, ctx_size)
    tok = Tokenizer.from_gguf(file.reader)
    prompt = tok.encode(BENCH_PROMPT)
    device_list = parse_devices_for(devices)
    plans = {s.strip(): plan_stages(s.strip(), device_list, file.config.n_layers)
             for s in splits.split(";")}
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
                stamps = []
                seq = Sequence(prompt, SamplingParams(max_tokens=tokens), frozenset(), ctx_size,
                               on_token=lambda t: stamps.append(time.perf_counter()))
                generate_solo(run.pipe, seq)
                rate = (len(stamps) - 1) / (stamps[-1] - stamps[0])  # after the first token
                if rate > best.get(split, {}).get("tok_s", 0):
                    best[split] = {"stages": len(plans[split]), "tok_s": rate,
                                   "ms_per_token": 1e3 / rate}
    click.echo(f"{'split':>10} {'stages':>6} {'tok/s':>8} {'ms/token':>9}")
    for split, r in best.items():
        click.echo(f"{split:>10} {r['stages']:>6} {r['tok_s']:>8.2f} {r['ms_per_token']:>9.1f}")
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"machine": machine(), "tokens": tokens, "results": best}, f, indent=2)


@main.command(context_settings={"default_map": {"batch": 16}})
@launch_options
@click.option("--requests", type=int, default=16, show_default=True)
@click.option("--tokens", type=int, default=32, show_default=True, help="Max tokens per request.")
@click.option("--sampling", type=click.Choice(["greedy", "seeded", "both"]), default="both",
              show_default=True, help="seeded: temperature 0.7, top_k 20, a seed per request.")
@clean_errors("strata-bench exact")
def exact(requests, tokens, sampling, **launch):
    """Run the prompts alone (one at a time, the smallest window), together (windows as large
    as --batch allows) and staggered (half of them first, the rest a quarter of the way
    through, so windows change size mid-request); print each request's first mismatch and
    the window sizes each arm ran; exit 1 on any mismatch, on a request that fails, or when
    fewer than half of --requests x --tokens tokens were compared."""
    prep = prepare(**launch)
    tok = Tokenizer.from_gguf(prep.file.reader)
    prompts = [tok.encode(p) for p in harness.prompt_set(requests)]
    modes = ["greedy", "seeded"] if sampling == "both" else [sampling]
    # plain decoding, one at a time, each window sent once the one before is back
    alone_cfg = replace(prep.sched, groups=1, draft_tokens=0, decode_ahead=False)
    click.echo(f"# {requests} requests x {tokens} tokens, {len(prep.plan)} stage(s), batch "
               f"{prep.sched.slots}, groups {prep.sched.groups}, window rows "
               f"{prep.sched.window_rows}, draft tokens {prep.sched.draft_tokens}, decode "
               f"ahead {'on' if prep.sched.decode_ahead else 'off'}{harness.arithmetic(prep)}")
    failures, compared, stopped = [], 0, 0
    with prep.launch(say=lambda s: None) as run:
        for mode in modes:
            params = [harness.request_params(i, mode == "seeded", tokens)
                      for i in range(requests)]
            alone = exactness.run_arm("alone", run.pipe, alone_cfg, tok.stop_ids, prompts, params)
            others = [exactness.run_arm(name, run.pipe, prep.sched, tok.stop_ids, prompts, params)
                      for name in exactness.ARMS]
            verdict = exactness.compare(mode, alone, others)
            for line in verdict.lines:
                click.echo(line)
            for arm in [alone, *others]:
                click.echo(f"# {mode} {arm.name}: decode windows of {arm.sizes_said()}")
            if all(set(arm.sizes) <= set(alone.sizes) for arm in others) and requests:
                click.echo(f"# {mode}: every window had the rows of the solo run's, so no row was "
                           f"compared across window sizes; give --requests and --batch above "
                           f"{max(alone.sizes, default=8)} for that")
            failures += verdict.failures
            compared += verdict.compared
            stopped += sum(r.seq.finish_reason == "stop" for r in alone.requests)
    short = exactness.enough(compared, requests * len(modes), tokens, stopped)
    failures += [short] if short else []
    if failures:
        for why in dict.fromkeys(failures):
            click.echo(f"FAILED: {why}")
        sys.exit(1)
    click.echo(f"all requests identical ({compared} tokens compared)")


@main.command()
@launch_options
@click.option("--batches", default="8,16", show_default=True, help="Slot counts to measure.")
@click.option("--clients", type=int, default=None, help="Concurrent clients (default: = batch).")
@click.option("--tokens", type=int, default=32, show_default=True, help="Tokens per client.")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
@clean_errors("strata-bench throughput")
def throughput(batches, clients, tokens, json_out, **launch):
    """Total and per-request tok/s and time to first token, serial (groups 1) and pipelined
    (groups auto) side by side in one launch per batch size."""
    rows = []
    click.echo(f"# {tokens} tokens per client, {machine()}")
    click.echo(f"{'batch':>5} {'clients':>7} {'groups':>6} {'total tok/s':>11} "
               f"{'per-req tok/s':>13} {'TTFT med s':>10}")
    for batch in [int(b) for b in batches.split(",")]:
        prep = prepare(**{**launch, "batch": batch, "batch_groups": "1"})
        tok = Tokenizer.from_gguf(prep.file.reader)
        n_clients = clients or batch
        configs = {1: prep.sched,
                   auto_groups(batch, len(prep.plan)): replace(
                       prep.sched, groups=auto_groups(batch, len(prep.plan)))}
        with prep.launch(say=lambda s: None) as run:
            for groups, cfg in configs.items():
                r = harness.measure_throughput(run, cfg, tok, n_clients, tokens)
                row = {"batch": batch, "clients": n_clients, "groups": groups,
                       "stages": len(prep.plan), "total_tok_s": r.total_tok_s,
                       "per_request_tok_s": mean(r.per_request), "ttft_median_s": median(r.ttft)}
                rows.append(row)
                click.echo(f"{batch:>5} {n_clients:>7} {groups:>6} {r.total_tok_s:>11.2f} "
                           f"{row['per_request_tok_s']:>13.2f} {row['ttft_median_s']:>10.2f}")
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"machine": machine(), "tokens": tokens, "results": rows}, f, indent=2)


main.add_command(loadtest)
main.add_command(soak)
main.add_command(drafts)
main.add_command(sweep)
main.add_command(prompt)
main.add_command(peer)
main.add_command(grammar)


if __name__ == "__main__":
    main()
