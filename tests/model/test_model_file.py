"""strata.model.gguf_file: configuration, dequantized tensors in [out, in] order, errors a user
can cause, fingerprints, and a StageModel forward checked against a float64 llama forward."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from strata.model.gguf_file import ModelError, ModelFile
from strata.model.mkmodel import (SHAPES, ModelShape, add_llama_config, random_kquant_blocks,
                                  random_tensor, write_random_gguf, write_raw_blocks_gguf)
from strata.stage_worker.model import KVCache, Rows, StageModel

TINY = SHAPES["tiny"]  # the conftest tiny_model: F32, seed 1, tied
SMALL = ModelShape(n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, d_ffn=128, vocab=320)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _write_llama(path: Path, tensors: dict[str, tuple[np.ndarray, QType | None]],
                 shape: ModelShape = SMALL, arch: str = "llama", vocab_size: bool = True) -> Path:
    """A GGUF with a llama configuration of `shape` and exactly the given tensors (raw blocks
    when a QType is given)."""
    w = GGUFWriter(path, arch)
    w.add_name(f"test {path.stem}")
    add_llama_config(w, shape, vocab_size)
    for name, (data, raw) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _error(path, *words) -> str:
    with pytest.raises(ModelError) as info:
        ModelFile(path)
    text = str(info.value)
    for w in words:
        assert w in text, f"{w!r} not in {text!r}"
    return text


# --- configuration --------------------------------------------------------------------------

def test_tiny_config(tiny_model):
    cfg = ModelFile(tiny_model).config
    assert cfg.arch == "llama"
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == \
        (TINY.n_layers, TINY.d_model, TINY.n_heads, TINY.n_kv_heads, TINY.head_dim)
    assert (cfg.d_ffn, cfg.vocab, cfg.ctx_len) == (TINY.d_ffn, TINY.vocab, TINY.ctx_len)
    assert cfg.rope_base == TINY.rope_base and cfg.rope_dim == TINY.head_dim
    assert math.isclose(cfg.rms_eps, TINY.rms_eps, rel_tol=1e-6)  # stored as float32
    assert cfg.tied_head is True


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_reader_reads_what_gguf_py_reads(which, request):
    """ModelFile's reader parses the metadata faster (a plain view of the memory map, arrays
    in one loop); every field, to its parts, data indices and types, and every tensor is
    gguf-py's own reader's: the tiny model's, and SmolLM2's vocabulary, merges and token types."""
    path = request.getfixturevalue(which + "_model" if which == "tiny" else which)
    ours, theirs = ModelFile(path).reader, GGUFReader(path, "c")
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.name, mine.data, mine.types) == (
            field.offset, field.name, field.data, field.types), key
        assert len(mine.parts) == len(field.parts), key
        assert all(a.dtype == b.dtype and np.array_equal(a, b)
                   for a, b in zip(mine.parts, field.parts)), key
        assert mine.contents() == field.contents(), key
    vocab = ModelFile(path).config.vocab
    assert len(ours.fields["tokenizer.ggml.tokens"].contents()) == vocab
    assert len(ours.fields["tokenizer.ggml.token_type"].contents()) == vocab
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))


def test_reader_reads_arrays_of_every_kind_as_gguf_py(tmp_path):
    """Arrays of strings (an empty string among them), of numbers of three kinds, and of arrays,
    beside a plain string: the same parts, data indices, types and contents as gguf-py's."""
    from strata.model.gguf_file import Reader
    path = tmp_path / "arrays.gguf"
    w = GGUFWriter(path, "llama")
    w.add_array("a.strings", ["x", "", "h\u00e9llo"])
    w.add_array("a.ints", [1, -2, 3])
    w.add_array("a.floats", [0.5, 1.5])
    w.add_array("a.bools", [True, False])
    w.add_array("a.nested", [[1, 2], [3]])
    w.add_string("a.string", "v")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = Reader(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.data, mine.types, len(mine.parts)) == (
            field.data, field.types, len(field.parts)), key
        assert all(a.dtype == b.dtype and np.array_equal(a, b)
                   for a, b in zip(mine.parts, field.parts)), key
    assert ours.fields["a.strings"].contents() == ["x", "", "h\u00e9llo"]
    assert ours.fields["a.nested"].contents() == theirs.fields["a.nested"].contents()


def test_smollm2_config_and_a_q4_1_tensor(smollm2):
    file = ModelFile(smollm2)
    cfg = file.config
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ffn,
            cfg.vocab, cfg.rope_base, cfg.tied_head) == \
        (30, 576, 9, 3, 64, 1536, 49152, 100000.0, True)
    t = file.tensors["blk.0.ffn_down.weight"]
    assert t.tensor_type == QType.Q4_1
    down = file.tensor("blk.0.ffn_down.weight")
    assert down.shape == (576, 1536) and down.dtype == torch.float32   # [out, in]
    assert torch.equal(down, torch.from_numpy(dequantize(t.data, QType.Q4_1)))


# --- tensors: every supported type, [out, in] order -----------------------------------------

@pytest.fixture(scope="module")
def typed_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("typed")
    return {wt: write_random_gguf(d / f"small-{wt}.gguf", SMALL, seed=3, weight_type=wt)
            for wt in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")}


def _expected(values: np.ndarray, weight_type: str) -> np.ndarray:
    """What the file holds for float32 values, dequantized by gguf-py."""
    if weight_type == "F32":
        return values
    if weight_type == "F16":
        return values.astype(np.float16).astype(np.float32)
    qtype = QType[weight_type]
    return dequantize(quantize(values, qtype), qtype)


# per-type bound on |dequantized - original| for N(0, 0.02) values
QUANT_ERROR = {"F32": 0.0, "F16": 4e-5, "BF16": 4e-4, "Q8_0": 6e-4, "Q4_0": 1.2e-2,
               "Q4_1": 6e-3}


@pytest.mark.parametrize("weight_type", list(QUANT_ERROR))
def test_tensor_dequantizes_in_out_in_order(typed_files, weight_type):
    file = ModelFile(typed_files[weight_type])
    for name, shape in [("blk.0.ffn_gate.weight", (128, 64)), ("blk.0.ffn_down.weight", (64, 128)),
                        ("token_embd.weight", (320, 64)), ("blk.0.attn_k.weight", (32, 64))]:
        assert file.tensors[name].tensor_type == QType[weight_type]
        got = file.tensor(name)
        assert got.dtype == torch.float32 and tuple(got.shape) == shape, name
        values = random_tensor(SMALL, name, seed=3)
        # exactly gguf-py's dequantization of what was written ...
        assert np.array_equal(got.numpy(), _expected(values, weight_type)), name
        # ... which is close to the values written, in the same orientation
        err = np.abs(got.numpy() - values).max()
        assert err <= QUANT_ERROR[weight_type], (name, err)
        assert (got.numpy() * values).sum() > 0.9 * (values * values).sum()
    # norms stay F32 whatever the weight type
    norm = file.tensor("blk.0.attn_norm.weight")
    assert file.tensors["blk.0.attn_norm.weight"].tensor_type == QType.F32
    assert torch.equal(norm, torch.from_numpy(random_tensor(SMALL, "blk.0.attn_norm.weight",
                                                            seed=3)))


def test_tensor_dtype_argument(typed_files):
    file = ModelFile(typed_files["Q8_0"])
    f32 = file.tensor("blk.0.attn_q.weight")
    bf16 = file.tensor("blk.0.attn_q.weight", torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, f32.to(torch.bfloat16))
    f16 = ModelFile(typed_files["F16"]).tensor("blk.0.attn_q.weight", torch.float16)
    assert f16.dtype == torch.float16


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquant_tensor(tmp_path, qtype):
    rows, cols = 8, 512  # non-square: [out, in] = (8, 512)
    blocks = random_kquant_blocks(qtype, rows, cols, rng=11)
    path = _write_llama(tmp_path / f"{qtype}.gguf", {"blk.0.ffn_down.weight":
                                                     (blocks, QType[qtype])})
    file = ModelFile(path)
    assert file.tensors["blk.0.ffn_down.weight"].tensor_type == QType[qtype]
    got = file.tensor("blk.0.ffn_down.weight")
    want = dequantize(blocks, QType[qtype])
    assert want.shape == (rows, cols) and tuple(got.shape) == (rows, cols)
    assert np.array_equal(got.numpy(), want)
    assert np.isfinite(want).all() and 0.005 < want.std() < 0.08
    # row r of the tensor is block row r of the file
    assert np.array_equal(got[3].numpy(), dequantize(blocks[3:4], QType[qtype])[0])


def test_missing_tensor_names_it(tiny_model):
    with pytest.raises(ModelError, match="has no tensor blk.9.attn_q.weight"):
        ModelFile(tiny_model).tensor("blk.9.attn_q.weight")


# --- errors a user can cause ----------------------------------------------------------------

def test_missing_file(tmp_path):
    _error(tmp_path / "nope.gguf", "nope.gguf", "does not exist", "--model")
    _error(tmp_path, "is a directory, not a model file", "--model")
    (tmp_path / "m.gguf").write_bytes(b"")   # the directory's GGUF files are named
    _error(tmp_path, "is a directory", "(here: m.gguf)")


def test_random_bytes(tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 100_000, np.uint8).tobytes())
    _error(path, "noise.gguf", "is not a readable GGUF file")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _error(empty, "is not a readable GGUF file")


@pytest.mark.parametrize("keep", [0.002, 0.05, 0.5, 0.999])
def test_truncated_gguf(tmp_path, tiny_model, keep):
    data = Path(tiny_model).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    _error(path, "cut.gguf", "is not a readable GGUF file", "download it again")


def test_truncated_smollm2(tmp_path, smollm2):
    # the real file cut inside its vocabulary (the tiny model's cuts above reach the tensors)
    path = tmp_path / "smollm2-cut.gguf"
    with open(smollm2, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(256 << 10))
    _error(path, "is not a readable GGUF file")


def test_unsupported_architecture(tmp_path):
    path = write_random_gguf(tmp_path / "gpt2.gguf", SMALL, arch="gpt2")
    _error(path, "architecture 'gpt2' is not supported", "llama")


def _odd_type_file(tmp_path, qtype):
    """A file whose ffn_gate is random bytes of `qtype` (Q5_0/Q5_1: quantized by gguf-py)."""
    if qtype in (QType.Q5_0, QType.Q5_1):
        values = np.random.default_rng(0).standard_normal((4, 256), dtype=np.float32)
        data = quantize(values, qtype)
    else:
        block, size = GGML_QUANT_SIZES[qtype]
        data = np.random.default_rng(0).integers(0, 256, (4, 256 // block * size), np.uint8)
        if qtype in (QType.Q2_K, QType.IQ4_NL):   # a finite fp16 scale where these keep it
            at = size - 4 if qtype == QType.Q2_K else 0
            view = data.reshape(-1, size)
            view[:, at:at + 2] = np.full((len(view), 1), 0.01, np.float16).view(np.uint8)
    good = random_kquant_blocks("Q4_K", 4, 256, rng=0)
    return _write_llama(tmp_path / "odd.gguf", {"blk.0.attn_norm.weight": (np.ones(64, np.float32),
                                                                           None),
                                                "blk.0.ffn_up.weight": (good, QType.Q4_K),
                                                "blk.0.ffn_gate.weight": (data, qtype)})


@pytest.mark.parametrize("qtype", [QType.Q2_K, QType.IQ4_NL, QType.Q5_0, QType.Q5_1])
def test_every_type_gguf_py_dequantizes_loads(tmp_path, qtype):
    file = ModelFile(_odd_type_file(tmp_path, qtype))
    got = file.tensor("blk.0.ffn_gate.weight")
    raw, cols = file.blocks("blk.0.ffn_gate.weight")
    assert got.shape == (4, 256) and cols == 256 and file.tensor_type(
        "blk.0.ffn_gate.weight") == qtype.name
    assert torch.equal(got, torch.from_numpy(dequantize(raw, qtype).reshape(4, 256)))


def test_a_type_gguf_py_cannot_dequantize_is_refused(tmp_path):
    text = _error(_odd_type_file(tmp_path, QType.Q8_1), "blk.0.ffn_gate.weight",
                  "type Q8_1", "cannot dequantize", "llama-quantize")
    assert "gguf-py" in text


def test_missing_metadata_is_named(tmp_path):
    # one K-quant tensor and no llama configuration at all
    path = write_raw_blocks_gguf(tmp_path / "blocks.gguf", qtype="Q6_K")
    assert GGUFReader(path).tensors[0].tensor_type == QType.Q6_K
    _error(path, "blocks.gguf", "lacks the metadata key llama.")


def test_no_vocab_anywhere_is_a_model_error(tmp_path):
    path = _write_llama(tmp_path / "novocab.gguf",
                        {"output_norm.weight": (np.ones(64, np.float32), None)},
                        vocab_size=False)
    _error(path, "token_embd.weight")


def test_vocab_from_the_embedding_when_metadata_lacks_it(tmp_path):
    emb = random_tensor(SMALL, "token_embd.weight")
    path = _write_llama(tmp_path / "v.gguf", {"token_embd.weight": (emb, None)}, vocab_size=False)
    assert ModelFile(path).config.vocab == SMALL.vocab


# --- head, fingerprint ----------------------------------------------------------------------

def test_tied_and_untied_head(tmp_path, tiny_model):
    tied = ModelFile(tiny_model)
    assert tied.config.tied_head and "output.weight" not in tied.tensors
    last = StageModel(tied, 3, 4, ctx=16)
    assert last.last and not last.first and not hasattr(last, "embed")
    assert torch.equal(last.head, tied.tensor("token_embd.weight"))

    path = write_random_gguf(tmp_path / "untied.gguf", TINY, seed=1, tied=False)
    untied = ModelFile(path)
    assert not untied.config.tied_head
    last = StageModel(untied, 3, 4, ctx=16)
    head = torch.from_numpy(random_tensor(TINY, "output.weight", seed=1))
    assert last.head.shape == (TINY.vocab, TINY.d_model) and torch.equal(last.head, head)
    assert not torch.equal(last.head, untied.tensor("token_embd.weight"))
    first = StageModel(untied, 0, 1, ctx=16)
    assert first.first and not first.last and not hasattr(first, "head")


def test_fingerprint(tmp_path, tiny_model, typed_files):
    a = ModelFile(tiny_model).fingerprint()
    assert a == ModelFile(tiny_model).fingerprint()                # stable across opens
    assert len(a) == 16 and int(a, 16) >= 0
    copy = tmp_path / "copy.gguf"
    shutil.copy(tiny_model, copy)
    assert ModelFile(copy).fingerprint() == a                      # the same bytes elsewhere
    others = [ModelFile(p).fingerprint() for p in typed_files.values()]
    others.append(ModelFile(write_random_gguf(tmp_path / "u.gguf", TINY, seed=1,
                                              tied=False)).fingerprint())
    others.append(ModelFile(write_random_gguf(tmp_path / "n.gguf", TINY, seed=1,
                                              name="another name")).fingerprint())
    assert len(set(others + [a])) == len(others) + 1


def test_fingerprint_sees_the_weights(tmp_path, tiny_model):
    other = write_random_gguf(tmp_path / "seed2.gguf", TINY, seed=2)
    assert not torch.equal(ModelFile(other).tensor("blk.0.attn_q.weight"),
                           ModelFile(tiny_model).tensor("blk.0.attn_q.weight"))
    assert ModelFile(other).fingerprint() != ModelFile(tiny_model).fingerprint()


# --- numerics: StageModel against a float64 llama forward -----------------------------------

def _reference_logits(shape: ModelShape, seed: int, tokens: list[int]) -> torch.Tensor:
    """A plain float64 llama forward from mkmodel's values (GGUF Q/K layout: RoPE rotates
    adjacent pairs), causal attention with grouped kv heads, tied head."""
    w = lambda name: torch.from_numpy(random_tensor(shape, name, seed=seed)).double()  # noqa
    n, hd, h, kvh = len(tokens), shape.head_dim, shape.n_heads, shape.n_kv_heads
    eps = float(np.float32(shape.rms_eps))

    def norm(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    def rope(x):  # x: [n, heads, hd]; pairs (2i, 2i+1) times e^{i p base^(-2i/hd)}
        theta = shape.rope_base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angle = torch.arange(n, dtype=torch.float64)[:, None] * theta
        z = torch.complex(x[..., 0::2], x[..., 1::2]) * torch.polar(torch.ones_like(angle),
                                                                    angle)[:, None]
        return torch.stack((z.real, z.imag), -1).flatten(-2)

    emb = w("token_embd.weight")
    x = emb[tokens]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(shape.n_layers):
        b = f"blk.{i}."
        a = norm(x, w(b + "attn_norm.weight"))
        q = rope((a @ w(b + "attn_q.weight").T).view(n, h, hd))
        k = rope((a @ w(b + "attn_k.weight").T).view(n, kvh, hd))
        v = (a @ w(b + "attn_v.weight").T).view(n, kvh, hd)
        heads = []
        for head in range(h):
            kv = head // (h // kvh)
            scores = q[:, head] @ k[:, kv].T / math.sqrt(hd)
            scores = scores.masked_fill(~causal, float("-inf"))
            heads.append(torch.softmax(scores, -1) @ v[:, kv])
        x = x + torch.cat(heads, -1) @ w(b + "attn_output.weight").T
        f = norm(x, w(b + "ffn_norm.weight"))
        gate = f @ w(b + "ffn_gate.weight").T
        x = x + (gate * torch.sigmoid(gate) * (f @ w(b + "ffn_up.weight").T)) @ \
            w(b + "ffn_down.weight").T
    return norm(x, w("output_norm.weight")) @ emb.T


def test_stage_model_matches_float64_llama_forward(tiny_model):
    file = ModelFile(tiny_model)
    tokens = np.random.default_rng(4).integers(0, TINY.vocab, 40).tolist()
    ref = _reference_logits(TINY, 1, tokens)
    assert ref.std() > 0.05  # logits of a meaningful size for the tolerance below

    n = len(tokens)
    full = StageModel(file, 0, TINY.n_layers, ctx=64)
    cache = KVCache(TINY.n_layers, 1, file.config, 64, torch.device("cpu"), torch.float32)
    rows = Rows([0] * n, list(range(n)))
    with torch.inference_mode():
        hidden = full(torch.tensor(tokens), rows, cache)
        logits = full.logits(hidden)
    assert logits.shape == (n, TINY.vocab) and logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), ref, rtol=1e-4, atol=1e-4)
    # greedy tokens agree with the reference too
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))

    # the same forward split over two stages gives the same bits
    first, second = StageModel(file, 0, 2, ctx=64), StageModel(file, 2, TINY.n_layers, ctx=64)
    c1 = KVCache(2, 1, file.config, 64, torch.device("cpu"), torch.float32)
    c2 = KVCache(TINY.n_layers - 2, 1, file.config, 64, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        h1 = first(torch.tensor(tokens), rows, c1)
        h2 = second(h1.clone(), rows, c2)
        split_logits = second.logits(h2)
    assert torch.equal(h2, hidden) and torch.equal(split_logits, logits)
    assert torch.equal(c1.k[1], cache.k[1]) and torch.equal(c2.v[0], cache.v[2])


def test_reference_forward_is_sensitive_to_rope_layout(tiny_model):
    """The check above would catch a loader that un-permutes Q and K into transformers' halves
    layout but still rotates adjacent pairs (DESIGN.md's trap)."""
    file = ModelFile(tiny_model)
    tokens = list(range(5, 25))
    ref = _reference_logits(TINY, 1, tokens)
    model = StageModel(file, 0, TINY.n_layers, ctx=64)
    hd = TINY.head_dim
    perm = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])  # pairs -> halves
    for layer in model.layers:
        q_dim, kv_dim = TINY.n_heads * hd, TINY.n_kv_heads * hd
        wq = layer.wqkv[:q_dim].view(TINY.n_heads, hd, -1)[:, perm].reshape(q_dim, -1)
        wk = layer.wqkv[q_dim:q_dim + kv_dim].view(TINY.n_kv_heads, hd, -1)[:, perm]
        layer.wqkv = torch.cat([wq, wk.reshape(kv_dim, -1), layer.wqkv[q_dim + kv_dim:]])
    cache = KVCache(TINY.n_layers, 1, file.config, 64, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        logits = model.logits(model(torch.tensor(tokens), Rows([0] * 20, list(range(20))),
                                    cache))
    assert (logits.double() - ref).abs().max() > 1e-3
