"""`python -m strata.bench.tracereport DIR`: where a window's time goes, from a launch's traces.

DIR holds what `launch_stages(trace_dir=DIR)` had every process write (strata/trace.py):
coordinator.json and stage{k}.json. A window's wall time (coordinator: sent to result) splits
into a chain that adds up to it exactly:

    to stage 0's GPU      sent by the coordinator -> stage 0's kernels start
    stage k GPU           its kernels (CUDA events; on the last stage the head is included for
                          windows of 8 rows, whose graph holds it; other windows' head falls
                          under "last stage after GPU")
    stage k-1 -> k        stage k-1's kernels end -> stage k's start (the link or the frames, the
                          header, stage k's host work, and any wait for stage k's GPU)
    last stage after GPU  its kernels end -> its Result is sent (sync, sampling)
    to the coordinator    the Result's hop

Of "last stage after GPU", windows that ask the drafter for proposals also say the drafter's
part: from the answer's wait for the device ("synced") to the proposals ("drafted"), the
host's reading of the window's tokens included.

and per stage, "overhead" = (ready -> done) - GPU, where ready is when both the header and the
previous stage's kernels were done, and done is when its output left (its kernels' end, or its
send if later): the time a stage adds to a window beyond its GPU time. "busy" is each GPU's
share of the traced interval (with several windows in flight, what a stage could still take).
"""
from __future__ import annotations

import json
from pathlib import Path
from statistics import median

import click


def load(trace_dir: Path) -> dict[str, dict]:
    """{"coordinator": {...}, "stage0": {...}, ...} with marks as {window: {what: t}} and
    spans as {window: (start, end)}."""
    out = {}
    for path in sorted(Path(trace_dir).glob("*.json")):
        raw = json.loads(path.read_text())
        marks: dict[int, dict[str, float]] = {}
        for w, what, t in raw["marks"]:
            marks.setdefault(w, {})[what] = t
        spans = {w: (a, b) for w, what, a, b in raw["spans"]}
        out[raw["name"]] = {"marks": marks, "spans": spans}
    return out


def windows_through(traces: dict[str, dict], chunks: bool = False) -> list[int]:
    """Ids of windows with a result at the coordinator and a GPU span on every stage: decode
    windows, or (chunks) prompt chunks."""
    stages = _stages(traces)
    done, sent = traces["coordinator"]["marks"], "chunk" if chunks else "submit"
    return sorted(w for w, m in done.items() if "result" in m and sent in m
                  and all(w in traces[s]["spans"] and "came" in traces[s]["marks"].get(w, {})
                          for s in stages))


def _sent(marks: dict[str, float]) -> float:
    return marks.get("submit", marks.get("chunk"))


def _stages(traces: dict[str, dict]) -> list[str]:
    return sorted((n for n in traces if n.startswith("stage")), key=lambda n: int(n[5:]))


def chain(traces: dict[str, dict], w: int) -> dict[str, float]:
    """One window's wall time split into consecutive segments (ms); they add up to "wall"."""
    stages = _stages(traces)
    c = traces["coordinator"]["marks"][w]
    seg, t = {}, _sent(c)
    for k, s in enumerate(stages):
        start, end = traces[s]["spans"][w]
        seg["to stage 0's GPU" if k == 0 else f"stage {k - 1} -> {k}"] = start - t
        seg[f"stage {k} GPU"] = end - start
        t = end
    sent = traces[stages[-1]]["marks"][w]["sent"]
    seg["last stage after GPU"] = sent - t
    seg["to the coordinator"] = c["result"] - sent
    seg["wall"] = c["result"] - _sent(c)
    return {k: v * 1e3 for k, v in seg.items()}


def stage_overheads(traces: dict[str, dict], w: int) -> list[dict[str, float]]:
    """Per stage: ready -> done wall, GPU and overhead (ms) of one window."""
    stages, out, prev_end = _stages(traces), [], None
    for s in stages:
        m, (start, end) = traces[s]["marks"][w], traces[s]["spans"][w]
        ready = m["came"] if prev_end is None else max(m["came"], prev_end)
        done = max(end, m.get("sent", end))
        out.append({"wall": (done - ready) * 1e3, "gpu": (end - start) * 1e3,
                    "overhead": (done - ready - (end - start)) * 1e3})
        prev_end = end
    return out


def busy(traces: dict[str, dict], windows: list[int]) -> list[float]:
    """Each stage's GPU time over the interval from the first window sent to the last result."""
    c = traces["coordinator"]["marks"]
    t0 = min(_sent(c[w]) for w in windows)        # results may come back out of id order
    t1 = max(c[w]["result"] for w in windows)
    return [sum(b - a for w, (a, b) in traces[s]["spans"].items() if t0 <= a and b <= t1)
            / (t1 - t0) for s in _stages(traces)]


def summarize(trace_dir: Path, skip: int = 0, ids: range | None = None,
              chunks: bool = False) -> dict:
    """Medians over the decode windows (or prompt chunks) that passed every stage, after the
    first `skip`, among `ids` if given."""
    traces = load(trace_dir)
    ws = [w for w in windows_through(traces, chunks) if ids is None or w in ids][skip:]
    if not ws:
        raise click.ClickException(f"no {'chunk' if chunks else 'decode window'} in "
                                   f"{trace_dir} passed every stage")
    chains = [chain(traces, w) for w in ws]
    per_stage = [stage_overheads(traces, w) for w in ws]
    last = traces[_stages(traces)[-1]]["marks"]
    drafter = [(last[w]["drafted"] - last[w]["synced"]) * 1e3 for w in ws
               if "drafted" in last[w] and "synced" in last[w]]
    return {"windows": len(ws),
            "chain_ms": {k: median(c[k] for c in chains) for k in chains[0]},
            "stages": [{k: median(p[i][k] for p in per_stage) for k in per_stage[0][i]}
                       for i in range(len(per_stage[0]))],
            "busy": busy(traces, ws),
            "drafter": {"windows": len(drafter), "ms": median(drafter) if drafter else None}}


def stages_line(s: dict) -> str:
    """Each stage's GPU and overhead ms per window and busy share, on one line."""
    line = "; ".join(f"stage {k} GPU {st['gpu']:.2f} + overhead {st['overhead']:.2f} ms, "
                     f"busy {s['busy'][k]:.0%}" for k, st in enumerate(s["stages"]))
    return line + _drafter(s)


def _drafter(s: dict) -> str:
    d = s.get("drafter") or {}
    return (f"; sync to proposals {d['ms']:.2f} ms in {d['windows']} windows asking some"
            if d.get("windows") else "")


def format_summary(s: dict) -> list[str]:
    lines = [f"{s['windows']} windows, medians in ms: "
             + ", ".join(f"{k} {v:.3f}" for k, v in s["chain_ms"].items())]
    for i, st in enumerate(s["stages"]):
        lines.append(f"  stage {i}: wall {st['wall']:.3f} = GPU {st['gpu']:.3f} + overhead "
                     f"{st['overhead']:.3f} ms per window; GPU busy {s['busy'][i]:.0%}")
    if _drafter(s):
        lines.append(f"  last stage{_drafter(s)[1:]} (medians, of its time after the GPU)")
    return lines


def chrome(trace_dir: Path) -> list[dict]:
    """The traces as Chrome trace events (load the JSON in https://ui.perfetto.dev)."""
    events = []
    for pid, (name, t) in enumerate(load(trace_dir).items()):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        for w, (a, b) in t["spans"].items():
            events.append({"ph": "X", "name": f"w{w}", "pid": pid, "tid": "gpu",
                           "ts": a * 1e6, "dur": (b - a) * 1e6})
        for w, m in t["marks"].items():
            first = _sent(m) if name == "coordinator" else m.get("came")
            last = m.get("result" if name == "coordinator" else "sent")
            if first is not None and last is not None:
                events.append({"ph": "X", "name": f"w{w}", "pid": pid, "tid": "host",
                               "ts": first * 1e6, "dur": (last - first) * 1e6})
    return events


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("trace_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--skip", type=int, default=0, show_default=True,
              help="Leave out the first N windows (warm-up, prompts).")
@click.option("--chunks", is_flag=True, help="Prompt chunks instead of decode windows.")
@click.option("--chrome-out", type=click.Path(dir_okay=False), default=None,
              help="Also write the timelines as a Chrome trace (open in ui.perfetto.dev).")
def main(trace_dir, skip, chunks, chrome_out):
    """Where a window's time goes, from the traces of one launch."""
    for line in format_summary(summarize(Path(trace_dir), skip, chunks=chunks)):
        click.echo(line)
    if chrome_out:
        Path(chrome_out).write_text(json.dumps({"traceEvents": chrome(Path(trace_dir))}))


if __name__ == "__main__":
    main()
