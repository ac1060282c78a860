"""The checks a window passes before a stage changes anything: a refused window gets a
sentence (RowError) and leaves the KV cache as it was."""
from __future__ import annotations

import math

import numpy as np

from strata.kernels.policy import MAX_DECODE_ROWS
from strata.kernels.sampling.logprobs import MAX_TOP
from strata.model.gguf_file import ModelConfig
from strata.protocol.messages import Window
from strata.stage_worker.config import WorkerConfig

ACTIVATION_DTYPES = ("float32", "uint16")  # fp32 from CPU stages, bf16 bits from CUDA stages


class RowError(ValueError):
    """A window whose rows this stage cannot run (the coordinator gets the sentence)."""


def check_window(w: Window, tensors: list[np.ndarray], cfg: WorkerConfig, model: ModelConfig,
                 first: bool, filled: list[int], last: bool = False) -> None:
    """Raises RowError unless stage `cfg` (its model's first stage or not, its last or not;
    slot s holding positions [0, filled[s])) can run window w with these activation frames."""
    _check_rows(w, cfg, model, first or last)
    _check_activations(w, tensors, cfg, model, first)
    _check_gaps(w, filled)
    if last:
        _check_sampling(w, model.vocab)
    if w.follows:
        _check_follows(w, first and last)


def _check_rows(w: Window, c: WorkerConfig, model: ModelConfig, reads_tokens: bool) -> None:
    if not w.slots:
        raise RowError(f"window {w.id} has no rows; send at least one (pad rows have slot -1)")
    if not w.chunk and len(w.slots) > MAX_DECODE_ROWS:
        raise RowError(f"window {w.id} has {len(w.slots)} rows; a decode window holds at most "
                       f"{MAX_DECODE_ROWS}, so send the rest in another window")
    for s, p, t in zip(w.slots, w.positions, w.tokens):
        if s >= c.slots:
            raise RowError(f"window {w.id}: slot {s} does not exist (this stage has {c.slots})")
        if s >= 0 and not 0 <= p < c.ctx:
            raise RowError(f"window {w.id}: position {p} is outside the context of {c.ctx}")
        if s >= 0 and reads_tokens and not 0 <= t < model.vocab:
            raise RowError(f"window {w.id}: token {t} is outside the vocabulary")
    if w.chunk and len({s for s in w.slots if s >= 0}) > 1:
        raise RowError(f"window {w.id} is marked as a prompt chunk but holds rows of several "
                       f"slots; a chunk reads one slot's prompt")
    words = -(-model.vocab // 32)
    if w.masks and w.mask_words() != words:
        raise RowError(f"window {w.id}: its token masks have {w.mask_words()} words each; this "
                       f"model's vocabulary of {model.vocab} needs {words} (one bit a token)")
    for commit in w.commits:
        if len(commit) != 2:
            raise RowError(f"window {w.id}: commit {commit} is not a [slot, length] pair")
        slot, length = commit
        if not (0 <= slot < c.slots and 0 <= length <= c.ctx):
            raise RowError(f"window {w.id}: commit ({slot}, {length}) is out of range")


def _check_activations(w: Window, tensors: list[np.ndarray], c: WorkerConfig,
                       model: ModelConfig, first: bool) -> None:
    if c.link != "zmq" and tensors:
        raise RowError(f"window {w.id}: {len(tensors)} tensor frame(s) came, but this stage "
                       f"takes activations over its {c.link} link")
    if not first and c.link == "zmq":
        if len(tensors) != 1 or tensors[0].shape != (len(w.slots), model.d_model):
            raise RowError(f"window {w.id}: expected activations of shape "
                           f"({len(w.slots)}, {model.d_model})")
        if str(tensors[0].dtype) not in ACTIVATION_DTYPES:
            raise RowError(f"window {w.id}: activations of dtype {tensors[0].dtype}; send "
                           f"float32 or bf16 bits as uint16")


def _check_gaps(w: Window, filled: list[int]) -> None:
    """Rows may extend a slot only without leaving a gap (after the window's commits)."""
    reach = list(filled)
    for slot, length in w.commits:
        reach[slot] = min(reach[slot], length)
    for s, p in zip(w.slots, w.positions):
        if s >= 0:
            if p > reach[s]:
                raise RowError(f"window {w.id}: slot {s} holds {reach[s]} positions, so "
                               f"position {p} would leave a gap")
            reach[s] = max(reach[s], p + 1)


def _check_sampling(w: Window, vocab: int) -> None:
    """The last stage's fields: penalties, biases and log-probabilities (their shapes are the
    message's own checks)."""
    if w.penalty and not w.output_start:
        raise RowError(f"window {w.id} has penalties but no output_start; send one per "
                       f"sampled row")
    for p in w.sampled:
        r = p.row
        if p.penalty and not (all(math.isfinite(v) for v in p.penalty) and p.penalty[0] > 0):
            raise RowError(f"window {w.id}: penalty {p.penalty} of row {r} is not finite "
                           f"numbers with a repetition penalty above 0")
        if not 0 <= p.output_start <= w.positions[r] + 1:
            raise RowError(f"window {w.id}: output_start {p.output_start} of row {r} is "
                           f"not within [0, its position + 1]")
        ids = p.bias_ids
        if any(not 0 <= t < vocab for t in ids) or len(set(ids)) != len(ids):
            raise RowError(f"window {w.id}: row {r}'s bias_ids are not distinct tokens of "
                           f"the vocabulary")
        if any(not (math.isfinite(b) or b == -math.inf) for b in p.bias):
            raise RowError(f"window {w.id}: row {r}'s biases are not finite numbers or -inf")
    sampled = {p.row for p in w.sampled}
    for s in w.scored:
        if not (0 <= s.token < vocab or (s.token == -1 and s.row in sampled)):
            raise RowError(f"window {w.id}: logprob row {s.row} asks for token {s.token}; give "
                           f"a token of the vocabulary, or -1 for a sampled row's own")
        if not 0 <= s.top <= MAX_TOP:
            raise RowError(f"window {w.id}: logprob row {s.row} asks for {s.top} top tokens; "
                           f"give 0 to {MAX_TOP}")
    if len({s.row for s in w.scored}) != len(w.scored):
        raise RowError(f"window {w.id} names a logprob row twice")


def _check_follows(w: Window, holds_picks: bool) -> None:
    """A window that decodes ahead (Window.follows) reads tokens a stage that is both first
    and last picked; its rows' penalties would read the slots' tokens before the picks come
    to the host (history.py), so its sampled rows have none. (Which picks the stage holds:
    LastStage.check_follows.)"""
    if not holds_picks:
        raise RowError(f"window {w.id} reads tokens from the picks of window {w.after}, which "
                       f"only a stage that is both first and last holds; send the tokens")
    if any(p.penalty for p in w.sampled):
        raise RowError(f"window {w.id} decodes ahead with penalties, which read each slot's "
                       f"tokens before the picks it follows are known; send it after those "
                       f"tokens come back")
