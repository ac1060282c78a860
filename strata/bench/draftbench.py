"""`strata-bench drafts`: plain decoding and decoding with draft tokens side by side in one
launch, on the bench's prompts or on a prompts file's held-out prompts, greedy or with a
temperature; the tokens of every arm are compared, and the drafts kept per draft position are
printed (the head's acceptance in real decoding)."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import click

from strata.coordinator.config import DRAFT_SAMPLINGS, MAX_DRAFT_TOKENS
from strata.coordinator.speculation.drafts import DraftCounts
from strata.coordinator.stages.pipeline import PipelineError
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import Request, Scheduler, SchedulerConfig
from strata.bench import harness
from strata.bench.harness import (chat_prompts, filter_options, filters_said, machine,
                                  read_prompts, sampled, split_option)
from strata.launch.options import clean_errors, launch_options, prepare
from strata.model.tokenizer import Tokenizer

def run_arm(run, cfg: SchedulerConfig, tok: Tokenizer, prompts: list[list[int]],
            params: list[SamplingParams], stop_ids: frozenset[int], clients: int) -> dict:
    """The requests, `clients` at a time (each wave to its end); their tokens and counts."""
    first = run.pipe.next_window_id
    start = time.perf_counter()
    reqs: list[Request] = []
    for i in range(0, len(prompts), clients):
        sched = Scheduler(run.pipe, cfg, stop_ids, tok.decode)
        reqs += [sched.submit(p, sp) for p, sp in zip(prompts[i:i + clients],
                                                       params[i:i + clients])]
        sched.run()
    seconds = time.perf_counter() - start
    for r in reqs:
        if r.error:
            raise PipelineError(r.error)
    tokens = sum(len(r.seq.generated) for r in reqs)
    windows = run.pipe.next_window_id - first
    counts = sum((r.drafts.counts for r in reqs), DraftCounts()).report(cfg.max_draft_tokens)
    return {"total_tok_s": tokens / seconds, "tokens": tokens, "windows": windows,
            "tok_per_window": tokens / windows, "drafted": counts["proposed"],
            "accepted": counts["accepted"], "rate": counts["rate"],
            "positions": counts.get("positions", []),
            "generated": [r.seq.generated for r in reqs]}


@click.command()
@launch_options(skip=("--draft-tokens", "--draft-sampling"))
@click.option("--draft-tokens", type=int, default=MAX_DRAFT_TOKENS, show_default=True,
              help=f"Draft tokens a slot may verify in the drafted arms, 1 to "
                   f"{MAX_DRAFT_TOKENS} (--drafter picks where they come from); the plain arm "
                   f"has none.")
@click.option("--draft-sampling", type=click.Choice(DRAFT_SAMPLINGS + ("both",)),
              default="argmax", show_default=True,
              help="How mtp proposes for sampled requests: coupled (the target's draw), argmax, "
                   "or both: two drafted arms side by side.")
@click.option("--clients", type=int, default=1, show_default=True,
              help="Requests decoding at once (give --batch at least this).")
@click.option("--tokens", type=int, default=128, show_default=True,
              help="Tokens per request (at most, with --prompts: a request ends at its stop "
                   "token; the bench's own prompts decode exactly this many).")
@click.option("--prompts", "prompts_file", type=str, default=None,
              help='A JSONL file of {"prompt": ..., "split": "train"|"heldout"} lines '
                   "(strata-train-mtp --write-prompts): each prompt of --split is a request, "
                   "through the model's chat template, --clients at a time. Default: "
                   "--clients of the bench's own prompts.")
@split_option
@click.option("--requests", type=int, default=None,
              help="With --prompts: at most this many of its prompts (the first ones).")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="0 = greedy; else request i samples with seed 1000 + i in every arm.")
@filter_options
@click.option("--repeats", type=int, default=2, show_default=True,
              help="Rounds; each runs every arm, alternating; the best of each is kept.")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
@clean_errors("strata-bench drafts")
def drafts(draft_tokens, draft_sampling, clients, tokens, prompts_file, split, requests,
           temperature, top_k, top_p, min_p, repeats, json_out, **launch):
    """Decoding with draft tokens (--drafter mtp: the model's NextN head; lookup: prompt
    lookup) against without, side by side in one launch: total tok/s, windows, drafts
    accepted in all and per draft position; exit 1 if any request's tokens differ between
    the arms."""
    if draft_tokens < 1:
        raise ValueError(f"--draft-tokens {draft_tokens} leaves the drafts arm without drafts; "
                         f"give 1 to {MAX_DRAFT_TOKENS}")
    if clients < 1 or (requests is not None and requests < 1):
        raise ValueError("--clients and --requests must be 1 or more")
    if requests is not None and not prompts_file:
        raise ValueError("--requests takes the first prompts of a --prompts file; without "
                         "one, --clients gives the number of requests")
    sampled(temperature, top_k, top_p, min_p, 0, tokens)   # refuses bad filters first
    texts = read_prompts(prompts_file, split) if prompts_file else None
    samplings = list(DRAFT_SAMPLINGS) if draft_sampling == "both" else [draft_sampling]
    prep = prepare(**launch, draft_tokens=draft_tokens,   # chooses the drafter, checks k
                   draft_sampling=samplings[0])
    tok = Tokenizer.from_gguf(prep.file.reader)
    if texts is not None:
        prompts, stop_ids = chat_prompts(tok, texts[:requests]), tok.stop_ids
    else:
        prompts, stop_ids = [tok.encode(t) for t in harness.prompt_set(clients)], frozenset()
    params = [sampled(temperature, top_k, top_p, min_p, i, tokens)
              for i in range(len(prompts))]
    arms = {"plain": replace(prep.sched, draft_tokens=0)}
    for s in samplings:
        arms["drafts" if len(samplings) == 1 else s] = replace(prep.sched, draft_sampling=s)
    k = prep.sched.draft_tokens
    source = f"{split} prompts of {prompts_file}" if texts else "the bench's prompts"
    click.echo(f"# {len(prompts)} request(s) ({source}), {clients} at a time, up to {tokens} "
               f"tokens, {filters_said(temperature, top_k, top_p, min_p)}, "
               f"{len(prep.plan)} stage(s), batch {prep.sched.slots}, groups "
               f"{prep.sched.groups}, window rows {prep.sched.window_rows}, up to {k} drafts a "
               f"slot ({prep.sched.drafter}"
               + (f", {draft_sampling} proposals" if prep.sched.drafter == "mtp" else "")
               + f"){harness.arithmetic(prep)}; {machine()}")
    best: dict[str, dict] = {}
    plain_tokens: list[list[int]] | None = None   # the first plain run's, every run compared
    differ: list[str] = []
    with prep.launch(say=lambda s: None) as run:
        # warm-up, not measured: every arm's first windows of each shape (CUDA graph
        # captures, the drafter's among them) on the first prompts, 16 tokens each
        warm = [replace(p, max_tokens=min(p.max_tokens, 16)) for p in params[:clients]]
        for cfg in arms.values():
            run_arm(run, cfg, tok, prompts[:clients], warm, stop_ids, clients)
        for _ in range(repeats):
            for arm, cfg in arms.items():
                row = {"arm": arm, **run_arm(run, cfg, tok, prompts, params, stop_ids, clients)}
                got = row.pop("generated")
                plain_tokens = plain_tokens or got
                if got != plain_tokens and arm not in differ:
                    differ.append(arm)
                if arm not in best or row["total_tok_s"] > best[arm]["total_tok_s"]:
                    best[arm] = row
    report(best)
    plain = best["plain"]["total_tok_s"]
    speed = ", ".join(f"{a}/plain {best[a]['total_tok_s'] / plain:.2f}x" for a in arms
                      if a != "plain")
    click.echo(f"{speed}; " + ("every request has the same tokens" if not differ else
                               f"TOKENS DIFFER in {', '.join(differ)}"))
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"machine": machine(), "clients": clients, "requests": len(prompts),
                       "prompt_tokens": sum(len(p) for p in prompts), "prompts": prompts_file,
                       "split": split if texts else None, "tokens": tokens,
                       "temperature": temperature, "top_k": top_k, "top_p": top_p,
                       "min_p": min_p, "draft_tokens": k,
                       "drafter": prep.sched.drafter, "draft_sampling": draft_sampling,
                       "results": list(best.values()), "same": not differ}, f, indent=2)
    sys.exit(1 if differ else 0)


def report(best: dict[str, dict]) -> None:
    """The arms' table, then each drafted arm's acceptance per draft position."""
    click.echo(f"{'arm':>7} {'total tok/s':>11} {'windows':>7} {'tok/window':>10} "
               f"{'drafted':>7} {'accepted':>8} {'rate':>5}")
    for row in best.values():
        click.echo(f"{row['arm']:>7} {row['total_tok_s']:>11.2f} {row['windows']:>7} "
                   f"{row['tok_per_window']:>10.2f} {row['drafted']:>7} {row['accepted']:>8} "
                   f"{row['rate'] or 0:>5.2f}")
    for row in best.values():
        if row["positions"]:
            click.echo(f"{row['arm']:>7} accepted per draft position: " + ", ".join(
                f"{p['position']}: {p['rate'] or 0:.2f} ({p['accepted']}/{p['proposed']})"
                for p in row["positions"]))
