"""Running many prompts through a launch: the exactness harness (alone vs together) and the
throughput measurement (concurrent clients), shared by strata-bench and the tests."""
from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field

from strata.coordinator.sampling import SamplingParams
from strata.coordinator.scheduler import Request, Scheduler, SchedulerConfig
from strata.launch.session import Launched

# A mix of lengths and kinds; the long one spans several prompt chunks.
PROMPTS = [
    "The capital of France is",
    "def quicksort(items):\n    ",
    "Once upon a time, in a village between two rivers, there lived",
    "<|im_start|>user\nName three prime numbers.<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at",
    "The three laws of thermodynamics say that",
    "import numpy as np\n\ndef moving_average(x, window):\n    ",
    "Les trois couleurs du drapeau français sont",
    "A haiku about autumn leaves:\n",
    "Q: What is 17 times 23?\nA:",
    "The quick brown fox",
    "In 1969, the first humans to walk on the Moon were",
    " ".join(["The history of the lighthouse begins with fires lit on hills to guide ships."] * 6),
    "My favourite recipe for bread needs flour, water,",
    "SELECT name, COUNT(*) FROM orders",
    "Dear team, thank you for",
]


def machine() -> str:
    """The conditions every benchmark prints beside its figures."""
    import torch
    return (f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}")


def prompt_set(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" (variant {i})")
            for i in range(n)]


def request_params(i: int, sampled: bool, max_tokens: int) -> SamplingParams:
    if not sampled:
        return SamplingParams(max_tokens=max_tokens)
    return SamplingParams(temperature=0.7, top_k=20, seed=1000 + i, max_tokens=max_tokens)


def run_together(run: Launched, cfg: SchedulerConfig, tok, prompts: list[list[int]],
                 params: list[SamplingParams]) -> list[Request]:
    sched = Scheduler(run.pipe, cfg, tok.stop_ids, tok.decode)
    reqs = [sched.submit(p, sp) for p, sp in zip(prompts, params)]
    sched.run()
    return reqs


def run_alone(run: Launched, cfg: SchedulerConfig, tok, prompts: list[list[int]],
              params: list[SamplingParams]) -> list[Request]:
    sched = Scheduler(run.pipe, cfg, tok.stop_ids, tok.decode)
    out = []
    for p, sp in zip(prompts, params):
        out.append(sched.submit(p, sp))
        sched.run()
    return out


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class Throughput:
    clients: int
    tokens: int
    seconds: float
    ttft: list[float]
    per_request: list[float]
    requests: list[Request] = field(default_factory=list, repr=False)

    @property
    def total_tok_s(self) -> float:
        return self.tokens / self.seconds


def measure_throughput(run: Launched, cfg: SchedulerConfig, tok, clients: int,
                       max_tokens: int) -> Throughput:
    """`clients` requests arrive at once; each decodes exactly max_tokens tokens (no EOS)."""
    sched = Scheduler(run.pipe, cfg, frozenset(), tok.decode)
    start = time.perf_counter()
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    reqs = []
    for i, text in enumerate(prompt_set(clients)):
        def on_token(t, i=i):
            now = time.perf_counter()
            first.setdefault(i, now)
            last[i] = now
        reqs.append(sched.submit(tok.encode(text), SamplingParams(max_tokens=max_tokens),
                                 on_token=on_token))
    sched.run()
    seconds = time.perf_counter() - start
    tokens = sum(len(r.seq.generated) for r in reqs)
    per_request = [(len(r.seq.generated) - 1) / (last[i] - first[i])
                   for i, r in enumerate(reqs) if len(r.seq.generated) > 1 and last[i] > first[i]]
    return Throughput(clients, tokens, seconds, [first[i] - start for i in first], per_request,
                      reqs)
