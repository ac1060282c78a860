"""strata-train-mtp's steps on one target model (cli.py reads the flags)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from strata.coordinator.sampling import SamplingParams
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

    def samples(self, prompts, keep: str | None, progress=None):
        """The target's answers to `prompts` (loaded from `keep` when it exists, else
        generated through strata and saved there)."""
        if keep and os.path.exists(keep):
            return train_data.load_samples(keep)
        chats = train_data.chat_prompts(self.tok, prompts, self.max_prompt_tokens)
        prep = prepare(model=self.model, layer_split=self.layer_split, devices=self.devices,
                       ctx_size=self.ctx, batch=self.batch, batch_groups=self.batch_groups,
                       window_rows="auto", chunk_rows="auto")
        passes = [SamplingParams(max_tokens=self.answer_tokens)] + [
            SamplingParams(temperature=t, seed=self.seed * 1_000_003 + 7919 * (n + 1),
                           max_tokens=self.answer_tokens)
            for n, t in enumerate(self.sampled)]
        # sampled passes answer the training prompts only: the held-out answers stay greedy
        held = [c for c in chats if c[1].split == "heldout"]
        train = [c for c in chats if c[1].split == "train"]
        start = time.monotonic()
        out = train_data.generate(prep, self.tok, held + train, passes[:1], self.answer_seconds,
                                  say=lambda s: None, progress=progress)
        left = (None if self.answer_seconds is None
                else self.answer_seconds - (time.monotonic() - start))
        if len(passes) > 1 and train and (left is None or left > 0):
            out += train_data.generate(prep, self.tok, train, passes[1:], left,
                                       say=lambda s: None, progress=progress)
        if keep:
            train_data.save_samples(keep, out)
        return out

    def head(self, path: str | None = None) -> NextNHead:
        """A new head (from the target's last block), or the one in the sidecar `path`."""
        if path is None:
            return NextNHead(self.target)
        source = find_head(self.file, path)
        f = open_head(source, self.file)
        b = source.block
        init = {n: f.tensor(f"blk.{b}.nextn.{n}.weight") for n in NEXTN_TENSORS}
        init.update({n: f.tensor(f"blk.{b}.{n}.weight") for n in BLOCK_TENSORS})
        return NextNHead(self.target, init)

    def fit(self, head: NextNHead, samples, options: dict, validation=(), say=print,
            progress=None, on_best=None) -> None:
        """Train on `samples`; with `validation` samples, keep the epoch whose first
        proposals match the target's greedy tokens there most often."""
        states = train_data.teacher_states(self.target, samples, progress=progress)
        check = None
        if validation:
            held = train_data.teacher_states(self.target, validation)

            def check(h):
                tried, right = acceptance(h, validation, held, 1)[0]
                return right / max(tried, 1)
        fit(head, samples, states, FitConfig(**options), check, say, progress, on_best)

    def acceptance(self, head: NextNHead, samples, passes: int):
        states = train_data.teacher_states(self.target, samples)
        return acceptance(head, samples, states, passes)

    def write(self, head: NextNHead, out: str, weight_type: str) -> Path:
        return write_head(out, head.tensors(), self.file, weight_type)
