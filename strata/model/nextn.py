"""Where a model's NextN (MTP) head is, and whether it fits the model: in the model file itself
(llama.cpp's layout: `{arch}.nextn_predict_layers` > 0, the NextN block at the last block
indices) or in a sidecar GGUF made for it (`--mtp-head PATH`).

A sidecar names its target: dimensions, vocabulary and a fingerprint of the target's token
embedding (`strata.nextn.target_fingerprint`); one made for another model is refused with a
sentence. The tensors are read by the stage that drafts (the last one).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader

from strata.model.gguf_file import ModelError, ModelFile, _field

TARGET_FINGERPRINT = "strata.nextn.target_fingerprint"


@dataclass(frozen=True)
class HeadSource:
    """Where the head's tensors are: `path` (the model file or a sidecar) and the block index
    of the NextN layer in it (`blk.{block}.nextn.*`, `blk.{block}.attn_*`, ...)."""
    path: Path
    block: int
    sidecar: bool

    def describe(self) -> str:
        return f"the sidecar {self.path}" if self.sidecar else f"the model file {self.path.name}"


def nextn_layers(reader: GGUFReader, arch: str) -> int:
    """`{arch}.nextn_predict_layers` (0 when absent)."""
    return int(_field(reader, f"{arch}.nextn_predict_layers", 0) or 0)


def embedding_fingerprint(file: ModelFile) -> str:
    """Identifies a model's token embedding (shape, type, and its first and last bytes)."""
    t = file.tensors.get("token_embd.weight")
    if t is None:
        raise ModelError(f"model file {file.path} has no token_embd.weight to fingerprint")
    raw = t.data.reshape(-1).view(np.uint8)
    h = hashlib.sha256(f"{t.tensor_type.name}:{list(t.shape)};".encode())
    h.update(raw[:4096].tobytes() + raw[-4096:].tobytes())
    return h.hexdigest()[:16]


def find_head(file: ModelFile, sidecar: str | os.PathLike | None = None) -> HeadSource | None:
    """The model's NextN head: the sidecar when given (checked against the model), else the
    model file's own NextN layer, else None."""
    cfg = file.config
    if sidecar is None:
        if nextn_layers(file.reader, cfg.arch) < 1:
            return None
        return HeadSource(file.path, cfg.n_layers, sidecar=False)
    path = Path(sidecar)
    if not path.is_file():
        raise ModelError(f"--mtp-head {path} does not exist; pass the path of a NextN head "
                         f"GGUF made for this model (strata-train-mtp writes one)")
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # gguf-py raises ValueError, struct errors, IndexError...
        raise ModelError(f"--mtp-head {path} is not a readable GGUF file "
                         f"({type(e).__name__}: {e})") from e
    arch = _field(reader, "general.architecture")
    if arch != cfg.arch or nextn_layers(reader, arch) < 1:
        raise ModelError(f"--mtp-head {path} is not a NextN head for a {cfg.arch} model (its "
                         f"architecture is {arch!r}, its {arch}.nextn_predict_layers "
                         f"{nextn_layers(reader, arch) if arch else 0})")
    mismatch = []
    for key, want in (("embedding_length", cfg.d_model), ("vocab_size", cfg.vocab)):
        have = _field(reader, f"{arch}.{key}")
        if have is None or int(have) != want:
            mismatch.append(f"{key} {have} (the model's: {want})")
    have = _field(reader, TARGET_FINGERPRINT)
    if have != embedding_fingerprint(file):
        mismatch.append(f"target fingerprint {have} (the model's: {embedding_fingerprint(file)})")
    if mismatch:
        raise ModelError(f"--mtp-head {path} was made for another model: {'; '.join(mismatch)}; "
                         f"use a head trained for {file.path.name}")
    return HeadSource(path, cfg.n_layers, sidecar=True)
