"""What the last stage's head computed for a window's sampled and scored rows, and the answer
it gives: a token per sampled row, and log-probabilities where the window asks for them.

For a window, in this order (each step per row: a row's answer never depends on the others):
1. `penalised`: penalties and biases (kernels/sampling/penalties.py) on the logits of the sampled
   rows that have any, from their slots' tokens (history.py); such a greedy row takes the argmax
   of its penalised logits;
2. `apply_masks`: a structured output's token masks (SamplingRow.mask): a masked row's forbidden
   tokens get -inf, and its argmax is taken again;
3. the pick: greedy rows the argmax, rows with a temperature kernels/sampling/sample.py's sampler
   (its own temperature, filters and draw, over the penalised and masked logits);
4. the log-probabilities of Window.scored's rows (kernels/sampling/logprobs.py), from the model's
   own logits (before steps 1 to 3): of the token a row picked, or of a given one (the next
   token of a prompt row, for a request that scores its prompt).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from strata.kernels.device import to_device
from strata.kernels.sampling.logprobs import row_logprobs
from strata.kernels.sampling.penalties import apply_penalties
from strata.kernels.sampling.sample import (filtered, pick_unfiltered, sample_rows,
                                            sample_rows_on_device)
from strata.protocol.messages import Window
from strata.stage_worker.history import SlotTokens


@dataclass
class HeadOutput:
    """The head's output for the sampled and scored rows of a window (on the device; static
    buffers of a graph when graphed: read them before the next window)."""
    logits: torch.Tensor | None  # fp32 [N, V] the sampler reads (penalised, masked);
                                 # None once the tokens are picked (tokens_to_host)
    argmax: torch.Tensor         # [N] int64: the first index of each row's maximum in
                                 # `logits`; without logits, each sampled row's token
    rows: list[int]              # the index into logits / argmax of each sampled row, in order
    scored: list[int] = field(default_factory=list)   # the index of each of Window.scored
    raw: torch.Tensor | None = None   # the model's logits where `logits` were penalised or masked
    # once picked on the device (tokens_to_host): per logprob row, on the host, (logprob [k]
    # float64, top ids [k, T], top logprobs [k, T] float64), T the window's largest top
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def model_logits(self) -> torch.Tensor:
        """The model's own logits [N, V] (before penalties and biases)."""
        return self.raw if self.raw is not None else self.logits

    def tokens_to_host(self, w: Window) -> "HeadOutput":
        """The tokens of the window's sampled rows picked on the device, queued behind the
        window's kernels (greedy rows: the argmax; rows with a temperature:
        sample_rows_on_device, as sample_rows on CUDA; where none has top-k, top-p or min-p,
        pick_unfiltered for every row in one call), and the log-probabilities the window asks
        for, copied without waiting into pinned host memory (read them once the device is
        past this point); the logits are dropped. Nothing here waits for the device: the
        indices and parameters go to it from pinned memory too."""
        tokens, rows = self._picks_on_device(w)
        pinned = tokens.is_cuda
        logprobs = None
        if self.scored:
            logprobs = tuple(_to_host(t, pinned) for t in self._logprobs(w, tokens, rows))
        return HeadOutput(None, _to_host(tokens, pinned), rows, logprobs=logprobs)

    def _picks_on_device(self, w: Window) -> tuple[torch.Tensor, list[int]]:
        """(tokens, rows) on the logits' device: sampled row j's token is tokens[rows[j]]."""
        sampled = w.sampled
        tempered = [j for j, p in enumerate(sampled) if p.temperature > 0.0]  # into self.rows
        if not tempered:   # the argmax of every row, as it is: no copy of indices
            return self.argmax, self.rows
        device, n = self.argmax.device, len(self.rows)
        if not any(filtered(sampled[j], self.logits.shape[-1]) for j in tempered):
            # every row at once (greedy ones too: temperature 0 takes the argmax), with one
            # copy to the device of each row's (index, temperature, draw)
            given = to_device(torch.tensor([[r, p.temperature, p.u]
                                            for r, p in zip(self.rows, sampled)],
                                           dtype=torch.float64), device)
            return (pick_unfiltered(self.logits, given[:, 1], given[:, 2], rows=given[:, 0]),
                    list(range(n)))
        # one copy of the indices: the sampled rows, the tempered ones, their places
        m = len(tempered)
        index = to_device(self.rows + [self.rows[j] for j in tempered] + tempered, device)
        picks = sample_rows_on_device(self.logits[index[n:n + m]], [sampled[j] for j in tempered])
        return self.argmax[index[:n]].index_copy(0, index[n + m:], picks), list(range(n))

    def _logprobs(self, w: Window, tokens: torch.Tensor, rows: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """row_logprobs of the window's logprob rows (on the logits' device), given the
        sampled rows' tokens on that device (sampled row j's is tokens[rows[j]]): a row that
        asks for the token it samples (token -1) is one of them (checks.py)."""
        device = tokens.device
        sample_at = {p.row: rows[j] for j, p in enumerate(w.sampled)}
        given = [[s.token, sample_at.get(s.row, 0)] for s in w.scored]
        given = to_device(torch.tensor(given, dtype=torch.long).reshape(-1, 2).T, device)
        targets = torch.where(given[0] >= 0, given[0], tokens[given[1]] if len(tokens)
                              else given[0])
        x = self.model_logits[to_device(self.scored, device)]
        return row_logprobs(x, targets, max(s.top for s in w.scored))


def _to_host(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    """A copy of t on the host, made without waiting (pinned memory) when t is on CUDA."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
    host.copy_(t, non_blocking=pinned)
    return host


def apply_masks(head: HeadOutput | None, w: Window) -> HeadOutput | None:
    """The head's output with the window's token masks applied (SamplingRow.mask), after the
    penalties: a masked row's forbidden tokens get logit -inf and its argmax is taken again
    (the first index of the maximum, as sample_row's); rows without a mask keep theirs. The
    logits are copied, not written (a graph's output buffers stay as they are), and the
    model's own stay beside them for the log-probabilities. Every step is per row (a gather,
    shifts, a fill, an argmax), so a row's token depends on its own logits and mask alone."""
    masked = [j for j, p in enumerate(w.sampled) if p.mask >= 0]     # into the sampled rows
    if head is None or not masked:
        return head
    device, vocab = head.logits.device, head.logits.shape[-1]
    words = np.frombuffer(w.masks, dtype="<i4").reshape(-1, w.mask_words())
    at = to_device([head.rows[j] for j in masked], device)           # [M]
    bits = to_device(torch.from_numpy(words[[w.sampled[j].mask for j in masked]]),
                     device)                                         # [M, W]
    x = head.logits[at].masked_fill_(forbidden_tokens(bits, vocab), float("-inf"))
    return replace(head, logits=head.logits.index_copy(0, at, x),
                   argmax=head.argmax.index_copy(0, at, x.argmax(-1)), raw=head.model_logits)


def forbidden_tokens(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[M, W] int32 bitmasks (bit j of word i set: token 32 i + j allowed) -> [M, vocab] bool,
    True where a token is not allowed. The words' bytes in memory order (little-endian), 8
    bits each: byte k's bit j is token 8 k + j."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    octets = bits.contiguous().view(torch.uint8)                      # [M, 4 W]
    return ((octets[:, :, None] >> shifts) & 1 == 0).reshape(len(bits), -1)[:, :vocab]


def penalised(head: HeadOutput | None, w: Window, history: SlotTokens) -> HeadOutput | None:
    """The head's output with the window's penalties and biases applied to the logits of the
    sampled rows that have any (and their argmax taken again); as it is when none has. The
    window's rows must be in `history` already."""
    js = [j for j, p in enumerate(w.sampled) if p.penalty or p.bias_ids]   # into head.rows
    if head is None or not js:
        return head
    device, vocab = head.logits.device, head.logits.shape[-1]
    at = to_device([head.rows[j] for j in js], device)
    given = [w.sampled[j] for j in js]
    penalty = torch.tensor([p.penalty or [1.0, 0.0, 0.0] for p in given], dtype=torch.float32)
    # rows with a bias only: a neutral penalty over an empty history (history_counts' zeros)
    seen, counts = (history.counts(w, given, vocab, device) if any(p.penalty for p in given)
                    else (torch.zeros(len(js), vocab, dtype=torch.bool, device=device),
                          torch.zeros(len(js), vocab, dtype=torch.int32, device=device)))
    bias = None
    if any(p.bias_ids for p in given):
        places = [(i, t, b) for i, p in enumerate(given) for t, b in zip(p.bias_ids, p.bias)]
        rows, ids, values = zip(*places)
        bias = (to_device(list(rows), device), to_device(list(ids), device),
                to_device(list(values), device, torch.float32))
    x = apply_penalties(head.logits[at], seen, counts, to_device(penalty, device, torch.float32),
                        bias)
    return replace(head, logits=head.logits.index_copy(0, at, x),
                   argmax=head.argmax.index_copy(0, at, x.argmax(-1)), raw=head.model_logits)


def head_tokens(head: HeadOutput | None, w: Window) -> list[int]:
    """The tokens of the window's sampled rows: greedy rows take the argmax (the first index of
    the maximum, as sample_row); the rows with a temperature go to sample_rows together (on
    CUDA their logits stay on the device; only the picks leave it), unless the device picked
    them already (tokens_to_host)."""
    if head is None:
        return []
    sampled = w.sampled
    greedy = head.argmax.tolist()
    tokens = [greedy[r] for r in head.rows]
    tempered = [j for j, p in enumerate(sampled) if p.temperature > 0.0]  # into head.rows
    if tempered and head.logits is not None:
        index = to_device([head.rows[j] for j in tempered], head.logits.device)
        picks = sample_rows(head.logits[index], [sampled[j] for j in tempered])
        for j, token in zip(tempered, picks):
            tokens[j] = token
    return tokens


def head_logprobs(head: HeadOutput | None, w: Window, tokens: list[int]
                  ) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """Result.logprobs, top_ids and top_logprobs of the window's logprob rows (each row's top
    cut to its own `top`), given the sampled rows' tokens; ([], [], []) when it asks
    for none."""
    if head is None or not w.scored:
        return [], [], []
    if head.logprobs is None:
        on = to_device(tokens, head.argmax.device)
        head = replace(head, logprobs=tuple(t.cpu() for t in head._logprobs(
            w, on, list(range(len(tokens))))))
    chosen, ids, values = (t.tolist() for t in head.logprobs)
    return (chosen, [row[:s.top] for row, s in zip(ids, w.scored)],
            [row[:s.top] for row, s in zip(values, w.scored)])


def head_logits(head: HeadOutput | None, vocab: int) -> np.ndarray:
    """The model's fp32 logits [N, V] of the sampled rows, on the host ([0, V] without sampled
    rows)."""
    if head is None or not head.rows:
        return np.zeros((0, vocab), dtype=np.float32)
    return head.model_logits[head.rows].cpu().numpy()
