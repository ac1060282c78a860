"""`strata-bench soak`: a bounded soak of `strata-launch` serving. C clients send a pool of
distinct requests (greedy and seeded, chat and completion, whole and streamed, max_tokens
varied) over HTTP for a duration while stage processes are killed (SIGKILL) and stopped
(SIGSTOP, then SIGCONT) on a schedule (soak_checks.fault_schedule); the server, started with
--restart-stages, restarts them. Then it checks that no request was lost, that every answer
equals the same request's answer run alone afterwards on the same server, and that the
resident memory of the server and of each stage process is back to what it was after the
warm-up. It exits 1 on any lost request, any mismatch, or memory past the tolerance.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp
import click

from strata.bench import harness
from strata.bench.harness import split_option
from strata.bench.loadtest import (ServerProcess, get_json, idle_status, launch_args,
                                   post_request, rss_mib)
from strata.bench.soak_checks import (Fault, SoakRequest, compare, describe, fault_schedule,
                                      memory_verdict, mib, output, print_summary, request_pool,
                                      why_lost)
from strata.launch.options import clean_errors, launch_options, prepare

WATCH_S = 1.0    # how often the stages' pids are read from /v1/status (a change: a restart)


def is_stage_worker(pid: int) -> bool:
    """Whether `pid` runs a strata stage worker: no signal goes to a pid taken by another
    process since it was read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")
    except OSError:
        return False
    return b"strata.stage_worker" in cmd or any(c.endswith(b"strata-worker") for c in cmd)


@dataclass(frozen=True)
class SoakPlan:
    clients: int
    duration: float          # seconds during which clients start requests
    warmup: float            # seconds of load before the memory's start is read
    faults: tuple[Fault, ...]
    tolerance_pct: float     # memory_verdict's
    floor_mib: float
    progress_every: float    # seconds between progress lines


@dataclass
class Soak:
    """The state of a soak while its clients run."""
    pool: list[SoakRequest]
    url: str
    headers: dict
    say: Callable[[str], None]
    outputs: dict[int, list[tuple]] = field(default_factory=dict)  # pool index -> outputs
    lost: list[str] = field(default_factory=list)
    sent: int = 0
    done: int = 0
    tokens: int = 0
    restarts: int = 0
    pids: dict[int, int] = field(default_factory=dict)    # stage -> its process, as last seen
    faults: list[dict] = field(default_factory=list)      # what was done, when, to which pid
    stopped: set[int] = field(default_factory=set)        # pids under SIGSTOP now
    start: float = 0.0
    last_end: float = 0.0

    def now(self) -> float:
        return time.monotonic() - self.start

    def note(self, line: str) -> None:
        self.say(f"{self.now():7.1f} s  {line}")

    def count(self, kind: str) -> int:
        return sum(f["kind"] == kind and f["sent"] for f in self.faults)


async def _client(soak: Soak, session: aiohttp.ClientSession, counter, deadline: float) -> None:
    while time.monotonic() < deadline:
        req = soak.pool[next(counter) % len(soak.pool)]
        soak.sent += 1
        answer = await post_request(session, soak.url, req.body())
        why = why_lost(answer)
        if why is not None:
            soak.lost.append(f"request {req.index}: {why}")
            await asyncio.sleep(0.1)   # a server that refuses at once would take a core
            continue
        soak.done += 1
        soak.tokens += answer.completion_tokens
        soak.last_end = time.monotonic()
        soak.outputs.setdefault(req.index, []).append(output(answer))


async def _read_pids(soak: Soak, session: aiohttp.ClientSession) -> None:
    """The stages' pids from /v1/status; a stage whose pid changed was restarted (one missing
    from the list keeps its last pid until it is back)."""
    try:
        async with session.get(f"{soak.url}/status") as resp:
            stages = (await resp.json())["stages"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
        return
    for s in stages:
        old = soak.pids.get(s["stage"])
        if old is not None and s["pid"] != old:
            soak.restarts += 1
            soak.note(f"stage {s['stage']} restarted: pid {old} -> {s['pid']}")
        soak.pids[s["stage"]] = s["pid"]


async def _watch(soak: Soak, session: aiohttp.ClientSession) -> None:
    while True:
        await asyncio.sleep(WATCH_S)
        await _read_pids(soak, session)


def _signal(soak: Soak, fault: Fault, sig: int) -> int | None:
    """Sends `sig` to the stage's current process; its pid, or None where there is none."""
    pid = soak.pids.get(fault.stage)
    if pid is None or not is_stage_worker(pid):
        return None
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return None
    return pid


async def _cont(soak: Soak, pid: int, stage: int, hold: float) -> None:
    await asyncio.sleep(hold)
    soak.stopped.discard(pid)
    if is_stage_worker(pid):
        os.kill(pid, signal.SIGCONT)
        soak.note(f"SIGCONT stage {stage} (pid {pid})")
    else:
        soak.note(f"stage {stage}'s stopped process (pid {pid}) is gone: the server replaced it")


async def _inject(soak: Soak, faults: list[Fault],
                  session: aiohttp.ClientSession | None = None) -> None:
    """Each fault at its time, to the stage's process as /v1/status names it just before
    (without a session: as soak.pids holds it)."""
    conts = []
    for fault in faults:
        await asyncio.sleep(max(0.0, soak.start + fault.at - time.monotonic()))
        if session is not None:
            await _read_pids(soak, session)
        sig = signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP
        pid = _signal(soak, fault, sig)
        soak.faults.append({"at_s": round(soak.now(), 1), "kind": fault.kind,
                            "stage": fault.stage, "pid": pid, "sent": pid is not None})
        if pid is None:
            soak.note(f"{fault.kind}: stage {fault.stage} has no process now; skipped")
        elif fault.kind == "kill":
            soak.note(f"SIGKILL stage {fault.stage} (pid {pid})")
        else:
            soak.note(f"SIGSTOP stage {fault.stage} (pid {pid}) for {fault.hold:g} s")
            soak.stopped.add(pid)
            conts.append(asyncio.create_task(_cont(soak, pid, fault.stage, fault.hold)))
    await asyncio.gather(*conts)


async def _progress(soak: Soak, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        soak.note(f"requests {soak.done} done, {len(soak.lost)} lost, "
                  f"{soak.sent - soak.done - len(soak.lost)} in flight; kills "
                  f"{soak.count('kill')}, stops {soak.count('stop')}, restarts {soak.restarts}")


async def _load(soak: Soak, plan: SoakPlan, on_warm: Callable[[], None]) -> None:
    counter = iter(range(10**12))
    timeout = aiohttp.ClientTimeout(total=max(600.0, plan.duration * 5))
    connector = aiohttp.TCPConnector(limit=plan.clients + 1)   # one more for /v1/status
    async with aiohttp.ClientSession(headers=soak.headers, timeout=timeout,
                                     connector=connector) as session:
        soak.start = time.monotonic()

        async def warm() -> None:
            await asyncio.sleep(plan.warmup)
            on_warm()

        side = [asyncio.create_task(c) for c in (_watch(soak, session), warm(),
                                                 _progress(soak, plan.progress_every))]
        injecting = asyncio.create_task(_inject(soak, list(plan.faults), session))
        try:
            await asyncio.gather(*(_client(soak, session, counter, soak.start + plan.duration)
                                   for _ in range(plan.clients)))
            await injecting
        finally:
            for task in [*side, injecting]:
                task.cancel()
            for pid in soak.stopped:   # never leave a stage stopped
                if is_stage_worker(pid):
                    os.kill(pid, signal.SIGCONT)


async def _solo(url: str, headers: dict, pool: list[SoakRequest], indices) -> dict:
    """Each request again, alone: one at a time, nothing else in flight."""
    async with aiohttp.ClientSession(headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        return {i: await post_request(session, url, pool[i].body()) for i in sorted(indices)}


def memory(server_pid: int, stage_pids: dict[int, int]) -> tuple[dict, dict]:
    """Resident MiB of the server and of each stage process, and their pids."""
    pids = {"server": server_pid, **{f"stage {k}": p for k, p in sorted(stage_pids.items())}}
    return {name: rss_mib(pid) for name, pid in pids.items()}, pids


async def _final_status(url: str, headers: dict, wait: float) -> dict:
    """/v1/status once every slot is idle and the server healthy (no stage restarting), or
    after `wait` seconds; a server that no longer answers has no stages."""
    end = time.monotonic() + wait
    while True:
        try:
            status = await idle_status(url, headers, max(0.0, end - time.monotonic()))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            return {"healthy": False, "error": f"/v1/status: {e}", "stages": []}
        if status["healthy"] or time.monotonic() >= end:
            return status
        await asyncio.sleep(0.5)


def run_soak(server: ServerProcess, url: str, pool: list[SoakRequest], plan: SoakPlan,
             api_key: str | None = None, say=click.echo) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    first = asyncio.run(get_json(f"{url}/status", headers))
    soak = Soak(pool, url, headers, say, pids={s["stage"]: s["pid"] for s in first["stages"]})
    warm = {}

    def on_warm():
        warm["rss"], warm["pids"] = memory(server.proc.pid, soak.pids)
        soak.note("warm: " + ", ".join(f"{n} {mib(m)} MiB" for n, m in warm["rss"].items()))

    asyncio.run(_load(soak, plan, on_warm))
    seconds = soak.last_end - soak.start if soak.done else 0.0
    # a stage may still be restarting: wait for idle slots, unless the soak failed already
    status = asyncio.run(_final_status(url, headers, wait=0.0 if soak.lost else 60.0))
    soak.pids = {s["stage"]: s["pid"] for s in status["stages"]}
    end_rss, end_pids = memory(server.proc.pid, soak.pids)
    say(f"# solo runs: {len(soak.outputs)} distinct requests, one at a time")
    solo = asyncio.run(_solo(url, headers, pool, soak.outputs))
    mismatches = compare(soak.outputs, solo)
    memory_bad = memory_verdict(warm["rss"], end_rss, plan.tolerance_pct, plan.floor_mib)
    report = {
        "clients": plan.clients, "duration_s": plan.duration, "warmup_s": plan.warmup,
        "distinct_requests": len(pool), "requests": soak.sent, "completed": soak.done,
        "lost": len(soak.lost), "lost_samples": soak.lost[:10],
        "mismatches": len(mismatches), "mismatched_answers": sum(m.times for m in mismatches),
        "mismatch_samples": [m.sentence() for m in mismatches[:10]],
        "kills": soak.count("kill"), "stops": soak.count("stop"), "restarts": soak.restarts,
        "faults": soak.faults, "tokens": soak.tokens, "seconds": seconds,
        "tok_s": soak.tokens / seconds if seconds else 0.0, "healthy": status["healthy"],
        "memory_mib": {name: {"pid_start": warm["pids"][name], "start": warm["rss"][name],
                              "pid_end": end_pids.get(name), "end": end_rss.get(name)}
                       for name in warm["rss"]},
        "memory_tolerance": {"percent": plan.tolerance_pct, "floor_mib": plan.floor_mib},
        "memory_failures": memory_bad}
    print_summary(report, say)
    return report


@click.command()
@launch_options
@click.option("--clients", type=int, default=64, show_default=True)
@click.option("--duration", type=float, default=300.0, show_default=True,
              help="Seconds during which clients start requests (then they finish).")
@click.option("--warmup", type=float, default=30.0, show_default=True,
              help="Seconds of load before the memory's start is read; faults come after.")
@click.option("--max-tokens", type=int, default=32, show_default=True,
              help="The most tokens a request asks for; requests ask for a quarter, half, "
                   "three quarters or all of it.")
@click.option("--distinct-requests", type=int, default=64, show_default=True,
              help="Distinct requests the clients send in turn; each is run alone afterwards.")
@click.option("--prompts", "prompts_file", type=str, default=None,
              help='A JSONL file of {"prompt": ..., "split": "train"|"heldout"} lines '
                   "(strata-train-mtp --write-prompts): the requests' texts [default: the "
                   "harness's texts].")
@split_option
@click.option("--kill-every", type=float, default=60.0, show_default=True,
              help="SIGKILL a stage process every S seconds after the warm-up, round robin "
                   "from stage 0 (0: never).")
@click.option("--stop-every", type=float, default=None,
              help="SIGSTOP a stage process every S seconds, half a period before each kill's "
                   "time, round robin from the last stage [default: --kill-every, or 60].")
@click.option("--stop-for", type=float, default=10.0, show_default=True,
              help="Seconds a stopped stage stays stopped before SIGCONT (0: no stops). Unless "
                   "--stage-timeout is given, the server's is half of it, so a stop is a hang.")
@click.option("--restart-stages/--no-restart-stages", default=None,
              help="Start the server with --restart-stages [default: when there are faults].")
@click.option("--memory-tolerance", type=float, default=10.0, show_default=True,
              help="Percent by which a process's (and the total) resident memory may grow "
                   "from the warm-up to the end of the load.")
@click.option("--memory-floor", type=float, default=32.0, show_default=True,
              help="MiB a process may grow by in any case (where the percent gives less).")
@click.option("--progress-every", type=float, default=5.0, show_default=True,
              help="Seconds between progress lines.")
@click.option("--api-key", default=None)
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="The stages' logs, and strata-launch's stderr as strata-launch.log.")
@click.option("--json-out", "--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="Write the summary as JSON.")
@clean_errors("strata-bench soak")
def soak(clients, duration, warmup, max_tokens, distinct_requests, prompts_file, split,
         kill_every, stop_every, stop_for, restart_stages, memory_tolerance, memory_floor,
         progress_every, api_key, log_dir, json_out, **launch):
    """C clients for a bounded time against strata-launch with stages killed and stopped;
    exit 1 on any lost request, any answer unlike its solo run, or memory past the tolerance."""
    if clients < 1 or duration <= 0 or max_tokens < 1 or distinct_requests < 1:
        raise click.BadParameter("--clients, --duration, --max-tokens and --distinct-requests "
                                 "must be positive")
    if not 0 <= warmup < duration:
        raise click.BadParameter(f"--warmup must be at least 0 and below --duration "
                                 f"({duration:g} s)")
    if min(kill_every, stop_for, progress_every, memory_tolerance, memory_floor) < 0 or \
            (stop_every is not None and stop_every <= 0) or progress_every == 0:
        raise click.BadParameter("--kill-every, --stop-for, --memory-tolerance and "
                                 "--memory-floor must be 0 or more, --stop-every and "
                                 "--progress-every positive")
    texts = harness.read_prompts(prompts_file, split) if prompts_file else harness.PROMPTS
    pool = request_pool(texts, distinct_requests, max_tokens)
    if stop_for > 0 and launch["stage_timeout"] is None:
        launch["stage_timeout"] = stop_for / 2
    stages = len(prepare(**launch).plan)
    faults = fault_schedule(duration, warmup, stages, kill_every,
                            stop_every or kill_every or 60.0, stop_for)
    restart = bool(faults) if restart_stages is None else restart_stages
    args = launch_args(launch) + ["--host", "127.0.0.1", "--port", "0"]
    args += ["--log-dir", log_dir] if log_dir else []
    args += ["--api-key", api_key] if api_key else []
    args += ["--restart-stages"] if restart else []
    server = ServerProcess(args)
    try:
        url = server.wait_ready().rstrip("/")
    except RuntimeError as e:
        server.stop()
        raise click.ClickException(str(e)) from None
    try:
        click.echo(f"# soak: {clients} clients for {duration:g} s (warm-up {warmup:g} s), "
                   f"{distinct_requests} distinct requests of up to {max_tokens} tokens, "
                   f"{url}, {stages} stages" + (", --restart-stages" if restart else ""))
        for line in describe(faults, launch["stage_timeout"], stop_for):
            click.echo(line)
        plan = SoakPlan(clients, duration, warmup, tuple(faults), memory_tolerance,
                        memory_floor, progress_every)
        report = run_soak(server, url, pool, plan, api_key)
    finally:
        code = server.stop()
        click.echo(f"server stopped with exit code {code}")
        if log_dir:   # what the server said of its stages (restarts included)
            with open(os.path.join(log_dir, "strata-launch.log"), "w") as f:
                f.write(server.stderr())
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)
    sys.exit(1 if report["lost"] or report["mismatches"] or report["memory_failures"] else 0)
