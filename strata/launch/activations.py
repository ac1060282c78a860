"""--weights auto, --activations and --min-window-rows resolved for a plan: whether CUDA stages
keep a quantized file's matrices in their blocks, what they multiply them with (docs/GPU.md,
"Int8 activations"), and the fewest rows of a decode window."""
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
# --weights auto keeps the blocks (and int8 activations) where a decode row reads at least this
# many billion weights and no window passes INT8_ROWS, else widens to bf16 where it fits. On
# one H100, Q4_K_M files, the blocks against bf16 (docs/BENCHMARKS.md, "Quantized weights"):
# the llama3-8b shape at batch 16, 1.81x, 1.28x, 1.12x and 0.95x at 1, 4, 8 and 16 clients;
# llama3-1b at batch 8, 1.31x and 0.90x at 1 and 8; SmolLM2-135M at batch 8, 0.68x and 0.40x
# (its small matrices: the kernels' latency, not their bytes, sets the time). Widening the
# first two would lose more where few clients decode (0.55x, 0.76x) than keeping the blocks
# loses at a full batch
MIN_BILLIONS = 1.0


def largest_window(sched: SchedulerConfig) -> int:
    """The most rows a decode window of this launch takes as the auto rules count them: a
    group's slots and each one's drafts, rounded up to WINDOW_ROW_STEP, within the windows'
    bound (--window-rows, and with drafts what they may add). --draft-tokens auto's drafts are
    left out: auto drafts only as many as its measured windows say are faster, none where
    proposals are seldom kept, so its windows are the slots' own wherever drafts do not pay
    (and the int8 kernels lose little on larger ones, while the float kernels take about twice
    int8's time on windows of a few rows)."""
    drafts = sched.draft_tokens if sched.draft_tokens and not sched.auto_drafts else 0
    bound = (sched.draft_window_rows(sched.window_rows) if drafts else sched.window_rows)
    return min(round_rows(sched.slots // sched.groups * (1 + drafts)), bound)


def packs_matrices(file: ModelFile) -> bool:
    """Whether the file has a matrix of a type the quantized kernels keep in its blocks."""
    return any(len(t.shape) >= 2 and t.tensor_type.name in KERNEL_TYPES
               for t in file.tensors.values())


def row_weights(file: ModelFile) -> float:
    """Billions of weights a decode row reads: the layers' matrices (routed experts' at the
    share a row takes) and the head (the token embedding where tied; the embedding itself is
    a lookup). A NextN block past the layers is left out."""
    cfg = file.config
    total = 0
    for name, t in file.tensors.items():
        block = name.split(".")[1] if name.startswith("blk.") else None
        if (len(t.shape) < 2 or name == "token_embd.weight"
                or (block is not None and int(block) >= cfg.n_layers)):
            continue
        n = int(t.n_elements)
        if "_exps." in name and cfg.n_experts:
            n = n * cfg.n_experts_used // cfg.n_experts
        total += n
    if cfg.tied_head:
        total += int(file.tensors["token_embd.weight"].n_elements)
    return total / 1e9


def resolve_weights(weights: str, activations: str, plan: list[StagePlan],
                    sched: SchedulerConfig, file: ModelFile) -> str:
    """--weights before memory.check_fits: auto on a CUDA stage is quantized where int8
    activations are asked for, or (activations auto) where the file has matrices the kernels
    keep in blocks, no decode window has more than INT8_ROWS rows and a row reads at least
    MIN_BILLIONS billion weights; otherwise auto stays (bf16 where it fits, else quantized)."""
    if weights != "auto" or activations == "float" or all(p.device == "cpu" for p in plan):
        return weights
    if activations == "int8":
        return "quantized"
    keep = (largest_window(sched) <= INT8_ROWS and row_weights(file) >= MIN_BILLIONS
            and packs_matrices(file))
    return "quantized" if keep else weights


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
