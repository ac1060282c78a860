"""Pipelined batch MTP through real CPU stages (2 stages, 2 groups of slots in flight): every
request gets exactly the tokens it gets alone without drafts, greedy and seeded (temperature
0.7), at concurrency 4 and with 8 slots, with drafts in rows past each window's pad, K fixed
and automatic, and requests cancelled mid-decode in both groups.

The model is the tiny shape with weights of std 0.12 (tied head): its greedy text repeats its
last token about 80% of the time and otherwise depends on the context (tens of distinct tokens
a request), and its seeded text rarely repeats. The sidecar head proposes the token it reads
(test_mtp.repeating_head), so greedy drafts are mostly kept and some rejected, seeded ones
mostly rejected: acceptance is partial, rejected drafts' rows are committed away on both
groups, and a wrong acceptance, commit or row would show as a different token. The long run
(32 requests of 512 tokens, several minutes) is marked long: `python -m pytest -m long`."""
from __future__ import annotations

import pytest

from strata.bench import harness
from strata.coordinator.config import round_rows
from strata.coordinator.speculation.drafts import DraftCounts
from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.launch.plan import plan_stages
from strata.launch.session import launch_stages
from strata.model.gguf_file import ModelFile
from strata.model.mkmodel import SHAPES, write_random_gguf
from strata.model.tokenizer import Tokenizer
from test_mtp import repeating_head

SLOTS, CTX = 8, 1024


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """2 CPU stages of the tiny std-0.12 model with the repeating head, 8 slots."""
    root = tmp_path_factory.mktemp("pipemtp")
    model = write_random_gguf(root / "m.gguf", SHAPES["tiny"], seed=1, std=0.12)
    head = repeating_head(root / "head.gguf", model)
    file = ModelFile(model)
    tok = Tokenizer.from_gguf(file.reader)
    plan = plan_stages("2", ["cpu"], file.config.n_layers)
    with launch_stages(file, plan, slots=SLOTS, ctx=CTX, mtp_head=head,
                       say=lambda s: None) as run:
        yield run, tok


class Recorder:
    """The pipeline as the scheduler sees it, keeping each decode window's (rows, live rows,
    slots)."""

    def __init__(self, pipe):
        self.pipe, self.decodes = pipe, []

    def new_window_id(self) -> int:
        return self.pipe.new_window_id()

    def submit(self, w) -> None:
        live = [s for s in w.slots if s >= 0]
        if live and not w.chunk:
            self.decodes.append((len(w.slots), len(live), len(set(live))))
        self.pipe.submit(w)

    def receive(self, timeout=None):
        return self.pipe.receive(timeout)


def drafted_run(run, tok, cfg, prompts, params, cancel_after: int | None = None):
    """All requests through one scheduler (cfg.slots at a time); with cancel_after, every
    fifth request is cancelled once it has that many tokens."""
    rec = Recorder(run.pipe)
    sched = Scheduler(rec, cfg, tok.stop_ids, tok.decode)
    reqs = [sched.submit(p, sp) for p, sp in zip(prompts, params)]
    doomed = reqs[2::5] if cancel_after else []
    while sched.step():
        for r in doomed:
            if len(r.seq.generated) >= cancel_after and not r.done:
                sched.cancel(r)
    assert sched.idle
    return reqs, rec.decodes


def check(run, tok, n: int, tokens: int, cancel_after: int | None = None) -> None:
    prompts = [tok.encode(t) for t in harness.prompt_set(n)]
    configs = {   # concurrency 4 (2 groups of 2 slots), and 8 slots (2 groups of 4)
        "4 slots K=7": SchedulerConfig(slots=4, groups=2, ctx=CTX, draft_tokens=7,
                                       drafter="mtp", prompt_depth=3),
        "8 slots K=auto": SchedulerConfig(slots=8, groups=2, ctx=CTX, draft_tokens="auto",
                                          drafter="mtp", prompt_depth=3),
    }
    for mode in ("greedy", "seeded"):
        params = [harness.request_params(i, mode == "seeded", tokens) for i in range(n)]
        alone = [r.seq.generated for r in harness.run_alone(
            run, SchedulerConfig(slots=1, ctx=CTX), tok, prompts, params)]
        assert len({tuple(t) for t in alone}) > n // 2, alone   # the texts differ
        for label, cfg in configs.items():
            reqs, decodes = drafted_run(run, tok, cfg, prompts, params, cancel_after)
            for i, (want, r) in enumerate(zip(alone, reqs)):
                if r.seq.finish_reason == "cancelled":
                    assert r.seq.generated == want[:len(r.seq.generated)], (mode, label, i)
                else:
                    assert r.seq.generated == want, (mode, label, i)
            counts = sum((r.drafts.counts for r in reqs), DraftCounts())
            drafted, accepted = counts.drafted, counts.accepted
            if cfg.auto_drafts:
                # auto drafts as its timings say: at least its first try (K = 1), whose drafts
                # may all be rejected before it stops
                assert drafted > 0, (mode, label)
            else:
                assert 0 < accepted < drafted, (mode, label, drafted, accepted)
            if mode == "greedy" and not cfg.auto_drafts:
                # many kept, many not (auto drafts only as much as its timings say pays)
                assert min(accepted, drafted - accepted) >= 50, (label, drafted, accepted)
                # drafts took rows past the pad: more live rows than the slots rounded up
                assert any(live > round_rows(slots) for _, live, slots in decodes), label
            if cancel_after:
                assert any(r.seq.finish_reason == "cancelled" for r in reqs), label


def test_pipelined_mtp_equals_solo_without_drafts(stages):
    run, tok = stages
    check(run, tok, n=10, tokens=32, cancel_after=8)   # 10 requests through 8 slots: 2 wait


@pytest.mark.long
def test_pipelined_mtp_equals_solo_in_a_long_run(stages):
    """32 requests of 512 tokens, at concurrency 4 and with 8 slots: zero mismatches."""
    run, tok = stages
    check(run, tok, n=32, tokens=512)
