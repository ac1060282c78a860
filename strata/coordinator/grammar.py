"""Structured output on the coordinator: a request's grammar as an llguidance matcher, advanced
by every token the request keeps, and the token masks its sampled rows carry (Window.mask).

llguidance (the library behind vLLM's "guidance" backend and llama.cpp's) reads the model's
`tokenizers` pipeline as strata builds it from the GGUF (Tokenizer.tokenizers_json: byte-level
BPE and SentencePiece with byte fallback alike) and compiles a JSON schema, a regular
expression, a choice of strings or a Lark/GBNF grammar into a matcher: for each state, the set
of tokens that keep the output inside the grammar, as a bitmask (one bit a token, 32 to an
int32 word). The stop tokens are the matcher's end of text: allowed once the grammar is
satisfied, forbidden before.

Exactness: a row's mask depends only on the grammar and the tokens before its position (the
request's kept tokens, then the drafts before the row), and llguidance's limits count work,
not time, so the same request gets the same masks alone or batched, serial or pipelined, with
drafts or without. A draft row's mask is the matcher's after the drafts before it (advanced
and rolled back within llguidance's call); drafts the grammar forbids are cut before the
window is built (Constraint.drafts), as are drafts at or past a stop token, which could only
be kept after the request ends. A request ends with finish "stop" once its grammar is
complete (the matcher takes nothing but a stop token).
"""
from __future__ import annotations

import functools
import threading

import llguidance
import llguidance.numpy
import numpy as np


# errors as one line, without llguidance's dump of the parser's state
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
PROBE_TOKENS = 8   # tokens a new grammar is followed along before its request is taken
EMPTY = "NoExtensionBias"   # llguidance's error where no text can satisfy the grammar
FORBIDDEN = "doesn't satisfy the grammar"   # its error for a token the grammar forbids


class GrammarError(ValueError):
    """A grammar that cannot be served: llguidance cannot compile it, it accepts no text, or
    it meets one of the library's limits in its first masks. The message is a sentence (the
    library's reason in it, one line)."""


def reason(matcher: llguidance.LLMatcher) -> str:
    """The matcher's error on one line, without a dump of the parser's state."""
    text = matcher.get_error().split("<state>")[0].replace("<non-verbose/>", "")
    return " ".join(text.split())[:400]


class Grammars:
    """The model's vocabulary as llguidance reads it, built when first needed (about 0.4 s for
    SmolLM2's 49k tokens, 4 s for Gemma 3's 262k), and the compiler of requests' grammars.
    `vocab` is the model's (the head's columns): tokens past the tokenizer's are never
    allowed. Thread-safe: requests compile in the server's parsing threads."""

    def __init__(self, tok, vocab: int):
        """tok: the model's Tokenizer (its tokenizers_json and stop_ids, read when needed)."""
        self.tok, self.vocab = tok, vocab
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def words(self) -> int:
        """int32 words of one mask."""
        return -(-self.vocab // 32)

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self.tok.tokenizers_json(), n_vocab=self.vocab,
                    eos_token=sorted(self.tok.stop_ids))
            return self._tokenizer

    def compile(self, grammar: str, field: str = "the grammar") -> "Constraint":
        """A fresh matcher of `grammar` (llguidance's grammar text: LLMatcher.grammar_from_*),
        followed along its first tokens (probe); raises GrammarError with a sentence when it
        cannot be compiled or served."""
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise GrammarError(f"llguidance cannot compile it ({reason(matcher)})")
        self.probe(matcher.deep_copy())
        return Constraint(matcher, self.words, self.tok.stop_ids, field)

    def probe(self, matcher: llguidance.LLMatcher) -> None:
        """Follow `matcher` (a copy: it is advanced) PROBE_TOKENS tokens along one path, each
        step's lowest allowed token that is not a stop token: a grammar that accepts no text,
        or whose first masks meet one of llguidance's limits (a lexer too large to build, a
        step that needs too much work), fails here, before any window, not at a stage. The
        limits count work, not time, so the same grammar always gets the same answer."""
        bits = np.zeros((1, self.words), dtype=np.int32)
        stops = np.array(sorted(self.tok.stop_ids), dtype=np.int64)
        for step in range(PROBE_TOKENS):
            llguidance.numpy.fill_next_token_bitmask(matcher, bits, 0)
            if matcher.is_error():
                if step == 0 and reason(matcher) == EMPTY:
                    raise GrammarError("it accepts no text (no output can satisfy it)")
                raise GrammarError(f"llguidance cannot follow it ({reason(matcher)})")
            allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
            text = allowed[~np.isin(allowed, stops)]
            if not len(text):
                if not len(allowed):
                    raise GrammarError("it accepts no text (no output can satisfy it)")
                return   # complete: only a stop token may follow
            if not matcher.consume_token(int(text[0])):
                raise GrammarError(f"llguidance cannot follow it ({reason(matcher)})")


class Constraint:
    """One request's grammar state. Once made (in a parsing thread) only the engine thread
    touches it."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int, stop_ids: frozenset[int],
                 field: str = "the grammar"):
        """field: where the request gave it (its errors name it), e.g. guided_regex."""
        self.matcher, self.words, self.stop_ids, self.field = matcher, words, stop_ids, field

    def copy(self) -> "Constraint":
        """A matcher of the same grammar in the same state, advanced on its own (each choice of
        a request with n > 1 has one): llguidance's deep_copy, no second compilation."""
        return Constraint(self.matcher.deep_copy(), self.words, self.stop_ids, self.field)

    def accept(self, token: int) -> bool:
        """Advance by a kept token (not a stop token: the request ends on those); False when the
        grammar forbids it (the masks were wrong: an invariant, the request ends in error)."""
        return self.matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and takes nothing more but a stop token."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def error(self) -> str:
        return reason(self.matcher)

    @property
    def forbidden(self) -> bool:
        """The matcher's error is a token its grammar forbids (a mask was not obeyed), not
        one of llguidance's limits."""
        return FORBIDDEN in self.matcher.get_error()

    def drafts(self, drafts: list[int]) -> list[int]:
        """The drafts worth verifying: the longest prefix the grammar allows, cut before the
        first stop token (a stop draft's row would sample past the request's end)."""
        cut = next((i for i, t in enumerate(drafts) if t in self.stop_ids), len(drafts))
        return drafts[:self.matcher.validate_tokens(drafts[:cut])] if cut else []


class WindowMasks:
    """The token masks of one window: each constrained slot's rows in order (its last token's
    row, then one per draft), filled on llguidance's threads (one call for the slots without
    drafts, one for those with) into one [rows, words] int32 array, which the window carries
    as Window.masks."""

    def __init__(self):
        self.entries: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        self.count, self.words = 0, 0

    def add(self, c: Constraint, drafts: list[int]) -> int:
        """Masks for a slot's rows (drafts: those Constraint.drafts kept); returns the index of
        its first row's mask (row j's is that + j)."""
        index = self.count
        self.entries.append((c.matcher, index, list(drafts)))
        self.count += 1 + len(drafts)
        self.words = c.words
        return index

    def fill(self) -> np.ndarray | None:
        """[count, words] int32, or None without masks. Zeros to begin with: a row the library
        left unwritten would allow nothing (an error), never everything."""
        if not self.entries:
            return None
        bits = np.zeros((self.count, self.words), dtype=np.int32)
        plain = [(m, index) for m, index, drafts in self.entries if not drafts]
        drafted = [e for e in self.entries if e[2]]   # (the library takes no empty drafts)
        if plain:
            llguidance.numpy.fill_next_token_bitmask_par(executor(), plain, bits)
        if drafted:
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(executor(), drafted,
                                                                          bits)
        return bits


@functools.cache
def executor() -> llguidance.LLExecutor:
    """llguidance's thread pool (80% of the host's cores, at most 32)."""
    return llguidance.LLExecutor()
