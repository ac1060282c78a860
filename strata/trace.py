"""A timeline of one process: host marks and GPU spans per window, written as JSON on close.

A stage worker (`--trace PATH`) marks when a window came, when its kernels were queued and
when it was passed on, and brackets its device work with two CUDA events; the coordinator's
Pipeline marks when it sent a window and when its result came. Every time is in seconds of
`time.perf_counter()`, which on Linux is CLOCK_MONOTONIC, one clock for every process of the
host. On a CUDA device a span's ends are events on the stream; an event only measures from another
event, so the trace records an anchor event at start and one at close, each synchronized and
timed on the host, and places every event on the host clock between them (linearly, so the
GPU clock's drift over a run cancels). On a CPU device, where compute is synchronous, a span
is host time.
`strata.bench.tracereport` reads a launch's files and says where a window's time goes.

Tracing costs two events and a few list appends a window; off (no path), every call returns
at once. torch is imported only by a trace that times CUDA spans.
May import: nothing
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


class Trace:
    def __init__(self, name: str, path: str | os.PathLike | None, device=None):
        self.name, self.path = name, Path(path) if path else None
        self.cuda = self.path is not None and device is not None and _on_cuda(device)
        self.marks: list[tuple[int, str, float]] = []
        self.spans: list[tuple[int, str, object, object]] = []
        self._begun: tuple[int, object] | None = None   # the GPU span opened, not yet closed
        self._anchor0 = self._anchor() if self.cuda else None

    @property
    def on(self) -> bool:
        return self.path is not None

    def mark(self, window: int, what: str) -> None:
        if self.path is not None:
            self.marks.append((window, what, time.perf_counter()))

    def gpu_begin(self, window: int) -> None:
        """Open a window's GPU span: an event on the current stream (on a CPU device, where
        compute is synchronous, the host time)."""
        if self.path is not None:
            self._begun = (window, self._now())

    def gpu_end(self) -> None:
        """Close the span gpu_begin opened (none when the window never launched)."""
        if self._begun is not None:
            window, start = self._begun
            self.spans.append((window, "gpu", start, self._now()))
            self._begun = None

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        import torch
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _anchor(self) -> tuple[object, float]:
        """A torch.cuda.Event and its host time: the middle of record .. synchronize returning."""
        import torch
        torch.cuda.synchronize()
        event = torch.cuda.Event(enable_timing=True)
        before = time.perf_counter()
        event.record()
        event.synchronize()
        return event, (before + time.perf_counter()) / 2

    def close(self) -> None:
        """Write the file (once); GPU spans are resolved here, after a synchronization."""
        if self.path is None:
            return
        spans = [[w, what, a, b] for w, what, a, b in self.spans] if not self.cuda else []
        if self.cuda and self.spans:
            (e0, t0), (e1, t1) = self._anchor0, self._anchor()
            scale = (t1 - t0) / max(e0.elapsed_time(e1) / 1e3, 1e-9)

            def host(event) -> float:
                return t0 + e0.elapsed_time(event) / 1e3 * scale

            spans = [[w, what, host(a), host(b)] for w, what, a, b in self.spans]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as f:
            json.dump({"name": self.name, "pid": os.getpid(),
                       "marks": [list(m) for m in self.marks], "spans": spans}, f)
        self.path = None


def _on_cuda(device) -> bool:
    import torch
    return torch.device(device).type == "cuda"
