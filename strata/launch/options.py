"""The options every strata command shares (model, split, devices, slots, groups, windows),
and turning them into a checked plan before any process starts."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import click

from strata.config_error import ConfigError
from strata.coordinator.config import SchedulerConfig, auto_groups
from strata.coordinator.windows import DEFAULT_CHUNK_ROWS, DEFAULT_WINDOW_ROWS
from strata.launch.memory import check_fits
from strata.launch.plan import PlanError, StagePlan, parse_devices, plan_stages, resolve_link
from strata.model.gguf_file import ModelError, ModelFile
from strata.model.registry import DEFAULT_MODEL, resolve_model


def say(text: str) -> None:
    click.echo(text, err=True)


def cuda_count() -> int:
    """The CUDA devices torch sees. Without the CUDA driver's library (which the CUDA runtime
    loads by this name) there are none, and torch, over a second to import, is not needed to say
    so: on a CPU machine the launcher checks every flag without it."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def open_model(model: str, ctx_size: int) -> ModelFile:
    file = ModelFile(resolve_model(model, say=say))
    if ctx_size > file.config.ctx_len:
        raise ModelError(f"--ctx-size {ctx_size} exceeds the {file.config.ctx_len} positions "
                         f"the model was trained for; use --ctx-size {file.config.ctx_len} or less")
    return file


def launch_options(f=None, *, skip: tuple[str, ...] = ()):
    """Decorator: the shared options, passed to the command as keyword arguments.
    `@launch_options(skip=("--draft-tokens",))` leaves out the options a command defines itself."""
    if f is None:
        return lambda g: launch_options(g, skip=skip)
    options = [
        click.option("--model", default=DEFAULT_MODEL, show_default=True,
                     help="smollm2-135m (embedded) or the path of a GGUF file."),
        click.option("--layer-split", default="auto", show_default=True,
                     help="auto, or layer boundaries K1,K2,..: 12,24 on 30 layers = "
                          "[0,12) [12,24) [24,30)."),
        click.option("--devices", default="auto", show_default=True,
                     help="auto, cpu, or one per stage: cuda:0,cuda:1 (stages may share one)."),
        click.option("--ctx-size", type=int, default=2048, show_default=True,
                     help="Positions of KV cache per slot (prompt + generated tokens)."),
        click.option("--batch", type=int, default=1, show_default=True,
                     help="Slots: requests decoding together (more wait in a queue)."),
        click.option("--batch-groups", default="1", show_default=True,
                     help="1 = serial windows; G or auto = G groups of slots in flight at once."),
        click.option("--window-rows", type=int, default=DEFAULT_WINDOW_ROWS, show_default=True,
                     help="Rows of a decode window (more slots rotate through several)."),
        click.option("--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS, show_default=True,
                     help="Rows of a prompt chunk."),
        click.option("--draft-tokens", type=int, default=0, show_default=True,
                     help="Draft tokens a decoding slot may verify in its window's spare rows "
                          "(prompt lookup; the same tokens, fewer windows where text repeats; "
                          "0 = off)."),
        click.option("--graph-cache", type=int, default=8, show_default=True,
                     help="CUDA graphs kept per stage, one per window shape (0: always eager)."),
        click.option("--stage-link", default="auto", show_default=True,
                     type=click.Choice(["auto", "zmq", "nccl", "gloo"]),
                     help="Activations between stages: auto = nccl (GPU to GPU) when each "
                          "stage has a CUDA device of its own, else zmq frames; gloo links CPU "
                          "stages through torch.distributed (for tests)."),
        click.option("--transport", default="unix", show_default=True,
                     type=click.Choice(["unix", "zmq"]),
                     help="Headers and messages between the processes of this host: unix "
                          "sockets read by the receiver itself (fast), or ZeroMQ ipc (an I/O "
                          "thread per side; stages on other hosts always use ZeroMQ tcp)."),
    ]
    own = len(getattr(f, "__click_params__", []))  # the command's options, applied before these
    for option in reversed(options):
        f = option(f)
    f.__click_params__[own:] = [p for p in f.__click_params__[own:] if not set(p.opts) & set(skip)]
    return f


@dataclass
class Prepared:
    file: ModelFile
    plan: list[StagePlan]
    sched: SchedulerConfig
    graph_cache: int = 8
    link: str = "zmq"
    transport: str = "unix"

    def launch(self, **kwargs):
        """The stages of this plan, as a context manager (see session.launch_stages)."""
        from strata.launch.session import launch_stages
        return launch_stages(self.file, self.plan, slots=self.sched.slots, ctx=self.sched.ctx,
                             graph_cache=self.graph_cache, link=self.link,
                             transport=self.transport, **kwargs)


def prepare(model, layer_split, devices, ctx_size, batch, batch_groups, window_rows,
            chunk_rows, graph_cache=8, stage_link="auto", transport="unix", draft_tokens=0,
            **_) -> Prepared:
    """Check everything that can be checked before a process starts. The values are checked
    by the configs that take them (SchedulerConfig, the stages' settings); clean_errors names
    the flags."""
    from strata.stage_worker.config import check_stage_settings
    if batch_groups == "auto":
        groups = None
    else:
        try:
            groups = int(batch_groups)
        except ValueError:
            raise PlanError(f"--batch-groups {batch_groups!r} is not a number or auto") from None
    check_stage_settings(batch, ctx_size, graph_cache)
    file = open_model(model, ctx_size)
    plan = plan_stages(layer_split, parse_devices(devices, cuda_count()), file.config.n_layers)
    if groups is None:
        groups = auto_groups(batch, len(plan))
    sched = SchedulerConfig(slots=batch, groups=groups,
                            window_rows=window_rows, chunk_rows=chunk_rows, ctx=ctx_size,
                            draft_tokens=draft_tokens,
                            prompt_depth=len(plan) + 1)  # + 1: the next chunk waits at stage 0
    check_fits(file.config, plan, batch, ctx_size)
    return Prepared(file, plan, sched, graph_cache, resolve_link(stage_link, plan), transport)


def parse_devices_for(devices: str) -> list[str]:
    return parse_devices(devices, cuda_count())


# the library's config fields as strata-launch's flags, and the choices only the CLI offers
FLAGS = {"slots": "--batch", "groups": "--batch-groups", "window_rows": "--window-rows",
         "chunk_rows": "--chunk-rows", "ctx": "--ctx-size", "draft_tokens": "--draft-tokens",
         "graph_cache": "--graph-cache", "port": "--port", "api_key": "--api-key",
         "read_timeout": "--read-timeout", "max_connections": "--max-connections",
         "max_client_connections": "--max-client-connections"}
CHOICES = {"groups": "auto"}


def clean_errors(command_name: str):
    """Decorator: a user's mistake ends the command with its sentence and exit 2, a failed
    stage with exit 1; never with a traceback."""
    import functools
    import sys

    from strata.coordinator.generate import RequestError
    from strata.coordinator.pipeline import PipelineError, WindowFailed

    def wrap(f):
        @functools.wraps(f)
        def run(*args, **kwargs):
            try:
                return f(*args, **kwargs)
            except ConfigError as e:
                say(f"{command_name}: {e.render(FLAGS, CHOICES)}")
                sys.exit(2)
            except (ModelError, PlanError, RequestError, ValueError) as e:
                say(f"{command_name}: {e}")
                sys.exit(2)
            except (PipelineError, WindowFailed) as e:
                say(f"{command_name}: {e}")
                sys.exit(1)
            except KeyboardInterrupt:
                say(f"{command_name}: interrupted; stages stopped")
                sys.exit(130)
        return run
    return wrap
