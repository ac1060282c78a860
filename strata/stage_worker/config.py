"""One stage process's configuration (strata-worker's options), validated once, here."""
from __future__ import annotations

from dataclasses import dataclass

from strata.config_error import ConfigError
from strata.protocol.transport import check_tcp


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
    graph_cache: int = 16  # CUDA graphs kept (one per window shape); 0 = eager
    weights: str = "bf16"  # quantized: block types with a kernel stay packed on CUDA;
                           # bf16: every matrix widened (stage_worker/weights.py)
    activations: str = "float"  # int8: decode windows quantize rows against quantized weights
                                # (kernels/quant/a8.py); CUDA stages with weights quantized
    link: str = "zmq"      # activations to/from neighbours: zmq frames, or nccl / gloo
    link_init: str = ""    # torch.distributed init method of the link (e.g. file://...)
    link_world: int = 1    # stages in the link (every stage of the launch)
    trace: str = ""        # write a timeline of the windows here on exit (strata/trace.py)
    mtp_head: str | None = None  # a NextN head sidecar for the last stage's drafter (else the
                                 # model file's own NextN layer, if it has one)
    keys: str | None = None  # a keys directory (strata-keys): CURVE on every ZeroMQ socket
    insecure: bool = False   # without keys, allow listening on a non-loopback TCP endpoint

    def __post_init__(self):
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(f"layer range {self.layer_start}:{self.layer_end} is empty")
        check_stage_settings(self.slots, self.ctx, self.graph_cache)
        if self.weights not in ("quantized", "bf16"):
            raise ConfigError("weights", f"{{weights}} {self.weights!r} is not quantized or "
                              f"bf16")
        if self.activations not in ("float", "int8"):
            raise ConfigError("activations", f"{{activations}} {self.activations!r} is not "
                              f"float or int8")
        if self.activations == "int8" and (self.weights != "quantized"
                                           or not self.device.startswith("cuda")):
            raise ConfigError("activations", "{activations} int8 multiplies quantized weights "
                              f"on a CUDA device, and this stage has {{weights}} "
                              f"{self.weights} on {self.device}",
                              "give --device cuda:N and --weights quantized, or leave "
                              "{activations} out")
        check_tcp(self.listen, bind=True, keyed=self.keys is not None, insecure=self.insecure,
                  warn=False)  # refused before the model loads; the socket warns when bound
        if self.link != "zmq" and not self.link_init:
            raise ConfigError("link_init", f"{{link}} {self.link} needs {{link_init}} "
                              f"(e.g. file:///tmp/run/link)")


def check_stage_settings(slots: int, ctx: int, graph_cache: int) -> None:
    """The settings every stage of a launch shares; a launcher checks them before it spawns."""
    for name, value in (("slots", slots), ("ctx", ctx)):
        if value < 1:
            raise ConfigError(name, f"{{{name}}} {value} is below 1", "use 1 or more")
    if graph_cache < 0:
        raise ConfigError("graph_cache", f"{{graph_cache}} {graph_cache} is below 0",
                          "use 0 to run windows eagerly")
