"""SentencePiece vocabularies of GGUF files (`tokenizer.ggml.model == "llama"`: Llama 2,
Mistral, Gemma) as a HuggingFace `tokenizers` pipeline whose ids are the file's indices.

The file lists tokens and scores but no merges. SentencePiece's BPE joins, at each step, the
adjacent pair whose joined piece ranks best; as a `tokenizers` BPE that is every split of a
vocabulary token into two vocabulary tokens, ranked by the joined token's score, with byte
fallback (`<0x0A>` tokens) for what the vocabulary cannot spell. Spaces are spelled U+2581;
files that ask for it (tokenizer.ggml.add_space_prefix, true unless said otherwise) get one
before the text, and lose it on decode. Gemma's files differ in two ways transformers' GGUF
loader knows: their scores do not follow the merge order, the order of the tokens in the file
does; and a token of several spaces is stored with real spaces.
"""
from __future__ import annotations

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as _Backend

SPACE = "\u2581"
_CONTROL, _USER_DEFINED = 3, 4


def spm_backend(tokens: list[str], types: list[int], scores: list[float] | None,
                unk_id: int | None, prefix_space: bool, rank_by_order: bool) -> _Backend:
    """The pipeline (see the module); rank_by_order: Gemma's merge ranking (file order)."""
    if rank_by_order:   # Gemma: "  " stored with spaces, spelled as the model reads it
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    for index, (text, kind) in enumerate(zip(tokens, types)):
        if kind in (_CONTROL, _USER_DEFINED):
            added.append(AddedToken(text, special=kind == _CONTROL, normalized=False))
        vocab[text] = index   # a repeated spelling keeps its last id, as transformers reads it
    rank = ({t: -i for i, t in enumerate(tokens)} if rank_by_order or scores is None
            else dict(zip(tokens, scores)))
    bpe = models.BPE(vocab=vocab, merges=_merges(vocab, rank), fuse_unk=True,
                     unk_token=tokens[unk_id] if unk_id is not None else None,
                     byte_fallback=True)
    backend = _Backend(bpe)
    spaces = normalizers.Replace(" ", SPACE)
    backend.normalizer = (normalizers.Sequence([normalizers.Prepend(SPACE), spaces])
                          if prefix_space else spaces)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)]
                                                 if prefix_space else []))
    backend.add_tokens(added)   # already in the vocabulary: they keep their file ids
    return backend


def _merges(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary tokens, the best-ranked joined token first
    (ties: the longer left piece, then the longer right one, then the file's order, as
    transformers orders them)."""
    found = []
    for token, score in rank.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found += [(score, left, right) for left, right in pairs]
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in found]
