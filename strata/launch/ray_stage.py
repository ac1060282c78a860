"""The Ray actor that holds one stage on a node of a Ray cluster (strata-launch --cluster ray):
it runs `strata-worker --join ...` as a subprocess of its own, so the stage is an ordinary
strata-worker process there (attach a debugger to it, read its log), watches it, reports its
exit, and stops it.

This module runs on the cluster's nodes: it imports neither ray nor the rest of strata (Ray
pickles the class by reference, so strata must be installed on every node). The launcher's
side is ray_cluster.py.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections import deque

PR_SET_PDEATHSIG = 1


def _die_with_actor() -> None:  # runs in the child between fork and exec
    # the signal comes when the thread that forked ends; that thread waits for this child, so
    # it ends only with it, or when the actor's process dies (ray.kill, a node that goes)
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class StageHost:
    """One stage's strata-worker process on this node (a Ray actor: ray_cluster.py creates it
    with the stage's resources in its placement group bundle)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.exited = threading.Event()
        self.started = threading.Event()
        self.dir = tempfile.mkdtemp(prefix="strata-stage-")
        self.log = os.path.join(self.dir, "stage.log")

    def start(self, args: list[str], env: dict[str, str]) -> dict:
        """Run `strata-worker ARGS` (this node's Python, `env` over the actor's), its output in a
        log of this node; returns where it runs: node id, address, host name, pid, log. Once
        the last worker has exited, a second start restarts the stage (the log goes on)."""
        import ray   # the actor's process has it: Ray started it

        assert self.proc is None or self.exited.is_set(), "one worker at a time"
        self.started.clear()
        self.exited.clear()
        error: list[BaseException] = []

        def keep() -> None:   # forks the worker, then waits for it (see _die_with_actor)
            try:
                with open(self.log, "a") as log:
                    self.proc = subprocess.Popen(
                        [sys.executable, "-m", "strata.stage_worker", *args],
                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        env={**os.environ, **env}, preexec_fn=_die_with_actor)
            except BaseException as e:
                error.append(e)
                return
            finally:
                self.started.set()
            self.proc.wait()
            self.exited.set()

        threading.Thread(target=keep, name="stage-worker", daemon=True).start()
        self.started.wait()
        if error:
            raise error[0]
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "address": ray.util.get_node_ip_address(), "host": socket.gethostname(),
                "pid": self.proc.pid, "log": self.log}

    def wait(self) -> int:
        """The worker's exit code, once it has exited (the launcher holds this call's result
        as the stage's end: ray.wait on it says whether the stage is still running)."""
        self.exited.wait()
        return self.proc.returncode

    def stop(self, grace: float) -> tuple[int, bool]:
        """Let the worker leave by itself for `grace` seconds (the launcher sent Shutdown; a
        stopped worker is continued first), then terminate it, then kill it. Returns its exit
        code and whether it had to be terminated (a slow exit is no error of the stage)."""
        proc = self.proc
        if proc is None:
            return 0, False
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
        if self.exited.wait(grace):
            return proc.wait(), False
        proc.terminate()
        if not self.exited.wait(3.0):
            proc.kill()
        return proc.wait(), True

    def log_tail(self, lines: int = 12) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return "".join(deque(f, lines)).rstrip()
        except OSError:
            return "(no log)"

    def take_log(self) -> str:
        """The whole log; this node's copy is removed (the launcher keeps it)."""
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except OSError:
            return ""
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
