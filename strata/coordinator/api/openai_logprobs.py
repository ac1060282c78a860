"""OpenAI's logprobs objects, from the log-probabilities the last stage reports
(coordinator/sampling_params.py TokenLogprob: the model's own distribution at each position, before
temperature, penalties and filters).

Chat (`logprobs: true`, `top_logprobs: N`): {"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...N]}, ...], "refusal": null}.
Completions (`logprobs: N`): {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, a
list each, one entry per token; each top_logprobs entry maps the N most likely tokens' text to
their log-probability, and holds the chosen token too (so it may have N + 1 entries, as
OpenAI's and vLLM's do); with `echo`, the prompt's tokens come first, the first with null
(nothing predicts it). A token's text is the token decoded alone (special tokens spelled
out), text_offset the sum of the texts before it, from the start of the choice's text (as
vLLM counts them). A log-probability that is not finite is reported as -9999.0, OpenAI's
value for a token too unlikely to say.
"""
from __future__ import annotations

import math
from functools import lru_cache

from strata.coordinator.sampling_params import TokenLogprob

UNLIKELY = -9999.0


def _value(x: float) -> float:
    return x if math.isfinite(x) else UNLIKELY


class Spelling:
    """Each token's text and bytes as the logprobs objects show them."""

    def __init__(self, tok):
        self.text = lru_cache(maxsize=1 << 16)(lambda t: tok.decode([t], skip_special=False))
        self.bytes = lru_cache(maxsize=1 << 16)(lambda t: list(tok.token_bytes(t)))

    def chat(self, entries: list[TokenLogprob]) -> dict:
        def one(token: int, logprob: float) -> dict:
            return {"token": self.text(token), "logprob": _value(logprob),
                    "bytes": self.bytes(token)}
        return {"content": [{**one(e.token, e.logprob),
                             "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}

    def completion(self, tokens: list[int], entries: list[TokenLogprob | None],
                   offset: int = 0) -> dict:
        """tokens and their entries (None: a token nothing predicts, the prompt's first);
        offset: the text before the first token (a stream's earlier chunks)."""
        texts = [self.text(t) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        tops = []
        for e in entries:
            if e is None:
                tops.append(None)
                continue
            top = {self.text(t): _value(lp) for t, lp in e.top}
            top.setdefault(self.text(e.token), _value(e.logprob))
            tops.append(top)
        return {"tokens": texts,
                "token_logprobs": [None if e is None else _value(e.logprob) for e in entries],
                "top_logprobs": tops, "text_offset": offsets}


class Logprobs:
    """The logprobs objects of one choice: the whole answer's, or a stream's chunk by chunk
    (completions' text_offset runs on from one chunk to the next). `wanted`: the request
    asks for log-probabilities (else every object is None)."""

    def __init__(self, spelling: Spelling, chat: bool, wanted: bool):
        self.spelling, self.chat, self.wanted = spelling, chat, wanted
        self.offset = 0

    def of(self, tokens: list[int], entries: list[TokenLogprob | None], whole: bool = False
           ) -> dict | None:
        """The object of `tokens` (None when not wanted, or for a stream chunk of no token;
        `whole`: the answer's, an object with empty lists then)."""
        if not self.wanted or not (tokens or whole):
            return None
        if self.chat:
            return self.spelling.chat(entries)
        out = self.spelling.completion(tokens, entries, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out
