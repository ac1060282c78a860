"""The last stage's work after its layers: the window's tokens (penalties and biases, the
grammar's masks, the pick: head.py), its answer to the coordinator, deferred on CUDA until the
device is past the window, and the drafter's proposals (drafter.py), computed as the window is
answered, so drafting costs no window and no round trip of its own."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from strata.kernels.device import to_device
from strata.model.gguf_file import ModelFile
from strata.model.nextn import find_head
from strata.protocol.messages import Result, Window
from strata.stage_worker.checks import RowError
from strata.stage_worker.config import WorkerConfig
from strata.stage_worker.drafter import Drafter
from strata.stage_worker.head import (HeadOutput, head_logits, head_logprobs, head_tokens,
                                     picked)
from strata.stage_worker.history import SlotTokens
from strata.stage_worker.model import StageModel

log = logging.getLogger("strata.worker")


@dataclass
class PendingAnswer:
    """A last-stage window computed (or queued on the device) and not yet answered."""
    window: Window
    t0: float                    # when the window came (time.perf_counter)
    head: HeadOutput | None      # None: no sampled or scored rows
    done: torch.cuda.Event | None = None  # recorded after the head: the device is past it
    hidden: torch.Tensor | None = None    # the window's final hidden states, for the drafter


class LastStage:
    """`pick` each window's tokens behind its kernels, then `answer` it: at once on a CPU; on
    CUDA once the next window is enqueued or the device is idle (`await_pending`), so the GPU
    does not idle while this host syncs, answers and takes the next window. `send(result,
    frames)` hands a Result to the coordinator."""

    def __init__(self, cfg: WorkerConfig, file: ModelFile, model: StageModel, graphs: bool,
                 send: Callable[[Result, list], None]):
        self.vocab, self.graphs, self.send = model.cfg.vocab, graphs, send
        self.cuda = model.device.type == "cuda"
        self.history = SlotTokens(cfg.slots, cfg.ctx)   # each slot's tokens, for penalties
        # it drafts with a NextN head: a sidecar, or the model file's own layer
        source = find_head(file, cfg.mtp_head, shipped=False)
        self.drafter = (Drafter(source, file, model, cfg.slots, cfg.ctx, graphs=graphs)
                        if source is not None else None)
        if source is not None:
            log.info("stage %d: drafts with the NextN head of %s", cfg.stage, source.describe())
        self.pending: PendingAnswer | None = None  # a window not yet answered
        # decoding ahead (Window.follows): the last window picked, its sampled rows' tokens
        # on the device (at `rows` of the tensor; None when picked on the host), and the
        # last window answered with its tokens
        self.picked: tuple[int, list[int], torch.Tensor | None] = (-1, [], None)
        self.answered: tuple[int, list[int]] = (-1, [])
        # the worker's trace: a window's answer past the device ("synced") and its proposals
        # ("drafted", when it asks for some)
        self.mark: Callable[[int, str], None] = lambda window, what: None

    def nbytes(self) -> int:
        """The drafter's cache and store (the KV cache's neighbours on the device)."""
        return self.drafter.nbytes() if self.drafter is not None else 0

    def _deferred(self, w: Window) -> bool:
        """On CUDA a window's tokens are picked on the device behind its kernels (in its GPU
        span), unless it wants its logits."""
        return self.cuda and not w.want_logits

    def pick(self, w: Window, head: HeadOutput | None) -> HeadOutput | None:
        """The window's tokens in the history, then its penalties and biases and the grammar's
        masks (the sampler reads both); deferred: the tokens picked on the device."""
        deferred = self._deferred(w)
        self.history.write(w)
        head = picked(head, w, self.history, deferred)
        self.picked = ((w.id, head.rows, head.picks) if head is not None else (w.id, [], None))
        return head

    def check_follows(self, w: Window) -> None:
        """Refuses (RowError) a window whose rows read picks this stage does not hold: those
        of a window other than the last it computed, or of a row it did not sample."""
        if not w.follows:
            return
        window, rows, picks = self.picked
        if w.after != window:
            raise RowError(f"window {w.id} reads the tokens window {w.after} picked, but the "
                           f"last window this stage computed is {window}; send a window that "
                           f"decodes ahead right after the one it follows")
        if picks is None and self.answered[0] != window:
            raise RowError(f"window {w.id} follows window {window}, which sampled no row")
        if max(w.follows) >= len(rows):
            raise RowError(f"window {w.id} reads sampled row {max(w.follows)} of window "
                           f"{window}, which sampled {len(rows)}")

    def follow(self, w: Window) -> tuple[list[int], Callable[[torch.Tensor], None] | None]:
        """The tokens of a window that decodes ahead (check_follows passed): its own, with
        those of the rows that follow the last window's picks where this host has them (that
        window answered), else a function that writes those into the window's token tensor
        on the device (in place, queued behind the picks)."""
        tokens = list(w.tokens)
        at = [(r, j) for r, j in enumerate(w.follows) if j >= 0]
        window, host = self.answered
        if window == w.after:
            for r, j in at:
                tokens[r] = host[j]
            return tokens, None
        _, rows, picks = self.picked   # (check_follows: on the device)
        index = to_device([[r for r, _ in at], [rows[j] for _, j in at]], picks.device)

        def patch(t: torch.Tensor) -> None:
            t[index[0]] = picks[index[1]].to(t.dtype)
        return tokens, patch

    def answer(self, w: Window, t0: float, hidden: torch.Tensor,
               head: HeadOutput | None) -> None:
        """Answer the window, or keep it (deferred) until the next one is enqueued."""
        self.answer_pending()  # the previous window: computed before this one, now enqueued
        answer = PendingAnswer(w, t0, head)
        if self.drafter is not None:
            # a graph's output buffer is overwritten by the next replay: the drafter, which
            # runs when the window is answered, reads a copy queued before that
            answer.hidden = hidden.clone() if self.graphs else hidden
        if self._deferred(w):
            # the tokens are in pinned memory once the device is past this point (a Result
            # says the window is computed)
            answer.done = torch.cuda.Event()
            answer.done.record()
            self.pending = answer
            return
        self._answer(answer)

    def await_pending(self, inbox) -> None:
        """Answer the window in hand once the device has computed it, unless another window
        comes first (`inbox.poll`): that one is enqueued behind it (answer answers this one
        then), so a header that comes while the device works is taken at once."""
        if self.pending is None:
            return
        assert self.pending.done is not None  # only a deferred answer waits
        while not inbox.poll(0):
            if self.pending.done.query():
                self.answer_pending()
                return

    def answer_pending(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._answer(pending)

    def _answer(self, a: PendingAnswer) -> None:
        """The Result of a window: the tokens of its sampled rows, the log-probabilities it
        asks for (and the logits if it wants them), the proposals it asks for."""
        w = a.window
        if a.done is not None:
            a.done.synchronize()
        self.mark(w.id, "synced")
        tokens = head_tokens(a.head, w)
        if w.follows:   # the picks the rows followed, where the drafter and the slots'
            window, host = self.answered   # histories read the rows' tokens
            assert window == w.after, (window, w.after)   # answers keep the windows' order
            w.tokens = [host[j] if j >= 0 else t for t, j in zip(w.tokens, w.follows)]
            self.history.write(w)
        self.answered = (w.id, tokens)
        logprobs = head_logprobs(a.head, w, tokens)
        # the drafter keeps the window's rows and writes the NextN rows of the proposals it
        # asks for: before the answer when it asks for some, else after it (off the window's
        # path, before this stage takes its next window)
        asks = self.drafter is not None and bool(w.propose)
        proposals = self.drafter.run(w, a.hidden, tokens) if asks else []
        if asks:
            self.mark(w.id, "drafted")
        extra = [head_logits(a.head, self.vocab)] if w.want_logits else []
        w.stage_ms.append((time.perf_counter() - a.t0) * 1e3)
        self.send(Result(w.id, tokens, w.stage_ms, proposals, *logprobs), extra)
        if self.drafter is not None and not asks:
            self.drafter.run(w, a.hidden, tokens)
