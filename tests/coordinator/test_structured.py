"""Structured output: the request fields (grammar_fields.py), the masks of a window's rows and
the drafts the grammar allows (grammar.py), the last stage's masked sampling (head.py), the
masks on the wire, and the scheduler's exactness with grammars: against a fake pipeline whose
"model" gives every history its own random logits and whose last stage masks them as the real
one does, each request gets the same tokens alone, together, in pipelined groups, with MTP and
lookup drafts. The real SmolLM2 cases: tests/system/test_structured_smollm2.py."""
from __future__ import annotations

import json
import random
import re
import zlib

import numpy as np
import pytest
import torch

from strata.coordinator.api import openai_api as api
from strata.coordinator.speculation.drafts import DraftCounts
from strata.coordinator.grammar import Grammars, WindowMasks
from strata.coordinator.api.prompts import Prompts
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.kernels.sampling.sample import sample_row
from strata.model.gguf_file import ModelFile
from strata.model.tokenizer import Tokenizer
from strata.protocol.messages import ProtocolError, Result, Window
from strata.protocol.transport import pack, unpack
from strata.stage_worker.head import HeadOutput, head_tokens, picked
from strata.stage_worker.history import SlotTokens
from test_mtp_scheduler import WRONG, DraftingPipeline, random_policy
from test_scheduler import FakePipeline, prompts

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(smollm2) -> Tokenizer:
    return Tokenizer.from_gguf(ModelFile(smollm2).reader)


@pytest.fixture(scope="module")
def grammars(tok) -> Grammars:
    return Grammars(tok, tok.vocab_size)


def parse(tok, grammars, **body) -> api.Parsed:
    return api.parse({"prompt": "Hi", **body}, chat=False,
                     prompts=Prompts(tok, tok.vocab_size, 512), grammars=grammars)


def compiled(tok, grammars, **body):
    """The constraint of the request's (first) choice."""
    return parse(tok, grammars, **body).choices[0].grammar


def follows(c, tok, text: str) -> bool:
    """Whether the constraint takes `text`'s tokens and is then satisfied."""
    return c.matcher.consume_tokens(tok.encode(text)) and c.matcher.is_accepting()


# --- the fields ---------------------------------------------------------------------------

@pytest.mark.parametrize("body,good,wrong", [
    ({"response_format": {"type": "json_object"}}, '{"a": [1, 2]}', '[1, 2]'),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON, "strict": True}}},
     '{"name": "Ada", "age": 36}', '{"name": "Ada"}'),
    ({"guided_json": json.dumps(PERSON)}, '{"name": "Ada", "age": 36}', '{"age": "36"}'),
    ({"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
     '{"name":"Ada","age":36}', '{"name": "Ada", "age": 36}'),
    ({"structured_outputs": {"json_object": True}}, '{}', '"x"'),
    ({"guided_regex": r"[a-z]+@example\.(com|org)"}, "ada@example.org", "ada@example.net"),
    ({"structured_outputs": {"regex": r"\d{3}"}}, "123", "1234"),
    ({"guided_choice": ["yes", "no", "naïve \"q\""]}, 'naïve "q"', "maybe"),
    ({"structured_outputs": {"choice": ["left", "right"]}}, "right", "up"),
    ({"guided_grammar": 'root ::= "a" root | "b"'}, "aab", "aba"),        # GBNF
    ({"structured_outputs": {"grammar": 'start: "x"+ "y"'}}, "xxy", "y"),  # Lark
])
def test_each_shape_constrains_as_it_says(tok, grammars, body, good, wrong):
    assert follows(compiled(tok, grammars, **body), tok, good)
    assert not follows(compiled(tok, grammars, **body), tok, wrong)


def test_text_and_no_format_ask_for_nothing(tok, grammars):
    assert compiled(tok, grammars, response_format={"type": "text"}) is None
    assert compiled(tok, grammars) is None


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, "response_format.json_schema.schema",
     "Invalid type: objekt"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema", "has no 'schema'"),
    ({"response_format": {"type": "xml"}}, "response_format", "\"json_object\""),
    ({"response_format": {"type": "text", "json_schema": {}}},
     "response_format.json_schema", "does not know"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema",
     "does not know"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"guided_json": {"type": "string", "format": "weird"}}, "guided_json", "weird"),
    ({"guided_choice": []}, "guided_choice", "non-empty array of strings"),
    ({"guided_choice": ["a", 1]}, "guided_choice", "non-empty array of strings"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "missing"),
    # compiles, but llguidance's lexer cannot follow its first token: refused before a window
    ({"guided_regex": "(a{1000}){1000}"}, "guided_regex", "too many expressions constructed"),
    # no output satisfies them (Lark, GBNF, a schema that only refers to itself)
    ({"guided_grammar": 'start: a\na: a "x"'}, "guided_grammar", "accepts no text"),
    ({"guided_grammar": 'root ::= root "x"'}, "guided_grammar", "accepts no text"),
    ({"guided_json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}},
     "guided_json", "accepts no text"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "give one of them"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "give one of them"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace", "JSON output only"),
    ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}},
     "structured_outputs.backend", "does not know"),
])
def test_a_bad_structured_request_is_a_400_naming_its_field(tok, grammars, body, param, words):
    with pytest.raises(api.ApiError) as e:
        parse(tok, grammars, **body)
    assert (e.value.status, e.value.param) == (400, param)
    assert words in e.value.message, e.value.message
    assert "<state>" not in e.value.message and "\n" not in e.value.message   # no internals


def test_a_grammar_llguidance_stops_following_is_the_requests_400(tok, grammars, monkeypatch):
    """A grammar whose limits only show after the probe (here: no probe at all) ends its
    request with an error that names the field, a 400 (not a window's 500)."""
    from strata.coordinator import grammar
    from strata.coordinator.api.choices import failure
    from strata.coordinator.engine.engine import Finished
    from strata.coordinator.sequence import Sequence
    monkeypatch.setattr(grammar, "PROBE_TOKENS", 0)
    c = compiled(tok, grammars, guided_regex="(a{1000}){1000}")
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=50), tok.stop_ids, 512, grammar=c)
    masks = WindowMasks()
    masks.add(c, [])
    masks.fill()                              # the window's mask, as the scheduler makes it
    assert seq.accept(tok.encode("aaaa")[0]) and seq.grammar_failed
    assert seq.error.startswith("guided_regex cannot be followed past 0 tokens")
    e = failure(Finished("error", [], "", seq.error, grammar=seq.grammar_failed))
    assert (e.status, e.code) == (400, "invalid_grammar") and "<state>" not in e.message


# --- masks and drafts ---------------------------------------------------------------------

def mask_of(c, tokens: list[int]) -> np.ndarray:
    """The reference: a fresh copy of the matcher advanced by `tokens`, its mask."""
    m = c.matcher.deep_copy()
    assert m.consume_tokens(tokens)
    return np.frombuffer(m.compute_bitmask(), dtype="<i4")[:c.words]   # (it gives a word more)


def test_window_masks_follow_each_slots_drafts_and_leave_its_state(tok, grammars):
    doc = tok.encode('{"name": "Ada Lovelace", "age": 36}')
    body = {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}
    a, b = (compiled(tok, grammars, **body) for _ in range(2))
    # a inside the name, its drafts past the string's end into the next key; b at the age
    assert a.matcher.consume_tokens(doc[:6]) and b.matcher.consume_tokens(doc[:12])
    masks = WindowMasks()
    assert masks.add(b, []) == 0 and masks.add(a, doc[6:11]) == 1
    bits = masks.fill()
    assert bits.shape == (7, grammars.words)
    expected = [mask_of(b, [])] + [mask_of(a, doc[6:6 + j]) for j in range(6)]
    assert all((row == e).all() for row, e in zip(bits, expected))
    assert len({row.tobytes() for row in bits}) > 2   # masks that differ: the test can fail
    again = WindowMasks()   # the matchers were rolled back: the same masks again
    again.add(b, [])
    again.add(a, doc[6:11])
    assert (again.fill() == bits).all()


def test_each_choice_has_a_matcher_of_its_own(tok, grammars):
    """n > 1 (and a list of prompts): one compilation, a matcher per choice, each advanced
    alone."""
    body = {"prompt": ["Hi", "Yo"], "n": 2, "guided_regex": r"[a-z]+@example\.com"}
    cs = [c.grammar for c in parse(tok, grammars, **body).choices]
    assert len({id(c.matcher) for c in cs}) == 4
    ada, bob = tok.encode("ada@example.com"), tok.encode("bob")
    assert follows(cs[0], tok, "ada@example.com") and cs[0].complete
    assert cs[1].matcher.consume_tokens(bob) and not cs[1].complete
    # the others are where they began: what the first took, they take too, and not more
    assert all((mask_of(c, []) == mask_of(cs[3], [])).all() for c in cs[2:])
    assert cs[2].drafts(ada) == ada and cs[3].drafts(bob + [WRONG]) == bob


def test_drafts_stop_where_the_grammar_or_the_text_does(tok, grammars):
    c = compiled(tok, grammars, guided_regex=r"[a-z]+@example\.com")
    ids = tok.encode("ada@example.com")
    assert c.drafts(ids) == ids
    assert c.drafts(ids[:2] + [WRONG] + ids[2:]) == ids[:2]      # forbidden: cut there
    assert c.drafts(ids + tok.encode("x")) == ids                 # past the grammar's end
    assert c.drafts([ids[0], 2, ids[1]]) == [ids[0]]             # a stop token: cut before
    assert c.drafts([]) == []


def test_a_request_ends_when_its_grammar_is_complete(tok, grammars):
    from strata.coordinator.sequence import Sequence
    c = compiled(tok, grammars, guided_choice=["yes", "no"])
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=50), tok.stop_ids, 512, grammar=c)
    assert seq.accept(tok.encode("yes")[0]) and seq.finish_reason == "stop"
    c = compiled(tok, grammars, guided_choice=["yes", "no"])
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=50), tok.stop_ids, 512, grammar=c)
    assert seq.accept(tok.encode("maybe")[0]) and seq.finish_reason == "error"
    assert "forbids" in seq.error


# --- the last stage -----------------------------------------------------------------------

VOCAB = 100


def masked_window(rng: random.Random, rows: int, sampled: list[int], masked: list[int],
                  params: list[SamplingParams]) -> tuple[Window, np.ndarray]:
    """A window whose sampled rows `sampled` have params; those at `masked` (indices into
    sampled) a random mask. Returns it and the masks' allowed sets [len(masked), VOCAB]."""
    words = -(-VOCAB // 32)
    allowed = np.array([[rng.random() < 0.3 for _ in range(VOCAB)] for _ in masked])
    allowed[:, rng.randrange(VOCAB)] = True
    bits = np.zeros((len(masked), words * 32), dtype=np.uint8)
    bits[:, :VOCAB] = allowed
    packed = np.packbits(bits, axis=1, bitorder="little").view("<i4")
    w = Window(1, list(range(rows)), list(range(rows)), [0] * rows, sample_rows=sampled,
               temperature=[p.temperature for p in params], top_k=[p.top_k for p in params],
               top_p=[p.top_p for p in params], min_p=[p.min_p for p in params],
               u=[rng.random() for _ in params],
               mask=[masked.index(j) if j in masked else -1 for j in range(len(sampled))],
               masks=packed.tobytes())
    return unpack(pack(w))[0], allowed


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("graphed", [False, True])
def test_a_masked_row_samples_as_if_forbidden_logits_were_minus_inf(graphed, device):
    """Greedy, unfiltered and filtered rows, masked or not, against sample_row over the row's
    logits with the forbidden ones at -inf; a head whose logits are every row's (a decode
    window's graph) or the sampled rows' only. On CUDA the tokens are picked on the device
    (picked), as a CUDA last stage does."""
    rng = random.Random(graphed)
    torch.manual_seed(int(graphed))
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=1.5, top_k=20, top_p=0.9, seed=2),
              SamplingParams(), SamplingParams(temperature=1.1, min_p=0.05, seed=3)]
    sampled, masked = [0, 2, 3, 5, 7], [0, 1, 2, 4]
    w, allowed = masked_window(rng, 8, sampled, masked, params)
    logits = torch.randn(8 if graphed else len(sampled), VOCAB) * 3
    rows = sampled if graphed else list(range(len(sampled)))
    head = HeadOutput(logits.to(device), logits.argmax(-1).to(device), rows)
    out = picked(head, w, SlotTokens(8, 8), device == "cuda")
    if device == "cuda":
        torch.cuda.synchronize()
    tokens = head_tokens(out, w)
    expected = []
    for j, (r, p) in enumerate(zip(rows, w.sampled)):
        x = logits[r].clone()
        if j in masked:
            x[~torch.from_numpy(allowed[masked.index(j)])] = float("-inf")
        expected.append(sample_row(x, p))
    assert tokens == expected
    assert all(allowed[masked.index(j)][t] for j, t in enumerate(tokens) if j in masked)
    assert (head.logits.cpu() == logits).all()   # the head's buffers are left as they were
    unmasked = head_tokens(HeadOutput(logits, logits.argmax(-1), rows), w)
    assert tokens[3] == unmasked[3] and tokens != unmasked


def test_masks_on_the_wire_are_checked():
    w = Window(1, [0, 1], [0, 0], [5, 6], sample_rows=[0, 1], temperature=[0, 0],
               top_k=[0, 0], top_p=[1, 1], min_p=[0, 0], u=[0, 0], mask=[-1, 0],
               masks=bytes(16))
    back = unpack(pack(w))[0]
    assert (back.mask, back.masks, back.mask_words()) == ([-1, 0], bytes(16), 4)
    for mask, masks in (([0], bytes(16)), ([0, 1], bytes(16 + 2)), ([0, -1], b""),
                        ([-1, -1], bytes(4)), ([-2, 0], bytes(4))):
        with pytest.raises(ProtocolError):
            Window(1, [0, 1], [0, 0], [5, 6], sample_rows=[0, 1], temperature=[0, 0],
                   top_k=[0, 0], top_p=[1, 1], min_p=[0, 0], u=[0, 0], mask=mask, masks=masks)


def test_a_stage_refuses_masks_of_another_vocabulary(tiny_model):
    from strata.stage_worker.checks import RowError, check_window
    from strata.stage_worker.config import WorkerConfig
    config = ModelFile(tiny_model).config
    cfg = WorkerConfig(model=str(tiny_model), stage=0, layer_start=0,
                       layer_end=config.n_layers, listen="ipc:///tmp/x", coordinator="ipc:///y",
                       next=None, slots=2, ctx=64)
    words = -(-config.vocab // 32)
    for n, ok in ((words, True), (words + 1, False)):
        w = Window(1, [0], [0], [5], sample_rows=[0], temperature=[0], top_k=[0], top_p=[1],
                   min_p=[0], u=[0], mask=[0], masks=bytes(4 * n))
        if ok:
            check_window(w, [], cfg, config, True, [0, 0])
        else:
            with pytest.raises(RowError, match=f"needs {words}"):
                check_window(w, [], cfg, config, True, [0, 0])


# --- the scheduler against a fake model -------------------------------------------------------

class MaskedPipeline(FakePipeline):
    """The fake pipeline with a model: every history gets its own random logits over the real
    vocabulary, masked and sampled by the last stage's own functions. It checks that no
    window carries a draft its row's predecessor's mask forbids."""

    vocab = 49152   # SmolLM2's

    def __init__(self, slots: int, ctx: int):
        super().__init__(slots, ctx)
        self.history = SlotTokens(slots, ctx)   # the last stage's, for the penalties

    def logits(self, history: list[int]) -> torch.Tensor:
        seed = zlib.crc32(np.asarray(history, dtype=np.int64).tobytes())
        return torch.from_numpy(np.random.default_rng(seed).standard_normal(
            self.vocab, dtype=np.float32) * 4)

    def receive(self, timeout=None):
        w = self.queue[0]
        result, tensors = super().receive(timeout)   # the rows written, as a stage's KV
        if not w.sample_rows:
            return result, tensors
        logits = torch.stack([self.logits(self.kv[w.slots[r]][:w.positions[r] + 1])
                              for r in w.sample_rows])
        head = HeadOutput(logits, logits.argmax(-1), list(range(len(w.sample_rows))))
        self.history.write(w)
        masked = picked(head, w, self.history, False)
        for j, r in enumerate(w.sample_rows[:-1]):   # a draft follows its row's mask
            if w.slots[r + 1] == w.slots[r] and w.sample_rows[j + 1] == r + 1:
                assert masked.logits[j, w.tokens[r + 1]] > float("-inf"), "a forbidden draft"
        return Result(w.id, head_tokens(masked, w)), tensors


class MaskedDrafting(DraftingPipeline, MaskedPipeline):
    """The fake model, and a last stage that proposes (test_mtp_scheduler's)."""


BODIES = [{"guided_regex": r"[a-z]{2,8}@example\.(com|org)"},
          {"structured_outputs": {"disable_any_whitespace": True, "json": {
              "type": "object", "additionalProperties": False, "required": ["ok", "color", "n"],
              "properties": {"ok": {"type": "boolean"},
                             "color": {"enum": ["red", "green", "blue"]},
                             "n": {"type": "integer", "minimum": 0, "maximum": 999}}}}},
          {"guided_choice": ["the first answer", "another one", "a third, longer answer"]}]


def valid(body: dict, text: str) -> bool:
    if "guided_regex" in body:
        return re.fullmatch(body["guided_regex"], text) is not None
    if "guided_choice" in body:
        return text in body["guided_choice"]
    out = json.loads(text)
    return set(out) == {"ok", "color", "n"} and out["color"] in ("red", "green", "blue")


def request(i: int) -> tuple[SamplingParams, dict]:
    """Request i's sampling (odd ones seeded) and structured output."""
    params = (SamplingParams(temperature=0.9, seed=i, max_tokens=40) if i % 2
              else SamplingParams(max_tokens=40))
    return params, BODIES[i % len(BODIES)]


def run(tok, grammars, ps, pipe, cfg: SchedulerConfig, first: int = 0):
    """Requests first, first + 1, ... with prompts ps, together."""
    sched = Scheduler(pipe, cfg, tok.stop_ids, tok.decode)
    reqs = []
    for i, p in enumerate(ps, first):
        params, body = request(i)
        reqs.append(sched.submit(p, params, grammar=compiled(tok, grammars, **body)))
    sched.run()
    assert sched.idle
    return reqs


def test_grammars_keep_every_schedule_exact(tok, grammars):
    rng = random.Random(5)
    ps = prompts(12, rng)
    ctx = 256
    assert MaskedPipeline.vocab == tok.vocab_size
    alone = [run(tok, grammars, [p], MaskedPipeline(1, ctx),
                 SchedulerConfig(slots=1, ctx=ctx, chunk_rows=8), first=i)[0].seq.generated
             for i, p in enumerate(ps)]
    truth = [p + g for p, g in zip(ps, alone)]
    for pipe, cfg in [
            (MaskedPipeline(4, ctx), SchedulerConfig(slots=4, ctx=ctx, chunk_rows=8)),
            (MaskedPipeline(4, ctx), SchedulerConfig(slots=4, groups=2, ctx=ctx,
                                                            chunk_rows=8, prompt_depth=2)),
            (MaskedPipeline(4, ctx), SchedulerConfig(slots=4, ctx=ctx, chunk_rows=8,
                                                            draft_tokens=3, drafter="lookup")),
            (MaskedDrafting(4, ctx, truth, random_policy(3), 3),
             SchedulerConfig(slots=4, groups=2, ctx=ctx, chunk_rows=8, draft_tokens=3,
                             drafter="mtp"))]:
        reqs = run(tok, grammars, ps, pipe, cfg)
        assert [r.seq.generated for r in reqs] == alone, cfg
        assert all(r.error is None for r in reqs)
    # the MTP run: true proposals kept, the fake's wrong ones (a token no grammar allows) cut
    counts = sum((r.drafts.counts for r in reqs), DraftCounts())
    assert 0 < counts.accepted <= counts.drafted
    assert pipe.asked > sum(r.drafts.counts.drafted > 0 for r in reqs)
    texts = [tok.decode(g) for g in alone]
    done = [i for i, r in enumerate(reqs) if r.seq.finish_reason == "stop"]
    assert len(done) >= len(ps) // 2, [r.seq.finish_reason for r in reqs]
    assert all(valid(request(i)[1], texts[i]) for i in done), texts


def test_the_grammar_bench_prints_a_row_per_draft_count(tmp_path):
    from click.testing import CliRunner

    from strata.bench.cli import main   # (through the group: its -h stays the command's)
    out = tmp_path / "g.json"
    r = CliRunner().invoke(main, ["grammar", "--slots", "3", "--drafts", "0,2", "--windows",
                                  "12", "--json-out", str(out)], prog_name="strata-bench")
    assert r.exit_code == 0, (r.output, r.exception)
    rows = json.loads(out.read_text())["results"]
    assert [row["drafts"] for row in rows] == [0, 2]
    assert rows[0]["rows"] == 3 and 3 < rows[1]["rows"] <= 9
    assert all(row["masks_ms"][0] > 0 for row in rows)
