"""The options every strata command shares (model, split, devices, slots, groups, windows),
and turning them into a checked plan before any process starts."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace
from pathlib import Path

import click

from strata.config_error import ConfigError
from strata.coordinator.config import (AUTO, DRAFT_SAMPLINGS, DRAFT_TILES, DRAFTERS,
                                       MAX_DRAFT_TOKENS, MAX_WINDOW_ROWS, WINDOW_ROW_STEP,
                                       SchedulerConfig, auto_groups)
from strata.coordinator.stages.liveness import FIRST_S, FLOOR_S, MARGIN_S, Liveness
from strata.coordinator.windows import DEFAULT_CHUNK_ROWS
from strata.launch.activations import (ACTIVATIONS, INT8_ROWS, MIN_BILLIONS,
                                       resolve_activations, resolve_min_window_rows,
                                       resolve_weights)
from strata.launch.memory import check_fits, layer_bytes, tensor_bytes
from strata.launch.plan import PlanError, StagePlan, parse_devices, plan_stages, resolve_link
from strata.model.gguf_file import ModelError, ModelFile
from strata.model.nextn import find_head, open_head
from strata.model.registry import DEFAULT_MODEL, resolve_model


# prompt chunk rows on CUDA stages: a 128-token prompt in one chunk (docs/BENCHMARKS.md, the
# comparison with llama.cpp); CPU stages compute every row, so their chunks stay small
GPU_CHUNK_ROWS = 128


def say(text: str) -> None:
    """A line on stderr; none when stderr is gone (a closed pipe or terminal): the launch goes
    on, and stops when asked, without its console."""
    try:
        click.echo(text, err=True)
    except OSError:
        pass


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
                     help="1 = serial windows; G = G groups of slots with a window in flight "
                          "each (G divides --batch); auto = one group per stage, or the "
                          "largest count below that divides --batch (64 slots over 2 stages: "
                          "2 groups of 32)."),
        click.option("--window-rows", default="auto", show_default=True,
                     help=f"The most rows of a decode window's decoding slots: a multiple of "
                          f"8 up to {MAX_WINDOW_ROWS}, or auto = a group's slots (--batch / "
                          f"groups) rounded up to 8, at most {MAX_WINDOW_ROWS}. Each decode "
                          f"window has its decoding slots rounded up to 8 rows (1 slot: 8 rows, "
                          f"9: 16), up to this; more slots take turns. Drafts may add "
                          f"--draft-rows more (never past {MAX_WINDOW_ROWS})."),
        click.option("--min-window-rows", default="auto", show_default=True,
                     help="The fewest rows of a decode window: 8, or 1, 2 or 4: then windows "
                          "of up to 4 rows (decoding slots and their drafts) take the smallest "
                          "of 1, 2 and 4 that holds them, so a lone request pays for 1 row "
                          "(the int8 GEMV tiles serve those windows); auto = 1 with int8 "
                          "activations, else 8."),
        click.option("--decode-ahead", type=click.Choice(["auto", "on", "off"]),
                     default="auto", show_default=True,
                     help="Send the next window while the one before it computes, decode "
                          "rows reading the tokens it samples where the stage picked them (on "
                          "a GPU, on the device), so the stage need not wait for the "
                          "coordinator between windows. Needs one stage, one group and no "
                          "drafts; a decode window with a request that has a grammar or "
                          "penalties waits instead. auto = on where the launch allows it."),
        click.option("--chunk-rows", default="auto", show_default=True,
                     help=f"Rows of a prompt chunk (one slot's prompt tokens), or auto = "
                          f"{GPU_CHUNK_ROWS} when every stage is on a CUDA device (a chunk "
                          f"costs about what a decode window does: fewer, larger chunks read "
                          f"prompts faster), else {DEFAULT_CHUNK_ROWS}."),
        click.option("--draft-tokens", default="0", show_default=True,
                     help=f"Draft tokens a decoding slot may verify in its decode window, "
                          f"0 (off) to {MAX_DRAFT_TOKENS}: the same tokens in fewer windows "
                          f"where the drafts are right; or auto = per group of slots, the "
                          f"number (0 included) with the most tokens per second by the "
                          f"group's measured window times and acceptance."),
        click.option("--draft-rows", default="auto", show_default=True,
                     help=f"The most rows drafts may add to a decode window beyond its "
                          f"decoding slots rounded up to 8: a multiple of 8 from 0 to "
                          f"{MAX_WINDOW_ROWS - WINDOW_ROW_STEP} (0: only the pad rows), or auto "
                          f"= on CUDA stages up to the window's row tile ({DRAFT_TILES[0]} rows "
                          f"while the slots take at most {DRAFT_TILES[0]}, else "
                          f"{DRAFT_TILES[1]}), on CPU stages (which compute every row) 0. When "
                          f"the slots want more, the rows go to the slots whose drafts are "
                          f"kept most often."),
        click.option("--drafter", type=click.Choice(DRAFTERS), default=None,
                     help="Where drafts come from: mtp = the model's NextN head on the last "
                          "stage (in the model file, or --mtp-head), lookup = prompt lookup "
                          "(what followed the last tokens earlier in the text). Default when "
                          "drafting: mtp where there is a head, else lookup."),
        click.option("--draft-sampling", type=click.Choice(DRAFT_SAMPLINGS), default="argmax",
                     show_default=True,
                     help="How the mtp drafter proposes for a request with a temperature: "
                          "argmax = the head's most likely token; coupled = drawn from the "
                          "head's distribution with the draw the target will use at that "
                          "position (kept more often where the head's distribution is close "
                          "to the target's; picked inside the drafter's graph, with top-k, "
                          "top-p or min-p among the head's 128 most likely tokens). "
                          "Greedy requests always take the argmax."),
        click.option("--mtp-head", type=click.Path(dir_okay=False), default=None,
                     help="A NextN head GGUF made for the model (a sidecar), for --drafter "
                          "mtp; without it, the model file's own NextN layer if it has one."),
        click.option("--graph-cache", type=int, default=16, show_default=True,
                     help="CUDA graphs kept per stage, one per window shape (0: always eager)."),
        click.option("--weights", type=click.Choice(["auto", "quantized", "bf16"]),
                     default="auto", show_default=True,
                     help="How CUDA stages hold a quantized file's matrices: quantized keeps "
                          "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS "
                          "matrices in "
                          "their blocks (the file's bytes; other types are widened to bf16); "
                          "bf16 widens every matrix (2-4x the memory). auto = quantized with "
                          f"int8 activations where decode windows have at most {INT8_ROWS} rows "
                          f"and a row reads at least {MIN_BILLIONS:g} billion weights (faster "
                          "there: docs/BENCHMARKS.md), else bf16 where the stages fit their "
                          "devices so, else quantized. "
                          "CPU stages always widen to fp32."),
        click.option("--activations", type=click.Choice(ACTIVATIONS), default="auto",
                     show_default=True,
                     help="What CUDA stages' decode windows multiply quantized weights with: "
                          "float, the rows in bf16 against the weights dequantized; int8, each "
                          "row quantized to int8 (a scale per 32 values) and integer block "
                          "sums (a different arithmetic, the same for every window size; "
                          "docs/GPU.md). int8 needs --weights quantized (or auto that keeps "
                          f"blocks) and CUDA stages. auto = int8 where the weights stay "
                          f"quantized on a CUDA stage and no decode window has more than "
                          f"{INT8_ROWS} rows (--batch, its groups and a fixed count of drafts; "
                          f"drafts auto are not counted), else float."),
        click.option("--stage-link", default="auto", show_default=True,
                     type=click.Choice(["auto", "zmq", "nccl", "gloo"]),
                     help="Activations between stages: auto = nccl (GPU to GPU) when each "
                          "stage has a CUDA device of its own, else zmq frames; gloo links CPU "
                          "stages through torch.distributed (for tests). With --listen, auto "
                          "is zmq, and nccl or gloo meet through a rendezvous this launch "
                          "hosts on the --listen address: neither is authenticated or "
                          "encrypted, so they take no --keys (beyond loopback, --insecure)."),
        click.option("--stage-timeout", type=float, default=None,
                     help=f"Seconds after which a stage that does not answer its heartbeats, "
                          f"or a window that does not come back, is taken for hung: every "
                          f"request then fails, naming the stage. Default: twice the slowest "
                          f"window seen so far plus {MARGIN_S:g} s, and at least {FLOOR_S:g} s "
                          f"(a long prompt chunk is no hang); {FIRST_S:g} s until a window "
                          f"has come back, and while a decode window of a row count not seen "
                          f"back yet is in flight (it may compile kernels and capture a CUDA "
                          f"graph)."),
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
    graph_cache: int = 16
    weights: str = "quantized"     # resolved: quantized or bf16
    activations: str = "float"     # float or int8 (CUDA stages over quantized weights)
    link: str = "zmq"
    transport: str = "unix"
    mtp_head: Path | None = None   # a sidecar head for the last stage's drafter
    stage_timeout: float | None = None   # seconds; None: liveness.py's default

    def launch(self, **kwargs):
        """The stages of this plan, as a context manager (see session.launch_stages)."""
        from strata.launch.session import launch_stages
        return launch_stages(self.file, self.plan, slots=self.sched.slots, ctx=self.sched.ctx,
                             graph_cache=self.graph_cache, weights=self.weights,
                             activations=self.activations, link=self.link,
                             transport=self.transport, mtp_head=self.mtp_head,
                             stage_timeout=self.stage_timeout, **kwargs)


def prepare(model, layer_split, devices, ctx_size, batch, batch_groups, window_rows,
            chunk_rows, graph_cache=16, stage_link="auto", transport="unix", draft_tokens=0,
            drafter=None, mtp_head=None, draft_rows="auto", draft_sampling="argmax",
            stage_timeout=None, cuda_devices=None, check_memory=True, weights="auto",
            activations="auto", min_window_rows="auto", decode_ahead="auto",
            **_) -> Prepared:
    """Check everything that can be checked before a process starts. The values are checked
    by the configs that take them (SchedulerConfig, the stages' settings); clean_errors names
    the flags. cuda_devices: the CUDA devices the stages may have (None: this host's);
    check_memory: whether this host's memory must hold the stages (not where a cluster
    places them)."""
    from strata.stage_worker.config import check_stage_settings
    groups = _number_or_auto("--batch-groups", batch_groups)
    window_rows = _number_or_auto("--window-rows", window_rows)
    chunk_rows = _number_or_auto("--chunk-rows", chunk_rows)
    draft_tokens = _number_or_auto("--draft-tokens", draft_tokens)
    draft_tokens = AUTO if draft_tokens is None else draft_tokens
    draft_rows = _number_or_auto("--draft-rows", draft_rows)
    min_window_rows = _number_or_auto("--min-window-rows", min_window_rows)
    check_stage_settings(batch, ctx_size, graph_cache)
    Liveness(stage_timeout)   # refuses a timeout that is not a positive number of seconds
    file = open_model(model, ctx_size)
    if cuda_devices is None:
        cuda_devices = cuda_count()
    device_list = parse_devices(devices, cuda_devices)
    plan = plan_stages(layer_split, device_list, file.config.n_layers,
                       balance_bytes(file, device_list, weights) if layer_split == "auto"
                       else None)
    if groups is None:
        groups = auto_groups(batch, len(plan))
    if chunk_rows is None:
        chunk_rows = auto_chunk_rows(plan)
    if draft_rows is None:
        draft_rows = auto_draft_rows(plan)
    sched = SchedulerConfig(slots=batch, groups=groups, window_rows=window_rows,
                            # until the activations are resolved below
                            min_window_rows=resolve_min_window_rows(min_window_rows, "float"),
                            chunk_rows=chunk_rows, ctx=ctx_size,
                            draft_tokens=draft_tokens, drafter=drafter or "lookup",
                            draft_rows=draft_rows,
                            draft_sampling=draft_sampling,
                            prompt_depth=len(plan) + 1)  # + 1: the next chunk waits at stage 0
    sched = replace(sched, decode_ahead=resolve_decode_ahead(decode_ahead, len(plan), sched))
    drafter, sidecar = choose_drafter(file, draft_tokens, drafter, mtp_head)
    sched = replace(sched, drafter=drafter)
    weights = resolve_weights(weights, activations, plan, sched, file)
    if check_memory:
        source = find_head(file, str(sidecar) if sidecar else None, shipped=False)
        head = None   # the last stage's drafter, if it will have one
        if source is not None:
            try:
                head = (open_head(source, file), source.block)
            except ModelError:
                pass   # a head that does not fit: its stage refuses it with the sentence
        weights = check_fits(file, plan, batch, ctx_size, weights, head=head)
    elif weights == "auto":
        weights = "bf16"   # where a cluster places the stages, their memory is not seen here
    activations = resolve_activations(activations, weights, plan, sched, file)
    sched = replace(sched, min_window_rows=resolve_min_window_rows(min_window_rows, activations))
    return Prepared(file, plan, sched, graph_cache, weights, activations,
                    resolve_link(stage_link, plan), transport, sidecar, stage_timeout)


def resolve_decode_ahead(value: str, stages: int, sched: SchedulerConfig) -> bool:
    """--decode-ahead: auto is on with one stage, one group and no drafts; on refuses the
    others with a sentence."""
    why = (f"the launch has {stages} stages (the first reads the tokens the last picks)"
           if stages > 1 else f"--batch-groups is {sched.groups}" if sched.groups > 1
           else f"--draft-tokens is {sched.draft_tokens}" if sched.draft_tokens else "")
    if value == "on" and why:
        raise PlanError(f"--decode-ahead on needs one stage, one group and no drafts, but {why}; "
                        f"use --decode-ahead auto or off")
    return value != "off" and not why


def balance_bytes(file: ModelFile, devices: list[str], weights: str) -> list[int]:
    """Each layer's bytes as --layer-split auto balances them: as the first device holds
    them (the quantized blocks where they may stay so)."""
    mode = "quantized" if weights in ("auto", "quantized") else "bf16"
    sizes = layer_bytes(file, devices[0], mode)
    head = "token_embd.weight" if file.config.tied_head else "output.weight"
    sizes[0] += tensor_bytes(file, "token_embd.weight", devices[0], mode)
    sizes[-1] += tensor_bytes(file, head, devices[-1], mode)   # read by every window
    return sizes


def choose_drafter(file: ModelFile, draft_tokens: int, drafter: str | None,
                   mtp_head: str | None) -> tuple[str, Path | None]:
    """(--drafter resolved, the sidecar the last stage loads for it or None). Without
    --drafter, --draft-tokens drafts with mtp where the model has a NextN head (its own or
    --mtp-head), else with lookup, and says which on stderr. A sidecar made for another model
    is refused (find_head's sentence). A head shipped for the model counts only when drafting,
    and the last stage gets a sidecar only then: without drafts it runs no drafter."""
    head = find_head(file, mtp_head, shipped=bool(draft_tokens))
    if drafter is not None and not draft_tokens:
        raise PlanError(f"--drafter {drafter} drafts nothing with --draft-tokens 0; add "
                        f"--draft-tokens K (1 to {MAX_DRAFT_TOKENS}) or leave --drafter out")
    if drafter == "mtp" and head is None:
        raise PlanError(f"--drafter mtp needs a NextN head, and the model file "
                        f"{file.path.name} has none; pass --mtp-head PATH (a head made for "
                        f"this model) or use --drafter lookup")
    if drafter is None:
        drafter = "mtp" if head is not None else "lookup"
        if draft_tokens:
            say(f"strata: --draft-tokens {draft_tokens} drafts with "
                + (f"mtp (the NextN head in {head.describe()})" if head is not None else
                   "lookup (prompt lookup: the model has no NextN head; --mtp-head PATH "
                   "gives one)"))
    sidecar = (head.path if draft_tokens and drafter == "mtp" and head is not None
               and head.sidecar else None)
    return drafter, sidecar


def auto_chunk_rows(plan: list[StagePlan]) -> int:
    """--chunk-rows auto: GPU_CHUNK_ROWS when every stage is on a CUDA device, else the
    coordinator's default."""
    cuda = all(p.device.startswith("cuda") for p in plan)
    return GPU_CHUNK_ROWS if cuda else DEFAULT_CHUNK_ROWS


def auto_draft_rows(plan: list[StagePlan]) -> int | None:
    """--draft-rows auto: on CUDA stages, None (up to the window's row tile: a window of up to
    32 rows costs about what one of 8 does there); CPU stages compute every row, in blocks of
    8, so there drafts take only the pad rows (0)."""
    return None if all(p.device.startswith("cuda") for p in plan) else 0


def _number_or_auto(flag: str, value) -> int | None:
    """An int, or None for auto."""
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise PlanError(f"{flag} {value!r} is not a number or auto") from None


def parse_devices_for(devices: str) -> list[str]:
    return parse_devices(devices, cuda_count())


# the library's config fields as strata-launch's flags, and the choices only the CLI offers
FLAGS = {"slots": "--batch", "groups": "--batch-groups", "window_rows": "--window-rows",
         "chunk_rows": "--chunk-rows", "ctx": "--ctx-size", "draft_tokens": "--draft-tokens",
         "drafter": "--drafter", "draft_rows": "--draft-rows",
         "draft_sampling": "--draft-sampling",
         "graph_cache": "--graph-cache", "port": "--port", "api_key": "--api-key",
         "served_model_name": "--served-model-name",
         "read_timeout": "--read-timeout", "max_connections": "--max-connections",
         "max_client_connections": "--max-client-connections",
         "stage_timeout": "--stage-timeout", "activations": "--activations",
         "min_window_rows": "--min-window-rows", "decode_ahead": "--decode-ahead"}
CHOICES = {"groups": "auto", "window_rows": "auto", "chunk_rows": "auto", "draft_rows": "auto"}


def clean_errors(command_name: str):
    """Decorator: a user's mistake ends the command with its sentence and exit 2, a failed
    stage with exit 1; never with a traceback."""
    import functools
    import sys

    from strata.coordinator.sequence import RequestError
    from strata.coordinator.stages.pipeline import PipelineError, WindowFailed

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
