"""A request's life on the coordinator: `Sequence` holds what a request has read and
generated and decides when it ends; schedulers (generate.py's solo path, scheduler.py's
batches) decide which windows carry its rows."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from strata.coordinator.grammar import Constraint
from strata.coordinator.sampling_params import SamplingParams, TokenLogprob
from strata.coordinator.windows import Row


class RequestError(ValueError):
    """A request that cannot run as given; the message says what to change."""


@dataclass
class Sequence:
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    ctx: int
    detokenize: Callable[[list[int]], str] = lambda ids: ""
    on_token: Callable[[int], None] = lambda token: None  # each token added to `generated`
    grammar: Constraint | None = None   # structured output: its rows are masked (grammar.py)
    generated: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None   # "stop" | "length" | "cancelled" | "error"
    error: str | None = None           # why it ended in "error"
    grammar_failed: bool = False       # the error: llguidance could not follow the grammar
    # with params.logprobs: each generated token's (TokenLogprob); with params.prompt_logprobs:
    # each prompt position's (None at position 0, which nothing predicts), as windows land
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    stops: frozenset[int] = field(init=False)   # the tokens that end the output (below)

    def __post_init__(self):
        if not self.prompt:
            raise RequestError("the prompt is empty; give at least one token of text")
        if len(self.prompt) >= self.ctx:
            raise RequestError(f"the prompt has {len(self.prompt)} tokens, which does not leave "
                               f"room to generate in a context of {self.ctx}; shorten the prompt "
                               f"or raise --ctx-size")
        # the tokens that end the output: the model's end of text (unless ignore_eos) and the
        # request's stop_token_ids; none of them is part of the output
        self.stops = ((frozenset() if self.params.ignore_eos else frozenset(self.stop_ids))
                      | frozenset(self.params.stop_token_ids))
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt)

    @property
    def length(self) -> int:
        """Tokens held so far: the prompt and every generated token."""
        return len(self.prompt) + len(self.generated)

    @property
    def last_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt[-1]

    def sampled_row(self, slot: int, position: int, token: int, mask: int = -1) -> Row:
        """The row at `position` (reading `token`) that samples the token at position + 1:
        while fewer than min_tokens tokens come before that one in the output, it may not
        sample a stop token. mask: its token mask's index (grammar.WindowMasks; -1: none)."""
        early = position + 1 - len(self.prompt) < self.params.min_tokens
        return Row(slot, position, token, self.params, len(self.prompt),
                   self.stops if early else frozenset(), mask=mask)

    def decode_rows(self, slot: int, drafts: list[int], mask: int = -1) -> list[Row]:
        """A decode window's rows of the sequence: its last token at position L - 1 and its
        drafts after it, each the sampled_row of its position (masks mask, mask + 1, .. when
        mask >= 0)."""
        first = len(self.prompt) + len(self.generated) - 1   # L - 1
        # rows before this index are early (sampled_row): they may not sample a stop token
        early = self.params.min_tokens - len(self.generated)
        stops, prompt_len, params = self.stops, len(self.prompt), self.params
        return [Row(slot, first + j, t, params, prompt_len,
                    stops if j < early else frozenset(), mask=-1 if mask < 0 else mask + j)
                for j, t in enumerate([self.last_token] + drafts)]

    def ahead_row(self, slot: int) -> Row:
        """The decode row after the one in flight (decoding ahead): at position L, reading the
        token the row in flight samples (unknown here: the stage reads its pick; the row says
        0), itself sampling the token after that one."""
        early = len(self.generated) + 1 < self.params.min_tokens
        return Row(slot, self.length, 0, self.params, len(self.prompt),
                   self.stops if early else frozenset())

    def ahead_room(self) -> bool:
        """Whether the sequence may go on past the token in flight: it cannot end by length
        there (a stop token still may end it)."""
        return (len(self.generated) + 1 < self.params.max_tokens
                and self.length + 1 < self.ctx)

    def scored_row(self, slot: int, position: int) -> Row:
        """Prompt row `position`; with prompt_logprobs, it reports the next prompt token's
        log-probability (none for the last prompt row, which samples)."""
        top = self.params.prompt_logprobs
        score = ((self.prompt[position + 1], top)
                 if top is not None and position + 1 < len(self.prompt) else None)
        return Row(slot, position, self.prompt[position], score=score)

    def accept(self, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Take a sampled token (and its log-probability, with params.logprobs); True when the
        sequence has ended."""
        if token in self.stops:
            self.finish_reason = "stop"
            return True
        if self.grammar is not None and not self.grammar.accept(token):
            self.finish_reason = "error"
            if self.grammar.forbidden:   # the mask was not obeyed: the window's failure
                self.error = (f"token {token} was sampled though the grammar forbids it "
                              f"({self.grammar.error})")
            else:                        # one of llguidance's limits: the request's grammar
                self.grammar_failed = True
                self.error = (f"{self.grammar.field} cannot be followed past "
                              f"{len(self.generated)} tokens: llguidance stopped at token "
                              f"{token} ({self.grammar.error}); simplify it and send the "
                              f"request again")
            return True
        self.generated.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        self.on_token(token)
        if self.params.stop:
            self.text = self.detokenize(self.generated)
            cut = min((i for i in (self.text.find(s) for s in self.params.stop) if i >= 0),
                      default=-1)
            if cut >= 0:
                self.text = self.text[:cut]
                self.finish_reason = "stop"
                return True
        if self.grammar is not None and self.grammar.complete:
            self.finish_reason = "stop"
            return True
        if len(self.generated) >= self.params.max_tokens or self.length >= self.ctx:
            self.finish_reason = "length"
            return True
        return False

    def final_text(self) -> str:
        """The generated text, cut before a stop string if one ended it."""
        return self.text if self.params.stop else self.detokenize(self.generated)
