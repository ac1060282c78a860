"""Write GGUF files of the model families (model/families.py) with random weights.

Used by tests to make tiny models, and by ``strata-mkmodel`` to make files of real shapes
(SmolLM2-135M, Llama-3-8B) for performance runs.

Layout: tensors are generated in GGUF's row-major ``(out, in)`` order (torch's ``[out, in]``),
so GGUFReader reports ``t.shape == [in, out]``. Q and K are whatever random numbers were drawn:
there is no "unpermuted" original, so a loader must treat them as llama.cpp-layout weights.

Reproducibility: each tensor has its own generator, ``numpy.random.default_rng([seed,
crc32(name)])``, drawn row-chunk by row-chunk. A tensor's values therefore depend only on
(seed, name, shape, std), not on the weight type, on tying or on the other tensors, and
:func:`random_tensor` recomputes exactly what the writer generated before quantization.

Memory: tensor infos are declared up front and data is streamed one tensor at a time, each
generated in row chunks into a buffer of the output type, so the peak is about one tensor in
the output type (for llama3-8b in BF16: the 1 GB embedding) plus one chunk, whatever the model
size.
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QType
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

from strata.model.kquant_blocks import (DEFAULT_STD, random_blocks,  # noqa: F401
                                        random_kquant_blocks, random_pool, write_raw_blocks_gguf)
from strata.model.quant_mix import (MIX_TYPES, MIXES, QUANTIZABLE_TYPES,  # noqa: F401
                                    RANDOM_BLOCK_TYPES, WEIGHT_TYPES, file_type, mix_tensor_type,
                                    weight_type_name)
# the vocabulary's names stay importable from here, where tests and tools look for them
from strata.model.families import FAMILIES
from strata.model.shapes import SHAPES, ModelShape, add_llama_config, get_shape  # noqa: F401
from strata.model.synthetic_vocab import (CHAT_TEMPLATE, EOS_TOKEN, N_BASE_TOKENS,  # noqa: F401
                                          PRE_TOKENIZER, SPECIAL_TOKENS, Vocabulary,
                                          add_tokenizer, bytes_to_unicode, make_vocabulary)


# --------------------------------------------------------------------------------------------
# Weight types
# --------------------------------------------------------------------------------------------

# The weight types (WEIGHT_TYPES) and what each tensor gets are in quant_mix; the blocks of
# the types gguf-py cannot quantize to (RANDOM_BLOCK_TYPES) are made by kquant_blocks.

def _row_nbytes(qtype: QType, cols: int) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"row length {cols} is not a multiple of the {qtype.name} block size "
                         f"{block}")
    return cols // block * type_size


# --------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # torch order: (out, in) for matrices ((experts, out, in) for an
                            # MoE layer's), (n,) for norms
    kind: str               # "norm" (F32, ~1.0), "bias" or "router" (F32, ~N(0, std)) or
                            # "matrix" (weight_type, ~N(0, std))

    @property
    def rows(self) -> int:
        """A matrix's rows as the file stores them (an expert tensor's: experts x out)."""
        return int(np.prod(self.shape[:-1]))


def _block_specs(block: int, shape: ModelShape) -> list[TensorSpec]:
    """A block's tensors (attention and FFN) under blk.{block}, with its family's own."""
    d, hd, ffn = shape.d_model, shape.head_dim, shape.d_ffn
    q_out, kv_out = shape.n_heads * hd, shape.n_kv_heads * hd
    b = f"blk.{block}."
    family = FAMILIES[shape.arch]
    extra = []
    if family.qkv_bias:
        extra += [TensorSpec(b + f"attn_{p}.bias", (n,), "bias")
                  for p, n in (("q", q_out), ("k", kv_out), ("v", kv_out))]
    if family.qk_norm:
        extra += [TensorSpec(b + f"attn_{p}_norm.weight", (hd,), "norm") for p in "qk"]
    if family.post_norms:
        extra += [TensorSpec(b + f"{n}.weight", (d,), "norm")
                  for n in ("post_attention_norm", "post_ffw_norm")]
    return extra + [
        TensorSpec(b + "attn_norm.weight", (d,), "norm"),
        TensorSpec(b + "attn_q.weight", (q_out, d), "matrix"),
        TensorSpec(b + "attn_k.weight", (kv_out, d), "matrix"),
        TensorSpec(b + "attn_v.weight", (kv_out, d), "matrix"),
        TensorSpec(b + "attn_output.weight", (d, q_out), "matrix"),
        TensorSpec(b + f"{family.ffn_norm}.weight", (d,), "norm"),
    ] + (_expert_specs(b, shape) if shape.routed(block) else [
        TensorSpec(b + "ffn_gate.weight", (ffn, d), "matrix"),
        TensorSpec(b + "ffn_up.weight", (ffn, d), "matrix"),
        TensorSpec(b + "ffn_down.weight", (d, ffn), "matrix"),
    ])


def _expert_specs(b: str, shape: ModelShape) -> list[TensorSpec]:
    """A routed block's feed-forward in llama.cpp's layout: the router (F32, as llama-quantize
    leaves it), the experts [E, F, D] / [E, D, F], glm4moe's correction bias and shared
    expert."""
    d, (count, _, width) = shape.d_model, shape.experts
    family = FAMILIES[shape.arch]
    specs = [TensorSpec(b + "ffn_gate_inp.weight", (count, d), "router"),
             TensorSpec(b + "ffn_gate_exps.weight", (count, width, d), "matrix"),
             TensorSpec(b + "ffn_up_exps.weight", (count, width, d), "matrix"),
             TensorSpec(b + "ffn_down_exps.weight", (count, d, width), "matrix")]
    if family.sigmoid_gating:
        specs.append(TensorSpec(b + "exp_probs_b.bias", (count,), "bias"))
    if family.shared_expert:
        specs += [TensorSpec(b + "ffn_gate_shexp.weight", (width, d), "matrix"),
                  TensorSpec(b + "ffn_up_shexp.weight", (width, d), "matrix"),
                  TensorSpec(b + "ffn_down_shexp.weight", (d, width), "matrix")]
    return specs


def nextn_specs(shape: ModelShape) -> list[TensorSpec]:
    """A NextN (MTP) head in llama.cpp's layout at block n_layers: its projections and norms,
    then an ordinary block. No embed_tokens or shared_head_head: the model's own serve."""
    d, n = shape.d_model, f"blk.{shape.n_layers}.nextn."
    return [TensorSpec(n + "eh_proj.weight", (d, 2 * d), "matrix"),
            TensorSpec(n + "enorm.weight", (d,), "norm"),
            TensorSpec(n + "hnorm.weight", (d,), "norm"),
            TensorSpec(n + "shared_head_norm.weight", (d,), "norm"),
            ] + _block_specs(shape.n_layers, shape)


def tensor_specs(shape: ModelShape, tied: bool = True, nextn: bool = False) -> list[TensorSpec]:
    """The tensors of a llama model in the order they are written (with nextn, a NextN head
    after the blocks)."""
    specs = [TensorSpec("token_embd.weight", (shape.vocab, shape.d_model), "matrix")]
    for i in range(shape.n_layers):
        specs += _block_specs(i, shape)
    if nextn:
        specs += nextn_specs(shape)
    specs.append(TensorSpec("output_norm.weight", (shape.d_model,), "norm"))
    if not tied:
        specs.append(TensorSpec("output.weight", (shape.vocab, shape.d_model), "matrix"))
    return specs


def _tensor_types(specs: list[TensorSpec], weight_type: str, shape: ModelShape,
                  nextn: bool) -> list[QType]:
    """Each tensor's ggml type: F32 for norms; for matrices ``weight_type`` (a name of
    WEIGHT_TYPES), or for a mix its choice for the tensor in a file of the model's blocks."""
    if weight_type not in MIXES:
        return [QType.F32 if s.kind != "matrix" else QType[weight_type] for s in specs]
    tied = all(s.name != "output.weight" for s in specs)
    n_blocks = shape.n_layers + int(nextn)  # block_count: a sidecar's head types as in a model
    llama_70b = shape.n_layers == 80 and shape.n_heads != shape.n_kv_heads  # llama.cpp's 70B
    return [QType.F32 if s.kind != "matrix" else
            mix_tensor_type(weight_type, s.name, s.shape[-1], n_blocks, tied, llama_70b,
                            shape.experts[0])
            for s in specs]


_CHUNK_ELEMENTS = 1 << 24  # 16M values (64 MB of float32) per generated chunk


def _tensor_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _iter_chunks(spec: TensorSpec, seed: int, std: float) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, float32 rows) chunks of the tensor's random values."""
    rng = _tensor_rng(seed, spec.name)
    if spec.kind == "norm":
        yield 0, (1.0 + 0.1 * rng.standard_normal(spec.shape, dtype=np.float32)).astype(np.float32)
        return
    if spec.kind in ("bias", "router"):
        yield 0, (std * rng.standard_normal(spec.shape, dtype=np.float32)).astype(np.float32)
        return
    rows, cols = spec.rows, spec.shape[-1]
    step = max(1, _CHUNK_ELEMENTS // cols)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        chunk = rng.standard_normal((n, cols), dtype=np.float32)
        chunk *= np.float32(std)
        yield r0, chunk


def random_tensor(shape: ModelShape, name: str, *, seed: int = 0, std: float = 0.02) -> np.ndarray:
    """The float32 values write_random_gguf generates for tensor ``name`` (before quantization),
    in torch order (out, in): what a tensor of a QUANTIZABLE_TYPES type holds, up to
    quantization. A tensor of a RANDOM_BLOCK_TYPES type (which a mix may give it) holds random
    blocks of about the same spread instead, and none of a --fast file holds these values."""
    specs = {s.name: s for s in tensor_specs(shape, tied=False, nextn=True)}
    if name not in specs:
        raise KeyError(f"no tensor {name!r} in a llama model")
    return _random_values(specs[name], seed, std)


def _random_values(spec: TensorSpec, seed: int, std: float) -> np.ndarray:
    out = np.empty(spec.shape, dtype=np.float32)
    rows = out.reshape(-1, spec.shape[-1]) if spec.kind == "matrix" else out
    for r0, chunk in _iter_chunks(spec, seed, std):
        rows[r0:r0 + len(chunk)] = chunk
    return out


def _tensor_plan(spec: TensorSpec, qtype: QType) -> tuple[Sequence[int], np.dtype, int]:
    """(shape to declare, dtype to declare, nbytes) for add_tensor_info of a ``qtype`` tensor;
    a ValueError if its rows are not whole blocks."""
    if qtype in (QType.F32, QType.F16):
        dt = np.dtype(np.float32 if qtype == QType.F32 else np.float16)
        return spec.shape, dt, int(np.prod(spec.shape)) * dt.itemsize
    rows, cols = spec.rows, spec.shape[-1]
    try:
        row_nbytes = _row_nbytes(qtype, cols)
    except ValueError as e:
        raise ValueError(f"cannot write {spec.name} {list(spec.shape)} as {qtype.name}: {e}; "
                         f"choose a type of smaller blocks (Q8_0, Q4_0, IQ4_NL have 32) or a mix "
                         f"(Q4_K_M...), which falls back to one that fits as llama-quantize "
                         f"does") from e
    return (*spec.shape[:-1], row_nbytes), np.dtype(np.uint8), rows * row_nbytes


def _make_tensor_data(spec: TensorSpec, qtype: QType, seed: int, std: float) -> np.ndarray:
    """The bytes (as the array GGUFWriter writes) of one tensor, built chunk by chunk."""
    if spec.kind != "matrix":   # norms, biases and routers: F32
        return _random_values(spec, seed, std)
    rows, cols = spec.rows, spec.shape[-1]
    if qtype.name in RANDOM_BLOCK_TYPES:
        # random valid blocks, scaled so that the dequantized spread is about std
        rng = _tensor_rng(seed, spec.name)
        out = np.empty((rows, _row_nbytes(qtype, cols)), dtype=np.uint8)
        step = max(1, _CHUNK_ELEMENTS // cols)
        for r0 in range(0, rows, step):
            n = min(step, rows - r0)
            out[r0:r0 + n] = random_blocks(qtype, n, cols, rng, scale=std / DEFAULT_STD)
        return out
    out = None
    for r0, chunk in _iter_chunks(spec, seed, std):
        enc = quantize(chunk, qtype)  # float arrays for F32/F16, uint8 bytes otherwise
        if out is None:
            out = np.empty((rows, enc.shape[1]), dtype=enc.dtype)
        out[r0:r0 + len(enc)] = enc
    assert out is not None
    return out


def _pattern_tensor_data(spec: TensorSpec, qtype: QType, pool: np.ndarray) -> np.ndarray:
    """--fast: the pool of ``qtype`` units repeated from an offset given by the tensor's name
    (memory speed, not random-number speed), as uint8 rows."""
    rows, cols = spec.rows, spec.shape[-1]
    units = rows * cols // GGML_QUANT_SIZES[qtype][0]
    start = zlib.crc32(spec.name.encode()) % len(pool)
    data = np.resize(np.concatenate([pool[start:], pool[:start]]), (units, pool.shape[1]))
    return data.reshape(rows, -1)


# --------------------------------------------------------------------------------------------
# The writer
# --------------------------------------------------------------------------------------------

def estimated_size(shape: ModelShape, weight_type: str = "F32", tied: bool = True,
                   nextn: bool = False) -> int:
    """Bytes of tensor data write_random_gguf would write (metadata not counted); a
    ValueError if a matrix's rows are not whole blocks of its type."""
    specs = tensor_specs(shape, tied, nextn)
    types = _tensor_types(specs, weight_type_name(weight_type), shape, nextn)
    return sum(_tensor_plan(s, t)[2] for s, t in zip(specs, types))


def write_random_gguf(path: str | os.PathLike, shape: ModelShape, *, seed: int = 0,
                      weight_type: str = "F32", tied: bool = True, arch: str | None = None,
                      std: float = 0.02, name: str | None = None,
                      progress: bool | Callable[[TensorSpec], None] = False,
                      fast: bool = False, nextn: bool = False) -> Path:
    """Write a GGUF with random weights of ``shape`` and a small gpt2-style tokenizer.

    Matrices (token_embd, attention, ffn, and output when ``tied`` is False) are of
    ``weight_type`` (WEIGHT_TYPES): N(0, std) quantized through gguf-py for QUANTIZABLE_TYPES
    (F32, F16, BF16, Q8_0, Q4_0, ...), random valid blocks of similar spread for
    RANDOM_BLOCK_TYPES (K-quants, IQ types, NVFP4; every matrix's row length must be a multiple
    of the type's block size, 256 for most), or, for MIX_TYPES (Q3_K_M, Q4_K_M, Q5_K_M), the
    type llama.cpp's llama-quantize gives each tensor (:func:`quant_mix.mix_tensor_type`).
    Norm weights are F32, 1 + 0.1*N(0, 1). Values are reproducible: see :func:`random_tensor`.

    Tensors are streamed one at a time, so memory stays around one tensor whatever the model
    size. The file is written to ``path`` + ".partial" and renamed when complete.
    ``progress``: True for a tqdm bar over tensors, or a callback called after each tensor.
    ``fast``: for performance runs of large shapes, every matrix repeats one pool of random
    values or blocks of its type, from an offset given by its name: seconds instead of
    minutes, but :func:`random_tensor` no longer gives the written values.
    ``nextn``: a random NextN (MTP) head in llama.cpp's layout after the blocks
    (:func:`nextn_specs`; block_count + 1, nextn_predict_layers 1).
    """
    weight_type = weight_type_name(weight_type)
    specs = tensor_specs(shape, tied, nextn)
    arch = arch or shape.arch   # another name: a file strata refuses (tests)

    def metadata(writer: GGUFWriter) -> None:
        writer.add_type("model")
        writer.add_name(name or f"strata random {arch} {shape.n_layers}x{shape.d_model} "
                                f"{weight_type}")
        writer.add_file_type(int(file_type(weight_type)))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        add_llama_config(writer, shape, nextn=nextn)
        add_tokenizer(writer, shape.vocab)

    return _write_gguf(Path(path), arch, specs, _tensor_types(specs, weight_type, shape, nextn),
                       metadata, seed=seed, std=std, progress=progress, fast=fast)


def write_nextn_sidecar(path: str | os.PathLike, model: str | os.PathLike, shape: ModelShape,
                        *, seed: int = 0, weight_type: str = "F32", std: float = 0.02,
                        arch: str | None = None) -> Path:
    """Write a sidecar GGUF holding a random NextN head (:func:`nextn_specs`, the values
    write_random_gguf's nextn head gets with the same seed) for the model file ``model`` of
    ``shape``: its metadata names the target (dimensions, vocabulary, the fingerprint of its
    token embedding) as strata.model.nextn.find_head checks."""
    from strata.model.gguf_file import ModelFile
    from strata.model.nextn import TARGET_FINGERPRINT, embedding_fingerprint
    specs = nextn_specs(shape)
    arch = arch or shape.arch
    types = _tensor_types(specs, weight_type_name(weight_type), shape, nextn=True)
    fingerprint = embedding_fingerprint(ModelFile(model))

    def metadata(writer: GGUFWriter) -> None:
        writer.add_name(f"strata random NextN head for {Path(model).name}")
        add_llama_config(writer, shape, nextn=True)
        writer.add_string(TARGET_FINGERPRINT, fingerprint)

    return _write_gguf(Path(path), arch, specs, types, metadata, seed=seed, std=std)


def _write_gguf(path: Path, arch: str, specs: list[TensorSpec], types: list[QType],
                metadata: Callable[[GGUFWriter], None], *, seed: int, std: float,
                progress: bool | Callable[[TensorSpec], None] = False,
                fast: bool = False) -> Path:
    """Stream the tensors of ``specs``, of ``types``, after the metadata into ``path`` (see
    write_random_gguf)."""
    plans = [_tensor_plan(s, t) for s, t in zip(specs, types)]  # checks blocks before writing
    pools: dict[QType, np.ndarray] = {}  # --fast: one per matrix type, made when first needed

    tmp = path.with_name(path.name + ".partial")
    writer = GGUFWriter(tmp, arch)
    metadata(writer)

    for spec, tq, (decl_shape, decl_dtype, nbytes) in zip(specs, types, plans):
        raw = None if tq in (QType.F32, QType.F16) else tq
        writer.add_tensor_info(spec.name, decl_shape, decl_dtype, nbytes, raw_dtype=raw)

    bar = None
    callback = progress if callable(progress) else None
    if progress is True:
        from tqdm import tqdm
        bar = tqdm(total=len(specs), unit="tensor", desc=path.name)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for spec, tq, (_, _, nbytes) in zip(specs, types, plans):
            if fast and spec.kind == "matrix":
                if tq not in pools:
                    rng = np.random.default_rng([seed, 0x5EED])
                    pools[tq] = random_pool(tq, rng, scale=std / DEFAULT_STD)
                data = _pattern_tensor_data(spec, tq, pools[tq])
            else:
                data = _make_tensor_data(spec, tq, seed, std)
            assert data.nbytes == nbytes, (spec.name, data.nbytes, nbytes)
            writer.write_tensor_data(data)
            del data
            if bar is not None:
                bar.set_postfix_str(spec.name, refresh=False)
                bar.update(1)
            if callback is not None:
                callback(spec)
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return path
