"""One stage process's configuration (strata-worker's options), validated once, here."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    stage: int
    layer_start: int
    layer_end: int
    listen: str            # endpoint this stage binds for its input
    coordinator: str       # the coordinator's inbox (hello, errors, and results if last)
    next: str | None       # the next stage's listen endpoint; None on the last stage
    device: str = "cpu"
    slots: int = 1
    ctx: int = 2048
    graph_cache: int = 8   # CUDA graphs kept (one per window shape); 0 = eager
    link: str = "zmq"      # activations to/from neighbours: zmq frames, or nccl / gloo
    link_init: str = ""    # torch.distributed init method of the link (e.g. file://...)
    link_world: int = 1    # stages in the link (every stage of the launch)
    trace: str = ""        # write a timeline of the windows here on exit (strata/trace.py)

    def __post_init__(self):
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(f"layer range {self.layer_start}:{self.layer_end} is empty")
        if self.slots < 1 or self.ctx < 1:
            raise ValueError("--slots and --ctx-size must be at least 1")
        if self.graph_cache < 0:
            raise ValueError(f"--graph-cache {self.graph_cache} is below 0; use 0 for no graphs")
        if self.link != "zmq" and not self.link_init:
            raise ValueError(f"--link {self.link} needs --link-init (e.g. file:///tmp/run/link)")
