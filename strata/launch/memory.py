"""Will the weights and the KV cache fit? Checked before any stage starts (by the bytes each
stage will hold, from the file's tensor types), so a split, --batch or --ctx-size too large
gets a sentence with the numbers instead of a stage dying out of memory."""
from __future__ import annotations

from strata.launch.plan import PlanError, StagePlan
from strata.model.gguf_file import ModelConfig, ModelFile

HEADROOM = 0.85  # of the memory available, what strata may plan to use


def cpu_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def device_available(device: str) -> int:
    if device == "cpu":
        return cpu_available()
    import torch
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return free


def kv_bytes_per_slot(cfg: ModelConfig, layers: int, ctx: int, elem: int = 4) -> int:
    return 2 * layers * cfg.n_kv_heads * ctx * cfg.head_dim * elem


def stage_tensors(file: ModelFile, start: int, end: int) -> list[str]:
    """The file's tensors a stage of layers [start, end) loads (its blocks, the embedding on
    the first stage, the final norm and head on the last)."""
    n = file.config.n_layers
    names = [t for t in file.tensors if any(t.startswith(f"blk.{i}.") for i in range(start, end))]
    if start == 0:
        names.append("token_embd.weight")
    if end == n:
        names.append("output_norm.weight")
        if not file.config.tied_head:
            names.append("output.weight")
        elif start != 0:
            names.append("token_embd.weight")
    return names


def tensor_bytes(file: ModelFile, name: str, device: str, weights: str) -> int:
    """A tensor's bytes on `device` with --weights `weights` (stage_worker/weights.py's rules:
    a matrix of a kernel type stays packed on CUDA with quantized; the rest is fp32 on a CPU
    and bf16 on CUDA)."""
    from strata.kernels.blocks import KERNEL_TYPES
    t = file.tensors[name]
    if device != "cpu" and weights == "quantized" and len(t.shape) == 2 \
            and t.tensor_type.name in KERNEL_TYPES:
        return int(t.n_bytes)
    return int(t.n_elements) * (4 if device == "cpu" else 2)


def stage_bytes(file: ModelFile, start: int, end: int, device: str, weights: str
                ) -> tuple[int, int]:
    """(weights, scratch) bytes a stage holds on `device`: the scratch, where its layers are
    packed, holds the largest fused layer matrix a prompt chunk dequantizes."""
    names = stage_tensors(file, start, end)
    total = sum(tensor_bytes(file, n, device, weights) for n in names)
    cfg = file.config
    from strata.kernels.blocks import KERNEL_TYPES
    packed = device != "cpu" and weights == "quantized" and any(
        n.startswith("blk.") and file.tensors[n].tensor_type.name in KERNEL_TYPES
        for n in names if len(file.tensors[n].shape) == 2)
    if not packed:
        return total, 0
    largest = max((cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim * cfg.d_model,
                  2 * cfg.d_ffn * cfg.d_model, cfg.n_heads * cfg.head_dim * cfg.d_model)
    return total, 2 * largest


def layer_bytes(file: ModelFile, device: str, weights: str) -> list[int]:
    """Each layer's weight bytes on `device` (what --layer-split auto balances)."""
    per = [0] * file.config.n_layers
    for name in file.tensors:
        if name.startswith("blk."):
            i = int(name.split(".")[1])
            if i < len(per):
                per[i] += tensor_bytes(file, name, device, weights)
    return per


def check_fits(file: ModelFile, plan: list[StagePlan], slots: int, ctx: int,
               weights: str = "auto", available=device_available) -> str:
    """Raise PlanError when the stages on some device would not fit with `slots` slots; else
    return --weights resolved: auto is bf16 where every CUDA stage's widened matrices fit
    (the faster decode today: docs/BENCHMARKS.md), else quantized."""
    if weights == "auto":
        weights = "quantized"
        if any(p.device != "cpu" for p in plan):
            try:
                _check(file, plan, slots, ctx, "bf16", available)
                return "bf16"
            except PlanError:
                pass
    _check(file, plan, slots, ctx, weights, available)
    return weights


def _check(file: ModelFile, plan: list[StagePlan], slots: int, ctx: int, weights: str,
           available) -> None:
    cfg = file.config
    by_device: dict[str, list[StagePlan]] = {}
    for p in plan:
        by_device.setdefault(p.device, []).append(p)
    for device, stages in by_device.items():
        elem = 4 if device == "cpu" else 2  # fp32 on CPU stages, bf16 on CUDA stages
        layers = sum(p.layer_end - p.layer_start for p in stages)
        held = [stage_bytes(file, p.layer_start, p.layer_end, device, weights) for p in stages]
        weight = sum(w + s for w, s in held)
        per_slot = kv_bytes_per_slot(cfg, layers, ctx, elem)
        free = available(device)
        budget = int(free * HEADROOM) - weight
        fit = max(0, budget // per_slot)
        what = f"--weights {weights}, " if device != "cpu" else ""
        if budget <= 0:
            raise PlanError(f"the stages on {device} need {weight / 2**30:.1f} GiB of weights "
                            f"({what}layers {', '.join(f'{p.layer_start}-{p.layer_end - 1}' for p in stages)}) "
                            f"and {device} has {free / 2**30:.1f} GiB free ({HEADROOM:.0%} of "
                            f"it usable): spread the layers over more devices (--devices, "
                            f"--layer-split)" + ("" if weights == "quantized" or device == "cpu"
                                                  else " or keep them quantized (--weights "
                                                       "quantized)"))
        if slots > fit:
            raise PlanError(f"--batch {slots} needs {slots * per_slot / 2**30:.1f} GiB of KV cache "
                            f"on {device} (--ctx-size {ctx}), beside {weight / 2**30:.1f} GiB of "
                            f"weights ({what.rstrip(', ') or 'fp32'}); {fit} slot(s) fit: use "
                            f"--batch {fit} or less, or a smaller --ctx-size")
