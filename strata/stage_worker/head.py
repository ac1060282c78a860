"""What the last stage's head computed for a window's sampled rows, and the tokens it gives."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from strata.kernels.sampling import (SamplingRow, filtered, pick_unfiltered, sample_rows,
                                     sample_rows_on_device, to_device)
from strata.protocol.messages import Window


@dataclass
class HeadOutput:
    """The head's output for the sampled rows of a window (on the device; static buffers of a
    graph when graphed: read them before the next window)."""
    logits: torch.Tensor | None  # fp32 [N, V]; None once the tokens are picked (tokens_to_host)
    argmax: torch.Tensor         # [N] int64: the first index of each row's maximum; without
                                 # logits, each row's token (sampled rows' included)
    rows: list[int]              # the index into logits / argmax of each sampled row, in order

    def tokens_to_host(self, w: Window) -> "HeadOutput":
        """The tokens of the window's sampled rows picked on the device, queued behind the
        window's kernels (greedy rows: the argmax; rows with a temperature:
        sample_rows_on_device, as sample_rows on CUDA; where none has top-k, top-p or min-p,
        pick_unfiltered for every row in one call), and copied without waiting into
        pinned host memory (read them once the device is past this point); the logits are
        dropped. Nothing here waits for the device: the indices and parameters go to it from
        pinned memory too."""
        params = row_params(w)
        tempered = [j for j, p in enumerate(params) if p.temperature > 0.0]   # into self.rows
        tokens, rows = self.argmax, self.rows
        if tempered and not any(filtered(params[j], self.logits.shape[-1]) for j in tempered):
            # every row at once (greedy ones too: temperature 0 takes the argmax), with one
            # copy to the device of each row's (index, temperature, draw)
            given = to_device(torch.tensor([[r, p.temperature, p.u]
                                            for r, p in zip(rows, params)],
                                           dtype=torch.float64), tokens.device)
            tokens = pick_unfiltered(self.logits, given[:, 1], given[:, 2], rows=given[:, 0])
            rows = list(range(len(rows)))
        elif tempered:
            # one copy of the indices: the sampled rows, the tempered ones, their places
            n, m = len(rows), len(tempered)
            index = to_device(rows + [rows[j] for j in tempered] + tempered, tokens.device)
            picks = sample_rows_on_device(self.logits[index[n:n + m]],
                                          [params[j] for j in tempered])
            tokens = tokens[index[:n]].index_copy(0, index[n + m:], picks)
            rows = list(range(n))
        host = torch.empty(tokens.shape, dtype=torch.long, pin_memory=tokens.is_cuda)
        host.copy_(tokens, non_blocking=tokens.is_cuda)
        return HeadOutput(None, host, rows)


def apply_masks(head: HeadOutput | None, w: Window) -> HeadOutput | None:
    """The head's output with the window's token masks applied (Window.mask): a masked row's
    forbidden tokens get logit -inf and its argmax is taken again (the first index of the
    maximum, as sample_row's); rows without a mask keep theirs. Only the sampled rows' logits
    are copied (a graph's output buffers stay as they are). Every step is per row (a gather,
    shifts, a fill, an argmax), so a row's token depends on its own logits and mask alone."""
    if head is None or not any(i >= 0 for i in w.mask):
        return head
    device, vocab, n = head.logits.device, head.logits.shape[-1], len(head.rows)
    masked = [j for j, i in enumerate(w.mask) if i >= 0]            # into the sampled rows
    words = np.frombuffer(w.masks, dtype="<i4").reshape(-1, w.mask_words())
    index = to_device(head.rows + masked, device)                   # one copy of the indices
    bits = to_device(torch.from_numpy(words[[w.mask[j] for j in masked]]), device)  # [M, W]
    logits, at = head.logits[index[:n]], index[n:]                  # [N, V] (a copy), [M]
    masked = logits[at].masked_fill_(forbidden_tokens(bits, vocab), float("-inf"))
    logits[at] = masked
    argmax = head.argmax[index[:n]]
    argmax[at] = masked.argmax(-1)
    return HeadOutput(logits, argmax, list(range(n)))


def forbidden_tokens(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[M, W] int32 bitmasks (bit j of word i set: token 32 i + j allowed) -> [M, vocab] bool,
    True where a token is not allowed. The words' bytes in memory order (little-endian), 8
    bits each: byte k's bit j is token 8 k + j."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    octets = bits.contiguous().view(torch.uint8)                      # [M, 4 W]
    return ((octets[:, :, None] >> shifts) & 1 == 0).reshape(len(bits), -1)[:, :vocab]


def row_params(w: Window) -> list[SamplingRow]:
    return [SamplingRow(*p) for p in zip(w.temperature, w.top_k, w.top_p, w.min_p, w.u)]


def head_tokens(head: HeadOutput | None, w: Window) -> list[int]:
    """The tokens of the window's sampled rows: greedy rows take the argmax (the first index of
    the maximum, as sample_row); the rows with a temperature go to sample_rows together (on
    CUDA their logits stay on the device; only the picks leave it), unless the device picked
    them already (tokens_to_host)."""
    if head is None:
        return []
    params = row_params(w)
    greedy = head.argmax.tolist()
    tokens = [greedy[r] for r in head.rows]
    tempered = [j for j, p in enumerate(params) if p.temperature > 0.0]   # into head.rows
    if tempered and head.logits is not None:
        index = to_device([head.rows[j] for j in tempered], head.logits.device)
        picks = sample_rows(head.logits[index], [params[j] for j in tempered])
        for j, token in zip(tempered, picks):
            tokens[j] = token
    return tokens


def head_logits(head: HeadOutput | None, vocab: int) -> np.ndarray:
    """fp32 logits [N, V] of the sampled rows, on the host ([0, V] without sampled rows)."""
    if head is None:
        return np.zeros((0, vocab), dtype=np.float32)
    return head.logits[head.rows].cpu().numpy()
