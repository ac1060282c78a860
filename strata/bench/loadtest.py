"""`strata-bench loadtest`: C concurrent HTTP clients against `strata-launch` serving, for a
bounded time, with small max_tokens. It starts the server itself (or targets --url, on this
host: it reads the stages' memory from /proc), and ends with the figures a release wants:
requests completed, errors (must be 0), tokens/s, latency percentiles, the final /v1/status
(every slot idle) and each stage's resident memory at start, after warm-up and at the end.

`ServerProcess` (strata-launch as a child process, ready once it prints its URL) is shared
with the tests; `post_request` (one request's answer, whole or streamed) with the soak.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import aiohttp
import click

from strata.bench import harness
from strata.launch.options import clean_errors, launch_options

SERVING = re.compile(r"^strata: serving (\S+) on (http://\S+/v1) ")


def _sigint_default() -> None:   # in the child, before exec
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class ServerProcess:
    """`strata-launch ARGS` serving HTTP as a child process; own_group: in a process group of
    its own, as a terminal starts a command (stop(group=True) then signals the whole group,
    as Ctrl-C does)."""

    def __init__(self, args: list[str], env: dict | None = None, own_group: bool = False):
        self.lines: list[str] = []
        self.url: str | None = None
        self.model: str | None = None
        self._ready = threading.Event()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "strata.launch.cli", *args], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})}, start_new_session=own_group,
            # as a terminal starts it: a shell running this in the background ignores SIGINT
            preexec_fn=_sigint_default if own_group else None)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = SERVING.match(line)
            if m:
                self.model, self.url = m.groups()
                self._ready.set()
        self._ready.set()  # exited: wait_ready looks at the url

    def wait_ready(self, timeout: float = 300.0) -> str:
        exited = self._ready.wait(timeout) and self.url is None   # stderr closed
        if self.url is None:
            code = self.proc.wait(5) if exited else self.proc.poll()
            why = (f"exited with code {code} before serving" if code is not None else
                   f"did not start serving within {timeout:.0f}s")
            raise RuntimeError(f"strata-launch {why}:\n{self.stderr()}")
        return self.url

    def stderr(self) -> str:
        return "".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0, group: bool = False) -> int:
        """Signal it (group: its whole process group) and wait; kill it if it does not exit
        in time. The exit code."""
        if self.proc.poll() is None:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self._reader.join(timeout=5)
        return code


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


@dataclass
class Tally:
    latency: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    last_end: float = 0.0


@dataclass
class Answer:
    """What one request got: its text (a stream's deltas joined), usage's completion tokens and
    the finish reason; or `error`, why it got no complete answer (an HTTP error, an SSE error
    event, a stream cut before its usage or its [DONE], a broken connection)."""
    text: str = ""
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    ttft: float | None = None   # seconds to a stream's first text


async def post_request(session: aiohttp.ClientSession, url: str, body: dict) -> Answer:
    """POST `body` to /completions, or /chat/completions where it has messages, whole or
    streamed (a stream must ask for include_usage) and read the answer."""
    chat, stream = "messages" in body, body.get("stream", False)
    out = Answer()
    t0 = time.monotonic()
    try:
        async with session.post(f"{url}/{'chat/completions' if chat else 'completions'}",
                                json=body) as resp:
            if resp.status != 200:
                out.error = f"{resp.status}: {(await resp.text())[:200]}"
                return out
            if not stream:
                obj = await resp.json()
                choice = obj["choices"][0]
                out.text = choice["message"]["content"] if chat else choice["text"]
                out.finish_reason = choice["finish_reason"]
                out.completion_tokens = obj["usage"]["completion_tokens"]
                return out
            done, texts = False, []
            async for raw in resp.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done = True
                if not line.startswith("data: ") or done:
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    out.error = f"stream: {obj['error']['message'][:200]}"
                    return out
                if obj.get("usage"):
                    out.completion_tokens = obj["usage"]["completion_tokens"]
                if not obj["choices"]:
                    continue
                choice = obj["choices"][0]
                text = choice.get("delta", {}).get("content") if chat else choice.get("text")
                if text:
                    texts.append(text)
                    out.ttft = time.monotonic() - t0 if out.ttft is None else out.ttft
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
            out.text = "".join(texts)
            if out.completion_tokens is None or not done:
                out.error = f"stream ended without {'usage' if done else '[DONE]'}"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


def request_body(n: int, max_tokens: int) -> dict:
    """Request n: chat or completion, streamed or not, greedy or seeded, by n's bits."""
    chat, stream, seeded = n % 2 == 0, n % 4 < 2, n % 8 < 4
    text = harness.PROMPTS[n % len(harness.PROMPTS)]
    body = {"max_tokens": max_tokens, "stream": stream}
    if seeded:
        body.update(temperature=0.8, top_p=0.95, seed=n)
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _one(session: aiohttp.ClientSession, url: str, n: int, max_tokens: int,
               tally: Tally) -> None:
    t0 = time.monotonic()
    answer = await post_request(session, url, request_body(n, max_tokens))
    if answer.error is not None:
        tally.errors.append(answer.error)
        return
    if answer.ttft is not None:
        tally.ttft.append(answer.ttft)
    tally.tokens += answer.completion_tokens
    tally.last_end = time.monotonic()
    tally.latency.append(tally.last_end - t0)


async def _load(url: str, clients: int, duration: float, max_tokens: int,
                headers: dict, on_warm) -> tuple[Tally, float]:
    tally = Tally()
    counter = iter(range(10**9))
    timeout = aiohttp.ClientTimeout(total=max(600.0, duration * 5))
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=clients)) as session:
        start = time.monotonic()
        deadline = start + duration

        async def client() -> None:
            while time.monotonic() < deadline:
                await _one(session, url, next(counter), max_tokens, tally)

        async def warm() -> None:  # memory after the first minute's worth of work (or 10%)
            await asyncio.sleep(min(60.0, duration / 10))
            on_warm()

        warming = asyncio.create_task(warm())
        await asyncio.gather(*(client() for _ in range(clients)))
        warming.cancel()
    return tally, start


async def get_json(url: str, headers: dict) -> dict:
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.get(url) as resp:
            return await resp.json()


async def idle_status(url: str, headers: dict, wait: float = 10.0) -> dict:
    """/v1/status once every slot is idle (the last answer may beat the engine's snapshot)."""
    end = time.monotonic() + wait
    while True:
        status = await get_json(f"{url}/status", headers)
        idle = all(s["state"] == "idle" for s in status["slots"]) and not status["queued"]
        if idle or time.monotonic() > end:
            return status
        await asyncio.sleep(0.2)


def run_load(url: str, clients: int, duration: float, max_tokens: int,
             api_key: str | None = None, say=click.echo) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    first = asyncio.run(get_json(f"{url}/status", headers))
    pids = {s["stage"]: s["pid"] for s in first["stages"]}
    memory = {k: {"start": rss_mib(pid)} for k, pid in pids.items()}

    def on_warm():
        for k, pid in pids.items():
            memory[k]["warm"] = rss_mib(pid)

    say(f"# loadtest: {clients} clients for {duration:g} s, max_tokens {max_tokens}, "
        f"{url} (batch {first['batch']}, groups {first['batch_groups']}, "
        f"{len(pids)} stages)")
    tally, start = asyncio.run(_load(url, clients, duration, max_tokens, headers, on_warm))
    status = asyncio.run(idle_status(url, headers))
    for k, pid in pids.items():
        memory[k]["end"] = rss_mib(pid)
    seconds = max(tally.last_end - start, 1e-9)
    done = len(tally.latency)
    idle = sum(s["state"] == "idle" for s in status["slots"])
    report = {"clients": clients, "duration_s": duration, "max_tokens": max_tokens,
              "requests": done, "errors": len(tally.errors), "tokens": tally.tokens,
              "seconds": seconds, "tok_s": tally.tokens / seconds, "req_s": done / seconds,
              "latency_s": {q: percentile(tally.latency, q) for q in (50, 90, 99, 100)},
              "ttft_s": {q: percentile(tally.ttft, q) for q in (50, 90, 99)},
              "slots_idle": idle, "slots": len(status["slots"]), "queued": status["queued"],
              "healthy": status["healthy"], "memory_mib": memory,
              "error_samples": tally.errors[:5]}
    _print(report, say)
    return report


def _print(r: dict, say) -> None:
    lat, ttft = r["latency_s"], r["ttft_s"]
    say(f"requests completed  {r['requests']} in {r['seconds']:.1f} s ({r['req_s']:.2f}/s)")
    say(f"errors              {r['errors']}")
    for e in r["error_samples"]:
        say(f"  {e}")
    say(f"generated tokens    {r['tokens']} ({r['tok_s']:.1f} tok/s)")
    say(f"latency s           p50 {lat[50]:.2f}  p90 {lat[90]:.2f}  p99 {lat[99]:.2f}  "
        f"max {lat[100]:.2f}")
    say(f"first token s       p50 {ttft[50]:.2f}  p90 {ttft[90]:.2f}  p99 {ttft[99]:.2f} "
        f"(streamed requests)")
    say(f"final status        {r['slots_idle']} of {r['slots']} slots idle, {r['queued']} "
        f"queued, {'healthy' if r['healthy'] else 'UNHEALTHY'}")
    say("stage memory        RSS MiB at start / after warm-up / at end")
    for k, m in sorted(r["memory_mib"].items()):
        cells = " / ".join("n/a" if m.get(w) is None else f"{m[w]:.0f}"
                           for w in ("start", "warm", "end"))
        say(f"  stage {k}           {cells}")


def launch_args(launch: dict) -> list[str]:
    """The shared launch options back as strata-launch arguments."""
    args = []
    for name, value in launch.items():
        if value is not None:
            args += [f"--{name.replace('_', '-')}", str(value)]
    return args


@click.command()
@launch_options
@click.option("--url", default=None, help="Target a running server (on this host: "
              "http://127.0.0.1:PORT/v1) instead of starting one.")
@click.option("--clients", type=int, default=64, show_default=True)
@click.option("--duration", type=float, default=120.0, show_default=True,
              help="Seconds during which clients start requests (then they finish).")
@click.option("--max-tokens", type=int, default=16, show_default=True)
@click.option("--api-key", default=None)
@click.option("--log-dir", type=click.Path(file_okay=False), default=None)
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
@clean_errors("strata-bench loadtest")
def loadtest(url, clients, duration, max_tokens, api_key, log_dir, json_out, **launch):
    """C concurrent HTTP clients for a bounded time against a server it starts (or --url);
    exit 1 on any error or a slot left busy."""
    if clients < 1 or duration <= 0 or max_tokens < 1:
        raise click.BadParameter("--clients, --duration and --max-tokens must be positive")
    server = None
    if url is None:
        args = launch_args(launch) + ["--host", "127.0.0.1", "--port", "0"]
        args += ["--log-dir", log_dir] if log_dir else []
        args += ["--api-key", api_key] if api_key else []
        server = ServerProcess(args)
        try:
            url = server.wait_ready()
        except RuntimeError as e:
            server.stop()
            raise click.ClickException(str(e)) from None
    try:
        report = run_load(url.rstrip("/"), clients, duration, max_tokens, api_key)
    finally:
        if server is not None:
            code = server.stop()
            click.echo(f"server stopped with exit code {code}")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)
    sys.exit(1 if report["errors"] or report["slots_idle"] != report["slots"] else 0)
