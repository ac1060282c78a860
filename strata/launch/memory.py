"""Will the KV cache fit? Checked before any stage starts, so --batch too large gets a sentence
saying how many slots fit instead of a stage dying out of memory."""
from __future__ import annotations

from strata.launch.plan import PlanError, StagePlan
from strata.model.gguf_file import ModelConfig

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


def weight_bytes(cfg: ModelConfig, layers: int, first: bool, last: bool, elem: int = 4) -> int:
    d, h = cfg.d_model, cfg.head_dim
    per_layer = d * (cfg.n_heads * h + 2 * cfg.n_kv_heads * h) + cfg.n_heads * h * d \
        + 3 * d * cfg.d_ffn + 2 * d
    return elem * (layers * per_layer + (cfg.vocab * d if first else 0)
                   + ((cfg.vocab * d + d) if last else 0))


def check_fits(cfg: ModelConfig, plan: list[StagePlan], slots: int, ctx: int,
               available=device_available) -> None:
    """Raise PlanError when the stages on some device would not fit with `slots` slots."""
    by_device: dict[str, list[StagePlan]] = {}
    for p in plan:
        by_device.setdefault(p.device, []).append(p)
    for device, stages in by_device.items():
        elem = 4 if device == "cpu" else 2  # fp32 on CPU stages, bf16 on CUDA stages
        layers = sum(p.layer_end - p.layer_start for p in stages)
        weights = sum(weight_bytes(cfg, p.layer_end - p.layer_start, p.layer_start == 0,
                                   p.layer_end == cfg.n_layers, elem) for p in stages)
        per_slot = kv_bytes_per_slot(cfg, layers, ctx, elem)
        budget = int(available(device) * HEADROOM) - weights
        fit = max(0, budget // per_slot)
        if slots > fit:
            raise PlanError(f"--batch {slots} needs {slots * per_slot / 2**30:.1f} GiB of KV cache "
                            f"on {device} (--ctx-size {ctx}), beside {weights / 2**30:.1f} GiB of "
                            f"weights; {fit} slot(s) fit: use --batch {fit} or less, or a "
                            f"smaller --ctx-size")
