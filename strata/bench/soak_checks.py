"""The pure parts of `strata-bench soak`: the requests it sends, when it kills and stops which
stage, its three verdicts (lost requests, outputs against their solo runs, memory) and the
summary it prints."""
from __future__ import annotations

from dataclasses import dataclass

from strata.bench import harness
from strata.bench.loadtest import Answer

FINISHED = ("stop", "length")


# --- the requests -----------------------------------------------------------------------------

@dataclass(frozen=True)
class SoakRequest:
    """One distinct request of the soak; the clients send each many times."""
    index: int
    text: str
    chat: bool
    stream: bool
    sampled: bool        # temperature 0.7, top_k 20, seed 1000 + index; else greedy
    max_tokens: int

    def body(self) -> dict:
        p = harness.request_params(self.index, self.sampled, self.max_tokens)
        body = {"max_tokens": self.max_tokens, "stream": self.stream}
        if self.sampled:
            body.update(temperature=p.temperature, top_k=p.top_k, seed=p.seed)
        else:
            body["temperature"] = 0
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.text}]
        else:
            body["prompt"] = self.text
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


def request_pool(texts: list[str], n: int, max_tokens: int) -> list[SoakRequest]:
    """`n` distinct requests over `texts` (harness.prompt_set): greedy and seeded alternate,
    chat and completion go in pairs, one in three is streamed, and max_tokens is a quarter,
    half, three quarters or all of `max_tokens` in runs of four (so requests start and end at
    different times). Every mix of the four comes within 48 requests."""
    return [SoakRequest(i, text, chat=(i // 2) % 2 == 0, stream=i % 3 == 0,
                        sampled=i % 2 == 1,
                        max_tokens=max(1, max_tokens * (1 + (i // 4) % 4) // 4))
            for i, text in enumerate(harness.prompt_set(n, texts))]


# --- the faults -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    at: float            # seconds after the load starts
    kind: str            # "kill": SIGKILL; "stop": SIGSTOP, then SIGCONT `hold` seconds later
    stage: int
    hold: float = 0.0


def fault_schedule(duration: float, warmup: float, stages: int, kill_every: float,
                   stop_every: float, stop_for: float) -> list[Fault]:
    """The faults of a soak, in time order, all after the warm-up: a kill every `kill_every`
    seconds (0: none), round robin over the stages from stage 0; a stop of `stop_for` seconds
    (0: none) every `stop_every` seconds, half a period before each kill's time, so between the
    kills when both periods are equal, round robin from the last stage. Kills start before
    `duration`, stops end by it."""
    faults = []
    k = 1
    while kill_every > 0 and warmup + k * kill_every < duration:
        faults.append(Fault(warmup + k * kill_every, "kill", (k - 1) % stages))
        k += 1
    k = 1
    while stop_for > 0 and stop_every > 0 and \
            warmup + (k - 0.5) * stop_every + stop_for <= duration:
        faults.append(Fault(warmup + (k - 0.5) * stop_every, "stop", (stages - k) % stages,
                            stop_for))
        k += 1
    return sorted(faults, key=lambda f: f.at)


# --- the verdicts -----------------------------------------------------------------------------

def why_lost(a: Answer) -> str | None:
    """Why an answer is not a complete one, or None: no error, usage given, finish reason stop
    or length."""
    if a.error is not None:
        return a.error
    if a.completion_tokens is None:
        return "no usage in the answer"
    if a.finish_reason not in FINISHED:
        return f"finish_reason {a.finish_reason!r}"
    return None


def output(a: Answer) -> tuple[str, int, str]:
    """What must match the solo run: the server returns no token ids, so the text, the count
    of tokens generated and the finish reason."""
    return a.text, a.completion_tokens, a.finish_reason


@dataclass(frozen=True)
class Mismatch:
    index: int           # the distinct request
    times: int           # how many of its answers under load were this one
    solo: tuple | None   # output(); None: the solo run got no complete answer
    got: tuple
    at: int              # the first character that differs

    def sentence(self) -> str:
        if self.solo is None:
            return f"request {self.index}: its solo run got no complete answer"
        return (f"request {self.index}: {self.times} answer(s) under load differ from its solo "
                f"run at character {self.at}: solo {self.solo[1]} tokens, "
                f"{self.solo[2]}, {self.solo[0][self.at:self.at + 30]!r}; under load "
                f"{self.got[1]} tokens, {self.got[2]}, {self.got[0][self.at:self.at + 30]!r}")


def compare(under_load: dict[int, list[tuple]], solo: dict[int, Answer]) -> list[Mismatch]:
    """Each distinct output (text, tokens, finish) a request got under load, against its solo
    answer: one Mismatch for each that differs, with how many times it came."""
    out = []
    for index, outputs in sorted(under_load.items()):
        alone = solo[index]
        want = None if why_lost(alone) else output(alone)
        for got in sorted(set(outputs)):
            if got != want:
                at = 0 if want is None else harness.first_mismatch(want[0], got[0]) or 0
                out.append(Mismatch(index, outputs.count(got), want, got, at))
    return out


def memory_verdict(start: dict[str, float | None], end: dict[str, float | None],
                   tolerance_pct: float, floor_mib: float) -> list[str]:
    """A sentence for each process (and the total) whose resident memory after the load
    exceeds its start by more than `tolerance_pct` percent of the start or `floor_mib` MiB,
    whichever is more, or that could not be measured."""
    out = []

    def check(name: str, a: float | None, b: float | None) -> None:
        if a is None or b is None:
            out.append(f"{name}: no process to measure {'at start' if a is None else 'at end'}")
            return
        allowed = max(a * tolerance_pct / 100, floor_mib)
        if b - a > allowed:
            out.append(f"{name}: {a:.0f} MiB -> {b:.0f} MiB, {b - a:.0f} MiB more "
                       f"(allowed {allowed:.0f})")

    for name in start:
        check(name, start[name], end.get(name))
    if start and all(start[n] is not None and end.get(n) is not None for n in start):
        check("total", sum(start.values()), sum(end[n] for n in start))
    return out


# --- the summary ------------------------------------------------------------------------------

def mib(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}"


def print_summary(r: dict, say) -> None:
    say(f"requests            {r['requests']} sent, {r['completed']} complete, "
        f"{r['lost']} lost ({r['distinct_requests']} distinct)")
    for line in r["lost_samples"]:
        say(f"  {line.splitlines()[0][:160]}")
    say(f"mismatches          {r['mismatches']} ({r['mismatched_answers']} answers under load "
        f"differ from their solo run)")
    for line in r["mismatch_samples"]:
        say(f"  {line}")
    say(f"faults              {r['kills']} kills, {r['stops']} stops, {r['restarts']} restarts "
        f"seen")
    say(f"generated tokens    {r['tokens']} ({r['tok_s']:.1f} tok/s)")
    say(f"final status        {'healthy' if r['healthy'] else 'UNHEALTHY'}")
    tol = r["memory_tolerance"]
    say(f"memory              RSS MiB after warm-up / after the load (allowed: +"
        f"{tol['percent']:g}% or +{tol['floor_mib']:g} MiB, whichever is more)")
    mem = r["memory_mib"]
    for name, m in mem.items():
        pid = f"pid {m['pid_start']}" + ("" if m["pid_end"] == m["pid_start"]
                                         else f" -> {m['pid_end']}")
        say(f"  {name:<17} {mib(m['start']):>6} / {mib(m['end']):>6}  ({pid})")
    if all(m["start"] is not None and m["end"] is not None for m in mem.values()):
        say(f"  {'total':<17} {sum(m['start'] for m in mem.values()):>6.0f} / "
            f"{sum(m['end'] for m in mem.values()):>6.0f}")
    for line in r["memory_failures"]:
        say(f"  past the tolerance: {line}")
    ok = not (r["lost"] or r["mismatches"] or r["memory_failures"])
    say("soak passed" if ok else "soak FAILED")


def describe(faults: list[Fault], stage_timeout: float | None, stop_for: float) -> list[str]:
    lines = []
    for kind, what in (("kill", "SIGKILL"), ("stop", f"SIGSTOP for {stop_for:g} s")):
        picked = [f for f in faults if f.kind == kind]
        if picked:
            lines.append(f"# {what} at " + ", ".join(f"{f.at:g} s (stage {f.stage})"
                                                     for f in picked))
    if any(f.kind == "stop" for f in faults):
        lines.append(f"# stage timeout {stage_timeout:g} s: " +
                     ("a stop is a hang; the server takes the stage for hung and restarts it"
                      if stage_timeout < stop_for else
                      "a stop is a pause, shorter than the stage timeout; no restart"))
    return lines or ["# no faults: the load alone"]
