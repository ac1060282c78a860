"""A GGUF model file: its configuration, its fingerprint and its tensors, read through gguf-py.

The reader memory-maps the file, so a stage that loads only its own layers touches only their
bytes. Dequantization is gguf-py's (`gguf.quants.dequantize`); nothing here re-implements it.
torch is imported only where a tensor is made: the launcher reads the configuration and refuses
a bad flag without it.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from strata.model.families import FAMILIES, Family

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHS = tuple(FAMILIES)
# a block's matrices as a stage computes them: [q; k; v] and [gate; up] fused, one matmul each
FUSED_MATRICES = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"),
                  ("ffn_down",))
ATTENTION_MATRICES = FUSED_MATRICES[:2]   # an MoE block's: its experts are tensors of their own
FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)


def gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(version unknown)"


class ModelError(ValueError):
    """A model file the user pointed at that strata cannot use; the message says why."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ffn: int
    vocab: int
    ctx_len: int
    rope_base: float
    rope_dim: int
    rms_eps: float
    tied_head: bool  # no output.weight: the head is the token embedding
    family: Family = FAMILIES["llama"]   # how the forward path differs (model/families.py)
    attn_scale: float = 0.0   # the scores' scale; 0: 1/sqrt(head_dim)
    window: int = 0           # a sliding layer's keys (positions p - window + 1 .. p); 0: none
    rope_scale: float = 1.0   # linear RoPE scaling of the global layers (positions / scale)
    n_experts: int = 0        # routed experts a layer (0: a dense feed-forward)
    n_experts_used: int = 0   # experts a row takes
    d_ffn_expert: int = 0     # an expert's feed-forward width
    n_dense_first: int = 0    # MoE: the first layers keep a dense feed-forward
    expert_scale: float = 1.0           # the routed weights' scale
    expert_groups: tuple[int, int] = (1, 1)   # (groups of experts, groups a row chooses in)

    def routed(self, layer: int) -> bool:
        """Whether a layer's feed-forward is routed experts."""
        return self.family.moe and layer >= self.n_dense_first
    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    def sliding(self, layer: int) -> bool:
        """Whether a layer attends in a window (with the family's local RoPE base)."""
        period = self.family.sliding_period
        return bool(self.window and period and (layer + 1) % period)

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"{self.n_heads} query heads is not a multiple of "
                             f"{self.n_kv_heads} key/value heads")
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise ModelError(f"rope dimension count {self.rope_dim} does not fit head size "
                             f"{self.head_dim}")


_ARRAY, _STRING = int(GGUFValueType.ARRAY), int(GGUFValueType.STRING)


class Reader(GGUFReader):
    """gguf-py's reader, parsing the metadata faster into the same fields. Through a plain-array
    view of its memory map (the same pages): slicing an np.memmap runs memmap's Python hooks for
    each of the ~250k slices a vocabulary of 49k tokens and its merges are parsed into. And the
    arrays of strings and numbers a slice an element in one loop (_get_field_parts), where
    gguf-py parses each element as a field of its own: SmolLM2's 49k tokens, their types and
    49k merges, which every stage process parses on opening the file and never uses."""

    def _build_fields(self, *args, **kwargs):  # GGUFReader.__init__ parses the fields here
        self.data = self.data.view(np.ndarray)
        return super()._build_fields(*args, **kwargs)

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        """gguf-py's parts of a field (its size, parts, data indices, types), an array of
        strings or of one number type read here: a length and a bytes slice a string, a
        one-element slice a number, as gguf-py makes them. Other fields, and files of the other
        byte order, are gguf-py's."""
        if raw_type != _ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        itype = int(raw_itype[0])
        number = self.gguf_scalar_to_np.get(GGUFValueType(itype))
        if itype != _STRING and number is None:      # arrays of arrays
            return super()._get_field_parts(orig_offs, raw_type)
        alen = self._get(orig_offs + 4, np.uint64)
        count, data, offs = int(alen[0]), self.data, orig_offs + 12
        parts = [raw_itype, alen]
        if itype == _STRING:
            for _ in range(count):
                size = data[offs:offs + 8].view(np.uint64)
                end = offs + 8 + int(size[0])
                if end > len(data):
                    raise ValueError(f"a string at byte {offs} runs past the end of the file")
                parts += (size, data[offs + 8:end])
                offs = end
            at = list(range(3, len(parts), 2))
        else:
            end = offs + np.dtype(number).itemsize * count
            if end > len(data):
                raise ValueError(f"an array at byte {offs} runs past the end of the file")
            values = data[offs:end].view(number)
            parts += (values[i:i + 1] for i in range(count))
            offs, at = end, list(range(2, len(parts)))
        return offs - orig_offs, parts, at, [GGUFValueType.ARRAY] + (
            [GGUFValueType(itype)] if count else [])


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


class ModelFile:
    """An opened GGUF file. Cheap to open: tensors are read only when asked for."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if self.path.is_dir():
            ggufs = sorted(p.name for p in self.path.glob("*.gguf"))
            raise ModelError(f"{self.path} is a directory, not a model file; pass --model with "
                             f"the path of a .gguf file" + (f" (here: {', '.join(ggufs[:3])})"
                                                             if ggufs else ""))
        if not self.path.is_file():
            raise ModelError(f"model file {self.path} does not exist; pass --model with the path "
                             f"of a .gguf file, or smollm2-135m for the embedded model")
        try:
            self.reader = Reader(self.path, "c")  # copy-on-write: tensors are writable
        except Exception as e:  # gguf-py raises ValueError, struct errors, IndexError...
            raise ModelError(f"model file {self.path} is not a readable GGUF file "
                             f"({type(e).__name__}: {e}); check the path or download it again") from e
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.config = self._read_config()
        self._check_tensor_types()

    def _read_config(self) -> ModelConfig:
        arch = _field(self.reader, "general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise ModelError(f"model architecture {arch!r} is not supported; strata runs "
                             f"{', '.join(SUPPORTED_ARCHS)}")

        def need(key):
            value = _field(self.reader, f"{arch}.{key}")
            if value is None:
                raise ModelError(f"model file {self.path} lacks the metadata key {arch}.{key}")
            return value

        d_model, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
        head_dim = int(_field(self.reader, f"{arch}.attention.key_length", d_model // n_heads))
        family = FAMILIES[arch]
        n_layers = int(need("block_count")) - int(_field(self.reader,
                                                         f"{arch}.nextn_predict_layers", 0) or 0)
        vocab = _field(self.reader, f"{arch}.vocab_size")
        if vocab is None:
            if "token_embd.weight" not in self.tensors:
                raise ModelError(f"model file {self.path} has neither {arch}.vocab_size nor "
                                 f"token_embd.weight")
            vocab = self.tensors["token_embd.weight"].shape[-1]
        scaling = _field(self.reader, f"{arch}.rope.scaling.type")
        if scaling not in (None, "none", "linear"):
            raise ModelError(f"model file {self.path} asks for {scaling!r} RoPE scaling; "
                             f"strata applies none or linear")
        attn_scale = 0.0
        if arch == "gemma3" and n_layers == 62:   # 27B: llama.cpp's query_pre_attn_scalar
            attn_scale = (d_model / n_heads) ** -0.5
        return ModelConfig(
            arch=arch,
            # a NextN (MTP) layer sits at the last block indices (strata/model/nextn.py)
            n_layers=n_layers,
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(_field(self.reader, f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            d_ffn=int(need("feed_forward_length")),
            vocab=int(vocab),
            ctx_len=int(_field(self.reader, f"{arch}.context_length", 2048)),
            rope_base=float(_field(self.reader, f"{arch}.rope.freq_base", 10000.0)),
            rope_dim=int(_field(self.reader, f"{arch}.rope.dimension_count", head_dim)),
            rms_eps=float(need("attention.layer_norm_rms_epsilon")),
            tied_head="output.weight" not in self.tensors,
            family=family,
            attn_scale=attn_scale,
            window=int(_field(self.reader, f"{arch}.attention.sliding_window", 0) or 0)
            if family.sliding_period else 0,
            rope_scale=float(_field(self.reader, f"{arch}.rope.scaling.factor", 1.0) or 1.0)
            if scaling == "linear" else 1.0,
            **(self._experts(arch, need) if family.moe else {}),
        )

    def _experts(self, arch: str, need) -> dict:
        """The routed experts' keys (llama.cpp's names)."""
        get = lambda key, default: _field(self.reader, f"{arch}.{key}", default)  # noqa: E731
        return dict(n_experts=int(need("expert_count")),
                    n_experts_used=int(need("expert_used_count")),
                    d_ffn_expert=int(need("expert_feed_forward_length")),
                    n_dense_first=int(get("leading_dense_block_count", 0)),
                    expert_scale=float(get("expert_weights_scale", 1.0) or 1.0),
                    expert_groups=(int(get("expert_group_count", 1) or 1),
                                   int(get("expert_group_used_count", 1) or 1)))

    def _check_tensor_types(self):
        """Every type gguf-py can dequantize loads: each type's first block is tried."""
        tried = set(FLOAT_TYPES)
        for t in self.reader.tensors:
            if t.tensor_type in tried:
                continue
            tried.add(t.tensor_type)
            block_bytes = GGML_QUANT_SIZES[t.tensor_type][1]
            try:
                dequantize(t.data.reshape(-1)[:block_bytes].view(np.uint8), t.tensor_type)
            except NotImplementedError:
                raise ModelError(f"tensor {t.name} has type {t.tensor_type.name}, which gguf-py "
                                 f"{gguf_version()} cannot dequantize; convert the file to "
                                 f"another type (llama.cpp's llama-quantize) or upgrade the "
                                 f"gguf package") from None

    def tensor_type(self, name: str) -> str:
        """The GGUF type name of a tensor (F32, BF16, Q4_K, IQ3_S, ...)."""
        return self._info(name).tensor_type.name

    def blocks(self, name: str) -> tuple[np.ndarray, int]:
        """A matrix's rows as the file stores them: (uint8 [N, K / block * type_size], K),
        a view of the memory map."""
        t = self._info(name)
        cols = int(t.shape[0])
        return np.asarray(t.data).reshape(int(np.prod(t.shape[1:])), -1).view(np.uint8), cols

    def _info(self, name: str):
        t = self.tensors.get(name)
        if t is None:
            raise ModelError(f"model file {self.path} has no tensor {name}")
        return t

    def fingerprint(self) -> str:
        """Identifies the model: size, tensor layout, metadata, and the first and last bytes of
        every tensor (a few KiB each, so gigabytes of weights are not hashed)."""
        h = hashlib.sha256(str(self.path.stat().st_size).encode())
        for t in self.reader.tensors:
            h.update(f"{t.name}:{t.tensor_type.name}:{list(t.shape)}:{t.data_offset};".encode())
            raw = t.data.reshape(-1).view(np.uint8)
            h.update(raw[:4096].tobytes() + raw[-4096:].tobytes())
        for key in ("general.architecture", "general.name", "general.file_type"):
            h.update(f"{key}={_field(self.reader, key)};".encode())
        return h.hexdigest()[:16]

    def tensor(self, name: str, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None) -> torch.Tensor:
        """Dequantized tensor in torch's [out, in] order (GGUF lists dimensions reversed), as
        `dtype` (default: float32) on `device` (default: the CPU).

        F16 and BF16 tensors are read straight from the memory map (no float32 round trip) and
        converted on the device; both widen to float32 exactly, so every dtype gets the same
        values as through gguf-py. Quantized types go through gguf-py on the CPU.
        """
        t = self._info(name)
        import torch
        dtype = dtype or torch.float32
        shape = tuple(int(d) for d in reversed(t.shape))
        device = torch.device(device or "cpu")
        if t.tensor_type in (QType.F16, QType.BF16):
            # the mapped bytes as 16-bit words [out, in]: no copy until .to()
            raw = torch.from_numpy(np.asarray(t.data).reshape(-1).view(np.int16)).view(shape)
            raw = raw.view(torch.float16 if t.tensor_type == QType.F16 else torch.bfloat16)
            return raw.to(device, copy=True).to(dtype)
        if t.tensor_type == QType.F32:
            data = np.asarray(t.data, dtype=np.float32)
        else:
            data = dequantize(t.data, t.tensor_type)
        out = torch.from_numpy(np.ascontiguousarray(data).reshape(shape))
        return out.to(dtype) if device.type == "cpu" else out.to(device).to(dtype)
