"""strata.model.mkmodel: random-weight llama GGUF files, read back with gguf-py."""
from __future__ import annotations

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from strata.model.mkmodel import (
    CHAT_TEMPLATE, KQUANT_TYPES, QUANTIZABLE_TYPES, SHAPES, ModelShape, bytes_to_unicode,
    estimated_size, main, make_vocabulary, random_kquant_blocks, random_tensor, tensor_specs,
    write_random_gguf, write_raw_blocks_gguf,
)

TINY = SHAPES["tiny"]


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
             for wt in QUANTIZABLE_TYPES}
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


@pytest.mark.parametrize("weight_type", QUANTIZABLE_TYPES)
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
               "Q8_0": absmax / 127, "Q4_0": absmax / 8, "Q4_1": absmax / 15}[weight_type]
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
        write_random_gguf(tmp_path / "x.gguf", TINY, weight_type="Q3_K")
    with pytest.raises(ValueError, match="Q4_K"):  # rows of 64 are not whole 256-blocks
        write_random_gguf(tmp_path / "x.gguf", TINY, weight_type="Q4_K")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("qtype", KQUANT_TYPES)
def test_kquant_raw_blocks(tmp_path, qtype):
    rows, cols = 6, 512
    path = write_raw_blocks_gguf(tmp_path / "k.gguf", "blk.0.ffn_down.weight", qtype,
                                 rows, cols, seed=3)
    r = gguf.GGUFReader(path)
    (t,) = r.tensors
    assert t.name == "blk.0.ffn_down.weight" and t.tensor_type == QType[qtype]
    assert [int(x) for x in t.shape] == [cols, rows]
    got = dequantize(t.data, t.tensor_type)
    assert got.shape == (rows, cols) and got.dtype == np.float32
    assert np.isfinite(got).all()
    assert 0.005 < float(got.std()) < 0.05 and float(np.abs(got).max()) < 1.0
    again = random_kquant_blocks(qtype, rows, cols, 3)
    np.testing.assert_array_equal(np.asarray(t.data).reshape(again.shape), again)


@pytest.mark.parametrize("qtype", KQUANT_TYPES)
def test_kquant_model(tmp_path, qtype):
    shape = ModelShape(1, 256, 4, 2, 512, 300)
    r = gguf.GGUFReader(write_random_gguf(tmp_path / "k.gguf", shape, weight_type=qtype,
                                          tied=False))
    assert [t.name for t in r.tensors] == _expected_names(shape, tied=False)
    for t in r.tensors:
        want = QType.F32 if t.name.endswith("norm.weight") else QType[qtype]
        assert t.tensor_type == want
        got = dequantize(t.data, t.tensor_type)
        assert got.shape == tuple(int(x) for x in reversed(t.shape))
        assert np.isfinite(got).all()


def test_cli(tmp_path):
    from click.testing import CliRunner

    runner = CliRunner()
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
