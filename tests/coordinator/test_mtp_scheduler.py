"""MTP drafts on the coordinator, against the fake pipeline of test_scheduler: its last stage
answers `propose` with proposals (the true next tokens for some slots, wrong ones for others,
a mix within one slot, or none), the scheduler verifies them by equality, and every request
still gets the tokens of plain decoding, alone, greedy and seeded.

The fake also checks the flow: the drafts of a slot's decode window are a prefix of what the
last window that sampled for that slot proposed (nothing, if it proposed nothing)."""
from __future__ import annotations

import asyncio
import re
import random

import pytest

from strata.coordinator.speculation.drafts import DraftCounts
from strata.coordinator.engine.engine import Engine, Finished, Job
from strata.coordinator.engine.metrics import Metrics
from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.protocol.messages import Result
from test_scheduler import STOP, FakePipeline, params, prompts, run_alone

WRONG = 1   # never sampled: the fake's tokens are 2..61


class DraftingPipeline(FakePipeline):
    """The fake pipeline whose last stage drafts. `truth`: each request's prompt and its solo
    tokens; `policy(slot, window id)` picks how a proposal entry is answered: true (the solo
    tokens after the accepted rows), wrong, mix (the first true, the rest wrong), none."""

    def __init__(self, slots: int, ctx: int, truth: list[list[int]], policy, draft_tokens: int,
                 mtp: bool = True):
        super().__init__(slots, ctx)
        self.mtp = mtp   # drafts must come from the proposals
        self.truth, self.policy, self.draft_tokens = truth, policy, draft_tokens
        self.proposed: dict[int, list[int]] = {}   # slot -> the last proposals for it
        self.asked = 0                             # propose entries seen
        self.asked_k: list[int] = []               # their k, in order
        self.decode_drafts: list[tuple[int, int]] = []   # (slot, drafts) per decode window row group

    def receive(self, timeout=None):
        w = self.queue[0]
        if not w.chunk:  # a slot's rows: its last token, then its drafts
            for slot in sorted({s for s in w.slots if s >= 0}):
                drafts = [t for s, t in zip(w.slots, w.tokens) if s == slot][1:]
                self.decode_drafts.append((slot, len(drafts)))
                assert not self.mtp or drafts == self.proposed.get(slot, [])[:len(drafts)], (
                    f"slot {slot}: drafts {drafts} were not proposed "
                    f"({self.proposed.get(slot)})")
        result, tensors = super().receive(timeout)
        sampled: dict[int, list[tuple[int, int, int]]] = {}   # slot -> (position, input, token)
        for row, token in zip(w.sample_rows, result.tokens):
            sampled.setdefault(w.slots[row], []).append((w.positions[row], w.tokens[row], token))
        for slot in sampled:
            self.proposed[slot] = []
        proposals = []
        for slot, k in w.propose:
            assert 1 <= k <= self.draft_tokens and slot in sampled, (slot, k)
            self.asked += 1
            self.asked_k.append(k)
            rows = sampled[slot]
            a = 0   # drafts accepted: leading rows whose input equals the token sampled before
            while a + 1 < len(rows) and rows[a + 1][1] == rows[a][2]:
                a += 1
            history = self.kv[slot][:rows[0][0] + a + 1] + [rows[a][2]]
            mode = self.policy(slot, w.id)
            if mode == "none":
                continue
            true = (self._true_next(history) + [WRONG] * k)[:k]
            ds = {"true": true, "wrong": [WRONG] * k,
                  "mix": true[:1] + [WRONG] * (k - 1)}[mode]
            self.proposed[slot] = ds
            proposals.append([slot, *ds])
        return Result(result.id, result.tokens, proposals=proposals), tensors

    def _true_next(self, history: list[int]) -> list[int]:
        for full in self.truth:
            if full[:len(history)] == history:
                return full[len(history):]
        return []


def random_policy(seed: int):
    rng = random.Random(seed)
    choices = ("true", "true", "mix", "wrong", "none")
    memo: dict[tuple[int, int], str] = {}
    return lambda slot, wid: memo.setdefault((slot, wid), rng.choice(choices))


def truth_of(ps, alone):
    return [p + g for p, g in zip(ps, alone)]


def mtp_config(**kw) -> SchedulerConfig:
    return SchedulerConfig(**{"chunk_rows": 8, "ctx": 256, "drafter": "mtp", **kw})


@pytest.mark.parametrize("slots,groups,window_rows,depth,k", [
    (1, 1, None, 1, 1), (1, 1, None, 1, 3), (4, 1, 8, 1, 3), (4, 2, 8, 3, 3),
    (8, 4, None, 1, 2), (6, 3, None, 4, 7), (20, 2, 8, 1, 3)])
def test_mtp_drafts_give_the_tokens_of_plain_decoding(slots, groups, window_rows, depth, k):
    rng = random.Random(slots * 10 + k)
    ps = prompts(16, rng)
    alone = run_alone(ps)
    pipe = DraftingPipeline(slots, 256, truth_of(ps, alone), random_policy(k), k)
    sched = Scheduler(pipe, mtp_config(slots=slots, groups=groups, window_rows=window_rows,
                                       prompt_depth=depth, draft_tokens=k), frozenset({STOP}))
    reqs = [sched.submit(p, params(i)) for i, p in enumerate(ps)]
    sched.run()
    assert [r.seq.generated for r in reqs] == alone
    assert pipe.max_in_flight <= groups * depth
    assert sched.idle and all(pipe.kv[s.index] == s.held for s in sched.table.slots)
    counts = sum((r.drafts.counts for r in reqs), DraftCounts())
    drafted, accepted = counts.drafted, counts.accepted
    assert sched.speculation.counts == counts
    # proposals asked for, some kept, some not (with 20 slots, once fewer than 8 decode)
    assert pipe.asked and 0 < accepted < drafted


@pytest.mark.parametrize("mode", ["true", "wrong", "mix", "none"])
def test_each_kind_of_proposal(mode):
    """True proposals are all kept (a window then yields K + 1 tokens), wrong ones none, a mix
    only its first; no proposals, no drafts. The tokens are always those of plain decoding."""
    k = 3
    ps = [list(range(5, 25)), [40, 41, 42]]
    alone = run_alone(ps)
    pipe = DraftingPipeline(1, 256, truth_of(ps, alone), lambda slot, wid: mode, k)
    sched = Scheduler(pipe, mtp_config(draft_tokens=k), frozenset({STOP}))
    reqs = [sched.submit(p, params(i)) for i, p in enumerate(ps)]
    sched.run()
    assert [r.seq.generated for r in reqs] == alone
    counts = sum((r.drafts.counts for r in reqs), DraftCounts())
    drafted, accepted = counts.drafted, counts.accepted
    windows = len(pipe.decode_drafts)
    tokens = sum(len(g) for g in alone)
    if mode == "true":
        assert drafted > 0 and accepted == drafted
        assert windows < tokens / 2   # most windows yield k + 1 tokens
    elif mode == "wrong":
        assert drafted > 0 and accepted == 0
    elif mode == "mix":
        assert 0 < accepted < drafted and accepted <= windows
    else:
        assert drafted == 0 and pipe.asked > 0
    if mode != "none":
        assert drafted >= windows   # each decode window had drafts up to the last ones


@pytest.mark.parametrize("sampling", ["coupled", "argmax"])
def test_windows_send_the_draws_of_the_positions_proposals_take(sampling):
    """Coupled: each propose entry of a slot that samples with a temperature carries the
    draws of the k positions after the one its last row samples (the draws its rows will
    sample with); a greedy slot's entry is []. argmax: no draws at all."""
    from strata.coordinator.sampling_params import draw_uniform
    ps = prompts(4, random.Random(8))
    alone = run_alone(ps)
    pipe = DraftingPipeline(4, 256, truth_of(ps, alone), random_policy(1), 3)
    sent = []
    submit = pipe.submit
    pipe.submit = lambda w: (sent.append(w), submit(w))
    sched = Scheduler(pipe, mtp_config(slots=4, draft_tokens=3, draft_sampling=sampling),
                      frozenset({STOP}))
    reqs = [sched.submit(p, params(i)) for i, p in enumerate(ps)]
    sched.run()
    assert [r.seq.generated for r in reqs] == alone
    seeds = {r.slot.index: r.seq.params.seed if r.seq.params.temperature > 0 else None
             for r in reqs}   # each slot served one request
    entries = 0
    for w in sent:
        if sampling == "argmax" or not w.propose:
            assert w.propose_u == []
            continue
        for (slot, k), us in zip(w.propose, w.propose_u):
            end = max(p for s, p in zip(w.slots, w.positions) if s == slot)
            seed = seeds[slot]
            assert us == ([] if seed is None else
                          [draw_uniform(seed, end + 1 + i) for i in range(1, k + 1)])
            entries += bool(us)
    assert sampling == "argmax" or entries > 10
    assert any(w.propose for w in sent)


def test_lookup_ignores_proposals_and_asks_for_none():
    ps = prompts(4, random.Random(3))
    alone = run_alone(ps)
    pipe = DraftingPipeline(2, 256, truth_of(ps, alone), lambda slot, wid: "true", 3, mtp=False)
    sched = Scheduler(pipe, SchedulerConfig(slots=2, chunk_rows=8, ctx=256, draft_tokens=3),
                      frozenset({STOP}))
    reqs = [sched.submit(p, params(i)) for i, p in enumerate(ps)]
    sched.run()
    assert [r.seq.generated for r in reqs] == alone and pipe.asked == 0


def test_cancels_and_slot_reuse_across_windows():
    """Requests cancelled mid-decode drop their proposals; the next request in their slot
    starts without any (the fake checks every draft was proposed for that slot after its last
    sampled window); the rest keep their solo tokens and no slot keeps a stale row."""
    rng = random.Random(11)
    ps = prompts(12, rng)
    alone = run_alone(ps)
    pipe = DraftingPipeline(2, 256, truth_of(ps, alone), random_policy(5), 3)
    sched = Scheduler(pipe, mtp_config(slots=2, groups=2, draft_tokens=3), frozenset({STOP}))
    reqs = [sched.submit(p, params(i)) for i, p in enumerate(ps)]
    for _ in range(2000):
        if not sched.step():
            break
        for r in reqs[::3]:
            if len(r.seq.generated) >= 2 and not r.done:
                sched.cancel(r)
    for i, r in enumerate(reqs):
        if r.seq.finish_reason == "cancelled":
            assert r.seq.generated == alone[i][:len(r.seq.generated)]
            assert r.drafts.proposals == []
        else:
            assert r.seq.generated == alone[i], i
    assert sum(r.seq.finish_reason == "cancelled" for r in reqs) >= 2
    assert sum(r.drafts.counts.accepted for r in reqs) > 0
    for slot in sched.table.slots:
        assert pipe.kv[slot.index] == slot.held


def test_a_reused_slot_starts_without_the_last_requests_proposals():
    """A request cancelled with proposals waiting; the next request in its slot reads its
    prompt with proposals refused (policy none): its first decode window has no drafts."""
    ps = [list(range(5, 25)), [40, 41, 42, 43]]
    alone = run_alone(ps)
    state = {"mode": "true"}
    pipe = DraftingPipeline(1, 256, truth_of(ps, alone), lambda slot, wid: state["mode"], 3)
    sched = Scheduler(pipe, mtp_config(draft_tokens=3), frozenset({STOP}))
    first = sched.submit(ps[0], params(0))
    while len(first.seq.generated) < 4 and sched.step():
        pass
    assert first.drafts.proposals   # waiting for its next decode window
    sched.cancel(first)
    state["mode"] = "none"
    second = sched.submit(ps[1], params(1))
    seen = len(pipe.decode_drafts)
    sched.run()
    assert first.drafts.proposals == [] and second.seq.generated == alone[1]
    assert pipe.decode_drafts[seen:] and all(d == 0 for _, d in pipe.decode_drafts[seen:])


def test_proposals_fit_the_room_the_request_has_left():
    """Near max_tokens a slot is asked for fewer proposals, and a window never carries more
    drafts than the request may still generate: after the prompt's first token, a request of
    max_tokens M has M - 1 to go, and its first decode window samples one beyond its drafts."""
    ps = [list(range(5, 25))]
    for max_tokens in (1, 2, 3, 5):
        p = params(0, max_tokens)
        sched0 = Scheduler(FakePipeline(1, 256), SchedulerConfig(slots=1, chunk_rows=8),
                           frozenset())
        ref = sched0.submit(ps[0], p)
        sched0.run()
        pipe = DraftingPipeline(1, 256, truth_of(ps, [ref.seq.generated]),
                                lambda slot, wid: "true", 7)
        sched = Scheduler(pipe, mtp_config(draft_tokens=7), frozenset())
        req = sched.submit(ps[0], p)
        sched.run()
        assert req.seq.generated == ref.seq.generated and len(req.seq.generated) == max_tokens
        assert req.drafts.counts.drafted == req.drafts.counts.accepted == max(max_tokens - 2, 0)
        # the prompt's last chunk asks for what the first decode window can take
        assert pipe.asked_k[:1] == ([max_tokens - 2] if max_tokens > 2 else [])


async def _finish(engine: Engine, name: str, prompt: list[int], p):
    job = Job(name, prompt, p.with_seed(), asyncio.get_running_loop(), asyncio.Queue())
    engine.submit(job)
    while not isinstance(item := await asyncio.wait_for(job.events.get(), 30), Finished):
        pass
    return job


def test_counters_and_status_count_drafts_proposed_and_accepted():
    ps = prompts(6, random.Random(4))
    alone = run_alone(ps)
    metrics = Metrics()

    async def main():
        pipe = DraftingPipeline(2, 256, truth_of(ps, alone), random_policy(2), 3)
        engine = Engine(pipe, mtp_config(slots=2, draft_tokens=3), frozenset({STOP}),
                        lambda ids: "", metrics)
        engine.start()
        try:
            jobs = await asyncio.gather(*[_finish(engine, str(i), p, params(i))
                                          for i, p in enumerate(ps)])
        finally:
            engine.stop()
        return engine, jobs

    engine, jobs = asyncio.run(main())
    drafted = sum(j.request.drafts.counts.drafted for j in jobs)
    accepted = sum(j.request.drafts.counts.accepted for j in jobs)
    assert 0 < accepted < drafted
    snap = engine.snapshot.draft_counts
    assert (snap.drafted, snap.accepted) == (drafted, accepted)
    text = metrics.render().decode()
    assert f"strata_draft_tokens_proposed_total {float(drafted)}" in text
    assert f"strata_draft_tokens_accepted_total {float(accepted)}" in text
    # /v1/status: the totals since the start
    import json

    from strata.coordinator.api.connections import ServerConfig
    from strata.coordinator.api.server import Server
    server = Server(engine, None, 64, ServerConfig(model="fake"), metrics, lambda: None)
    status = json.loads(asyncio.run(server.status(None)).text)
    positions = status["drafts"].pop("positions")
    assert status["drafts"] == {"proposed": drafted, "accepted": accepted,
                                "rate": round(accepted / drafted, 4)}
    # each draft is at one position: the positions add up to the totals
    assert [p["position"] for p in positions] == [1, 2, 3]
    assert sum(p["proposed"] for p in positions) == drafted
    assert sum(p["accepted"] for p in positions) == accepted
    assert (status["drafter"], status["draft_tokens"], status["draft_sampling"]) == (
        "mtp", 3, "argmax")
    assert DraftCounts().report()["rate"] is None


def test_a_decoding_slot_shows_its_drafts():
    """The slot's view and its /v1/status entry count its request's drafts, mid-request."""
    import json

    from strata.coordinator.api.connections import ServerConfig
    from strata.coordinator.api.server import Server
    ps = [list(range(5, 25))]
    alone = run_alone(ps)
    pipe = DraftingPipeline(1, 256, truth_of(ps, alone), lambda slot, wid: "mix", 3)
    engine = Engine(pipe, mtp_config(draft_tokens=3), frozenset({STOP}), lambda ids: "")
    sched = engine.scheduler   # stepped here, without the engine's thread
    req = sched.submit(ps[0], params(0))
    while req.drafts.counts.drafted < 6 and sched.step():
        pass
    view = sched.snapshot().slots[0]
    assert view.state == "decoding" and view.draft_counts == req.drafts.counts
    assert 0 < view.draft_counts.accepted < view.draft_counts.drafted
    engine._publish()
    server = Server(engine, None, 64, ServerConfig(model="fake"), Metrics(), lambda: None)
    slot = json.loads(asyncio.run(server.status(None)).text)["slots"][0]
    # "mix" proposals: the first is kept, the two after it never
    windows = req.drafts.counts.drafted // 3
    assert slot["drafts"] == {
        "proposed": req.drafts.counts.drafted, "accepted": req.drafts.counts.accepted,
        "rate": round(req.drafts.counts.accepted / req.drafts.counts.drafted, 4),
        "positions": [{"position": 1, "proposed": windows, "accepted": windows, "rate": 1.0},
                      {"position": 2, "proposed": windows, "accepted": 0, "rate": 0.0},
                      {"position": 3, "proposed": windows, "accepted": 0, "rate": 0.0}]}


def test_acceptance_per_draft_position_in_status_and_metrics():
    """A hand-counted case: one request, K = 3, the proposals each window makes scripted. The
    prompt's last chunk (window 3) proposes the true tokens: window 4 keeps all 3 drafts. Window
    4 proposes the true first token and two wrong ones: window 5 keeps the first only. Window 5
    proposes wrong tokens: window 6 keeps none. Later windows propose nothing. So per position
    j = 1, 2, 3: proposed 3, 3, 3; accepted 2, 1, 1 (a draft counts only after every one
    before it)."""
    import json

    from strata.coordinator.api.connections import ServerConfig
    from strata.coordinator.api.server import Server
    ps, p = [list(range(5, 25))], params(0, 12)
    solo = Scheduler(FakePipeline(1, 256), SchedulerConfig(slots=1, chunk_rows=8),
                     frozenset({STOP}))
    ref = solo.submit(ps[0], p)
    solo.run()
    assert len(ref.seq.generated) == 12   # no stop token: every window below happens
    script = {3: "true", 4: "mix", 5: "wrong"}
    pipe = DraftingPipeline(1, 256, truth_of(ps, [ref.seq.generated]),
                            lambda slot, wid: script.get(wid, "none"), 3)
    metrics = Metrics()
    engine = Engine(pipe, mtp_config(draft_tokens=3), frozenset({STOP}), lambda ids: "",
                    metrics)
    sched = engine.scheduler   # stepped here, without the engine's thread
    req = sched.submit(ps[0], p)
    while len(req.seq.generated) < 8 and sched.step():   # windows 4, 5, 6 have come back
        pass
    assert pipe.decode_drafts[:3] == [(0, 3), (0, 3), (0, 3)]
    assert (req.drafts.counts.drafted_at, req.drafts.counts.accepted_at) == ([3, 3, 3], [2, 1, 1])
    total = sched.speculation.counts
    assert (total.drafted_at, total.accepted_at) == ([3, 3, 3], [2, 1, 1])
    engine._publish()
    server = Server(engine, None, 64, ServerConfig(model="fake"), metrics, lambda: None)
    status = json.loads(asyncio.run(server.status(None)).text)
    want = {"proposed": 9, "accepted": 4, "rate": 0.4444, "positions": [
        {"position": 1, "proposed": 3, "accepted": 2, "rate": 0.6667},
        {"position": 2, "proposed": 3, "accepted": 1, "rate": 0.3333},
        {"position": 3, "proposed": 3, "accepted": 1, "rate": 0.3333}]}
    assert status["drafts"] == want and status["slots"][0]["drafts"] == want
    sched.run()
    assert req.seq.generated == ref.seq.generated
    engine._publish()
    text = metrics.render().decode()
    for j, (proposed, accepted) in enumerate([(3, 2), (3, 1), (3, 1)], 1):
        assert (f'strata_draft_position_tokens_proposed_total{{position="{j}"}} '
                f'{float(proposed)}') in text
        assert (f'strata_draft_position_tokens_accepted_total{{position="{j}"}} '
                f'{float(accepted)}') in text
    assert "strata_draft_tokens_proposed_total 9.0" in text
    assert "strata_draft_tokens_accepted_total 4.0" in text


# --- the flags ------------------------------------------------------------------------------

def write_sidecar(path, model, fingerprint: str | None = None):
    """A NextN head GGUF naming its target: the model's dimensions and vocabulary, and the
    given embedding fingerprint (default: the model's own)."""
    import gguf
    import numpy as np

    from strata.model.gguf_file import ModelFile
    from strata.model.nextn import TARGET_FINGERPRINT, embedding_fingerprint
    file = ModelFile(model)
    cfg = file.config
    w = gguf.GGUFWriter(str(path), cfg.arch)
    w.add_uint32(f"{cfg.arch}.nextn_predict_layers", 1)
    w.add_uint32(f"{cfg.arch}.embedding_length", cfg.d_model)
    w.add_uint32(f"{cfg.arch}.vocab_size", cfg.vocab)
    w.add_string(TARGET_FINGERPRINT, fingerprint or embedding_fingerprint(file))
    w.add_tensor(f"blk.{cfg.n_layers}.nextn.enorm", np.ones(cfg.d_model, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def launch_cli(*args):
    from click.testing import CliRunner

    from strata.launch.cli import main
    return CliRunner().invoke(main, ["--devices", "cpu", "--prompt", "hi", *args],
                              prog_name="strata-launch")


def one_sentence(out, *words):
    assert out.exit_code == 2, (out.output, out.exception)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_draft_tokens_past_7_is_refused(tiny_model, no_stage_left):
    one_sentence(launch_cli("--model", str(tiny_model), "--draft-tokens", "9"),
                 "strata-launch: --draft-tokens 9 is not from 0 to 7", "use 0 (off) to 7")


def test_drafter_mtp_without_a_head_is_refused(tiny_model, no_stage_left):
    one_sentence(launch_cli("--model", str(tiny_model), "--draft-tokens", "2", "--drafter",
                            "mtp"),
                 "--drafter mtp needs a NextN head", "tiny.gguf has none",
                 "pass --mtp-head PATH", "or use --drafter lookup")


def test_drafter_must_be_mtp_or_lookup(tiny_model, no_stage_left):
    out = launch_cli("--model", str(tiny_model), "--draft-tokens", "2", "--drafter", "bogus")
    assert out.exit_code == 2 and "'bogus' is not one of 'mtp', 'lookup'" in out.stderr


def test_a_drafter_without_draft_tokens_is_refused(tiny_model, no_stage_left):
    one_sentence(launch_cli("--model", str(tiny_model), "--drafter", "lookup"),
                 "--drafter lookup drafts nothing with --draft-tokens 0",
                 "add --draft-tokens K (1 to 7)")


def test_a_sidecar_for_another_model_is_refused(tiny_model, tmp_path, no_stage_left):
    head = write_sidecar(tmp_path / "head.gguf", tiny_model, fingerprint="0123456789abcdef")
    one_sentence(launch_cli("--model", str(tiny_model), "--draft-tokens", "2", "--mtp-head",
                            str(head)),
                 f"--mtp-head {head} was made for another model",
                 "target fingerprint 0123456789abcdef")


def test_the_automatic_choice_is_said_on_stderr(tiny_model, tmp_path, capsys):
    from strata.launch.options import prepare
    from strata.launch.processes import StageProcesses
    shared = dict(model=str(tiny_model), layer_split="2", devices="cpu", ctx_size=256,
                  batch=2, batch_groups="2", window_rows="auto", chunk_rows="auto")
    prep = prepare(**shared, draft_tokens=3)
    assert (prep.sched.drafter, prep.mtp_head) == ("lookup", None)
    assert capsys.readouterr().err == ("strata: --draft-tokens 3 drafts with lookup (prompt "
                                       "lookup: the model has no NextN head; --mtp-head PATH "
                                       "gives one)\n")
    head = write_sidecar(tmp_path / "head.gguf", tiny_model)
    prep = prepare(**shared, draft_tokens=3, mtp_head=str(head))
    assert (prep.sched.drafter, prep.mtp_head) == ("mtp", head)
    assert prep.sched.groups == 2   # MTP with several groups runs as asked
    assert capsys.readouterr().err == (f"strata: --draft-tokens 3 drafts with mtp (the NextN "
                                       f"head in the sidecar {head})\n")
    # the last stage's worker loads the sidecar; the others don't
    procs = StageProcesses(prep.file.path, prep.plan, slots=2, ctx=256, mtp_head=prep.mtp_head)
    try:
        commands = [procs.command(p.index) for p in prep.plan]
    finally:
        procs.remove_run_dir(keep_logs=False)
    assert commands[-1][-2:] == ["--mtp-head", str(head)]
    assert all("--mtp-head" not in c for c in commands[:-1])
    # an explicit drafter says nothing; lookup with a head given leaves the head out
    prep = prepare(**shared, draft_tokens=3, drafter="lookup", mtp_head=str(head))
    assert (prep.sched.drafter, prep.mtp_head) == ("lookup", None)
    assert capsys.readouterr().err == ""


def test_the_launch_summary_counts_the_drafts(tiny_model, shared_stages):
    out = launch_cli("--model", str(tiny_model), "--layer-split", "2", "--ctx-size", "256",
                     "--max-tokens", "24", "--draft-tokens", "2", "--drafter", "lookup",
                     "--seed", "1")
    assert out.exit_code == 0, (out.output, out.exception)
    assert shared_stages   # the session's stages served it
    summary = out.stderr.splitlines()[-2]   # then the rates
    m = re.fullmatch(r"\[\d+ prompt tokens, 24 generated, (\d+) of (\d+) drafts \(lookup\) "
                     r"accepted, finish: length, seed 1\]", summary)
    assert m and int(m[1]) <= int(m[2]), summary


def test_draft_sampling_must_be_coupled_or_argmax():
    from strata.config_error import ConfigError
    from strata.launch.options import CHOICES, FLAGS
    with pytest.raises(ConfigError) as e:
        SchedulerConfig(draft_sampling="sampled")
    assert e.value.render(FLAGS, CHOICES) == ("--draft-sampling 'sampled' is not one of "
                                              "coupled, argmax; use coupled or argmax")
