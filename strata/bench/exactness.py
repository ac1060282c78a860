"""The exactness harness behind `strata-bench exact`: the same requests alone, together and
arriving one after another, compared token by token, with the decode windows' sizes each arm
ran.

Three arms on one launch, each with a fresh scheduler:
  alone      one request at a time, serial, no drafts: every decode window is the smallest
             (one live row in 8 rows)
  together   every request at once under the given batch, groups and drafts: windows as large
             as the batch allows
  staggered  the first half of the requests at once, the rest once the first request has made
             a quarter of its tokens: windows grow while the first half decodes (from 8 to 16
             rows for 16 requests in 16 slots), and shrink as requests end

A run passes only if something was compared: a request that errors or ends without a finish
reason in any arm, no request at all, or fewer than half the tokens asked for
(requests x tokens) are failures with their reason, never "identical".
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from strata.bench.harness import CountingPipe, first_mismatch
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import Request, Scheduler, SchedulerConfig

ARMS = ("together", "staggered")   # compared against "alone"


@dataclass
class Arm:
    """One arm's requests (in submission order) and its decode windows by rows."""
    name: str
    requests: list[Request]
    sizes: Counter = field(default_factory=Counter)

    def sizes_said(self) -> str:
        """"8 rows x12, 16 rows x30": each decode window size and how many windows had it."""
        return ", ".join(f"{rows} rows x{n}" for rows, n in sorted(self.sizes.items())) or "none"


def run_arm(name: str, pipe, cfg: SchedulerConfig, stop_ids: frozenset[int],
            prompts: list[list[int]], params: list[SamplingParams]) -> Arm:
    """The requests through a fresh scheduler on `pipe`, as the arm `name` sends them."""
    counting = CountingPipe(pipe)
    sched = Scheduler(counting, cfg, stop_ids)
    jobs = list(zip(prompts, params))
    reqs: list[Request] = []
    if name == "together":
        reqs = [sched.submit(p, sp) for p, sp in jobs]
        sched.run()
    elif name == "alone":
        for p, sp in jobs:
            reqs.append(sched.submit(p, sp))
            sched.run()
    elif name == "staggered":
        half = -(-len(jobs) // 2)
        reqs = [sched.submit(p, sp) for p, sp in jobs[:half]]
        late = jobs[half:]
        while late:
            first = reqs[0]
            if first.done or 4 * len(first.seq.generated) >= first.seq.params.max_tokens:
                reqs += [sched.submit(p, sp) for p, sp in late]
                late = []
            elif not sched.step():
                break
        sched.run()
    else:
        raise ValueError(f"no arm {name!r}: alone, {', '.join(ARMS)}")
    return Arm(name, reqs, counting.sizes)


@dataclass
class Verdict:
    """What comparing arms found: lines to print, and the reasons the run fails (none: passed)."""
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    compared: int = 0      # tokens of the alone arm compared against every other arm


def compare(mode: str, alone: Arm, others: list[Arm]) -> Verdict:
    """Each request's tokens in every arm of `others` against its tokens alone."""
    v = Verdict()
    for arm in [alone, *others]:
        for i, r in enumerate(arm.requests):
            if r.error or r.seq.finish_reason not in ("stop", "length"):
                why = r.error or f"finish reason {r.seq.finish_reason!r}"
                v.failures.append(f"{mode} request {i} failed in the {arm.name} arm: {why}")
    for i, a in enumerate(alone.requests):
        mine = a.seq.generated
        bad = []
        for arm in others:
            theirs = arm.requests[i].seq.generated
            at = first_mismatch(mine, theirs)
            if at is not None:
                bad.append(f"{arm.name} at token {at}: alone {mine[at:at + 3]} "
                           f"{arm.name} {theirs[at:at + 3]}")
        if bad:
            v.failures.append(f"{mode} request {i} differs")
            v.lines.append(f"{mode:>6} request {i:>3}: MISMATCH " + "; ".join(bad))
        else:
            v.compared += len(mine)
            v.lines.append(f"{mode:>6} request {i:>3}: same {len(mine)} tokens alone, "
                           + ", ".join(arm.name for arm in others))
    return v


def enough(compared: int, requests: int, tokens: int, stopped: int) -> str | None:
    """Why `compared` tokens are too few to call a run exact (None: enough): no request, or
    fewer than half of requests x tokens."""
    if requests == 0:
        return "no request was compared: give --requests 1 or more"
    if 2 * compared < requests * tokens:
        return (f"only {compared} of {requests} x {tokens} tokens were compared ({stopped} "
                f"request(s) stopped early and requests that differ or fail count none); "
                f"at least half must be, so give more --requests or prompts that run longer")
    return None
