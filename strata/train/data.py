"""The training data: the target's own answers to the prompts, generated through strata (a
launch of its stages and a scheduler, as strata-launch runs them), then the target's final
hidden states at every position of each prompt + answer (torch_llama.Target)."""
from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from strata.coordinator.sampling_params import SamplingParams
from strata.train.prompts import Prompt
from strata.train.torch_llama import Target


@dataclass
class Sample:
    tokens: list[int]     # the prompt (chat-templated) and the target's answer
    prompt_len: int
    split: str            # "train" or "heldout"
    temperature: float = 0.0
    seed: int | None = None   # a sampled answer's seed (None: greedy)

    @property
    def prompt(self) -> tuple[int, ...]:
        return tuple(self.tokens[:self.prompt_len])

    def key(self) -> tuple:
        """What the answer answers: its prompt and how it was sampled."""
        return self.prompt, self.temperature, self.seed


# one answer to generate: the prompt's token ids, the prompt, how to sample
Work = tuple[list[int], Prompt, SamplingParams]


def sampled_by(params: SamplingParams) -> tuple[float, int | None]:
    """A Sample's temperature and seed for an answer sampled with `params`."""
    return params.temperature, (params.seed if params.temperature > 0 else None)


def work_key(item: Work) -> tuple:
    ids, _, params = item
    return (tuple(ids), *sampled_by(params))


def split_kept(work: list[Work], kept: list[Sample]) -> tuple[list[Sample], list[Work]]:
    """(the kept answers that `work` asks for, the work they leave to do). Each kept answer
    stands for one item of the same prompt, temperature and seed; the rest are not used."""
    have = Counter(work_key(w) for w in work)
    used = []
    for s in kept:
        if have[s.key()] > 0:
            have[s.key()] -= 1
            used.append(s)
    todo = []
    for w in reversed(work):     # the last items of a repeated key are the ones left to do
        if have[work_key(w)] > 0:
            have[work_key(w)] -= 1
            todo.append(w)
    return used, todo[::-1]


@dataclass
class TeacherStates:
    hidden: list[torch.Tensor]   # per sample [len, D], the target's final states before the norm


def chat_prompts(tok, prompts: list[Prompt], max_prompt_tokens: int):
    """(token ids, prompt) of each prompt as a chat (its history, then its text as the user's
    turn), those that fit."""
    out = []
    for p in prompts:
        ids = tok.encode(tok.render_chat(p.messages()))
        if len(ids) <= max_prompt_tokens:
            out.append((ids, p))
    return out


def generate(prep, tok, work: list[Work], seconds: float | None = None, say=print,
             progress=None, stopped_only: bool = False, desc: str = "answers") -> list[Sample]:
    """The answer of every item of `work`, in its order, through a launch of `prep`
    (strata.launch.options.prepare). Requests are fed as others finish, so the slots stay full;
    after `seconds`, no new one starts (the answers begun are finished and kept). With
    stopped_only, only answers that ended by a stop token are kept (not cut at max_tokens)."""
    from strata.coordinator.engine.scheduler import Scheduler
    bar = progress(total=len(work), desc=desc, unit="request") if progress else None
    out: list[Sample] = []
    pending = iter(work)
    deadline = None if seconds is None else time.monotonic() + seconds

    def feed(sched) -> None:
        if deadline is not None and time.monotonic() > deadline:
            return
        item = next(pending, None)
        if item is not None:
            ids, p, sp = item
            sched.submit(ids, sp, on_done=lambda req, p=p, sp=sp: finished(sched, req, p, sp))

    def finished(sched, req, p, sp) -> None:
        if req.error is None and (not stopped_only or req.seq.finish_reason == "stop"):
            prompt = req.seq.prompt
            out.append(Sample(list(prompt) + list(req.seq.generated), len(prompt), p.split,
                              *sampled_by(sp)))
        if bar is not None:
            bar.update(1)
        feed(sched)

    with prep.launch(say=say) as run:
        sched = Scheduler(run.pipe, prep.sched, tok.stop_ids, tok.decode)
        for _ in range(2 * prep.sched.slots):
            feed(sched)
        sched.run()
    if bar is not None:
        bar.close()
    return out


def open_user_turn(tok) -> str:
    """The chat template's text up to where the user's first message begins (its system turn,
    if it adds one, and the user's header): a prompt for the target to write a user's turn."""
    mark = "USER-TURN-9c1e"
    text = tok.render_chat([{"role": "user", "content": mark}], add_generation_prompt=False)
    if mark not in text:
        raise ValueError("the chat template does not show the user's message as written, so "
                         "--self-prompts cannot leave it open; leave --self-prompts out")
    return text[:text.index(mark)]


def self_prompts(prep, tok, count: int, temperature: float, max_tokens: int, seed: int,
                 say=print, progress=None) -> list[Prompt]:
    """Up to `count` training prompts the target writes itself, as Magpie does: the chat
    template with the user's turn left open, sampled at `temperature` (request i with seed
    seed + i) until the turn ends; those cut at max_tokens, empty ones and repeats left out."""
    prefix = tok.encode(open_user_turn(tok))
    work = [(prefix, Prompt("", "train"), SamplingParams(temperature=temperature, seed=seed + i,
                                                         max_tokens=max_tokens))
            for i in range(count)]
    out = generate(prep, tok, work, say=say, progress=progress, stopped_only=True,
                   desc="self-prompts")
    texts = dict.fromkeys(tok.decode(s.tokens[s.prompt_len:]).strip() for s in out)
    return [Prompt(t, "train") for t in texts if t]


def batches(samples: list[Sample], batch_tokens: int, rng: random.Random | None):
    """Index lists of samples of similar length, each padded batch under batch_tokens."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].tokens))
    out, cur = [], []
    for i in order:
        longest = max([len(samples[j].tokens) for j in cur] + [len(samples[i].tokens)])
        if cur and longest * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    if rng is not None:
        rng.shuffle(out)
    return out


def save_samples(path: str | Path, samples: list[Sample]) -> None:
    """JSON lines, one sample each (written aside, then moved into place)."""
    tmp = Path(str(path) + ".partial")
    with open(tmp, "w") as f:
        for s in samples:
            f.write(json.dumps(asdict(s)) + "\n")
    os.replace(tmp, path)


def load_samples(path: str | Path) -> list[Sample]:
    with open(path) as f:
        return [Sample(**json.loads(line)) for line in f if line.strip()]


@torch.no_grad()
def teacher_states(target: Target, samples: list[Sample], batch_tokens: int = 32768,
                   progress=None) -> TeacherStates:
    """The target's final hidden states of every sample, in batches of similar length."""
    device = target.embed.device
    hidden: list[torch.Tensor | None] = [None] * len(samples)
    plan = batches(samples, batch_tokens, None)
    bar = progress(total=len(plan), desc="teacher", unit="batch") if progress else None
    for index in plan:
        t = max(len(samples[i].tokens) for i in index)
        tokens = torch.zeros(len(index), t, dtype=torch.long)
        for b, i in enumerate(index):
            tokens[b, :len(samples[i].tokens)] = torch.tensor(samples[i].tokens)
        h = target.hidden(tokens.to(device))
        for b, i in enumerate(index):
            hidden[i] = h[b, :len(samples[i].tokens)].clone()
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return TeacherStates(hidden)
