"""A stage worker in the test's own process, with the two sockets a coordinator would hold:
for tests that drive one window at a time and read each answer (test_worker_errors.py,
test_drafter.py)."""
from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import zmq

from strata.protocol import transport
from strata.protocol.messages import Window
from strata.stage_worker.worker import StageWorker, WorkerConfig


class InProcess:
    """A one-stage StageWorker in this process and the coordinator's two sockets."""

    def __init__(self, worker: StageWorker, inbox: zmq.Socket, out: zmq.Socket):
        self.worker, self.inbox, self.out = worker, inbox, out

    def send(self, msg: Window | list) -> None:
        """A Window, or the frames of any message (malformed ones too)."""
        self.out.send_multipart(transport.pack(msg) if isinstance(msg, Window) else msg)

    def step(self) -> None:
        """Takes the next window (a CUDA stage may keep its answer until the next one)."""
        with torch.inference_mode():
            assert self.worker.step()

    def answers(self, n: int) -> list:
        """The next n messages to the coordinator (a deferred one is given once the device is
        done)."""
        with torch.inference_mode():
            self.worker._await_pending()
        out = []
        for _ in range(n):
            assert self.inbox.poll(5000), "the worker answered nothing"
            out.append(transport.recv(self.inbox)[0])
        return out

    def ask(self, msg: Window | list):
        self.send(msg)
        self.step()
        return self.answers(1)[0]


@contextmanager
def in_process_worker(model: Path, cls: type[InProcess] = InProcess,
                      **config) -> Iterator[InProcess]:
    """A StageWorker of `model` as stage 0 (and last: `layer_end` in config) in this process;
    config: the rest of its WorkerConfig (`stage` and `layer_start` too: a later stage that
    takes its activations as frames)."""
    run = Path(tempfile.mkdtemp(prefix="strata-w-"))  # short: ipc paths are limited
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(f"ipc://{run}/inbox")
    config = {"stage": 0, "layer_start": 0, **config}
    worker = StageWorker(WorkerConfig(model=str(model), listen=f"ipc://{run}/s0",
                                      coordinator=f"ipc://{run}/inbox", next=None, **config))
    out = ctx.socket(zmq.PUSH)
    out.connect(f"ipc://{run}/s0")
    try:
        yield cls(worker, inbox, out)
    finally:
        worker.close()
        inbox.close(linger=0)
        out.close(linger=0)
        ctx.term()
        shutil.rmtree(run, ignore_errors=True)
