"""Will the weights and the KV cache fit? Checked before any stage starts (by the bytes each
stage will hold, from the file's tensor types), so a split, --batch or --ctx-size too large
gets a sentence with the numbers instead of a stage dying out of memory."""
from __future__ import annotations

from strata.launch.plan import PlanError, StagePlan
from strata.kernels.quant.blocks import stays_packed
from strata.model.gguf_file import FUSED_MATRICES, ModelConfig, ModelFile

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


def _groups(file: ModelFile, names: list[str]) -> list[list[str]]:
    """The stage's tensors as its loader takes them: a block's fused matrices together
    (FUSED_MATRICES), every other tensor alone."""
    by_block: dict[str, list[str]] = {}
    singles = []
    for name in names:
        parts = name.split(".")
        piece = parts[2] if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" \
            else None   # a bias (blk.N.attn_q.bias) is a vector of its own
        group = next((g for g in FUSED_MATRICES if piece in g), None)
        if group is None:
            singles.append([name])
        else:
            by_block.setdefault(f"{parts[1]}.{group[0]}", []).append(name)
    return singles + list(by_block.values())


def group_bytes(file: ModelFile, names: list[str], device: str, weights: str
                ) -> tuple[int, bool]:
    """(bytes on `device`, whether packed) of tensors the loader takes as one (a fused
    projection): packed where blocks.stays_packed says so (matrices, and an MoE layer's expert
    tensors [E, N, K]), else fp32 on a CPU and bf16 on CUDA."""
    tensors = [file.tensors[n] for n in names]
    if all(len(t.shape) == 2 or _experts(n) for t, n in zip(tensors, names)) and stays_packed(
            [t.tensor_type.name for t in tensors], weights, device != "cpu"):
        return sum(int(t.n_bytes) for t in tensors), True
    return sum(int(t.n_elements) for t in tensors) * (4 if device == "cpu" else 2), False


def _experts(name: str) -> bool:
    """An MoE layer's expert tensor (blk.N.ffn_{gate,up,down}_exps.weight): 3-D, read packed
    in place by the expert kernels, never dequantized into the scratch."""
    return name.startswith("blk.") and "_exps." in name


def tensor_bytes(file: ModelFile, name: str, device: str, weights: str) -> int:
    return group_bytes(file, [name], device, weights)[0]


def stage_bytes(file: ModelFile, start: int, end: int, device: str, weights: str
                ) -> tuple[int, int]:
    """(weights, scratch) bytes a stage holds on `device`: the scratch, where a layer matrix
    stays packed, holds the largest one a prompt chunk dequantizes (in the stage's dtype)."""
    total, largest = 0, 0
    for group in _groups(file, stage_tensors(file, start, end)):
        size, packed = group_bytes(file, group, device, weights)
        total += size
        if packed and group[0].startswith("blk.") and not _experts(group[0]):
            largest = max(largest, sum(int(file.tensors[n].n_elements) for n in group))
    return total, largest * (4 if device == "cpu" else 2)


def layer_bytes(file: ModelFile, device: str, weights: str) -> list[int]:
    """Each layer's weight bytes on `device` (what --layer-split auto balances)."""
    return [sum(group_bytes(file, g, device, weights)[0]
                for g in _groups(file, [n for n in file.tensors if n.startswith(f"blk.{i}.")]))
            for i in range(file.config.n_layers)]


def head_bytes(file: ModelFile, head: ModelFile, block: int, last: StagePlan,
               weights: str) -> int:
    """What a last stage's NextN drafter holds beside the stage (stage_worker/drafter.py):
    the head's block (blk.{block}.* of `head`, the model file or a sidecar), and the token
    embedding again where the stage holds no copy and the head brings none."""
    names = [n for n in head.tensors if n.startswith(f"blk.{block}.")]
    total = sum(group_bytes(head, g, last.device, weights)[0] for g in _groups(head, names))
    own = f"blk.{block}.nextn.embed_tokens.weight" in head.tensors
    if not own and last.layer_start != 0 and not file.config.tied_head:
        total += tensor_bytes(file, "token_embd.weight", last.device, weights)
    return total


def check_fits(file: ModelFile, plan: list[StagePlan], slots: int, ctx: int,
               weights: str = "auto", available=device_available,
               head: tuple[ModelFile, int] | None = None) -> str:
    """Raise PlanError when the stages on some device would not fit with `slots` slots; else
    return --weights resolved: auto (where activations.resolve_weights left it) is bf16
    where every CUDA stage's widened matrices fit, else quantized. head: (file, block) of
    the last stage's NextN drafter, counted with its KV cache (one layer) and each slot's
    hidden states and tokens, which it keeps."""
    if weights == "auto":
        weights = "quantized"
        if any(p.device != "cpu" for p in plan):
            try:
                _check(file, plan, slots, ctx, "bf16", available, head)
                return "bf16"
            except PlanError:
                pass
    _check(file, plan, slots, ctx, weights, available, head)
    return weights


def _check(file: ModelFile, plan: list[StagePlan], slots: int, ctx: int, weights: str,
           available, head: tuple[ModelFile, int] | None) -> None:
    cfg = file.config
    by_device: dict[str, list[StagePlan]] = {}
    for p in plan:
        by_device.setdefault(p.device, []).append(p)
    for device, stages in by_device.items():
        elem = 4 if device == "cpu" else 2  # fp32 on CPU stages, bf16 on CUDA stages
        layers = sum(p.layer_end - p.layer_start for p in stages)
        held = [stage_bytes(file, p.layer_start, p.layer_end, device, weights) for p in stages]
        weight = sum(w + s for w, s in held)
        if head is not None and plan[-1] in stages:   # the drafter: its block and its KV
            weight += head_bytes(file, *head, plan[-1], weights)
            layers += 1
        per_slot = kv_bytes_per_slot(cfg, layers, ctx, elem)
        if head is not None and plan[-1] in stages:   # the drafter's hidden states and tokens
            per_slot += ctx * (cfg.d_model * elem + 8)
        free = available(device)
        budget = int(free * HEADROOM) - weight
        fit = max(0, budget // per_slot)
        what = f"--weights {weights}, " if device != "cpu" else ""
        if budget <= 0:
            ranges = ", ".join(f"{p.layer_start}-{p.layer_end - 1}" for p in stages)
            packed = sum(sum(stage_bytes(file, p.layer_start, p.layer_end, device, "quantized"))
                         for p in stages)
            raise PlanError(f"the stages on {device} need {weight / 2**30:.1f} GiB of weights "
                            f"({what}layers {ranges}) and {device} has {free / 2**30:.1f} GiB "
                            f"free ({HEADROOM:.0%} of it usable): spread the layers over more "
                            f"devices (--devices, --layer-split)"
                            + (" or keep them quantized (--weights quantized)"
                               if device != "cpu" and packed < weight else ""))
        if slots > fit:
            raise PlanError(f"--batch {slots} needs {slots * per_slot / 2**30:.1f} GiB of KV cache "
                            f"on {device} (--ctx-size {ctx}), beside {weight / 2**30:.1f} GiB of "
                            f"weights ({what.rstrip(', ') or 'fp32'}); {fit} slot(s) fit: use "
                            f"--batch {fit} or less, or a smaller --ctx-size")
