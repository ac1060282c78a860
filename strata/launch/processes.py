"""Spawning stage processes, watching them, starting one again, and tearing them all down.

Each spawned worker gets PR_SET_PDEATHSIG, so it dies with the launcher even if the launcher is
killed with SIGKILL; a normal exit sends Shutdown through the chain, then terminates, then kills.
A spawned worker ignores SIGINT: Ctrl-C in a terminal reaches the whole process group, and the
launcher alone decides how its stages stop (a stage that died of the same Ctrl-C would look
like a failure, and its logs would be kept).
The signal comes when the *thread* that spawned the worker ends, so a stage started again
(from the engine's thread) is spawned by a thread that lives as long as the launch.
"""
from __future__ import annotations

import ctypes
import functools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from strata.coordinator.stages.pipeline import PipelineError
from strata.launch.plan import StagePlan, resolve_link
from strata.protocol.join import free_ports

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:  # runs in the child between fork and exec
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # kept across exec: Python then leaves it
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before prctl: no signal will come
        os._exit(1)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def tail(path: Path, lines: int = 12) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, lines)).rstrip()
    except OSError:
        return "(no log)"


@dataclass
class Endpoints:
    inbox: str
    stages: list[str]


class StageProcesses:
    """The worker processes of one launch (spawned, or started by hand for --external-stage)."""

    def __init__(self, model: Path, plan: list[StagePlan], *, slots: int, ctx: int,
                 log_dir: Path | None = None, external: set[int] = frozenset(),
                 graph_cache: int | None = None, link: str | None = None,
                 trace_dir: Path | None = None, transport: str = "unix",
                 mtp_head: Path | None = None, keys: Path | None = None,
                 insecure: bool = False, listen_host: str | None = None,
                 weights: str | None = None, activations: str = "float"):
        """mtp_head: a sidecar NextN head for the last stage's drafter (a head in the model
        file needs none). keys: a keys directory (strata-keys) every stage is given;
        insecure: without keys, every stage may bind its tcp endpoint beyond loopback.
        listen_host: this host's address, for a launch whose external stages join from other
        hosts (joins.py): then every endpoint is ZeroMQ tcp there, on a free port, and an
        external stage's is the one it joins with."""
        self.model, self.plan, self.slots, self.ctx = model, plan, slots, ctx
        self.mtp_head = Path(mtp_head) if mtp_head else None
        self.keys = Path(keys).absolute() if keys else None  # as printed for an external stage
        self.insecure = insecure and self.keys is None
        self.trace_dir = Path(trace_dir) if trace_dir else None
        self.graph_cache = graph_cache
        self.weights = weights   # --weights for CUDA stages (None: the worker's default)
        self.activations = activations   # --activations for CUDA stages
        self.link = resolve_link(link or "auto", plan, across_hosts=listen_host is not None)
        if transport not in ("unix", "zmq"):
            raise ValueError(f"--transport {transport!r} is not unix or zmq")
        # the sockets and the link's meeting file; the stage logs too, unless log_dir is given.
        # mkdtemp makes it 0700: only this user can reach the unix:// and ipc:// sockets in it
        self.run_dir = Path(tempfile.mkdtemp(prefix="strata-"))
        self.log_dir = Path(log_dir) if log_dir else self.run_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.external = set(external)
        self.listen_host = listen_host
        # where a torch.distributed link meets; a launch that others join hosts a TCPStore
        # instead and sets this to it (joins.py)
        self.link_init = f"file://{self.run_dir}/link"
        if listen_host is not None:
            tcp = [f"tcp://{listen_host}:{port}" for port in free_ports(listen_host,
                                                                        1 + len(plan))]
            self.endpoints = Endpoints(inbox=tcp[0], stages=[
                "" if p.index in self.external else tcp[1 + p.index] for p in plan])
        else:
            scheme = "unix://" if transport == "unix" else "ipc://"  # unix: protocol/unixsock.py
            self.endpoints = Endpoints(
                inbox=f"{scheme}{self.run_dir}/inbox",
                stages=[f"{scheme}{self.run_dir}/stage{p.index}" for p in plan])
        self.procs: dict[int, subprocess.Popen] = {}
        self._spawner: ThreadPoolExecutor | None = None   # the thread that restarts spawn from

    @property
    def env(self) -> dict[str, str]:
        # Idle OpenMP threads spin by default; stages sharing CPU cores would steal each
        # other's time while they wait for their next window.
        return {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}

    def log_path(self, stage: int) -> Path:
        return self.log_dir / f"stage{stage}.log"

    def command(self, stage: int, security: bool = True) -> list[str]:
        """The strata-worker command of `stage`; without `security`, no --keys or --insecure
        (a stage that joins from another host brings its own)."""
        p = self.plan[stage]
        cmd = ["strata-worker", "--model", str(self.model), "--stage", str(stage),
               "--layers", f"{p.layer_start}:{p.layer_end}",
               "--listen", self.endpoints.stages[stage],
               "--coordinator", self.endpoints.inbox,
               "--device", p.device, "--slots", str(self.slots), "--ctx-size", str(self.ctx)]
        if stage + 1 < len(self.plan):
            cmd += ["--next", self.endpoints.stages[stage + 1]]
        if self.graph_cache is not None and p.device != "cpu":
            cmd += ["--graph-cache", str(self.graph_cache)]
        if self.weights is not None and p.device != "cpu":
            cmd += ["--weights", self.weights]
        if self.activations != "float" and p.device != "cpu":
            cmd += ["--activations", self.activations]
        if self.link != "zmq":
            cmd += ["--link", self.link, "--link-init", self.link_init,
                    "--link-world", str(len(self.plan))]
        if self.mtp_head is not None and stage == len(self.plan) - 1:
            cmd += ["--mtp-head", str(self.mtp_head)]
        if security and self.keys is not None:
            cmd += ["--keys", str(self.keys)]
        elif security and self.insecure:
            cmd += ["--insecure"]
        if self.trace_dir is not None:
            cmd += ["--trace", str(self.trace_dir / f"stage{stage}.json")]
        return cmd

    def start(self, say=print) -> None:
        for p in self.plan:
            cmd = self.command(p.index)
            if p.index in self.external:
                if self.listen_host is not None:
                    continue   # it has joined (joins.py), and runs on its own host
                say(f"stage {p.index} is external; start it yourself (e.g. prefix "
                    f"'python -m pdb -m strata.stage_worker' for the first word):\n  "
                    f"{shlex.join(cmd)}")
                continue
            self._spawn(p.index, cmd, "w")

    def _spawn(self, stage: int, cmd: list[str], mode: str) -> None:
        with open(self.log_path(stage), mode) as log:
            argv = [sys.executable, "-m", "strata.stage_worker"] + cmd[1:]
            self.procs[stage] = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                preexec_fn=functools.partial(_die_with_parent, os.getpid()))

    def restart(self, stage: int) -> None:
        """Start `stage` again (--restart-stages): kill its process if it still runs (it
        hangs), then spawn the same command, on the same endpoints; its log goes on in the
        same file. PipelineError for a stage this launch did not spawn."""
        proc = self.procs.get(stage)
        if proc is None:
            raise PipelineError(f"stage {stage} runs outside this launch (--external-stage), "
                                f"so it cannot be started again; start it again yourself and "
                                f"launch again")
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        how = (f"killed by {_signal_name(-proc.returncode)}" if proc.returncode < 0 else
               f"exited with code {proc.returncode}")
        with open(self.log_path(stage), "a") as log:
            log.write(f"--- strata-launch: stage {stage} {how}; starting it again ---\n")
        if self._spawner is None:
            self._spawner = ThreadPoolExecutor(1, thread_name_prefix="strata-spawn")
        self._spawner.submit(self._spawn, stage, self.command(stage), "a").result()

    def check_alive(self) -> None:
        """Raise PipelineError naming the first stage that has exited, with its log's end."""
        for stage, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                quoted = textwrap.indent(tail(self.log_path(stage)), "  | ")
                how = f", killed by {_signal_name(-code)}" if code < 0 else f" with code {code}"
                raise PipelineError(f"stage {stage} exited{how}; last lines of "
                                    f"{self.log_path(stage)}:\n{quoted}", stage=stage)

    def stop(self, grace: float = 5.0) -> bool:
        """Wait for a graceful exit (after Shutdown was sent; a stopped stage is continued
        first), then terminate, then kill.
        False when a stage exited by itself with an error code (a slow one, terminated after
        the grace period, is not counted: a loaded machine can delay any exit)."""
        clean = True
        deadline = time.monotonic() + grace
        for proc in self.procs.values():   # a stopped stage (SIGSTOP) takes the Shutdown too
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        for proc in self.procs.values():
            try:
                clean &= proc.wait(timeout=max(0.0, deadline - time.monotonic())) == 0
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._spawner is not None:
            self._spawner.shutdown()
        return clean

    @property
    def started(self) -> bool:
        """Whether a stage process was started (so a log may say why a launch failed)."""
        return bool(self.procs)

    def remove_run_dir(self, keep_logs: bool) -> Path | None:
        """Remove the run directory once every stage has stopped; with keep_logs, keep the stage
        logs it holds (no --log-dir) and return where they are; a launch that failed before
        it spawned any stage has none."""
        if not keep_logs or self.log_dir != self.run_dir or not self.started:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            return None
        for name in os.listdir(self.run_dir):
            if not name.endswith(".log"):
                (self.run_dir / name).unlink(missing_ok=True)
        return self.run_dir
