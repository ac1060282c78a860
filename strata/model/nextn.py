"""Where a model's NextN (MTP) head is, and whether it fits the model: in the model file itself
(llama.cpp's layout: `{arch}.nextn_predict_layers` > 0, the NextN block at the last block
indices) or in a sidecar GGUF made for it (`--mtp-head PATH`).

A sidecar names its target: dimensions, vocabulary and a fingerprint of the target's token
embedding (`strata.nextn.target_fingerprint`); one made for another model is refused with a
sentence. Heads that come with strata (strata/heads/: SmolLM2-135M-Instruct's) are found by
that fingerprint. The tensors are read by the stage that drafts (the last one: open_head, then
strata/stage_worker/drafter.py); strata-mkmodel --nextn / --nextn-sidecar writes random heads.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import GGUFReader

from strata.model.families import block_tensor_names, tensor_name
from strata.model.gguf_file import ModelConfig, ModelError, ModelFile, _field

TARGET_FINGERPRINT = "strata.nextn.target_fingerprint"
SHIPPED_HEADS = Path(__file__).resolve().parent.parent / "heads"


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


def shipped_head(file: ModelFile) -> HeadSource | None:
    """A head that comes with strata (strata/heads/, trained by strata-train-mtp) made for
    this model: its target fingerprint is the model's."""
    mine = None
    for path in sorted(SHIPPED_HEADS.glob("*.gguf")):
        have = _field(GGUFReader(path, "r"), TARGET_FINGERPRINT)
        mine = mine or embedding_fingerprint(file)
        if have == mine:
            return HeadSource(path, file.config.n_layers, sidecar=True)
    return None


def find_head(file: ModelFile, sidecar: str | os.PathLike | None = None,
              shipped: bool = True) -> HeadSource | None:
    """The model's NextN head: the sidecar when given (checked against the model), else the
    model file's own NextN layer, else (with `shipped`) a head shipped for it (shipped_head),
    else None. A stage passes shipped=False: the launch hands it a shipped head as its
    --mtp-head, and only when it drafts with it."""
    cfg = file.config
    if sidecar is None:
        if nextn_layers(file.reader, cfg.arch) < 1:
            return shipped_head(file) if shipped else None
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


# The head's tensors at block N (torch order [out, in]; D model width, V vocabulary): the
# NextN projections, then the block's own tensors as its family has them (a routed block
# for glm4moe). embed_tokens and shared_head_head are optional (absent: the model's own
# embedding and output head).
NEXTN_TENSORS = ("eh_proj", "enorm", "hnorm", "shared_head_norm")
NEXTN_OPTIONAL = ("embed_tokens", "shared_head_head")
BLOCK_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                 "ffn_gate", "ffn_up", "ffn_down")   # a llama block's (strata-train-mtp's)


def head_shapes(cfg: ModelConfig, block: int) -> dict[str, tuple[int, ...] | None]:
    """Every tensor a NextN head at `block` may hold, with its shape in torch order (None: a
    shared expert's, whose width the file alone says)."""
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.d_ffn
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    e, fe = cfg.n_experts, cfg.d_ffn_expert
    n = f"blk.{block}.nextn."
    shapes = {n + "eh_proj.weight": (d, 2 * d), n + "enorm.weight": (d,),
              n + "hnorm.weight": (d,), n + "shared_head_norm.weight": (d,),
              n + "embed_tokens.weight": (cfg.vocab, d),
              n + "shared_head_head.weight": (cfg.vocab, d)}
    known = {"attn_norm": (d,), cfg.family.ffn_norm: (d,), "attn_q": (q, d),
             "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q),
             "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
             "attn_q_norm": (hd,), "attn_k_norm": (hd,), "post_attention_norm": (d,),
             "post_ffw_norm": (d,), "ffn_gate": (f, d), "ffn_up": (f, d), "ffn_down": (d, f),
             "ffn_gate_inp": (e, d), "ffn_gate_exps": (e, fe, d), "ffn_up_exps": (e, fe, d),
             "ffn_down_exps": (e, d, fe), "exp_probs_b.bias": (e,)}
    for name in block_tensor_names(cfg.family, cfg.routed(block)):
        shapes[tensor_name(block, name)] = known.get(name)
    return shapes


class HeadFile(ModelFile):
    """A sidecar's tensors, read with the target model's configuration (a sidecar holds only
    the head: its block's shapes are the model's), but for the block's feed-forward width,
    which is the sidecar's own `{arch}.feed_forward_length` (a head may be wider than a
    layer of its model: strata-train-mtp --head-ffn)."""

    def __init__(self, path: Path, target: ModelConfig):
        # not ModelFile.__init__: that reads a model's configuration, which a sidecar may lack
        self.path = Path(path)
        self.reader = GGUFReader(self.path, "c")
        self.tensors = {t.name: t for t in self.reader.tensors}
        ffn = _field(self.reader, f"{target.arch}.feed_forward_length")
        self.config = target if ffn is None else replace(target, d_ffn=int(ffn))
        self._check_tensor_types()


def open_head(source: HeadSource, file: ModelFile) -> ModelFile:
    """The file to read the head's tensors from (the model file itself, or its sidecar read
    with the model's configuration), its tensors checked: each one present with the model's
    shapes (a sidecar's feed-forward width its own), or a ModelError that says which is not."""
    head = HeadFile(source.path, file.config) if source.sidecar else file
    wrong = []
    for name, shape in head_shapes(head.config, source.block).items():
        t = head.tensors.get(name)
        if t is None:
            if name.split(".")[-2] not in NEXTN_OPTIONAL:
                wrong.append(f"{name} is missing")
            continue
        have = tuple(int(x) for x in reversed(t.shape))
        if shape is not None and have != shape:
            wrong.append(f"{name} has shape {list(have)}, not {list(shape)}")
    if wrong:
        raise ModelError(f"the NextN head in {source.describe()} does not fit the model: "
                         f"{'; '.join(wrong)}; use a head made for {file.path.name}")
    return head
