"""What the last stage's head computed for a window's sampled rows, and the tokens it gives."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from strata.kernels.sampling import SamplingRow, sample_rows
from strata.protocol.messages import Window


@dataclass
class HeadOutput:
    """The head's output for the sampled rows of a window (on the device; static buffers of a
    graph when graphed: read them before the next window)."""
    logits: torch.Tensor | None  # fp32 [N, V]; None once only the argmax is kept (greedy rows)
    argmax: torch.Tensor         # [N] int64: the first index of each row's maximum
    rows: list[int]              # the index into logits / argmax of each sampled row, in order

    def argmax_to_host(self) -> "HeadOutput":
        """The argmax copied without waiting into pinned host memory (read it once the device
        is past this point); the logits are dropped. No pageable copy either: that would wait
        for the window's kernels."""
        host = torch.empty(self.argmax.shape, dtype=torch.long, pin_memory=True)
        host.copy_(self.argmax, non_blocking=True)
        return HeadOutput(None, host, self.rows)


def head_tokens(head: HeadOutput | None, w: Window) -> list[int]:
    """The tokens of the window's sampled rows: greedy rows take the argmax (the first index of
    the maximum, as sample_row); the rows with a temperature go to sample_rows together (on
    CUDA their logits stay on the device; only the picks leave it)."""
    if head is None:
        return []
    params = [SamplingRow(*p) for p in zip(w.temperature, w.top_k, w.top_p, w.min_p, w.u)]
    greedy = head.argmax.tolist()
    tokens = [greedy[r] for r in head.rows]
    tempered = [j for j, p in enumerate(params) if p.temperature > 0.0]   # into head.rows
    if tempered:
        index = torch.tensor([head.rows[j] for j in tempered], device=head.logits.device)
        picks = sample_rows(head.logits[index], [params[j] for j in tempered])
        for j, token in zip(tempered, picks):
            tokens[j] = token
    return tokens


def head_logits(head: HeadOutput | None, vocab: int) -> np.ndarray:
    """fp32 logits [N, V] of the sampled rows, on the host ([0, V] without sampled rows)."""
    if head is None:
        return np.zeros((0, vocab), dtype=np.float32)
    return head.logits[head.rows].cpu().numpy()
