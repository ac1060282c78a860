"""--activations and --min-window-rows resolved for a plan: what CUDA stages multiply quantized
weights with (docs/GPU.md, "Int8 activations"), and the fewest rows of a decode window."""
from __future__ import annotations

from strata.config_error import ConfigError
from strata.coordinator.config import WINDOW_ROW_STEP, SchedulerConfig, round_rows
from strata.kernels.quant.blocks import KERNEL_TYPES
from strata.launch.plan import StagePlan
from strata.model.gguf_file import ModelFile

ACTIVATIONS = ("auto", "float", "int8")
# --activations auto takes int8 where a launch's decode windows have at most this many rows:
# up to 16 rows the int8 kernels decode faster than the float ones on the same file, past it
# slower on a dense model (docs/BENCHMARKS.md, "Quantized weights")
INT8_ROWS = 16


def largest_window(sched: SchedulerConfig) -> int:
    """The most rows a decode window of this launch takes: a group's slots and each one's
    drafts, rounded up to WINDOW_ROW_STEP, within the windows' bound (--window-rows, and with
    drafts what they may add)."""
    drafts = sched.max_draft_tokens if sched.draft_tokens else 0
    bound = (sched.draft_window_rows(sched.window_rows) if drafts else sched.window_rows)
    return min(round_rows(sched.slots // sched.groups * (1 + drafts)), bound)


def packs_matrices(file: ModelFile) -> bool:
    """Whether the file has a matrix of a type the quantized kernels keep in its blocks."""
    return any(len(t.shape) >= 2 and t.tensor_type.name in KERNEL_TYPES
               for t in file.tensors.values())


def resolve_activations(activations: str, weights: str, plan: list[StagePlan],
                        sched: SchedulerConfig, file: ModelFile) -> str:
    """float or int8. int8 needs quantized weights on a CUDA stage (else a sentence); auto is
    int8 where the weights stay quantized on a CUDA stage, the file has matrices they keep in
    blocks, and no decode window has more than INT8_ROWS rows; else float."""
    if activations not in ACTIVATIONS:
        raise ConfigError("activations", f"{{activations}} {activations!r} is not "
                          f"{', '.join(ACTIVATIONS[:-1])} or {ACTIVATIONS[-1]}")
    cuda = any(p.device != "cpu" for p in plan)
    if activations == "auto":
        small = largest_window(sched) <= INT8_ROWS
        return "int8" if (cuda and weights == "quantized" and small
                          and packs_matrices(file)) else "float"
    if activations == "int8" and not cuda:
        raise ConfigError("activations", "{activations} int8 runs on CUDA stages, and every "
                          "stage is on the CPU (which computes in fp32)",
                          "give CUDA --devices, or leave {activations} out")
    if activations == "int8" and weights != "quantized":
        raise ConfigError("activations", "{activations} int8 multiplies quantized weights, and "
                          f"the stages widen them to {weights}",
                          "add --weights quantized, or leave {activations} out")
    return activations


def resolve_min_window_rows(value: int | None, activations: str) -> int:
    """--min-window-rows: auto (None) is 1 with int8 activations (a lone request's window
    takes the GEMV's 1-row tile), else WINDOW_ROW_STEP."""
    if value is not None:
        return value
    return 1 if activations == "int8" else WINDOW_ROW_STEP
