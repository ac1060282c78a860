"""`strata-bench sweep`: total tok/s against the number of concurrent clients, for several modes
side by side in one run, as a table, a JSON file and a plot.

  1gpu           one stage holding the whole model on the first device, groups 1
  serial         the --layer-split stages, groups 1 (a window passes every stage before the next)
  pipelined      the same stages, groups auto (one group of slots in flight per stage)
  serial-mtp     serial, with MTP drafts (--draft-tokens K or auto, the default here) from
                 the model's NextN head (its own or --mtp-head): batch MTP
  pipelined-mtp  pipelined, with the same drafts: pipelined batch MTP

Each stage layout is launched once; every client count and every mode of that layout runs inside
that launch, the modes interleaved per client count so that they share the machine's noise,
--repeats times; each row has the medians. Rows give the drafts' acceptance (kept over
verified) and the tokens a decode window gives (all its slots'; the plain modes: its slots).

Besides generated tokens over the run (total tok/s), each row has the two rates llama.cpp's
llama-batched-bench reports (strata/bench/llamacpp.py): the decode rate (tokens sampled after
every prompt has been read, over that time: its S_TG) and prompt and generated tokens over the
run (its S). With --prompt-tokens N every prompt is N tokens, as its -npp; --peer-json puts the
rows of `strata-bench peer --engine llama.cpp --json-out` beside strata's.
"""
from __future__ import annotations

import importlib.util
import json
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import mean, median

import click
from click.core import ParameterSource

from strata.coordinator.engine import ahead
from strata.coordinator.engine.scheduler import SchedulerConfig, auto_groups
from strata.bench import harness, tracereport
from strata.bench.harness import (Workload, chat_prompts, filter_options, filters_said,
                                  machine, read_prompts,
                                  split_option)
from strata.launch.options import (Prepared, clean_errors, launch_options, open_model,
                                   parse_devices_for, prepare)
from strata.model.tokenizer import Tokenizer

MODES = ("1gpu", "serial", "pipelined", "serial-mtp", "pipelined-mtp")
DRAFTED = ("serial-mtp", "pipelined-mtp")   # the modes with MTP drafts
COLUMNS = (f"{'mode':>13} {'clients':>7} {'stages':>6} {'groups':>6} {'total tok/s':>11} "
           f"{'per-req tok/s':>13} {'TTFT med s':>10} {'decode tok/s':>12} {'pp+tg tok/s':>11} "
           f"{'tok/window':>10} {'accepted':>8}")
# the measured fields of a row, each the median of its repetitions
MEDIANS = ("total_tok_s", "per_request_tok_s", "ttft_median_s", "decode_tok_s",
           "prompt_and_generated_tok_s", "tokens_per_window", "acceptance")
PEER_COLUMN = f" {'llama.cpp decode':>16}"


def parse_clients(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]: client counts, each at least 1, in the order given."""
    try:
        counts = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"--clients {text!r} is not a list of client counts of 1 or more; use "
                         f"e.g. --clients 1,2,4,8")
    return counts


def parse_modes(text: str) -> list[str]:
    """'serial,pipelined' -> the modes to run, checked, in the order of MODES."""
    asked = {m.strip() for m in text.split(",") if m.strip()}
    unknown = sorted(asked - set(MODES))
    if unknown or not asked:
        raise ValueError(f"--modes {text!r}: unknown or empty ({', '.join(unknown) or 'none'}); "
                         f"choose among {','.join(MODES)}")
    return [m for m in MODES if m in asked]


@dataclass
class Layout:
    """One launch of stages and the modes (name -> scheduler config) measured inside it."""
    prep: Prepared
    modes: dict[str, SchedulerConfig]

    @property
    def devices(self) -> str:
        return ",".join(p.device for p in self.prep.plan)


def plan_layouts(launch: dict, modes: list[str], batch: int,
                 groups: str = "auto") -> list[Layout]:
    """Check every layout before any process starts; modes whose stages are the same share one
    launch (e.g. 1gpu and a --layer-split of one stage on the same device). groups: the
    pipelined modes' groups, a number or auto (one per stage). The modes without -mtp have no
    drafts; the -mtp modes draft --draft-tokens (0, the default: auto) with the NextN head."""
    modes_of: dict[str, tuple[Prepared, SchedulerConfig]] = {}
    plain = {**launch, "draft_tokens": 0, "drafter": None, "mtp_head": None}
    if "1gpu" in modes:
        first = parse_devices_for(launch["devices"])[0]
        one = prepare(**{**plain, "layer_split": "auto", "devices": first, "batch": batch,
                         "batch_groups": "1"})
        modes_of["1gpu"] = (one, one.sched)
    split_modes = [m for m in modes if m != "1gpu"]
    if split_modes:
        drafted = [m for m in split_modes if m in DRAFTED]
        if drafted:
            check_head(launch, drafted)
            k = "auto" if str(launch["draft_tokens"]) == "0" else launch["draft_tokens"]
            args = {**launch, "draft_tokens": k, "drafter": "mtp"}
        else:
            args = plain
        split = prepare(**{**args, "batch": batch, "batch_groups": groups})
        piped = split.sched
        if piped.groups < 2:  # --batch-groups 1 would make it serial: one group per stage
            piped = replace(piped, groups=auto_groups(batch, len(split.plan)))
        # serial windows hold every slot when --window-rows is auto (a pipelined group's
        # hold its share)
        serial = replace(piped, groups=1, window_rows=(
            None if str(launch["window_rows"]) == "auto" else piped.window_rows))
        cfgs = {"serial": replace(serial, draft_tokens=0),
                "pipelined": replace(piped, draft_tokens=0),
                "serial-mtp": serial, "pipelined-mtp": piped}
        modes_of |= {m: (split, cfgs[m]) for m in split_modes}
    layouts: list[Layout] = []
    for mode, (prep, cfg) in modes_of.items():
        same = next((lay for lay in layouts if lay.prep.plan == prep.plan), None)
        if same is None:
            layouts.append(same := Layout(prep, {}))
        same.modes[mode] = cfg
    return layouts


def check_head(launch: dict, drafted: list[str]) -> None:
    """The -mtp modes need a NextN head: the model's own, or --mtp-head."""
    from strata.model.nextn import find_head
    file = open_model(launch["model"], launch["ctx_size"])
    if find_head(file, launch.get("mtp_head")) is None:
        names = ",".join(drafted)
        raise ValueError(f"--modes {names} draft with a NextN head, and the model file "
                         f"{file.path.name} has none; pass --mtp-head PATH (a head made for "
                         f"this model) or leave {names} out of --modes")


def measure(run, cfg: SchedulerConfig, tok, mode: str, clients: int, tokens: int,
            work: Workload = Workload(), offset: int = 0) -> dict:
    """One row: `clients` requests at once, `tokens` each, through this launch and config;
    prompts and sampling from `work` (its pool read from `offset`)."""
    r = harness.measure_throughput(run, cfg, tok, clients, tokens, work, offset)
    return {"mode": mode, "clients": clients, "stages": len(run.plan), "groups": cfg.groups,
            "total_tok_s": r.total_tok_s, "per_request_tok_s": mean(r.per_request),
            "ttft_median_s": median(r.ttft), "prompt_tokens_read": r.prompt_tokens,
            "decode_tok_s": r.decode_tok_s,
            "prompt_and_generated_tok_s": r.prompt_and_generated_tok_s,
            "draft_tokens": cfg.draft_tokens, "drafted": r.drafted, "accepted": r.accepted,
            "acceptance": r.accepted / r.drafted if r.drafted else None,
            "decode_windows": r.decode_windows, "tokens_per_window": r.tokens_per_window,
            "windows_by_k": r.windows_by_k, "choices": r.choices}


def median_row(rows: list[dict]) -> dict:
    """The repetitions of one mode and client count as one row: the median of each measured
    field (MEDIANS), each repetition's total tok/s beside."""
    row = dict(rows[0])
    for key in MEDIANS:
        values = [r[key] for r in rows if r[key] is not None]
        row[key] = median(values) if values else None
    for key in ("drafted", "accepted", "decode_windows"):
        row[key] = sum(r[key] for r in rows)
    row["windows_by_k"] = dict(sum((Counter(r["windows_by_k"]) for r in rows), Counter()))
    row["choices"] = [r["choices"] for r in rows]   # each repetition's groups' last choices
    row["repeats_total_tok_s"] = [r["total_tok_s"] for r in rows]
    return row


def format_row(row: dict) -> str:
    accepted = row["acceptance"]
    line = (f"{row['mode']:>13} {row['clients']:>7} {row['stages']:>6} {row['groups']:>6} "
            f"{row['total_tok_s']:>11.2f} {row['per_request_tok_s']:>13.2f} "
            f"{row['ttft_median_s']:>10.3f} {row['decode_tok_s']:>12.2f} "
            f"{row['prompt_and_generated_tok_s']:>11.2f} {row['tokens_per_window']:>10.2f} "
            + (f"{accepted:>8.2f}" if accepted is not None else f"{'-':>8}"))
    if "peer_decode_tok_s" not in row:
        return line
    peer = row["peer_decode_tok_s"]
    return line + (f" {peer:>16.2f}" if peer is not None else f" {'-':>16}")


def load_peer(path: str, prompt_tokens: int | None, tokens: int) -> dict:
    """The report of `strata-bench peer --engine llama.cpp --json-out`, checked to count what
    this sweep counts: the same prompt and generated tokens a request."""
    try:
        report = json.loads(Path(path).read_text())
        cond = report["conditions"]
        measured = (int(cond["prompt_tokens"]), int(cond["tokens_per_client"]))
        by_clients = {int(r["clients"]): float(r["decode_tok_s"]) for r in report["results"]}
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"--peer-json {path} is not a report of strata-bench peer --engine "
                         f"llama.cpp --json-out; write one with that command") from None
    if measured != (prompt_tokens, tokens):
        raise ValueError(f"--peer-json {path} measured {measured[0]}-token prompts and "
                         f"{measured[1]} tokens a request; run the sweep with --prompt-tokens "
                         f"{measured[0]} --tokens {measured[1]} so both count the same")
    return {"conditions": cond, "machine": report.get("machine"), "decode_tok_s": by_clients,
            "rows": report["results"]}


def run_sweep(layouts: list[Layout], clients: list[int], tokens: int, echo,
              trace_dir: Path | None = None, work: Workload = Workload(),
              peer: dict | None = None, repeats: int = 1) -> list[dict]:
    """Launch each layout once; for each client count, run its modes one after the other,
    `repeats` times over; a row has the medians (median_row). With a pool of prompts, each
    repetition reads the next `clients` of them, the same for every mode.
    With trace_dir, each launch's processes write their timelines under it, and each row gets
    the decode windows' breakdown (tracereport.summarize) once its launch has stopped. With
    peer (load_peer), each row carries llama.cpp's decode rate at its client count."""
    rows = []
    for i, layout in enumerate(layouts):
        tok = Tokenizer.from_gguf(layout.prep.file.reader)
        traced = trace_dir and Path(trace_dir) / f"launch{i}"
        windows: list[tuple[dict, range]] = []
        with layout.prep.launch(say=lambda s: None, trace_dir=traced) as run:
            # warm-up, not measured: the first windows of each shape (CUDA graph captures,
            # one per decode window size and, with drafts, per drafter step size): every
            # mode at every client count
            for cfg in layout.modes.values():
                for n in clients:
                    harness.measure_throughput(run, cfg, tok, n, min(tokens, 16), work)
            for n in clients:
                runs: dict[str, list[dict]] = {mode: [] for mode in layout.modes}
                ids: dict[str, set[int]] = {mode: set() for mode in layout.modes}
                for r in range(repeats):
                    for mode, cfg in layout.modes.items():
                        first = run.pipe.next_window_id + 1
                        runs[mode].append(measure(run, cfg, tok, mode, n, tokens, work,
                                                  offset=r * n))
                        ids[mode] |= set(range(first, run.pipe.next_window_id + 1))
                for mode in layout.modes:
                    rows.append(median_row(runs[mode]))
                    if peer is not None:
                        rows[-1]["peer_decode_tok_s"] = peer["decode_tok_s"].get(n)
                    echo(format_row(rows[-1]))
                    windows.append((rows[-1], ids[mode]))
        for row, ids in windows if traced else ():
            row["trace"] = tracereport.summarize(traced, ids=ids)
            echo(f"# {row['mode']} {row['clients']} clients: "
                 f"{tracereport.stages_line(row['trace'])}")
    order = {m: i for i, m in enumerate(MODES)}
    return sorted(rows, key=lambda r: (order[r["mode"]], clients.index(r["clients"])))


def check_plot_backend() -> None:
    """Fail before the sweep, not after it, when --plot cannot be drawn."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install matplotlib")


PANELS = (("decode_tok_s", "decode tok/s (llama.cpp's S_TG)", "decode_tok_s"),
          ("prompt_and_generated_tok_s", "prompt + generated tok/s (its S)",
           "prompt_and_generated_tok_s"),
          ("total_tok_s", "generated tok/s over the run", None))


def plot(path: str, rows: list[dict], title: str, peer: dict | None = None) -> None:
    """Tok/s against clients (log2 axis), one line per mode, in three panels: the decode rate,
    prompt and generated tokens, generated tokens; llama.cpp's rows (peer) dashed beside the
    first two. Rendered by Agg to PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter

    fig = Figure(figsize=(14, 4.5))
    FigureCanvasAgg(fig)
    counts = sorted({r["clients"] for r in rows})
    for i, (key, label, peer_key) in enumerate(PANELS):
        ax = fig.add_subplot(1, len(PANELS), i + 1)
        for mode in dict.fromkeys(r["mode"] for r in rows):
            points = [(r["clients"], r[key]) for r in rows if r["mode"] == mode]
            ax.plot(*zip(*points), marker="o", label=mode)
        if peer is not None and peer_key is not None:
            points = sorted((r["clients"], r[peer_key]) for r in peer["rows"])
            ax.plot(*zip(*points), marker="s", linestyle="--", color="black",
                    label=f"llama.cpp, {peer['conditions'].get('devices')}")
            counts = sorted(set(counts) | {c for c, _ in points})
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)


@click.command()
@launch_options
@click.option("--clients", default="1,2,4,8,16,32", show_default=True,
              help="Concurrent client counts to measure.")
@click.option("--modes", default="1gpu,serial,pipelined", show_default=True,
              help=f"Which of {', '.join(MODES)} to run (the -mtp modes: with MTP drafts, "
                   f"--draft-tokens K or auto, the default for them).")
@click.option("--repeats", type=int, default=3, show_default=True,
              help="Runs of each mode and client count, interleaved; each row has the "
                   "medians.")
@click.option("--tokens", type=int, default=32, show_default=True, help="Tokens per client.")
@click.option("--prompt-tokens", type=int, default=None,
              help="Every client's prompt has exactly this many tokens (llama-batched-bench's "
                   "-npp) [default: the harness's texts, of mixed lengths].")
@click.option("--prompts", "prompts_file", type=str, default=None,
              help='A JSONL file of {"prompt": ..., "split": "train"|"heldout"} lines '
                   "(strata-train-mtp --write-prompts): the clients send its --split prompts "
                   "through the chat template, each repetition the next ones [default: the "
                   "harness's texts]. Requests still decode exactly --tokens tokens.")
@split_option
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="0 = greedy; above 0, every request samples at this temperature, seeded "
                   "by its prompt's place.")
@filter_options
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG: decode, prompt + generated and generated tok/s against "
                   "clients, one line per mode.")
@click.option("--peer-json", type=click.Path(dir_okay=False, exists=True), default=None,
              help="The JSON of strata-bench peer --engine llama.cpp --json-out with the same "
                   "--prompt-tokens and --tokens: its decode rate beside strata's, in the table "
                   "and the plot.")
@click.option("--trace-dir", type=click.Path(file_okay=False), default=None,
              help="Trace every process (strata/trace.py) into this folder and print, per "
                   "row, each stage's GPU and overhead ms per decode window and GPU busy share.")
@clean_errors("strata-bench sweep")
def sweep(clients, modes, repeats, tokens, prompt_tokens, prompts_file, split, temperature,
          top_k, top_p, min_p, json_out, plot_path, peer_json, trace_dir, **launch):
    """Tok/s against concurrent clients for 1gpu, serial and pipelined (and with MTP drafts,
    serial-mtp and pipelined-mtp) side by side, medians of --repeats runs: generated tokens
    over the run, and llama.cpp's two rates (decode; prompt and generated tokens), with
    --prompt-tokens read as its -npp and --peer-json its rows beside; the drafts' acceptance and
    the tokens a decode window gives. --batch defaults to the
    largest client count; --batch-groups sets the pipelined mode's groups (default: one per
    stage; more groups than stages cover the hops' latency)."""
    counts, chosen = parse_clients(clients), parse_modes(modes)
    if repeats < 1:
        raise ValueError(f"--repeats {repeats} is below 1; use 1 or more (3: medians of three)")
    if tokens < 2:
        raise ValueError(f"--tokens {tokens} is below 2: a per-request rate needs two tokens")
    if prompt_tokens is not None and prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens {prompt_tokens}: give 1 or more tokens a prompt")
    if prompt_tokens is not None and prompt_tokens + tokens > launch["ctx_size"]:
        raise ValueError(f"--prompt-tokens {prompt_tokens} and --tokens {tokens} need "
                         f"{prompt_tokens + tokens} positions a request, past --ctx-size "
                         f"{launch['ctx_size']}; raise --ctx-size or shorten them")
    if prompts_file and prompt_tokens is not None:
        raise ValueError("--prompts and --prompt-tokens both choose the prompts; give one")
    if temperature < 0:
        raise ValueError(f"--temperature {temperature} is below 0; use 0 (greedy) or more")
    work = Workload(prompt_tokens, (), temperature, top_k, top_p, min_p)
    texts = read_prompts(prompts_file, split) if prompts_file else None
    peer = load_peer(peer_json, prompt_tokens, tokens) if peer_json else None
    if plot_path:
        check_plot_backend()
    if click.get_current_context().get_parameter_source("batch") is ParameterSource.DEFAULT:
        launch["batch"] = max(counts)
    groups = ("auto" if click.get_current_context().get_parameter_source("batch_groups")
              is ParameterSource.DEFAULT else launch["batch_groups"])
    layouts = plan_layouts(launch, chosen, launch["batch"], groups)
    model = layouts[0].prep.file.path.name
    pool = ()
    if texts:
        tok = Tokenizer.from_gguf(layouts[0].prep.file.reader)
        pool = tuple(tuple(p) for p in chat_prompts(tok, texts))
        longest = max(len(p) for p in pool) + tokens
        if longest > launch["ctx_size"]:
            raise ValueError(f"the longest prompt of --prompts {prompts_file} and --tokens "
                             f"{tokens} need {longest} positions, past --ctx-size "
                             f"{launch['ctx_size']}; raise --ctx-size or lower --tokens")
    work = replace(work, pool=pool)
    devices = "; ".join(f"{'/'.join(lay.modes)} on {lay.devices}" for lay in layouts)
    # the most rows a decode window takes, per layout (auto: a group's slots, up to 64)
    window_rows = {mode: cfg.window_rows for lay in layouts for mode, cfg in lay.modes.items()}
    conditions = {"model": model, "tokens_per_client": tokens, "batch": launch["batch"],
                  "window_rows": window_rows,
                  "chunk_rows": {"/".join(lay.modes): lay.prep.sched.chunk_rows for lay in layouts},
                  "ctx_size": launch["ctx_size"], "layer_split": launch["layer_split"],
                  "devices": devices, "clients": counts, "modes": chosen,
                  "prompt_tokens": prompt_tokens, "repeats": repeats,
                  "prompts": f"{split} prompts of {prompts_file}" if texts else None,
                  "temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
                  "draft_tokens": {"/".join(m for m in lay.modes if m in DRAFTED):
                                   lay.prep.sched.draft_tokens
                                   for lay in layouts if set(lay.modes) & set(DRAFTED)},
                  # the modes whose windows may go ahead (--decode-ahead; one stage, one group)
                  "decode_ahead": [mode for lay in layouts for mode, cfg in lay.modes.items()
                                   if ahead.allowed(cfg)],
                  # the modes whose CUDA stages take int8 activations (--activations)
                  "int8_activations": [mode for lay in layouts for mode in lay.modes
                                       if lay.prep.activations == "int8"]}
    prompts = (f"{len(pool)} {split} prompts of {prompts_file}" if pool else
               f"{prompt_tokens}-token prompts" if prompt_tokens else "the harness's prompts")
    sampling = filters_said(temperature, top_k, top_p, min_p)
    drafts = conditions["draft_tokens"]
    click.echo(f"# {model}, {prompts}, {tokens} tokens per client, {sampling}, "
               f"batch {launch['batch']}, "
               f"window rows up to {_named(window_rows)}"
               + (f", MTP drafts per slot {_named(drafts)}" if drafts else "")
               + (f", decoding ahead ({', '.join(conditions['decode_ahead'])})"
                  if conditions["decode_ahead"] else "")
               + (f", int8 activations ({', '.join(conditions['int8_activations'])})"
                  if conditions["int8_activations"] else "")
               + f", medians of {repeats}; {devices}; {machine()}")
    if peer is not None:
        click.echo(f"# llama.cpp: {peer_json}, {peer['conditions'].get('model')} on "
                   f"{peer['conditions'].get('devices')}; {peer['machine']}")
    click.echo(COLUMNS + (PEER_COLUMN if peer is not None else ""))
    rows = run_sweep(layouts, counts, tokens, click.echo, trace_dir, work, peer, repeats)
    if json_out:
        report = {"machine": machine(), "conditions": conditions, "results": rows}
        if peer is not None:
            report["peer"] = {"file": peer_json, "machine": peer["machine"],
                              "conditions": peer["conditions"], "results": peer["rows"]}
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)
    if plot_path:
        plot(plot_path, rows, f"{model}, {prompts}, {tokens} tokens a client, {sampling}: "
                              f"tok/s vs concurrent clients\n{devices}", peer)


def _named(values: dict) -> str:
    """{"1gpu": 64, "serial/pipelined": 32} -> "64 (1gpu), 32 (serial/pipelined)"."""
    return ", ".join(f"{v} ({k})" for k, v in values.items())
