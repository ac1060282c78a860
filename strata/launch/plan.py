"""Turning --layer-split, --devices and --stage-link into stages, with a sentence for every
mistake."""
from __future__ import annotations

import re
from dataclasses import dataclass


class PlanError(ValueError):
    """A --layer-split / --devices combination that cannot run; the message says what to change."""


@dataclass(frozen=True)
class StagePlan:
    index: int
    layer_start: int
    layer_end: int
    device: str


def parse_devices(text: str, cuda_count: int) -> list[str]:
    """'auto' | 'cpu' | 'cuda:0,cuda:1' | 'cpu,cpu' -> device names, checked."""
    if text == "auto":
        return [f"cuda:{i}" for i in range(cuda_count)] or ["cpu"]
    devices = [d.strip() for d in text.split(",") if d.strip()]
    if not devices:
        raise PlanError("--devices is empty; use auto, cpu, or a list like cuda:0,cuda:1")
    for d in devices:
        if d == "cpu":
            continue
        m = re.fullmatch(r"cuda(?::(\d+))?", d)
        if m is None:
            raise PlanError(f"unknown device {d!r}; use cpu or cuda:N (e.g. --devices cuda:0,cuda:1)")
        index = int(m.group(1) or 0)
        if index >= cuda_count:
            have = f"only {cuda_count} CUDA device(s)" if cuda_count else "no CUDA device"
            raise PlanError(f"device {d!r} does not exist: this machine has {have}")
    return devices


def plan_stages(split: str, devices: list[str], n_layers: int,
                layer_bytes: list[int] | None = None) -> list[StagePlan]:
    """split: 'auto' (one stage per device, layers spread evenly, by their bytes when
    layer_bytes gives them: a file whose layers differ in type, e.g. Q6_K ones among Q4_K)
    or boundaries 'K1,K2,..'."""
    if split == "auto":
        n = len(devices)
        if n > n_layers:
            raise PlanError(f"{n} stages for a model of {n_layers} layers: every stage needs at "
                            f"least one layer; use fewer devices")
        bounds = balanced_bounds(layer_bytes or [1] * n_layers, n)
    else:
        try:
            bounds = [int(x) for x in split.split(",") if x.strip()]
        except ValueError:
            raise PlanError(f"--layer-split {split!r} is not 'auto' or a list of layer numbers "
                            f"like 12,24") from None
        if len(bounds) + 1 > n_layers:
            raise PlanError(f"--layer-split {split} makes {len(bounds) + 1} stages for a model of "
                            f"{n_layers} layers: every stage needs at least one layer; give at "
                            f"most {n_layers - 1} boundaries")
        for b in bounds:
            if not 0 < b < n_layers:
                raise PlanError(f"--layer-split boundary {b} is out of range: boundaries lie "
                                f"between 1 and {n_layers - 1} for a model of {n_layers} layers")
        if any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise PlanError(f"--layer-split {split}: boundaries must increase, e.g. "
                            f"{round(n_layers / 3)},{round(2 * n_layers / 3)} for a model of "
                            f"{n_layers} layers")
    edges = [0] + bounds + [n_layers]
    n_stages = len(edges) - 1
    if len(devices) not in (1, n_stages):
        raise PlanError(f"{len(devices)} devices for {n_stages} stages: give one device for all "
                        f"stages or one per stage")
    stage_devices = devices * n_stages if len(devices) == 1 else devices
    return [StagePlan(i, edges[i], edges[i + 1], stage_devices[i]) for i in range(n_stages)]


def balanced_bounds(sizes: list[int], n: int) -> list[int]:
    """n - 1 increasing boundaries splitting sizes into n runs of at least one item each:
    boundary k where the running total comes nearest k / n of the whole (a tie: where
    round(k * items / n) puts it, so equal layers split as they always have)."""
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    bounds: list[int] = []
    for k in range(1, n):
        low = (bounds[-1] if bounds else 0) + 1
        high = len(sizes) - (n - k)          # leave a layer for each stage after this one
        target = prefix[-1] * k / n
        even = round(k * len(sizes) / n)
        bounds.append(min(range(low, high + 1),
                          key=lambda c: (abs(prefix[c] - target), abs(c - even))))
    return bounds


LINKS = ("auto", "zmq", "nccl", "gloo")


def resolve_link(link: str, plan: list[StagePlan], across_hosts: bool = False) -> str:
    """--stage-link: how activations go between stages. auto = nccl when there are several
    stages, each on a CUDA device of its own (one host), else ZeroMQ frames. across_hosts
    (stages join from other hosts): auto is ZeroMQ frames; nccl and gloo meet through the
    launcher's TCPStore (joins.py), and two stages may name the same GPU (on two hosts)."""
    devices = {p.device.split(":")[0] for p in plan}
    gpus = {p.device if ":" in p.device else p.device + ":0" for p in plan}
    shared = len(gpus) < len(plan) and not across_hosts  # NCCL refuses two ranks on one GPU
    if link not in LINKS:
        raise PlanError(f"--stage-link {link!r} is not one of {', '.join(LINKS)}")
    if link == "auto":
        if across_hosts:
            return "zmq"
        return "nccl" if len(plan) > 1 and devices == {"cuda"} and not shared else "zmq"
    if not plan:
        return link   # not planned yet (--cluster checks the name first)
    if len(plan) == 1:
        return "zmq"  # nothing to link
    if link == "nccl" and devices != {"cuda"}:
        raise PlanError("--stage-link nccl needs every stage on a CUDA device; use zmq (or "
                        "auto) when a stage runs on the CPU")
    if link == "nccl" and shared:
        raise PlanError("--stage-link nccl needs one GPU per stage (NCCL refuses two on one "
                        "device); use zmq (or auto) when stages share a GPU")
    if link == "gloo" and devices != {"cpu"}:
        raise PlanError("--stage-link gloo links CPU stages; use nccl (or auto) for CUDA stages")
    return link
