"""The tokenizer and chat template of a GGUF model, rebuilt from its `tokenizer.ggml.*` metadata.

A GGUF file carries no `tokenizer.json`: it stores the vocabulary, the merges, the token types and
the special ids as metadata under llama.cpp's key names, plus a name (`tokenizer.ggml.pre`) for the
way text is split before BPE runs. llama.cpp is what gives those names a meaning, so the splits
below copy its definitions (`llm_tokenizer_bpe` in src/llama-vocab.cpp) and are built as a
HuggingFace `tokenizers` pipeline:

    Split(regex_1) -> ... -> Split(regex_n) -> ByteLevel(no regex) -> BPE(vocab, merges)

Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are built here, SentencePiece
ones ("llama": Llama 2, Mistral, Gemma) in tokenizer_spm.py; WordPiece ("bert"), Unigram ("t5")
and the rest are refused with a ValueError.

The chat template is rendered with a sandboxed jinja2 environment set up as transformers sets up
its own (`apply_chat_template`, chat_template.py), so the prompt text matches it character for
character.

A message's content is text, never control tokens: `encode_chat` reads "<|im_end|>" written in
a message as the characters it spells, so no message can close its turn and forge another
(transformers and llama.cpp tokenize the rendered prompt whole, and would read it as the
token). Only the template's own control tokens are read as tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from strata.model.chat_template import compile_template, unused_mark
from strata.model.tokenizer_spm import spm_backend

# tokenizer.ggml.token_type values (gguf.TokenType); the ones this module treats specially.
_CONTROL = 3  # special: <|im_start|>, <|endoftext|>; matched whole in text, skipped on decode
_USER_DEFINED = 4  # added but not special, e.g. <think>; matched whole, kept on decode


# --- pre-tokenizers, as llama.cpp defines each `tokenizer.ggml.pre` name -------------------------

# GPT-2's split; identical to the one `tokenizers`' ByteLevel(use_regex=True) applies.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3's split (tiktoken cl100k): digits in groups of at most three, newlines kept apart.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's split: as Llama 3's, but every digit alone.
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")


@dataclasses.dataclass(frozen=True)
class _Split:
    """How one family of `pre` names splits text before BPE, and what llama.cpp sets with it."""

    regexes: tuple[str, ...]  # applied in order, each isolating its matches in every piece
    ignore_merges: bool = False  # a piece that is itself a vocabulary token is taken whole
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


_GPT2_SPLIT = _Split((_GPT2,))
# StarCoder-style vocabularies isolate every digit first. SmolLM2's own tokenizer.json does the
# same (Digits(individual_digits=True) then ByteLevel), so this is the split its merges were
# learned on; transformers' GGUF loader has no entry for "smollm" and uses plain GPT-2 instead.
_DIGITS_SPLIT = _Split((r"\p{N}", _GPT2))
_LLAMA3_SPLIT = _Split((_LLAMA3,), ignore_merges=True, add_bos=True)
# llama.cpp's fallback for a missing or "default" name: punctuation runs apart, then GPT-2, then
# digit runs, then runs cut into threes. A quirk of llama.cpp, kept so such files agree with it.
_DEFAULT_SPLIT = _Split((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))

_SPLITS: dict[str, _Split] = {
    "default": _DEFAULT_SPLIT,
    **dict.fromkeys(
        ["gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion", "granite-docling"],
        _GPT2_SPLIT,
    ),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
        _DIGITS_SPLIT,
    ),
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
        _LLAMA3_SPLIT,
    ),
    # Same regex as Llama 3, but llama.cpp sets neither ignore_merges nor a BOS default for them.
    **dict.fromkeys(["dbrx", "smaug-bpe"], _Split((_LLAMA3,))),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"], _Split((_QWEN2,))),
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (transformers' `bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    spelling = {b: chr(b) for b in printable}
    unprintable = [b for b in range(256) if b not in spelling]
    spelling.update({b: chr(256 + i) for i, b in enumerate(unprintable)})
    return spelling


_BYTE_SPELLING = _byte_alphabet()
_BYTE_CHARS = frozenset(_BYTE_SPELLING.values())
_BYTE_OF = {c: b for b, c in _BYTE_SPELLING.items()}


def _byte_level_spelling(token: str) -> str:
    """A normal token as BPE looks it up. GGUF files store byte-level spellings already ("Ġthe");
    one that is not (a hand-written vocabulary with a raw " the") is re-spelled, as transformers
    does, so that it can still be produced."""
    if _BYTE_CHARS.issuperset(token):
        return token
    return "".join(_BYTE_SPELLING[b] for b in token.encode("utf-8"))


# --- reading the metadata ------------------------------------------------------------------------


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    """A metadata value: a scalar, a str, or a list of either; None when the key is absent.

    Read through `parts`/`data` rather than `ReaderField.contents()`, which older gguf lacks."""
    field = reader.fields.get(key)
    if field is None:
        return None
    kind, element = field.types[0], field.types[-1]
    as_str = lambda i: bytes(field.parts[i]).decode("utf-8", errors="replace")  # noqa: E731
    as_val = lambda i: field.parts[i].tolist()[0]  # noqa: E731
    convert = as_str if element == gguf.GGUFValueType.STRING else as_val
    if kind == gguf.GGUFValueType.ARRAY:
        return [convert(i) for i in field.data]
    return convert(field.data[0])


def _pre_tokenizer(split: _Split) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in split.regexes]
        # The splits above did the regex work; ByteLevel now only spells bytes.
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _build_backend(
    tokens: list[str], types: list[int], merges: list[str], split: _Split
) -> _Backend:
    """A `tokenizers` pipeline whose ids are exactly the GGUF's token indices."""
    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    for index, (text, kind) in enumerate(zip(tokens, types)):
        if kind in (_CONTROL, _USER_DEFINED):
            # Stored as the literal text (llama.cpp's converter does not byte-spell added tokens).
            added.append(AddedToken(text, special=kind == _CONTROL, normalized=False))
        else:
            text = _byte_level_spelling(text)
        # A repeated spelling keeps its first id: BPE can produce only one id per spelling.
        vocab.setdefault(text, index)

    bpe = models.BPE(
        vocab=vocab,
        merges=[tuple(m.split(" ", 1)) for m in merges],
        ignore_merges=split.ignore_merges,
        fuse_unk=False,
        byte_fallback=False,
    )
    backend = _Backend(bpe)
    backend.pre_tokenizer = _pre_tokenizer(split)
    backend.decoder = decoders.ByteLevel()
    # Already in the vocabulary, so these keep their GGUF ids instead of being appended.
    backend.add_tokens(added)
    for token in added:
        assert backend.token_to_id(token.content) == vocab[token.content], token.content
    return backend


# Turn-end tokens some families' chat templates close a turn with, which their files do not
# always name as eot: generation stops on them too.
_TURN_ENDS = {"gemma3": ("<end_of_turn>",), "qwen2": ("<|im_end|>",), "qwen3": ("<|im_end|>",)}


_UNMATCHED = "\uffff"   # not a token: the text between added tokens, to the finder


def _cut(text: str, spans: list[tuple[int, int]]) -> tuple[list[str], list[str]]:
    """`text` cut at `spans`: the pieces around them (one more than the spans) and the spans'
    texts."""
    ends = [0] + [x for span in spans for x in span] + [len(text)]
    return ([text[a:b] for a, b in zip(ends[::2], ends[1::2])],
            [text[a:b] for a, b in spans])


# --- the tokenizer -------------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids for one GGUF model, and its chat template."""

    def __init__(
        self,
        backend: _Backend,
        tokens: list[str],
        *,
        eos_id: int,
        bos_id: int | None,
        add_bos: bool,
        stop_ids: frozenset[int],
        chat_template: str | None,
        byte_level: bool = True,
        types: list[int] | None = None,
    ) -> None:
        self._backend = backend
        self._tokens = tokens  # GGUF spelling of each id, for the template's bos/eos strings
        self._byte_level = byte_level  # byte-level BPE spellings (else SentencePiece pieces)
        self._types = types or [1] * len(tokens)
        self._eos_id = eos_id
        self._bos_id = bos_id
        self._add_bos = add_bos
        self._stop_ids = stop_ids
        self._chat_template = chat_template
        self.vocab_size: int = len(tokens)
        # a token spells at most this many characters (GGUF spellings are one character per
        # byte), so a text of n characters has at least n / longest_token tokens
        self.longest_token: int = max(len(t) for t in tokens)

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        model = _field(reader, "tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise ValueError(
                f"The GGUF's tokenizer is tokenizer.ggml.model={model!r}; strata supports "
                "'gpt2' (byte-level BPE) and 'llama' (SentencePiece) vocabularies, so use a "
                "model with one."
            )
        pre = _field(reader, "tokenizer.ggml.pre") or "default"
        if model == "gpt2" and pre not in _SPLITS:
            raise ValueError(
                f"The GGUF's pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported; "
                f"supported names are {sorted(_SPLITS)}."
            )
        # SentencePiece: llama.cpp adds BOS unless the file says not to
        split = _SPLITS[pre] if model == "gpt2" else _Split((), add_bos=True)

        tokens: list[str] = _field(reader, "tokenizer.ggml.tokens") or []
        if not tokens:
            raise ValueError("The GGUF has no tokenizer.ggml.tokens, so it has no vocabulary.")
        types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(types) != len(tokens):
            raise ValueError(
                f"The GGUF lists {len(tokens)} tokens but {len(types)} token types; "
                "the file is inconsistent."
            )
        merges: list[str] = _field(reader, "tokenizer.ggml.merges") or []

        def token_id(key: str) -> int | None:
            value = _field(reader, f"tokenizer.ggml.{key}")
            # llama.cpp ignores an out-of-range id rather than failing; do the same.
            return value if value is not None and 0 <= value < len(tokens) else None

        eos_id = token_id("eos_token_id")
        if eos_id is None:
            raise ValueError(
                "The GGUF has no valid tokenizer.ggml.eos_token_id, so generation could not stop; "
                "write one into the file."
            )
        bos_id = token_id("bos_token_id")
        add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
        add_bos = split.add_bos if add_bos is None else bool(add_bos)
        if add_bos and bos_id is None:
            raise ValueError("The GGUF asks for a BOS token (add_bos_token) but names none.")

        if model == "gpt2":
            backend = _build_backend(tokens, types, merges, split)
        else:
            arch = _field(reader, "general.architecture")
            prefix = _field(reader, "tokenizer.ggml.add_space_prefix")
            backend = spm_backend(tokens, types, _field(reader, "tokenizer.ggml.scores"),
                                  token_id("unknown_token_id"),
                                  prefix_space=True if prefix is None else bool(prefix),
                                  rank_by_order=str(arch).startswith("gemma"))
        # What the metadata names, and the turn ends of the families that close a chat turn
        # with a token of their own (llama.cpp stops on those by their text)
        by_text = [tokens.index(t) for t in _TURN_ENDS.get(_field(reader, "general.architecture"), ())
                   if t in tokens]
        return cls(
            backend,
            tokens,
            eos_id=eos_id,
            bos_id=bos_id,
            add_bos=add_bos,
            stop_ids=frozenset(
                i
                for i in (eos_id, token_id("eot_token_id"), token_id("eom_token_id"), *by_text)
                if i is not None
            ),
            chat_template=_field(reader, "tokenizer.chat_template"),
            byte_level=model == "gpt2",
            types=types,
        )

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end generation: eos, and eot/eom where the file names them."""
        return self._stop_ids

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`. Control and user-defined tokens written in it ("<|im_start|>") are
        read as their ids. BOS is prepended only when the file asks for it (and add_bos), and
        not a second time when `text` already starts with it (a rendered chat template often
        does)."""
        # encode_batch releases the GIL while it works (encode holds it): a long text tokenized
        # in a worker thread leaves the caller's other threads running
        ids: list[int] = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        return self._with_bos(ids, add_bos)

    def _with_bos(self, ids: list[int], add_bos: bool = True) -> list[int]:
        if add_bos and self._add_bos and (not ids or ids[0] != self._bos_id):
            assert self._bos_id is not None  # from_gguf refuses add_bos without a bos id
            ids.insert(0, self._bos_id)
        return ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    control_in_content: bool = False, add_bos: bool = True) -> list[int]:
        """Token ids of `messages` through the chat template (BOS as `encode` adds it). The
        text of a control token inside a message's content is read as plain text (the ids of
        its characters), unless `control_in_content`; then, and for every message that has
        none, the ids are encode(render_chat(messages)).

        How: each control token's text in a content is replaced by a mark, the template is
        rendered, the text is cut at the template's control tokens, the marks are put back,
        and the pieces are tokenized with special-token matching off. The backend cuts a text
        at its added tokens before it pre-tokenizes and normalizes each piece alone, so
        tokenizing the pieces apart gives the ids it gives the whole text."""
        contents = [m.get("content") if isinstance(m.get("content"), str) else ""
                    for m in messages]
        found = [] if control_in_content else self._controls_in(contents)
        if not any(found):
            return self.encode(self.render_chat(messages, add_generation_prompt), add_bos)
        mark = unused_mark(contents + [self._chat_template or ""])
        hidden: list[str] = []

        def hide(text: str, spans: list[tuple[int, int]]) -> str:
            pieces, controls = _cut(text, spans)
            hidden.extend(controls)
            first = len(hidden) - len(controls)
            return "".join(p + (f"{mark}{first + i}{mark}" if i < len(controls) else "")
                           for i, p in enumerate(pieces))

        text = self.render_chat([{**m, "content": hide(c, spans)} if spans else m
                                 for m, c, spans in zip(messages, contents, found)],
                                add_generation_prompt)
        marked = re.compile(f"{mark}(\\d+){mark}")
        return self._with_bos(self._encode_as_text(
            text, lambda piece: marked.sub(lambda m: hidden[int(m.group(1))], piece)), add_bos)

    def _encode_as_text(self, text: str, restore=lambda piece: piece) -> list[int]:
        """Ids of `text` with its control tokens read as tokens, and whatever restore(piece)
        adds to a piece between them read as plain text. No BOS."""
        pieces, controls = _cut(text, self._controls_in([text])[0])
        encoded = self._plain_backend.encode_batch([restore(p) for p in pieces],
                                                   add_special_tokens=False)
        ids: list[int] = []
        for i, piece in enumerate(encoded):
            ids += piece.ids
            if i < len(controls):
                ids.append(self._backend.token_to_id(controls[i]))
        return ids

    def _controls_in(self, texts: list[str]) -> list[list[tuple[int, int]]]:
        """Per text, the (start, end) characters of each control token the backend finds in
        it, in time linear in the text (a regex of many tokens is not)."""
        finder, controls = self._added_tokens
        return [[span for i, span in zip(e.ids, e.offsets) if i in controls]
                for e in finder.encode_batch(texts, add_special_tokens=False)]

    @functools.cached_property
    def _added_tokens(self) -> tuple[_Backend, frozenset[int]]:
        """A tokenizer of the backend's added tokens alone, matched as the backend matches
        them (the text between is one unknown piece); and the ids in it of the control ones."""
        finder = _Backend(models.WordLevel({_UNMATCHED: 0}, unk_token=_UNMATCHED))
        added = list(self._backend.get_added_tokens_decoder().values())
        finder.add_tokens(added)
        return finder, frozenset(finder.token_to_id(t.content) for t in added if t.special)

    @functools.cached_property
    def _plain_backend(self) -> _Backend:
        """The backend with special-token matching off: "<|im_end|>" is text in it."""
        plain = _Backend.from_str(self._backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def spellings(self, ids: list[int]) -> list[str]:
        """Each token as the model file spells it ("Ġthe", "<|im_end|>")."""
        return [self._tokens[i] for i in ids]

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        """Text of `ids`; control tokens are dropped when `skip_special`. Bytes that do not form
        whole UTF-8 characters (a cut-off multi-byte token) come out as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token spells (part of a UTF-8 character, for some): a control or
        user-defined token its text; a byte-level one its bytes; a SentencePiece piece its
        text with U+2581 as a space, a byte-fallback piece (<0x0A>) its byte."""
        text = self._tokens[token_id]
        if self._types[token_id] not in (_CONTROL, _USER_DEFINED):
            if self._byte_level and _BYTE_CHARS.issuperset(text):
                return bytes(_BYTE_OF[c] for c in text)
            if not self._byte_level:
                if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                    return bytes([int(text[3:5], 16)])
                text = text.replace("\u2581", " ")
        return text.encode("utf-8")

    def tokenizers_json(self) -> str:
        """The `tokenizers` pipeline as JSON (what grammar libraries read the vocabulary from:
        coordinator/grammar.py)."""
        return self._backend.to_str()

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]) through the
        model's chat template, as transformers' apply_chat_template(tokenize=False) renders it."""
        if self._chat_template is None:
            raise ValueError(
                "This model has no chat template (the GGUF lacks tokenizer.chat_template), so "
                "--chat can't be used with it; pass a plain prompt instead."
            )

        def spelled(token_id: int | None) -> str:
            return "" if token_id is None else self._tokens[token_id]

        return compile_template(self._chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            # transformers passes these as None when absent; templates test `tools is defined`.
            tools=None,
            documents=None,
            bos_token=spelled(self._bos_id),
            eos_token=spelled(self._eos_id),
        )
