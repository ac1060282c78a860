"""Batch slots and groups: every request gets exactly its solo tokens.

"Alone" is computed once per model (its fewest stages, one request at a time) and every batched
run is compared with it token by token. The matrix runs on `varied_model` (conftest: a tiny
random model whose tokens depend on the whole context, so a row that reads a wrong position,
slot or cache entry changes the text), all requests greedy, then all seeded; each property runs
once more on the real SmolLM2 (marked slow), on the session's 3-stage launch of it (conftest's
smollm2_stages), with greedy and seeded requests in the same windows ("mixed": even requests
greedy, odd ones seeded) and 12 tokens a request, against the session's reference alone
(conftest's smollm2_alone, which the HTTP server's cases compare with too). What each case
proves:

- test_batched_equals_alone: together == alone, with 8 requests through 4 or 8 slots (slots
  shared by windows, reused by later requests); serial (groups 1) == pipelined (groups 2 and
  auto) == alone; greedy, seeded and mixed; 2 and 3 stages (alone on 2). SmolLM2's case runs
  pipelined (auto groups) on 3 stages only: the varied model covers every group count and
  stage count, test_parity SmolLM2's stage counts.
- test_staggered_lifecycle: a long prompt admitted while slots decode (its chunks go between
  their windows), a cancelled request whose slot is reused at once, one finishing early;
  pipelined over 3 stages.
- test_32_requests_through_4_slots: the long lifecycle, each slot reused 8 times, pipelined
  (varied model only).
- test_multi_turn_reuses_the_slot_and_equals_a_fresh_read: the prompt cache: a follow-up reads
  only what its slot does not hold, and gets the tokens of a fresh read.
- test_drafts_give_the_solo_tokens: draft rows in the decode windows change no token, and some
  drafts are accepted.
"""
from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import replace

import pytest

from conftest import SHARED_GROUP, SMOLLM2_CTX, SMOLLM2_REQUESTS, SMOLLM2_SPLIT
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig, auto_groups
from strata.bench import harness
from strata.launch.plan import plan_stages
from strata.launch.session import Launched, launch_stages
from strata.model.gguf_file import ModelFile
from strata.model.tokenizer import Tokenizer

CTX = 512
N_REQUESTS = 8
N_TOKENS = 24
LONG_PROMPT = 360  # tokens: 12 chunks of 32
SLOTS = 8  # the most any case uses (the SmolLM2 cases: 4, conftest's SMOLLM2_SLOTS)
assert CTX == SMOLLM2_CTX and N_REQUESTS == SMOLLM2_REQUESTS
# the SmolLM2 subject takes the session's launch at run time (subjects, below)
pytestmark = pytest.mark.xdist_group(SHARED_GROUP)


class Subject:
    """A model under test, its stage splits (stage count -> --layer-split), its prompts, and
    once asked for, each prompt's tokens alone. Its launch (SLOTS slots, which every case's
    scheduler uses a part of) stays up from one case to the next while they ask for the same
    stage count; one launch per subject at a time. A subject given a launch (`shared`, one
    stage count) uses it for every case, and the reference alone computed on it (`reference`:
    conftest's smollm2_alone, in the "mixed" mode) instead of its own."""

    def __init__(self, path, splits: dict[int, str], every_group_count: bool,
                 shared: Launched | None = None, reference: tuple | None = None):
        self.file = ModelFile(path)
        self.every_group_count = every_group_count  # in test_batched_equals_alone
        self.tok = Tokenizer.from_gguf(self.file.reader)
        self.splits = splits
        self.base = min(splits)  # the stage count of "alone" and of the single-count cases
        self.prompts = [self.tok.encode(p) for p in harness.prompt_set(N_REQUESTS)]
        self.modes = ("greedy", "seeded") if reference is None else ("mixed",)
        self.tokens = N_TOKENS
        self._alone: dict[str, list[list[int]]] | None = None
        if reference is not None:
            _, prompts, params, alone = reference
            assert prompts == self.prompts, "the reference alone read other prompts"
            self.tokens = params[0].max_tokens
            assert params == params_for("mixed", tokens=self.tokens), params
            self._alone = {"mixed": [r.seq.generated for r in alone]}
        self._launch: tuple[int, Launched] | None = None
        if shared is not None:
            assert list(splits) == [len(shared.plan)], (splits, shared.plan)
            self._launch = len(shared.plan), shared
        self.shared = shared
        self._stack = ExitStack()

    def run(self, stages: int) -> Launched:
        if self.shared is not None:
            assert stages == len(self.shared.plan), stages
            return self.shared
        if self._launch is None or self._launch[0] != stages:
            self.close()
            plan = plan_stages(self.splits[stages], ["cpu"], self.file.config.n_layers)
            run = self._stack.enter_context(launch_stages(self.file, plan, slots=SLOTS, ctx=CTX,
                                                          say=lambda s: None))
            self._launch = stages, run
        return self._launch[1]

    def close(self) -> None:
        self._stack.close()
        self._launch = None

    def alone(self) -> dict[str, list[list[int]]]:
        """Each request alone by mode (greedy, seeded and mixed, or the reference's mixed): the
        fewest stages, one slot, one request at a time."""
        if self._alone is None:
            cfg = SchedulerConfig(slots=1, groups=1, ctx=CTX)
            self._alone = {mode: [r.seq.generated for r in harness.run_alone(
                self.run(self.base), cfg, self.tok, self.prompts, params_for(mode))]
                for mode in ("greedy", "seeded")}
            for mode, texts in self._alone.items():  # the comparisons see real, varied output
                assert sum(len(t) == N_TOKENS for t in texts) >= N_REQUESTS // 2, (mode, texts)
                assert len({tuple(t) for t in texts}) == N_REQUESTS, (mode, texts)
            # a request's tokens alone depend on its own parameters only
            self._alone["mixed"] = [self._alone["seeded" if i % 2 else "greedy"][i]
                                    for i in range(N_REQUESTS)]
        return self._alone


# name: (model fixture, stage count -> split, whether batched runs try every group count,
#        fixtures of a shared launch and of its reference alone, or None)
SUBJECTS = {"varied": ("varied_model", {2: "2", 3: "1,2"}, True, None),
            "smollm2": ("smollm2", {3: SMOLLM2_SPLIT}, False,
                        ("smollm2_stages", "smollm2_alone"))}
VARIED = pytest.param("varied", id="varied")
SMOLLM2 = pytest.param("smollm2", id="smollm2", marks=pytest.mark.slow)


@pytest.fixture(scope="module")
def made():
    subjects: dict[str, Subject] = {}
    yield subjects
    for s in subjects.values():
        s.close()


@pytest.fixture
def subject(request, made):
    """The subject named by the test's parameter, made once per module (a module-scoped
    fixture would be made again for every parameter set that names it)."""
    name = request.param
    if name not in made:
        fixture, splits, every_group_count, shared = SUBJECTS[name]
        launch, reference = [request.getfixturevalue(f) for f in shared] if shared else [None] * 2
        made[name] = Subject(request.getfixturevalue(fixture), splits, every_group_count,
                             launch, reference)
    failed = request.session.testsfailed
    yield made[name]
    if request.session.testsfailed != failed:
        made[name].close()  # a failed case may have left windows in flight


def params_for(mode: str, n: int = N_REQUESTS, tokens: int = N_TOKENS):
    """greedy, seeded, or mixed: even requests greedy, odd ones seeded."""
    return [harness.request_params(i, mode == "seeded" or (mode == "mixed" and i % 2 == 1),
                                   tokens) for i in range(n)]


def assert_same(alone_tokens, requests, label):
    for i, (want, req) in enumerate(zip(alone_tokens, requests)):
        at = harness.first_mismatch(want, req.seq.generated)
        assert at is None, (f"{label}: request {i} differs at token {at}: alone "
                            f"{want[at:at + 4]}, together {req.seq.generated[at:at + 4]}")


@pytest.mark.parametrize("subject,stages,batch", [
    pytest.param("varied", 2, 4, id="varied-2stages-batch4"),
    pytest.param("varied", 2, 8, id="varied-2stages-batch8"),
    pytest.param("varied", 3, 4, id="varied-3stages-batch4"),
    pytest.param("varied", 3, 8, id="varied-3stages-batch8"),
    pytest.param("smollm2", 3, 4, id="smollm2-3stages-batch4", marks=pytest.mark.slow),
], indirect=["subject"])
def test_batched_equals_alone(subject, stages, batch):
    alone = subject.alone()
    run = subject.run(stages)
    pipelined = auto_groups(batch, stages)
    for groups in sorted({1, 2, pipelined}) if subject.every_group_count else [pipelined]:
        cfg = SchedulerConfig(slots=batch, groups=groups, ctx=CTX)
        for mode in subject.modes:
            got = harness.run_together(run, cfg, subject.tok, subject.prompts,
                                       params_for(mode, tokens=subject.tokens))
            assert_same(alone[mode], got,
                        f"{stages} stages, batch {batch}, groups {groups}, {mode}")


@pytest.mark.parametrize("subject", [VARIED, SMOLLM2], indirect=True)
def test_staggered_lifecycle(subject):
    """A long prompt admitted while 3 slots decode, one request cancelled and its slot reused,
    one finishing early; pipelined over 3 stages. Greedy and seeded requests (mixed)."""
    tok, prompts, alone = subject.tok, subject.prompts, subject.alone()["mixed"]
    long_prompt = tok.encode(harness.PROMPTS[12] * 4)[:LONG_PROMPT]
    assert len(long_prompt) == LONG_PROMPT
    params = params_for("mixed", tokens=subject.tokens)
    run = subject.run(3)
    sched = Scheduler(run.pipe, SchedulerConfig(slots=4, groups=2, ctx=CTX), tok.stop_ids,
                      tok.decode)
    a, b, c = (sched.submit(prompts[i], params[i]) for i in range(3))
    while min(len(r.seq.generated) for r in (a, b, c)) < 3:
        sched.step()
    long_req = sched.submit(long_prompt, SamplingParams(max_tokens=8))
    a_before, a_when_read = len(a.seq.generated), None
    b_before = len(b.seq.generated)
    early = None
    while not long_req.done:
        sched.step()
        # b's first token among the long prompt's chunks (its group reads them): a and c are
        # still decoding then, even with SmolLM2's 12 tokens
        if len(b.seq.generated) > b_before and not b.cancelled:
            sched.cancel(b)      # b's slot is freed at its next window...
            early = sched.submit(prompts[4], replace(params[4], max_tokens=3))  # ...reused
        if a_when_read is None and long_req.seq.generated:
            a_when_read = len(a.seq.generated)
    # a kept decoding while the long prompt was read: the long prompt joins the group with
    # fewer busy slots (b's; c joined a's), and a's group runs its windows between its chunks
    assert a_when_read - a_before >= 5
    sched.run()
    alone_long = Scheduler(run.pipe, SchedulerConfig(slots=4, groups=1, ctx=CTX),
                           tok.stop_ids, tok.decode)
    ref_long = alone_long.submit(long_prompt, SamplingParams(max_tokens=8))
    alone_long.run()
    assert b.seq.finish_reason == "cancelled"
    assert b.seq.generated == alone[1][:len(b.seq.generated)]
    assert early.slot is b.slot  # the only slot free when it arrived
    assert early.seq.finish_reason == "length" and len(early.seq.generated) == 3
    assert early.seq.generated == alone[4][:3]
    assert a.seq.generated == alone[0]
    assert c.seq.generated == alone[2]
    assert long_req.seq.generated == ref_long.seq.generated
    assert sched.idle


@pytest.mark.parametrize("subject", [VARIED], indirect=True)
def test_32_requests_through_4_slots(subject):
    """32 requests x 24 tokens through 4 slots (pipelined), against each alone."""
    tok = subject.tok
    prompts = [tok.encode(t) for t in harness.prompt_set(32)]
    params = [harness.request_params(i, i % 2 == 1, N_TOKENS) for i in range(32)]
    run = subject.run(subject.base)
    together = harness.run_together(run, SchedulerConfig(slots=4, groups=2, ctx=CTX), tok,
                                    prompts, params)
    alone = harness.run_alone(run, SchedulerConfig(slots=4, groups=1, ctx=CTX), tok,
                              prompts, params)
    assert_same([r.seq.generated for r in alone], together, "32 requests through 4 slots")
    assert all(r.seq.finish_reason in ("stop", "length") for r in together)
    assert sum(len(r.seq.generated) for r in together) > 32 * N_TOKENS // 2  # most ran long
    assert len({r.slot.index for r in together}) == 4


@pytest.mark.parametrize("subject", [VARIED, SMOLLM2], indirect=True)
def test_multi_turn_reuses_the_slot_and_equals_a_fresh_read(subject, caplog):
    tok = subject.tok
    turn1 = tok.render_chat([{"role": "user", "content": "Name a colour."}])
    params = SamplingParams(max_tokens=12)
    run = subject.run(subject.base)
    sched = Scheduler(run.pipe, SchedulerConfig(slots=2, groups=2, ctx=CTX), tok.stop_ids,
                      tok.decode)
    first = sched.submit(tok.encode(turn1), params)
    sched.run()
    history = tok.encode(turn1) + first.seq.generated + tok.encode(
        "<|im_end|>\n<|im_start|>user\nAnd another one?<|im_end|>\n<|im_start|>assistant\n")
    with caplog.at_level(logging.INFO, logger="strata.scheduler"):
        second = sched.submit(history, params)
        sched.run()
    fresh_sched = Scheduler(run.pipe, SchedulerConfig(slots=2, groups=1, ctx=CTX),
                            tok.stop_ids, tok.decode)
    fresh = fresh_sched.submit(history, params)
    fresh_sched.run()
    assert second.slot is first.slot
    assert second.reused == len(tok.encode(turn1))  # the prompt of turn 1, not its answer
    assert f"reuses {second.reused} of {len(history)} prompt tokens" in caplog.text
    assert fresh.reused == 0
    assert second.seq.generated == fresh.seq.generated
    assert len(second.seq.generated) > 0


def test_groups_must_divide_batch():
    with pytest.raises(ValueError, match="does not divide"):
        SchedulerConfig(slots=6, groups=4)
    assert auto_groups(8, 2) == 2 and auto_groups(9, 2) == 1 and auto_groups(6, 4) == 3


@pytest.mark.parametrize("subject,batch,groups,drafts", [
    pytest.param("varied", 1, 1, 7, id="varied-batch1-drafts7"),
    pytest.param("varied", 4, 2, 3, id="varied-batch4-groups2-drafts3"),
    pytest.param("smollm2", 4, 2, 3, id="smollm2-batch4-groups2-drafts3", marks=pytest.mark.slow),
], indirect=["subject"])
def test_drafts_give_the_solo_tokens(subject, batch, groups, drafts):
    """Draft tokens (prompt lookup) verified in the windows' spare rows: every request still
    gets its plain solo tokens, greedy and seeded (mixed on SmolLM2), and some drafts were
    accepted."""
    alone = subject.alone()
    run = subject.run(subject.base)
    cfg = SchedulerConfig(slots=batch, groups=groups, ctx=CTX, draft_tokens=drafts)
    accepted = 0
    for mode in subject.modes:
        got = harness.run_together(run, cfg, subject.tok, subject.prompts,
                                   params_for(mode, tokens=subject.tokens))
        assert_same(alone[mode], got, f"drafts, batch {batch}, groups {groups}, {mode}")
        accepted += sum(r.drafts.counts.accepted for r in got)
    assert accepted > 0
