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


def prompt_ids(tok, clients: int, length: int) -> list[list[int]]:
    """`clients` prompts of exactly `length` tokens each (as llama-batched-bench's -npp): the
    harness's texts, each repeated until long enough, then cut."""
    prompts = []
    for text in prompt_set(clients):
        ids = tok.encode(text)
        assert ids, text
        prompts.append((ids * -(-length // len(ids)))[:length])
    return prompts


@dataclass
class Throughput:
    """One run of concurrent clients. The decode phase runs from the moment every prompt has
    been read (the last request's first token) to the last token: llama.cpp's T_TG, whose
    clients all decode from its start. decode_tokens are the tokens sampled in it."""
    clients: int
    tokens: int              # generated, all requests
    seconds: float           # from the first submit to the last token
    ttft: list[float]
    per_request: list[float]
    requests: list[Request] = field(default_factory=list, repr=False)
    prompt_tokens: int = 0   # read, all requests
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_windows: int = 0  # windows of decoding slots sent (each group's, all of them)

    @property
    def drafted(self) -> int:
        """Draft tokens verified in windows, all requests."""
        return sum(r.drafted for r in self.requests)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.requests)

    @property
    def tokens_per_window(self) -> float:
        """Tokens a decode window gives, all its slots: the tokens after each request's first
        (which its prompt's last chunk samples) over the decode windows."""
        return (self.tokens - self.clients) / self.decode_windows if self.decode_windows else 0.0

    @property
    def total_tok_s(self) -> float:
        """Generated tokens per second over the whole run."""
        return self.tokens / self.seconds

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second in the decode phase (llama-batched-bench's S_TG)."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def prompt_and_generated_tok_s(self) -> float:
        """Prompt and generated tokens per second over the whole run (llama-batched-bench's S)."""
        return (self.prompt_tokens + self.tokens) / self.seconds


def measure_throughput(run: Launched, cfg: SchedulerConfig, tok, clients: int,
                       max_tokens: int, prompt_tokens: int | None = None) -> Throughput:
    """`clients` requests arrive at once; each decodes exactly max_tokens tokens (no EOS).
    Prompts: the harness's texts, or with prompt_tokens, prompt_ids of that length."""
    pipe = CountingPipe(run.pipe)
    sched = Scheduler(pipe, cfg, frozenset(), tok.decode)
    prompts = (prompt_ids(tok, clients, prompt_tokens) if prompt_tokens
               else [tok.encode(text) for text in prompt_set(clients)])
    start = time.perf_counter()
    stamps: list[list[float]] = [[] for _ in prompts]  # each request's token arrival times
    reqs = [sched.submit(p, SamplingParams(max_tokens=max_tokens),
                         on_token=lambda t, i=i: stamps[i].append(time.perf_counter()))
            for i, p in enumerate(prompts)]
    sched.run()
    seconds = time.perf_counter() - start
    assert all(stamps), "every request samples at least one token"
    tokens = sum(len(r.seq.generated) for r in reqs)
    per_request = [(len(s) - 1) / (s[-1] - s[0]) for s in stamps if len(s) > 1 and s[-1] > s[0]]
    decode_tokens, decode_seconds = decode_phase(stamps)
    return Throughput(clients, tokens, seconds, [s[0] - start for s in stamps], per_request,
                      reqs, prompt_tokens=sum(len(p) for p in prompts),
                      decode_tokens=decode_tokens, decode_seconds=decode_seconds,
                      decode_windows=pipe.decode_windows)


class CountingPipe:
    """A launch's Pipeline as a scheduler sees it, counting the decode windows sent."""

    def __init__(self, pipe):
        self.pipe, self.decode_windows = pipe, 0

    def new_window_id(self) -> int:
        return self.pipe.new_window_id()

    def submit(self, w) -> None:
        self.pipe.submit(w)
        self.decode_windows += not w.chunk and any(s >= 0 for s in w.slots)

    def receive(self, timeout: float | None = None):
        return self.pipe.receive(timeout=timeout)


def decode_phase(stamps: list[list[float]]) -> tuple[int, float]:
    """(tokens, seconds) of the decode phase, from each request's token arrival times: from
    the last request's first token (every prompt read) to the last token."""
    read = max(s[0] for s in stamps)
    return sum(t > read for s in stamps for t in s), max(s[-1] for s in stamps) - read
