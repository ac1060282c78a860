"""Running many prompts through a launch: the exactness harness (alone vs together) and the
throughput measurement (concurrent clients), shared by strata-bench and the tests."""
from __future__ import annotations

import platform
import time
from collections import Counter
from dataclasses import dataclass, field

import click

from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import Request, Scheduler, SchedulerConfig
from strata.launch.options import say
from strata.launch.session import Launched
from strata.model.tokenizer import Tokenizer
from strata.train import prompts as train_prompts

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


SPLITS = ("heldout", "train", "all")
# the bench commands' --split, beside their --prompts
split_option = click.option("--split", type=click.Choice(SPLITS), default="heldout",
                            show_default=True,
                            help="Which lines of --prompts to take (all: every line).")


def filter_options(command):
    """--top-k, --top-p and --min-p: the filters of every sampled request (with
    --temperature), as the command's top_k, top_p and min_p."""
    for option in reversed([
            click.option("--top-k", type=int, default=0, show_default=True,
                         help="With --temperature: keep each step's K likeliest tokens "
                              "(0 = off)."),
            click.option("--top-p", type=float, default=1.0, show_default=True,
                         help="With --temperature: keep the likeliest tokens whose mass "
                              "reaches P (1 = off)."),
            click.option("--min-p", type=float, default=0.0, show_default=True,
                         help="With --temperature: keep tokens at least P times the likeliest "
                              "one's probability (0 = off).")]):
        command = option(command)
    return command


def sampled(temperature: float, top_k: int, top_p: float, min_p: float, index: int,
            max_tokens: int) -> SamplingParams:
    """The parameters of a bench's request `index`: greedy at temperature 0, else sampled
    with the filters and seed 1000 + index. Filters without a temperature, or out of range,
    are refused with a sentence (ValueError)."""
    filters = {"--top-k": top_k != 0, "--top-p": top_p != 1.0, "--min-p": min_p != 0.0}
    if temperature <= 0 and any(filters.values()):
        given = ", ".join(name for name, on in filters.items() if on)
        raise ValueError(f"{given} filter sampled tokens, and greedy requests sample none; "
                         f"add --temperature above 0 or leave {given} out")
    if temperature <= 0:
        return SamplingParams(max_tokens=max_tokens)
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          seed=1000 + index, max_tokens=max_tokens)


def filters_said(temperature: float, top_k: int, top_p: float, min_p: float) -> str:
    """"greedy", or "temperature T" and the filters that are on, for a bench's header."""
    if temperature <= 0:
        return "greedy"
    return f"temperature {temperature}" + "".join(
        f", {name} {value}" for name, value, off in
        [("top-k", top_k, 0), ("top-p", top_p, 1.0), ("min-p", min_p, 0.0)] if value != off)


def read_prompts(path: str, split: str) -> list[str]:
    """The prompts of a JSONL file whose lines are {"prompt": TEXT, "split": "train" |
    "heldout"} (strata-train-mtp --write-prompts writes it; strata.train.prompts reads it):
    those of `split`, or every one for "all". A missing file, a malformed line or no prompt
    of the split is a ValueError with a sentence."""
    found = train_prompts.read_prompts(path)
    later = next((n for n, p in enumerate(found, 1) if p.history), None)
    if later:
        raise ValueError(f"--prompts {path}: prompt {later} is a later turn (it has a "
                         f"history); the benchmarks send one-turn prompts: write the file "
                         f"without --turns")
    prompts = [p.text for p in found if split in ("all", p.split)]
    if not prompts:
        which = "no prompt" if split == "all" else f'no line of split "{split}"'
        raise ValueError(f"--prompts {path} has {which}; "
                         + ("use --split all to take every line" if split != "all" else
                            "give a file with at least one prompt"))
    return prompts


def chat_prompts(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text as one user message through the model's chat template (as strata-launch
    --chat), or as it is when the model has none (said on stderr)."""
    try:
        return [tok.encode(tok.render_chat([{"role": "user", "content": t}])) for t in texts]
    except ValueError:   # the model has no chat template
        say("strata-bench: the model has no chat template; the prompts are read as plain text")
        return [tok.encode(t) for t in texts]


def machine() -> str:
    """The conditions every benchmark prints beside its figures."""
    import torch
    return (f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}")


def arithmetic(prep) -> str:
    """What --weights and --activations resolved to where a stage is on CUDA (", weights
    quantized, int8 activations"), for a benchmark's header; "" where every stage is on the
    CPU (fp32)."""
    if all(p.device == "cpu" for p in prep.plan):
        return ""
    return f", weights {prep.weights}, {prep.activations} activations"


def prompt_set(n: int, texts: list[str] = PROMPTS) -> list[str]:
    """n distinct prompts: `texts` in turn, marked as variants from the second round."""
    return [texts[i % len(texts)] + ("" if i < len(texts) else f" (variant {i})")
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
    # those windows by the most proposals a slot they ask the drafter for (draft_tokens auto:
    # the K chosen), and each group's last choice with the windows it had timed (DraftChoice)
    windows_by_k: dict[int, int] = field(default_factory=dict)
    choices: list[dict | None] = field(default_factory=list)

    @property
    def drafted(self) -> int:
        """Draft tokens verified in windows, all requests."""
        return sum(r.drafts.counts.drafted for r in self.requests)

    @property
    def accepted(self) -> int:
        return sum(r.drafts.counts.accepted for r in self.requests)

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


@dataclass(frozen=True)
class Workload:
    """What the concurrent clients of a throughput run send: the harness's texts, or with
    prompt_tokens each of exactly that many tokens (prompt_ids), or prompts of a pool (token
    lists: e.g. a prompts file's held-out prompts through the chat template), taken in turn
    from an offset so that repeated runs read different prompts. Greedy, or with a temperature
    (and the filters top_k, top_p, min_p), each request seeded by its prompt's place in the
    pool. Every request decodes exactly max_tokens tokens: stop tokens do not end it, so that
    every arm makes the same tokens."""
    prompt_tokens: int | None = None
    pool: tuple[tuple[int, ...], ...] = ()
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        self.params(0, 1)   # filters without a temperature or out of range: refused here

    def prompts(self, tok, clients: int, offset: int = 0) -> list[tuple[int, list[int]]]:
        """(seed index, prompt) of each of `clients` requests."""
        if self.pool:
            picks = [(offset + i) % len(self.pool) for i in range(clients)]
            return [(i, list(self.pool[i])) for i in picks]
        if self.prompt_tokens:
            return list(enumerate(prompt_ids(tok, clients, self.prompt_tokens)))
        return [(i, tok.encode(text)) for i, text in enumerate(prompt_set(clients))]

    def params(self, index: int, max_tokens: int) -> SamplingParams:
        return sampled(self.temperature, self.top_k, self.top_p, self.min_p, index,
                       max_tokens)


def measure_throughput(run: Launched, cfg: SchedulerConfig, tok, clients: int,
                       max_tokens: int, work: Workload = Workload(),
                       offset: int = 0) -> Throughput:
    """`clients` requests arrive at once; each decodes exactly max_tokens tokens (no EOS).
    Prompts and sampling: `work`, its pool read from `offset`."""
    pipe = CountingPipe(run.pipe)
    sched = Scheduler(pipe, cfg, frozenset(), tok.decode)
    prompts = work.prompts(tok, clients, offset)
    start = time.perf_counter()
    stamps: list[list[float]] = [[] for _ in prompts]  # each request's token arrival times
    reqs = [sched.submit(p, work.params(index, max_tokens),
                         on_token=lambda t, i=i: stamps[i].append(time.perf_counter()))
            for i, (index, p) in enumerate(prompts)]
    sched.run()
    seconds = time.perf_counter() - start
    assert all(stamps), "every request samples at least one token"
    tokens = sum(len(r.seq.generated) for r in reqs)
    per_request = [(len(s) - 1) / (s[-1] - s[0]) for s in stamps if len(s) > 1 and s[-1] > s[0]]
    decode_tokens, decode_seconds = decode_phase(stamps)
    return Throughput(clients, tokens, seconds, [s[0] - start for s in stamps], per_request,
                      reqs, prompt_tokens=sum(len(p) for _, p in prompts),
                      decode_tokens=decode_tokens, decode_seconds=decode_seconds,
                      decode_windows=pipe.decode_windows, windows_by_k=dict(pipe.asked),
                      choices=[c and {"k": c.k, "acceptance": round(c.acceptance, 3),
                                      "timed": [list(t) for t in c.timed]}
                               for c in sched.speculation.choices()])


class CountingPipe:
    """A launch's Pipeline as a scheduler sees it, counting the decode windows sent by their
    rows (sizes: rows -> windows) and by the most proposals a slot they ask (asked)."""

    def __init__(self, pipe):
        self.pipe, self.sizes, self.asked = pipe, Counter(), Counter()

    @property
    def decode_windows(self) -> int:
        return sum(self.sizes.values())

    def new_window_id(self) -> int:
        return self.pipe.new_window_id()

    def submit(self, w) -> None:
        self.pipe.submit(w)
        if not w.chunk and any(s >= 0 for s in w.slots):
            self.sizes[len(w.slots)] += 1
            self.asked[max((k for _, k in w.propose), default=0)] += 1

    def receive(self, timeout: float | None = None):
        return self.pipe.receive(timeout=timeout)


def decode_phase(stamps: list[list[float]]) -> tuple[int, float]:
    """(tokens, seconds) of the decode phase, from each request's token arrival times: from
    the last request's first token (every prompt read) to the last token."""
    read = max(s[0] for s in stamps)
    return sum(t > read for s in stamps for t in s), max(s[-1] for s in stamps) - read
