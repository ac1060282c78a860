"""Penalties, biases and token masks on a sampled row's logits, before temperature and the
filters: what a request's own tokens, its logit_bias and its grammar do to the distribution it
samples.

In vLLM's order (its v1 sampler: logit bias and min-tokens, then penalties), in fp32:

1. bias: logits[t] += bias[t] for the row's biased tokens; a bias of -inf keeps a token from
   being sampled (min_tokens holds back the stop tokens that way);
2. repetition (transformers' RepetitionPenaltyLogitsProcessor, which vLLM follows): a token
   that occurs in the row's history, prompt or output, has its logit divided by the penalty
   where it is positive and multiplied by it where it is negative;
3. frequency and presence (OpenAI's definition): logits[t] -= frequency * count[t] +
   presence * (count[t] > 0), over the tokens of the row's output only.

Each step is per element (a row's result depends only on its own logits, history and
parameters, never on other rows), and a neutral value (repetition 1, frequency and presence 0,
no bias) leaves every logit's bits as they were. `history_counts` turns a row's tokens into
what the steps read.
"""
from __future__ import annotations

import torch


def history_counts(tokens: torch.Tensor, output: torch.Tensor, vocab: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [m, L] (int64; a pad entry is `vocab`), output [m, L] bool (the entry is an
    output token). Returns (seen [m, V] bool: the token occurs among the row's entries, counts
    [m, V] int32: how often among its output entries). Integer scatters: exact in any order."""
    m = tokens.shape[0]
    seen = torch.zeros(m, vocab + 1, dtype=torch.bool, device=tokens.device)
    seen.scatter_(1, tokens, True)
    counts = torch.zeros(m, vocab + 1, dtype=torch.int32, device=tokens.device)
    counts.scatter_add_(1, tokens, output.to(torch.int32))
    return seen[:, :vocab], counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor,
                    penalty: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor,
                                                       torch.Tensor] | None = None
                    ) -> torch.Tensor:
    """logits [m, V] fp32 (left as they are); seen, counts as history_counts gives them;
    penalty [m, 3] fp32 (repetition > 0, frequency, presence); bias: (rows [b], token ids [b],
    values [b] fp32) or None. Returns the penalised logits [m, V] (fp32)."""
    x = logits.clone()
    if bias is not None:
        rows, ids, values = bias
        x.index_put_((rows, ids), values, accumulate=True)   # one entry per (row, token)
    repetition, frequency, presence = penalty[:, 0:1], penalty[:, 1:2], penalty[:, 2:3]
    x = torch.where(seen, torch.where(x < 0, x * repetition, x / repetition), x)
    x -= frequency * counts
    x -= presence * (counts > 0)
    return x


def forbidden_tokens(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """A grammar's token masks: [M, W] int32 bitmasks (bit j of word i set: token 32 i + j
    allowed) -> [M, vocab] bool, True where a token is not allowed (its logit becomes -inf,
    after the steps above). The words' bytes in memory order (little-endian), 8 bits each:
    byte k's bit j is token 8 k + j."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    octets = bits.contiguous().view(torch.uint8)                      # [M, 4 W]
    return ((octets[:, :, None] >> shifts) & 1 == 0).reshape(len(bits), -1)[:, :vocab]
