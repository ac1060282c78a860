"""strata-train-mtp's steps on one target model (cli.py reads the flags)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from strata.coordinator.sampling_params import SamplingParams
from strata.launch.options import open_model, parse_devices_for, prepare
from strata.model.nextn import BLOCK_TENSORS, NEXTN_TENSORS, find_head, open_head
from strata.model.tokenizer import Tokenizer
from strata.train import data as train_data
from strata.train.export import write_head
from strata.train.fit import FitConfig, acceptance, fit
from strata.train.head import NextNHead
from strata.train.torch_llama import Target


@dataclass
class Job:
    model: str
    devices: str = "auto"
    layer_split: str = "auto"
    batch: int = 64
    batch_groups: str = "auto"
    max_prompt_tokens: int = 384
    answer_tokens: int = 256
    sampled: list[float] = field(default_factory=list)
    answer_seconds: float | None = None
    seed: int = 0

    def __post_init__(self):
        self.ctx = self.max_prompt_tokens + self.answer_tokens
        self.file = open_model(self.model, self.ctx)
        self.tok = Tokenizer.from_gguf(self.file.reader)
        self.device = torch.device(parse_devices_for(self.devices)[0])
        dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        # + 3: chained passes rotate rows up to three places past the context
        self.target = Target(self.file, self.device, dtype, self.ctx + 3)

    def chats(self, prompts):
        """(token ids, prompt) of each prompt that fits --max-prompt-tokens, as a chat."""
        return train_data.chat_prompts(self.tok, prompts, self.max_prompt_tokens)

    def work(self, prompts) -> list[train_data.Work]:
        """The answers to generate: every prompt greedy, held-out ones first, then the
        training prompts once per sampled temperature (pass n's seed offset by the prompt's
        index), in that order."""
        chats = self.chats(prompts)
        held = [c for c in chats if c[1].split == "heldout"]
        train = [c for c in chats if c[1].split == "train"]
        greedy = SamplingParams(max_tokens=self.answer_tokens)
        out = [(ids, p, greedy) for ids, p in held + train]
        for n, t in enumerate(self.sampled):
            base = self.seed * 1_000_003 + 7919 * (n + 1)
            out += [(ids, p, SamplingParams(temperature=t, seed=base + i,
                                            max_tokens=self.answer_tokens))
                    for i, (ids, p) in enumerate(train)]
        return out

    def samples(self, prompts, keep: str | None, progress=None, say=print):
        """The target's answers to `prompts` (see work()): those kept in `keep` are read back,
        the others generated through strata (for at most answer_seconds) and added there."""
        work = self.work(prompts)
        kept = train_data.load_samples(keep) if keep and os.path.exists(keep) else []
        used, todo = train_data.split_kept(work, kept)
        if kept:
            say(f"{keep}: {len(used)} of the {len(work)} answers asked for "
                f"({len(kept) - len(used)} others there not used)")
        if not todo or (self.answer_seconds is not None and self.answer_seconds <= 0):
            return used
        out = train_data.generate(self._prepare(), self.tok, todo, self.answer_seconds,
                                  say=lambda s: None, progress=progress)
        if keep:
            train_data.save_samples(keep, kept + out)
        return used + out

    def _prepare(self):
        return prepare(model=self.model, layer_split=self.layer_split, devices=self.devices,
                       ctx_size=self.ctx, batch=self.batch, batch_groups=self.batch_groups,
                       window_rows="auto", chunk_rows="auto")

    def self_prompts(self, count: int, temperature: float, progress=None):
        """`count` requests for prompts the target writes itself (data.self_prompts), each up to
        half of --max-prompt-tokens; the seeds follow --seed."""
        return train_data.self_prompts(self._prepare(), self.tok, count, temperature,
                                       self.max_prompt_tokens // 2, self.seed * 1_000_003 + 17,
                                       say=lambda s: None, progress=progress)

    def head(self, path: str | None = None, ffn: int | None = None) -> NextNHead:
        """A new head (from the target's last block), or the one in the sidecar `path`; with
        `ffn`, its feed-forward layer widened to that many units."""
        if path is None:
            return NextNHead(self.target, ffn=ffn)
        source = find_head(self.file, path)
        f = open_head(source, self.file)
        b = source.block
        init = {n: f.tensor(f"blk.{b}.nextn.{n}.weight") for n in NEXTN_TENSORS}
        init.update({n: f.tensor(f"blk.{b}.{n}.weight") for n in BLOCK_TENSORS})
        return NextNHead(self.target, init, ffn)

    def fit(self, head: NextNHead, samples, options: dict, validation=(), say=print,
            progress=None, on_best=None) -> None:
        """Train on `samples`; with `validation` samples, keep the epoch whose first
        proposals match the target's greedy tokens there most often."""
        states = train_data.teacher_states(self.target, samples, progress=progress)
        held = train_data.teacher_states(self.target, validation) if validation else None

        def check(h):
            tried, right = acceptance(h, validation, held, 1)[0]
            return right / max(tried, 1)
        fit(head, samples, states, FitConfig(**options), check if validation else None, say,
            progress, on_best)

    def acceptance(self, head: NextNHead, samples, passes: int):
        states = train_data.teacher_states(self.target, samples)
        return acceptance(head, samples, states, passes)

    def write(self, head: NextNHead, out: str, weight_type: str) -> Path:
        return write_head(out, head.tensors(), self.file, weight_type)
