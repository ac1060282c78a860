"""A small byte-level BPE vocabulary for GGUF files with random weights: GPT-2's 256 byte
tokens (id = byte value), three ChatML control tokens, merged tokens with matching merges, then
unused fillers up to the model's vocabulary size, and a ChatML chat template."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from gguf import GGUFWriter, TokenType

# The byte-level alphabet (256) plus <|endoftext|>, <|im_start|>, <|im_end|>.
N_BASE_TOKENS = 259

# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character mapping."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


EOS_TOKEN = "<|endoftext|>"
# tokenizer.ggml.pre: the merges are GPT-2-style, learned on GPT-2's split of text
PRE_TOKENIZER = "gpt-2"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Frequent English merges in GPT-2 style (Ġ is the byte-level space), each made of tokens that
# precede it; extended systematically by _merge_candidates.
_COMMON_MERGES = (
    "Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t", "Ġ w", "Ġ o",
    "e n", "Ġ c", "i t", "i s", "a n", "o r", "e s", "Ġ b", "e d", "Ġ f", "in g", "Ġ p",
    "o u", "Ġa n", "a l", "a r", "Ġt o", "Ġ m", "Ġo f", "Ġ in", "Ġ d", "Ġ h", "Ġan d", "i c",
    "a s", "l e", "Ġt h", "i on", "o m", "l l", "en t", "Ġ n", "Ġ l", "s t", "Ġ re", "v e",
    "Ġ e", "r o", "l y", "Ġb e", "Ġ g", "Ġ T", "c t", "Ġ S", "i d", "o t", "Ġ I", "u t",
    "e t", "Ġ A", "Ġi s", "Ġo n", "i m", "a m", "o w", "a y", "a d", "s e", "Ġth at", "Ġ C",
    "i g", "Ġf or", "a c", "Ġ y", "v er", "u r", "Ġ u", "l d", "Ġs t", "Ġ M", "' s", "Ġ he",
    "Ġ it", "at ion", "it h", "i r", "c e", "Ġy ou", "i l", "Ġ B", "Ġw h", "o l", "Ġ P",
    "Ġw ith", "Ġ 1", "t er", "c h", "Ġa s", "Ġw e", "Ġ (", "n d", "i ll", "Ġ D", "i f",
    "Ġ 2", "a g", "er s", "k e", "Ġ \"", "Ġ H", "e m", "Ġc on", "Ġ W", "Ġ R", "he r",
    "Ġw as", "Ġ r", "o d", "Ġ F", "u l", "at e", "Ġa t", "r i", "p p", "o re", "ĠT he",
    "Ġs e", "u s", "Ġp ro", "Ġh a", "u m", "Ġa re", "Ġd e", "a in", "an d", "Ġo r", "ig h",
    "es t", "is t", "a b", "r om", "Ġ N", "t h", "Ġc om", "Ġ G", "u n", "o p", "0 0", "Ġ L",
    "Ġn ot", "es s", "Ġe x", "Ġ v", "re s", "Ġ E", "e w", "it y", "an t", "Ġb y", "e l",
    "o s", "or t", "o c", "q u", "Ġf rom", "Ġha ve", "Ġs u", "i ve", "ou ld", "Ġs h",
    "Ġth is", "n t", "r a", "p e", "igh t", "ar t", "m ent", "a le", "' t", "en d", "Ġ O",
)


def _merge_candidates() -> Iterator[tuple[str, str]]:
    seen: set[str] = set()
    for m in _COMMON_MERGES:
        a, b = m.split(" ")
        if a + b not in seen:
            seen.add(a + b)
            yield a, b
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    for c in letters + letters.upper():
        if "Ġ" + c not in seen:
            seen.add("Ġ" + c)
            yield "Ġ", c
    for a in letters:
        for b in letters:
            if a + b not in seen:
                seen.add(a + b)
                yield a, b
    for a in letters:
        for b in letters:
            if "Ġ" + a + b not in seen:
                seen.add("Ġ" + a + b)
                yield "Ġ" + a, b


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    eos_id: int
    bos_id: int


def make_vocabulary(vocab_size: int) -> Vocabulary:
    """A byte-level gpt2-style vocabulary of exactly ``vocab_size`` tokens.

    Ids 0-255 are the byte-level characters in byte order (id == byte value), 256-258 the
    control tokens <|endoftext|> (eos and bos), <|im_start|>, <|im_end|>; then merged tokens
    with their merges (up to the candidates available), then "<|unused_N|>" tokens of type
    UNUSED.
    """
    if vocab_size < N_BASE_TOKENS:
        raise ValueError(f"vocab_size {vocab_size} < {N_BASE_TOKENS}")
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)] + list(SPECIAL_TOKENS)
    types = [int(TokenType.NORMAL)] * 256 + [int(TokenType.CONTROL)] * len(SPECIAL_TOKENS)
    merges: list[str] = []
    room = vocab_size - len(tokens)
    for a, b in _merge_candidates():
        if len(merges) >= room:
            break
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        types.append(int(TokenType.NORMAL))
    n_unused = vocab_size - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(n_unused)]
    types += [int(TokenType.UNUSED)] * n_unused
    eos = tokens.index(EOS_TOKEN)
    return Vocabulary(tokens, types, merges, eos_id=eos, bos_id=eos)


def add_tokenizer(writer: GGUFWriter, vocab_size: int) -> None:
    v = make_vocabulary(vocab_size)
    writer.add_tokenizer_model("gpt2")
    # GPT-2's split, under the name llama.cpp knows it by ("gpt2" it refuses as unknown)
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(v.tokens)
    writer.add_token_types(v.token_types)
    writer.add_token_merges(v.merges)
    writer.add_bos_token_id(v.bos_id)
    writer.add_eos_token_id(v.eos_id)
    writer.add_pad_token_id(v.eos_id)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHAT_TEMPLATE)


