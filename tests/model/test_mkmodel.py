"""strata.model.mkmodel: random-weight llama GGUF files, read back with gguf-py."""
from __future__ import annotations

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from gguf.constants import GGML_QUANT_SIZES

from strata.model.kquant_blocks import BLOCK_TYPES, random_blocks
from strata.model.mkmodel import (
    CHAT_TEMPLATE, MIX_TYPES, QUANTIZABLE_TYPES, RANDOM_BLOCK_TYPES, SHAPES, WEIGHT_TYPES,
    ModelShape, bytes_to_unicode, estimated_size, make_vocabulary, random_kquant_blocks,
    random_tensor, tensor_specs, write_random_gguf, write_raw_blocks_gguf,
)
from strata.model.mkmodel_cli import main
from strata.model.quant_mix import file_type, mix_tensor_type, use_more_bits

TINY = SHAPES["tiny"]
# rows of whole 256-value blocks (the K and IQ types): d_model 256, d_ffn 512
SMALL256 = ModelShape(n_layers=1, d_model=256, n_heads=4, n_kv_heads=2, d_ffn=512, vocab=300)
# the quantized types the tiny shape's rows of 64 values fit
TINY_TYPES = tuple(t for t in QUANTIZABLE_TYPES if 64 % GGML_QUANT_SIZES[QType[t]][0] == 0)


def _field(reader: gguf.GGUFReader, key: str):
    f = reader.fields.get(key)
    assert f is not None, f"missing metadata key {key}"
    return f.contents()


def _expected_names(shape: ModelShape, tied: bool) -> list[str]:
    names = ["token_embd.weight"]
    for i in range(shape.n_layers):
        names += [f"blk.{i}.{n}.weight" for n in (
            "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
            "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")]
    names.append("output_norm.weight")
    if not tied:
        names.append("output.weight")
    return names


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """The tiny shape written once per weight type (tied) plus an untied F32 file."""
    d = tmp_path_factory.mktemp("mkmodel")
    files = {wt: write_random_gguf(d / f"tiny-{wt}.gguf", TINY, weight_type=wt, seed=7)
             for wt in TINY_TYPES}
    files["F32-untied"] = write_random_gguf(d / "tiny-untied.gguf", TINY, seed=7, tied=False)
    return files


# ---------------------------------------------------------------------------------------------

def test_shapes():
    assert (TINY.n_layers, TINY.d_model, TINY.n_heads, TINY.n_kv_heads, TINY.d_ffn) == \
        (4, 64, 4, 2, 128)
    assert 259 <= TINY.vocab <= 512 and TINY.head_dim == 16
    s = SHAPES["smollm2-135m"]
    assert (s.n_layers, s.d_model, s.n_heads, s.n_kv_heads, s.d_ffn, s.vocab, s.rope_base) == \
        (30, 576, 9, 3, 1536, 49152, 100000.0)
    assert s.head_dim == 64
    assert 134e6 < s.n_params < 136e6
    s = SHAPES["llama3-8b"]
    assert (s.n_layers, s.d_model, s.n_heads, s.n_kv_heads, s.d_ffn, s.vocab, s.rope_base,
            s.ctx_len) == (32, 4096, 32, 8, 14336, 128256, 500000.0, 8192)
    assert 8.0e9 < s.n_params + s.vocab * s.d_model < 8.1e9  # untied Llama-3-8B: 8.03B
    assert estimated_size(s, "BF16", tied=False) == 2 * (s.n_params + s.vocab * s.d_model) \
        + (4 - 2) * (2 * s.n_layers + 1) * s.d_model  # norms stay F32


def test_moe_shapes():
    """Qwen3-30B-A3B: 30.5B parameters with its untied head, 3.3B a token; the GLM-4.5-Air
    shape: its layers' sizes, 12 of them."""
    s = SHAPES["qwen3-30b-a3b"]
    assert 30.4e9 < s.n_params + s.vocab * s.d_model < 30.6e9
    assert 3.3e9 < s.active_params + s.vocab * s.d_model < 3.4e9
    assert 17.5e9 < estimated_size(s, "Q4_K_M", tied=False) < 19e9   # llama.cpp's: 18.6 GB
    glm = SHAPES["glm4.5-air-12l"]
    assert glm.layer_params(1) - glm.layer_params(0) == 3 * 4096 * 1408 * 129 + 128 * 4096 \
        - 3 * 4096 * 10944


def test_shape_validation():
    with pytest.raises(ValueError, match="n_heads"):
        ModelShape(2, 64, 5, 1, 128, 300)
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelShape(2, 64, 4, 3, 128, 300)
    with pytest.raises(ValueError, match="vocab"):
        ModelShape(2, 64, 4, 2, 128, 100)


def test_metadata(tiny_files):
    r = gguf.GGUFReader(tiny_files["F32"])
    expect = {
        "general.architecture": "llama",
        "general.file_type": 0,
        "llama.block_count": 4,
        "llama.context_length": 2048,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 128,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.dimension_count": 16,
        "llama.vocab_size": TINY.vocab,
        "tokenizer.ggml.model": "gpt2",
        # a name llama.cpp knows (src/llama-vocab.cpp lists "gpt-2", not "gpt2", for this split)
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    for key, value in expect.items():
        assert _field(r, key) == value, key
    assert _field(r, "llama.rope.freq_base") == pytest.approx(10000.0)
    assert _field(r, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert gguf.GGUFReader(tiny_files["Q4_1"]).fields["general.file_type"].contents() == 3


def test_metadata_other_arch_and_rope(tmp_path):
    shape = ModelShape(1, 64, 4, 4, 64, 300, ctx_len=512, rope_base=500000.0, rms_eps=1e-6)
    r = gguf.GGUFReader(write_random_gguf(tmp_path / "m.gguf", shape, arch="mistral"))
    assert _field(r, "general.architecture") == "mistral"
    assert _field(r, "mistral.context_length") == 512
    assert _field(r, "mistral.rope.freq_base") == pytest.approx(500000.0)
    assert _field(r, "mistral.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)


def test_tokenizer_metadata(tiny_files):
    r = gguf.GGUFReader(tiny_files["F32"])
    tokens = _field(r, "tokenizer.ggml.tokens")
    types = _field(r, "tokenizer.ggml.token_type")
    merges = _field(r, "tokenizer.ggml.merges")
    assert len(tokens) == len(types) == TINY.vocab
    assert len(set(tokens)) == len(tokens)
    b2u = bytes_to_unicode()
    assert tokens[:256] == [b2u[b] for b in range(256)]
    assert len(set(tokens[:256])) == 256
    eos = _field(r, "tokenizer.ggml.eos_token_id")
    assert tokens[eos] == "<|endoftext|>" and _field(r, "tokenizer.ggml.bos_token_id") == eos
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert types[tokens.index(special)] == gguf.TokenType.CONTROL
    assert all(t == gguf.TokenType.NORMAL for t in types[:256])
    # merges are consistent: both parts precede the merged token, which is in the vocabulary
    index = {t: i for i, t in enumerate(tokens)}
    assert merges
    for m in merges:
        a, b = m.split(" ")
        assert index[a] < index[a + b] and index[b] < index[a + b]


def test_tokenizer_roundtrip_with_tokenizers(tiny_files):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    r = gguf.GGUFReader(tiny_files["F32"])
    tokens = _field(r, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in _field(r, "tokenizer.ggml.merges")]
    tok = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    text = "<|im_start|>user\nthe cat is on the mat, héllo ✓<|im_end|>"
    ids = tok.encode(text).ids
    assert max(ids) < TINY.vocab
    assert tokens.index("Ġthe") in ids and tokens.index("<|im_start|>") == ids[0]
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_strata_reads_the_written_tokenizer(tiny_files):
    """strata's Tokenizer loads the file's tokenizer.ggml.pre and splits text as GPT-2 does, the
    split the merges were made for: the same ids as a plain GPT-2 ByteLevel pipeline."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from strata.model.tokenizer import Tokenizer

    r = gguf.GGUFReader(tiny_files["F32"])
    tok = Tokenizer.from_gguf(r)
    tokens = _field(r, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in _field(r, "tokenizer.ggml.merges")]
    gpt2 = Backend(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    for text in ("the cat is on the mat, héllo ✓", "they're 12345 items;\n\n  indented",
                 "x = f(a, b)  # 3.14"):
        ids = tok.encode(text)
        assert ids == gpt2.encode(text).ids, text
        assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>user") == [tokens.index("<|im_start|>"), *tok.encode("user")]


def test_chat_template_renders():
    jinja2 = pytest.importorskip("jinja2")
    out = jinja2.Template(CHAT_TEMPLATE).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_large_vocabulary():
    v = make_vocabulary(49152)
    assert len(v.tokens) == len(v.token_types) == 49152 and len(set(v.tokens)) == 49152
    assert 0 < len(v.merges) < 49152
    assert v.token_types[-1] == gguf.TokenType.UNUSED


@pytest.mark.parametrize("weight_type", TINY_TYPES)
def test_tensors_roundtrip(tiny_files, weight_type):
    r = gguf.GGUFReader(tiny_files[weight_type])
    assert [t.name for t in r.tensors] == _expected_names(TINY, tied=True)
    specs = {s.name: s for s in tensor_specs(TINY, tied=True)}
    for t in r.tensors:
        spec = specs[t.name]
        assert [int(x) for x in t.shape] == list(reversed(spec.shape)), t.name
        ref = random_tensor(TINY, t.name, seed=7)
        assert ref.shape == spec.shape
        if spec.kind == "norm":
            assert t.tensor_type == QType.F32
            np.testing.assert_array_equal(t.data, ref)
            assert abs(float(ref.mean()) - 1.0) < 0.1
            continue
        assert t.tensor_type == QType[weight_type], t.name
        if weight_type in ("F32", "F16"):
            assert t.data.shape == spec.shape  # float types: (out, in)
        got = dequantize(t.data, t.tensor_type).reshape(spec.shape)
        absmax = float(np.abs(ref).max())
        err = float(np.abs(got - ref).max())
        tol = {"F32": 0.0, "F16": absmax * 2**-11, "BF16": absmax * 2**-8,
               "Q8_0": absmax / 127, "Q4_0": absmax / 8, "Q4_1": absmax / 15,
               "Q5_0": absmax / 16, "Q5_1": absmax / 31, "MXFP4": absmax / 3}[weight_type]
        assert err <= tol, (t.name, err, tol)
        if weight_type == "F32":
            np.testing.assert_array_equal(got, ref)
        corr = np.corrcoef(got.ravel(), ref.ravel())[0, 1]
        assert corr > (0.999 if weight_type in ("F32", "F16", "BF16", "Q8_0") else 0.95)
        assert 0.015 < float(ref.std()) < 0.025


def test_tied_vs_untied(tiny_files):
    tied = gguf.GGUFReader(tiny_files["F32"])
    untied = gguf.GGUFReader(tiny_files["F32-untied"])
    assert "output.weight" not in {t.name for t in tied.tensors}
    assert [t.name for t in untied.tensors] == _expected_names(TINY, tied=False)
    out = next(t for t in untied.tensors if t.name == "output.weight")
    assert [int(x) for x in out.shape] == [TINY.d_model, TINY.vocab]
    np.testing.assert_array_equal(out.data, random_tensor(TINY, "output.weight", seed=7))
    # the other tensors do not depend on tying
    emb = {r: next(t for t in r.tensors if t.name == "token_embd.weight") for r in (tied, untied)}
    np.testing.assert_array_equal(emb[tied].data, emb[untied].data)
    assert not np.array_equal(out.data, emb[untied].data)


def test_reproducible(tmp_path, tiny_files):
    a = write_random_gguf(tmp_path / "a.gguf", TINY, weight_type="Q8_0", seed=7)
    assert a.read_bytes() == tiny_files["Q8_0"].read_bytes()
    b = write_random_gguf(tmp_path / "b.gguf", TINY, weight_type="Q8_0", seed=8)
    assert a.read_bytes() != b.read_bytes()
    assert not list(tmp_path.glob("*.partial"))


def test_bad_weight_type_and_block_size(tmp_path):
    with pytest.raises(ValueError, match="unsupported weight type"):
        write_random_gguf(tmp_path / "x.gguf", TINY, weight_type="Q1_0")  # no gguf-py dequantizer
    # rows of 64 values are not whole 256-value blocks
    for weight_type in ("Q4_K", "IQ2_XXS"):
        with pytest.raises(ValueError, match=f"row length 64 is not a multiple of the "
                                             f"{weight_type} block size 256"):
            write_random_gguf(tmp_path / "x.gguf", TINY, weight_type=weight_type)
    with pytest.raises(ValueError, match="multiple of 256 values, got 100"):
        random_blocks("Q4_K", 2, 100)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("qtype", [t.name for t in BLOCK_TYPES])
def test_random_blocks(tmp_path, qtype):
    """random_blocks makes valid blocks of every type gguf-py dequantizes: finite, of about the
    spread asked (here 2.5 x 0.02), reproducible from the seed, read back as written."""
    rows, cols = 16, 512
    path = write_raw_blocks_gguf(tmp_path / "b.gguf", "blk.0.ffn_down.weight", qtype,
                                 rows, cols, seed=3, scale=2.5)
    (t,) = gguf.GGUFReader(path).tensors
    assert t.name == "blk.0.ffn_down.weight" and t.tensor_type == QType[qtype]
    assert [int(x) for x in t.shape] == [cols, rows]
    got = dequantize(t.data, t.tensor_type)
    assert got.shape == (rows, cols) and got.dtype == np.float32
    assert np.isfinite(got).all()
    assert 0.035 < float(got.std()) < 0.065
    again = random_blocks(qtype, rows, cols, 3, scale=2.5)
    np.testing.assert_array_equal(np.asarray(t.data).reshape(again.shape), again)
    assert random_kquant_blocks is random_blocks  # the name tests of K-quants import


@pytest.mark.parametrize("weight_type", RANDOM_BLOCK_TYPES + ("TQ1_0", "TQ2_0"))
def test_block_type_model(tmp_path, weight_type):
    """A model of every type the tiny shape's rows do not fit (all random-block types) is
    written and reads back through gguf-py: its file type, finite matrices of about the asked
    spread, as many bytes as estimated_size says."""
    r = gguf.GGUFReader(write_random_gguf(tmp_path / "m.gguf", SMALL256, weight_type=weight_type,
                                          tied=False, std=0.05))
    assert [t.name for t in r.tensors] == _expected_names(SMALL256, tied=False)
    assert _field(r, "general.file_type") == file_type(weight_type)
    assert sum(int(t.n_bytes) for t in r.tensors) == estimated_size(SMALL256, weight_type,
                                                                    tied=False)
    for t in r.tensors:
        got = dequantize(t.data, t.tensor_type)
        assert got.shape == tuple(int(x) for x in reversed(t.shape)) and np.isfinite(got).all()
        if t.name.endswith("norm.weight"):
            assert t.tensor_type == QType.F32
            continue
        assert t.tensor_type == QType[weight_type], t.name
        assert 0.035 < float(got.std()) < 0.065, t.name


def _small_pools(monkeypatch):
    """--fast pools of 2**17 values, not 2**24 (gguf-py quantizes those of Q8_0... slowly):
    still more blocks than the small shapes' matrices have rows."""
    from strata.model import kquant_blocks
    monkeypatch.setattr(kquant_blocks, "POOL_VALUES", 1 << 17)


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_K", "IQ4_NL", "Q4_K_M"])
def test_fast_block_types(tmp_path, monkeypatch, weight_type):
    """--fast writes block types too: the types and sizes of the file written without it, each
    matrix valid blocks of about the asked spread, no two rows alike (the pool is a prime
    number of blocks), matrices of one shape unlike each other."""
    _small_pools(monkeypatch)
    kw = dict(weight_type=weight_type, tied=False, std=0.05)
    slow = gguf.GGUFReader(write_random_gguf(tmp_path / "slow.gguf", SMALL256, **kw))
    fast = gguf.GGUFReader(write_random_gguf(tmp_path / "fast.gguf", SMALL256, fast=True, **kw))
    assert ([(t.name, t.tensor_type, int(t.n_bytes)) for t in fast.tensors]
            == [(t.name, t.tensor_type, int(t.n_bytes)) for t in slow.tensors])
    rows = {}
    for t in fast.tensors:
        if t.name.endswith("norm.weight"):
            continue
        rows[t.name] = np.asarray(t.data).reshape(int(t.shape[1]), -1)
        assert len(np.unique(rows[t.name], axis=0)) == len(rows[t.name]), t.name
        got = dequantize(t.data, t.tensor_type)
        assert np.isfinite(got).all() and 0.035 < float(got.std()) < 0.065, t.name
    assert not np.array_equal(rows["blk.0.attn_q.weight"], rows["blk.0.attn_output.weight"])


def test_use_more_bits():
    """llama.cpp's layers of more bits for Llama-3-8B's 32: the first and last 4 and every
    third between them."""
    assert [i for i in range(32) if use_more_bits(i, 32)] == [
        0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]


def test_mix_tensor_types():
    """What llama-quantize gives a llama model's tensors for Q4_K_M, Q5_K_M and Q3_K_M, here
    Llama-3-8B's (32 blocks, rows of 4096 values, 14336 for ffn_down)."""
    matrices = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

    def block(mix, i):
        return {n: mix_tensor_type(mix, f"blk.{i}.{n}.weight",
                                   14336 if n == "ffn_down" else 4096, 32, tied=False).name
                for n in matrices}

    def like(default, **special):
        return {n: special.get(n, default) for n in matrices}
    for i in (0, 6, 31):
        assert block("Q4_K_M", i) == like("Q4_K", attn_v="Q6_K", ffn_down="Q6_K")
        assert block("Q5_K_M", i) == like("Q5_K", attn_v="Q6_K", ffn_down="Q6_K")
    for i in (4, 7, 26):
        assert block("Q4_K_M", i) == like("Q4_K")
        assert block("Q5_K_M", i) == like("Q5_K")
    assert block("Q3_K_M", 1) == like("Q3_K", attn_v="Q5_K", attn_output="Q4_K", ffn_down="Q5_K")
    assert block("Q3_K_M", 2) == like("Q3_K", attn_v="Q4_K", attn_output="Q4_K", ffn_down="Q4_K")

    def head(mix, name, tied, cols=4096):
        return mix_tensor_type(mix, name, cols, 32, tied).name
    for mix in MIX_TYPES:
        assert head(mix, "output.weight", tied=False) == "Q6_K"
        assert head(mix, "token_embd.weight", tied=True) == "Q6_K"   # no output.weight
        assert head(mix, "token_embd.weight", tied=False) == mix[:4]  # Q4_K_M: Q4_K
        assert head(mix, "token_embd.weight", tied=True, cols=576) == "Q8_0"
    # a 70B (80 blocks, grouped-query attention): attn_v of Q4_K (or Q3_K) gets Q5_K
    assert mix_tensor_type("Q4_K_M", "blk.10.attn_v.weight", 8192, 80, False, True) == QType.Q5_K
    assert mix_tensor_type("Q4_K_M", "blk.12.attn_v.weight", 8192, 80, False, True) == QType.Q6_K
    assert mix_tensor_type("Q3_K_M", "blk.12.attn_v.weight", 8192, 80, False, True) == QType.Q5_K
    # rows that are not whole 256-value blocks (SmolLM2-135M's 576) fall back as in llama.cpp
    assert mix_tensor_type("Q4_K_M", "blk.1.attn_q.weight", 576, 30, False) == QType.Q5_0
    assert mix_tensor_type("Q5_K_M", "blk.1.attn_q.weight", 576, 30, False) == QType.Q5_1
    assert mix_tensor_type("Q3_K_M", "blk.1.attn_q.weight", 576, 30, False) == QType.Q4_0
    assert mix_tensor_type("Q4_K_M", "blk.0.attn_v.weight", 576, 30, False) == QType.Q8_0
    assert mix_tensor_type("Q4_K_M", "blk.0.ffn_down.weight", 1536, 30, False) == QType.Q6_K
    assert mix_tensor_type("Q4_K_M", "blk.1.attn_q.weight", 48, 30, False) == QType.F16


@pytest.mark.parametrize("tied", [True, False])
def test_q4_k_m_file(tmp_path, tied):
    """A Q4_K_M file has llama-quantize's types: attn_v and ffn_down in Q6_K in the layers of
    more bits (0, 3, 6, 7 of 8), the head in Q6_K (the token embedding when it is the head),
    the rest in Q4_K; so layer 0's q/k/v, fused, mix Q4_K and Q6_K."""
    shape = ModelShape(n_layers=8, d_model=256, n_heads=4, n_kv_heads=2, d_ffn=512, vocab=300)
    r = gguf.GGUFReader(write_random_gguf(tmp_path / "m.gguf", shape, weight_type="Q4_K_M",
                                          tied=tied))
    assert _field(r, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_K_M

    def want(name):
        if name.endswith("norm.weight"):
            return "F32"
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            return "Q6_K"
        if name.endswith(("attn_v.weight", "ffn_down.weight")):
            return "Q6_K" if int(name.split(".")[1]) in (0, 3, 6, 7) else "Q4_K"
        return "Q4_K"
    assert {t.name: t.tensor_type.name for t in r.tensors} == {
        n: want(n) for n in _expected_names(shape, tied)}
    assert sum(int(t.n_bytes) for t in r.tensors) == estimated_size(shape, "Q4_K_M", tied)
    for t in r.tensors:
        assert np.isfinite(dequantize(t.data, t.tensor_type)).all(), t.name


def test_mix_sizes_of_llama3_8b():
    """Llama-3-8B in Q4_K_M: attn_v and ffn_down of 16 of the 32 layers and the head in Q6_K,
    the rest Q4_K; 4.91 GB of tensors, the size of llama.cpp's files of it."""
    s = SHAPES["llama3-8b"]
    norms = (2 * s.n_layers + 1) * s.d_model
    matrices = s.n_params + s.vocab * s.d_model - norms
    q6k = 16 * s.d_model * (s.n_kv_heads * s.head_dim + s.d_ffn) + s.vocab * s.d_model
    assert estimated_size(s, "Q4_K_M", tied=False) == (
        matrices * 144 // 256 + q6k * (210 - 144) // 256 + 4 * norms)
    assert 4.90e9 < estimated_size(s, "Q4_K_M", tied=False) < 4.92e9
    assert (estimated_size(s, "Q3_K_M", tied=False) < estimated_size(s, "Q4_K", tied=False)
            < estimated_size(s, "Q4_K_M", tied=False) < estimated_size(s, "Q5_K_M", tied=False)
            < estimated_size(s, "Q6_K", tied=False))


def test_cli(tmp_path, monkeypatch):
    from click.testing import CliRunner

    runner = CliRunner()
    res = runner.invoke(main, ["--help"])
    assert res.exit_code == 0 and all(t.lower() in res.output for t in WEIGHT_TYPES)
    res = runner.invoke(main, ["nosuch", str(tmp_path / "x.gguf")])
    assert res.exit_code == 2
    assert "unknown shape 'nosuch'" in res.output
    for name in SHAPES:
        assert name in res.output

    out = tmp_path / "sub" / "tiny.gguf"
    res = runner.invoke(main, ["tiny", str(out), "--weight-type", "q8_0", "--seed", "7",
                               "--untied"])
    assert res.exit_code == 0, res.output
    r = gguf.GGUFReader(out)
    assert [t.name for t in r.tensors] == _expected_names(TINY, tied=False)
    assert r.tensors[1].tensor_type == QType.F32 and r.tensors[2].tensor_type == QType.Q8_0

    res = runner.invoke(main, ["tiny", str(out)])
    assert res.exit_code != 0 and "--force" in res.output
    res = runner.invoke(main, ["tiny", str(out), "--force"])
    assert res.exit_code == 0, res.output
    assert gguf.GGUFReader(out).tensors[2].tensor_type == QType.BF16

    # rows of 64 values: a K-quant is refused with a sentence, a mix falls back as llama.cpp's
    res = runner.invoke(main, ["tiny", str(out), "--force", "--weight-type", "q6_k"])
    assert res.exit_code == 2 and "row length 64 is not a multiple" in res.output
    _small_pools(monkeypatch)
    res = runner.invoke(main, ["tiny", str(out), "--force", "--weight-type", "q4_k_m", "--fast"])
    assert res.exit_code == 0, res.output
    r = gguf.GGUFReader(out)
    assert _field(r, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_K_M
    types = {t.name: t.tensor_type.name for t in r.tensors}
    # Q6_K -> Q8_0 (the tied head, attn_v of layers 2 and 3 of 4), Q4_K -> Q5_0
    assert (types["token_embd.weight"], types["blk.3.attn_v.weight"],
            types["blk.0.attn_v.weight"], types["blk.1.ffn_up.weight"]) == (
        "Q8_0", "Q8_0", "Q5_0", "Q5_0")


NEXTN_NAMES = [f"blk.{TINY.n_layers}.nextn.{n}.weight"
               for n in ("eh_proj", "enorm", "hnorm", "shared_head_norm")] + [
    f"blk.{TINY.n_layers}.{n}.weight" for n in (
        "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
        "ffn_up", "ffn_down")]


def test_cli_nextn_layer_and_sidecar(tmp_path):
    """--nextn: llama.cpp's layout (block_count + 1, nextn_predict_layers 1, the head at block
    n_layers, no embed_tokens or shared_head_head); the model still counts n_layers main
    blocks and its own head is found. --nextn-sidecar: the same head for the model written,
    accepted for it and refused, with a sentence, for a model of another seed or shape."""
    from click.testing import CliRunner

    from strata.model.gguf_file import ModelError, ModelFile
    from strata.model.nextn import find_head, open_head

    runner = CliRunner()
    model, sidecar = tmp_path / "tiny.gguf", tmp_path / "head.gguf"
    res = runner.invoke(main, ["tiny", str(model), "--weight-type", "f32", "--seed", "7",
                               "--nextn", "--nextn-sidecar", str(sidecar)])
    assert res.exit_code == 0, res.output
    r = gguf.GGUFReader(model)
    assert _field(r, "llama.block_count") == TINY.n_layers + 1
    assert _field(r, "llama.nextn_predict_layers") == 1
    names = [t.name for t in r.tensors]
    assert names[:-1] == _expected_names(TINY, tied=True)[:-1] + NEXTN_NAMES
    file = ModelFile(model)
    assert file.config.n_layers == TINY.n_layers
    own = find_head(file)
    assert own is not None and not own.sidecar and own.block == TINY.n_layers
    head = open_head(own, file)
    for name in ("blk.4.nextn.eh_proj.weight", "blk.4.attn_q.weight", "blk.4.nextn.enorm.weight"):
        np.testing.assert_array_equal(head.tensor(name).numpy(),
                                      random_tensor(TINY, name, seed=7))

    s = gguf.GGUFReader(sidecar)
    assert sorted(t.name for t in s.tensors) == sorted(NEXTN_NAMES)
    assert _field(s, "llama.nextn_predict_layers") == 1
    assert _field(s, "llama.vocab_size") == TINY.vocab
    side = find_head(file, sidecar)
    assert side is not None and side.sidecar and side.block == TINY.n_layers
    np.testing.assert_array_equal(open_head(side, file).tensor(NEXTN_NAMES[0]).numpy(),
                                  head.tensor(NEXTN_NAMES[0]).numpy())

    other_seed = write_random_gguf(tmp_path / "seed8.gguf", TINY, seed=8)
    other_shape = write_random_gguf(tmp_path / "wide.gguf", ModelShape(
        n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, d_ffn=128, vocab=400), seed=7)
    for other, words in ((other_seed, ["target fingerprint"]),
                         (other_shape, ["embedding_length 64 (the model's: 128)",
                                        "vocab_size 320 (the model's: 400)"])):
        with pytest.raises(ModelError) as e:
            find_head(ModelFile(other), sidecar)
        text = str(e.value)
        assert "made for another model" in text and "\n" not in text, text
        assert all(w in text for w in words), text
    assert find_head(ModelFile(other_seed)) is None   # no NextN layer of its own


def test_open_head_refuses_a_head_of_other_shapes(tmp_path):
    """A head whose block does not have the model's shapes is refused with a sentence naming
    the tensor (a sidecar's metadata may match while its tensors do not). Its feed-forward
    width is its own (the sidecar's feed_forward_length): only a block whose tensors disagree
    with it is refused."""
    from strata.model.gguf_file import ModelError, ModelFile
    from strata.model.mkmodel import write_nextn_sidecar
    from strata.model.nextn import HeadSource, open_head

    model = write_random_gguf(tmp_path / "tiny.gguf", TINY, seed=7)
    file = ModelFile(model)
    fewer_kv = ModelShape(n_layers=4, d_model=64, n_heads=4, n_kv_heads=1, d_ffn=128, vocab=320)
    sidecar = write_nextn_sidecar(tmp_path / "head.gguf", model, fewer_kv, seed=7)
    with pytest.raises(ModelError) as e:
        open_head(HeadSource(sidecar, TINY.n_layers, sidecar=True), file)
    assert "blk.4.attn_k.weight has shape [16, 64], not [32, 64]" in str(e.value)

    narrow = ModelShape(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ffn=64, vocab=320)
    sidecar = write_nextn_sidecar(tmp_path / "narrow.gguf", model, narrow, seed=7)
    assert open_head(HeadSource(sidecar, TINY.n_layers, sidecar=True), file).config.d_ffn == 64
    # tensors of one width under the metadata of another
    lying = tmp_path / "lying.gguf"
    lying.write_bytes(sidecar.read_bytes().replace(_u32_field(b"llama.feed_forward_length", 64),
                                                   _u32_field(b"llama.feed_forward_length", 128)))
    with pytest.raises(ModelError) as e:
        open_head(HeadSource(lying, TINY.n_layers, sidecar=True), file)
    assert "blk.4.ffn_gate.weight has shape [64, 64], not [128, 64]" in str(e.value)


def _u32_field(key: bytes, value: int) -> bytes:
    """A GGUF metadata key-value pair of type uint32, as written in the file."""
    import struct
    return struct.pack("<Q", len(key)) + key + struct.pack("<II", 4, value)


@pytest.mark.parametrize("name", ["qwen2-tiny", "qwen3-tiny", "gemma3-tiny", "qwen3moe-tiny",
                                  "glm4moe-tiny"])
def test_family_shapes_write_their_tensors_and_keys(tmp_path, name):
    from strata.model.families import FAMILIES, block_tensor_names, tensor_name
    from strata.model.gguf_file import ModelFile
    shape = SHAPES[name]
    path = write_random_gguf(tmp_path / f"{name}.gguf", shape, seed=2)
    file = ModelFile(path)
    family = FAMILIES[shape.arch]
    assert (file.config.arch, file.config.head_dim, file.config.window) == (
        shape.arch, shape.head_dim, shape.sliding_window)
    want = {tensor_name(i, n) for i in range(shape.n_layers)
            for n in block_tensor_names(family, shape.routed(i))}
    assert want == {n for n in file.tensors if n.startswith("blk.")}
    if family.moe:   # experts [E, F, D] in llama.cpp's layout, with the keys it reads
        cfg, layer = file.config, shape.dense_first
        assert (cfg.n_experts, cfg.n_experts_used, cfg.d_ffn_expert, cfg.n_dense_first,
                cfg.expert_scale, cfg.expert_groups) == (*shape.experts, shape.dense_first,
                                                         shape.expert_scale, shape.expert_groups)
        name = f"blk.{layer}.ffn_down_exps.weight"
        np.testing.assert_array_equal(file.tensor(name).numpy(), random_tensor(shape, name, seed=2))
        assert tuple(file.tensor(name).shape) == (shape.experts[0], shape.d_model, shape.experts[2])
        assert file.tensor_type(f"blk.{layer}.ffn_gate_inp.weight") == "F32"
    assert path.stat().st_size > estimated_size(shape, "F32")   # and the metadata
    if family.qkv_bias:   # biases are N(0, std), norms about 1
        assert abs(file.tensor("blk.0.attn_q.bias").mean()) < 0.01
    assert abs(file.tensor("blk.0.attn_norm.weight").mean() - 1) < 0.1
