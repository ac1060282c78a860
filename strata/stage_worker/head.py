"""What the last stage's head computed for a window's sampled and scored rows, and the answer
it gives: a token per sampled row, and log-probabilities where the window asks for them.

For a window, in this order (each step per row: a row's answer never depends on the others):
1. penalties and biases (kernels/sampling/penalties.py) on the logits of the sampled rows that
   have any, from their slots' tokens (history.py);
2. a structured output's token masks (SamplingRow.mask): a masked row's forbidden tokens get
   -inf; a row of steps 1 or 2 takes the argmax of its new logits;
3. the pick: greedy rows the argmax, rows with a temperature kernels/sampling/sample.py's sampler
   (its own temperature, filters and draw, over the logits of steps 1 and 2);
4. the log-probabilities of Window.scored's rows (kernels/sampling/logprobs.py), from the model's
   own logits (before steps 1 to 3): of the token a row picked, or of a given one (the next
   token of a prompt row, for a request that scores its prompt).
`picked` takes steps 1 and 2, and on CUDA 3 and 4 behind the window's kernels, with one copy
of what they read to the device; on a CPU `head_tokens` and `head_logprobs` take 3 and 4 when
the window is answered.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from strata.kernels.device import to_device, to_device_many, to_host
from strata.kernels.sampling.logprobs import row_logprobs
from strata.kernels.sampling.penalties import apply_penalties, forbidden_tokens, history_counts
from strata.kernels.sampling.sample import pick_arrays, pick_rows, pick_unfiltered, sample_rows
from strata.protocol.messages import Window
from strata.protocol.rows import SamplingRow
from strata.stage_worker.history import SlotTokens


@dataclass
class HeadOutput:
    """The head's output for the sampled and scored rows of a window (on the device; static
    buffers of a graph when graphed: read them before the next window)."""
    logits: torch.Tensor | None  # fp32 [N, V] the sampler reads (penalised, masked);
                                 # None once the tokens are picked (picked on the device)
    argmax: torch.Tensor         # [N] int64: the first index of each row's maximum in
                                 # `logits`; without logits, each sampled row's token
    rows: list[int]              # the index into logits / argmax of each sampled row, in order
    scored: list[int] = field(default_factory=list)   # the index of each of Window.scored
    raw: torch.Tensor | None = None   # the model's logits where `logits` were penalised or masked
    # once picked on the device (picked): per logprob row, on the host, (logprob [k]
    # float64, top ids [k, T], top logprobs [k, T] float64), T the window's largest top
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    picks: torch.Tensor | None = None   # once picked on the device: the tokens there, each
                                        # sampled row's at `rows` (a window decoding ahead
                                        # reads them: last_stage.py)

    @property
    def model_logits(self) -> torch.Tensor:
        """The model's own logits [N, V] (before penalties and biases)."""
        return self.raw if self.raw is not None else self.logits


def picked(head: HeadOutput | None, w: Window, history: SlotTokens, on_device: bool
           ) -> HeadOutput | None:
    """Steps 1 and 2 on the sampled rows that have a penalty, a bias or a mask, and their
    argmax taken again (the first index of the maximum, as sample_row's); with on_device
    steps 3 and 4 too, queued behind the window's kernels, their tokens and log-probabilities
    copied without waiting into pinned host memory (read them once the device is past this
    point) and the logits dropped. The window's rows must be in `history` already.

    Everything the steps read goes to the device in one copy (to_device_many), and nothing
    here waits for the device. A row of steps 1 and 2 with no penalty, bias or mask gets the
    neutral ones (repetition 1, no history, every token allowed), which leave its logits'
    bits as they are. The logits are copied, not written (a graph's output buffers stay as
    they are), and the model's own stay beside them for the log-probabilities. The pick:
    greedy rows take the argmax; rows with a temperature pick_rows' token (as sample_rows on
    CUDA), or where none has top-k, top-p or min-p, pick_unfiltered's for every row in one
    call."""
    if head is None:
        return None
    sampled, vocab, device = w.sampled, head.logits.shape[-1], head.logits.device
    js = [j for j, p in enumerate(sampled) if p.penalty or p.bias_ids or p.mask >= 0]
    given = [sampled[j] for j in js]
    penalised = any(p.penalty or p.bias_ids for p in given)
    arrays = _processing(head, w, history, js) if js else {}
    tempered = [j for j, p in enumerate(sampled) if p.temperature > 0.0]   # into head.rows
    mode = ("argmax" if not tempered else
            "unfiltered" if not any(sampled[j].filtered(vocab) for j in tempered) else
            "filtered")
    if on_device:
        arrays |= _picking(head, sampled, tempered, mode)
        # where a sampled row's token will be: among the argmax, or the picks' own order
        rows = head.rows if mode == "argmax" else list(range(len(head.rows)))
        arrays |= _scoring(w, head.scored, rows)
    if not (arrays or on_device):
        return head
    on = to_device_many(arrays, device) if arrays else {}   # greedy rows alone: no copy
    if js:   # steps 1 and 2
        at, x = on["at"], head.logits[on["at"]]
        if penalised:
            history_tokens = on["history"]
            seen, counts = history_counts(history_tokens[0], history_tokens[1].bool(), vocab)
            bias = ((on["bias_rows"], on["bias_ids"], on["bias"]) if len(on["bias"])
                    else None)
            x = apply_penalties(x, seen, counts, on["penalty"], bias)
        if "words" in on:
            x = x.masked_fill_(forbidden_tokens(on["words"], vocab), float("-inf"))
        head = replace(head, logits=head.logits.index_copy(0, at, x),
                       argmax=head.argmax.index_copy(0, at, x.argmax(-1)),
                       raw=head.model_logits)
    if not on_device:
        return head
    if mode == "argmax":   # step 3: the argmax of every row, as it is
        tokens = head.argmax
    elif mode == "unfiltered":
        tokens = pick_unfiltered(head.logits, on["temperature"], on["u"], rows=on["rows"])
    else:
        picks = pick_rows(head.logits[on["tempered"]], on["params"], on["sorts"], on["others"])
        tokens = head.argmax[on["rows"]].index_copy(0, on["places"], picks)
    logprobs = None
    if head.scored:        # step 4
        logprobs = tuple(to_host(t) for t in _logprobs(head, w, on, tokens))
    return HeadOutput(None, to_host(tokens), rows, logprobs=logprobs, picks=tokens)


def _logprobs(head: HeadOutput, w: Window, on: dict[str, torch.Tensor], tokens: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 4: row_logprobs of the window's logprob rows, from _scoring's arrays on the
    device and the sampled rows' tokens there."""
    targets = torch.where(on["given"] >= 0, on["given"],
                          tokens[on["sample_at"]] if len(tokens) else on["given"])
    return row_logprobs(head.model_logits[on["scored"]], targets, max(s.top for s in w.scored))


def _processing(head: HeadOutput, w: Window, history: SlotTokens, js: list[int]
                ) -> dict[str, np.ndarray]:
    """What steps 1 and 2 read for sampled rows js: their rows in the logits, penalties,
    biases, histories (_histories) and masks' words (-1, every token allowed, for a row
    without one), the last only when the window has masks."""
    given, m = [w.sampled[j] for j in js], len(js)
    places = [(i, t, b) for i, p in enumerate(given) for t, b in zip(p.bias_ids, p.bias)]
    rows, ids, bias = (list(c) for c in zip(*places)) if places else ([], [], [])
    arrays = {"at": np.asarray([head.rows[j] for j in js], dtype=np.int64),
              "penalty": np.asarray([p.penalty or (1.0, 0.0, 0.0) for p in given],
                                    dtype=np.float32).reshape(m, 3),
              "bias_rows": np.asarray(rows, dtype=np.int64),
              "bias_ids": np.asarray(ids, dtype=np.int64),
              "bias": np.asarray(bias, dtype=np.float32),
              "history": _histories(history, w, given, head.logits.shape[-1])}
    if any(p.mask >= 0 for p in given):
        masks = np.frombuffer(w.masks, dtype="<i4").reshape(-1, w.mask_words())
        words = np.full((m, masks.shape[1]), -1, dtype=np.int32)
        for i, p in enumerate(given):
            if p.mask >= 0:
                words[i] = masks[p.mask]
        arrays["words"] = words
    return arrays


def _picking(head: HeadOutput, sampled: list[SamplingRow], tempered: list[int], mode: str
             ) -> dict[str, np.ndarray]:
    """What step 3 reads in `mode`: nothing for the argmax; each row's (index, temperature,
    draw) for pick_unfiltered; else the rows, the tempered ones, their places, parameters
    and paths (pick_rows)."""
    if mode == "argmax":
        return {}
    if mode == "unfiltered":
        return {"rows": np.asarray(head.rows, dtype=np.int64),
                "temperature": np.asarray([[p.temperature] for p in sampled]),
                "u": np.asarray([[p.u] for p in sampled])}
    return {"rows": np.asarray(head.rows, dtype=np.int64),
            "tempered": np.asarray([head.rows[j] for j in tempered], dtype=np.int64),
            "places": np.asarray(tempered, dtype=np.int64),
            **pick_arrays([sampled[j] for j in tempered], head.logits.shape[-1])}


def _scoring(w: Window, scored: list[int], rows: list[int]) -> dict[str, np.ndarray]:
    """What step 4 reads: each logprob row's logits (scored, into the head's), its given token
    (-1: the one it samples) and where that is among the sampled rows' tokens (sampled row j's
    at rows[j]); a row that asks for the token it samples is one of them (checks.py)."""
    if not scored:
        return {}
    sample_at = {p.row: rows[j] for j, p in enumerate(w.sampled)}
    return {"scored": np.asarray(scored, dtype=np.int64),
            "given": np.asarray([s.token for s in w.scored], dtype=np.int64),
            "sample_at": np.asarray([sample_at.get(s.row, 0) for s in w.scored],
                                    dtype=np.int64)}


def _histories(history: SlotTokens, w: Window, sampled: list[SamplingRow], vocab: int
               ) -> np.ndarray:
    """[2, m, L] for these sampled rows of w, what history_counts reads: each row's slot's
    tokens at positions [0, p] (p its position; pad entries `vocab`), and 1 where one is
    output (from its output_start on). A row without a penalty gets pad entries only."""
    ends = [w.positions[p.row] + 1 if p.penalty else 0 for p in sampled]
    packed = np.full((2, len(sampled), max(ends, default=0)), vocab, dtype=np.int64)
    packed[1] = 0
    for i, (p, end) in enumerate(zip(sampled, ends)):
        if end:
            packed[0, i, :end] = history.tokens[w.slots[p.row], :end]
            packed[1, i, p.output_start:end] = 1
    return packed


def head_tokens(head: HeadOutput | None, w: Window) -> list[int]:
    """The tokens of the window's sampled rows: greedy rows take the argmax (the first index of
    the maximum, as sample_row); the rows with a temperature go to sample_rows together (on
    CUDA their logits stay on the device; only the picks leave it), unless the device picked
    them already (picked on the device)."""
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
    if head.logprobs is None:   # step 4 here: the tokens are the host's
        on = to_device_many(_scoring(w, head.scored, list(range(len(tokens))))
                            | {"tokens": np.asarray(tokens, dtype=np.int64)},
                            head.argmax.device)
        head = replace(head, logprobs=tuple(t.cpu() for t in _logprobs(head, w, on,
                                                                      on["tokens"])))
    chosen, ids, values = (t.tolist() for t in head.logprobs)
    return (chosen, [row[:s.top] for row, s in zip(ids, w.scored)],
            [row[:s.top] for row, s in zip(values, w.scored)])


def head_logits(head: HeadOutput | None, vocab: int) -> np.ndarray:
    """The model's fp32 logits [N, V] of the sampled rows, on the host ([0, V] without sampled
    rows)."""
    if head is None or not head.rows:
        return np.zeros((0, vocab), dtype=np.float32)
    return head.model_logits[head.rows].cpu().numpy()
