"""Traces of a launch (strata/trace.py) and their report: every process writes its timeline,
a window's chain of segments adds up to its wall time in causal order, and the per-stage
overheads and busy shares come out of the same files."""
from __future__ import annotations

import json

import pytest

from strata.coordinator.engine.scheduler import SchedulerConfig
from strata.bench import harness, tracereport
from strata.launch.plan import plan_stages
from strata.launch.session import launch_stages
from strata.model.gguf_file import ModelFile
from strata.model.mkmodel import SHAPES, write_nextn_sidecar
from strata.model.tokenizer import Tokenizer
from strata.trace import Trace

CTX = 256


def test_trace_off_records_nothing(tmp_path):
    t = Trace("stage0", None)
    t.mark(1, "came")
    t.gpu_begin(1)
    t.gpu_end()
    t.close()
    assert not t.on and not t.marks and not t.spans and not list(tmp_path.iterdir())


@pytest.mark.parametrize("groups,drafts", [(1, 0), (2, 1)])
def test_launch_traces_add_up(tiny_model, no_stage_left, tmp_path_factory, groups, drafts):
    """With drafts (a random NextN head), the last stage's drafter marks its part too."""
    file = ModelFile(tiny_model)
    tok = Tokenizer.from_gguf(file.reader)
    plan = plan_stages("2", ["cpu"], file.config.n_layers)
    prompts = [tok.encode(p) for p in harness.prompt_set(4)]
    params = [harness.request_params(i, i % 2 == 1, 6) for i in range(4)]
    tmp_path = tmp_path_factory.mktemp("trace")
    head = (write_nextn_sidecar(tmp_path_factory.mktemp("head") / "head.gguf", tiny_model,
                                SHAPES["tiny"], seed=3) if drafts else None)
    with launch_stages(file, plan, slots=4, ctx=CTX, trace_dir=tmp_path, mtp_head=head,
                       say=lambda s: None) as run:
        assert "--trace" in run.procs.command(1)
        cfg = SchedulerConfig(slots=4, groups=groups, ctx=CTX, draft_tokens=drafts,
                              drafter="mtp" if drafts else "lookup")
        reqs = harness.run_together(run, cfg, tok, prompts, params)
        sent = run.pipe.next_window_id
    assert all(r.seq.generated for r in reqs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coordinator.json", "stage0.json",
                                                         "stage1.json"]
    traces = tracereport.load(tmp_path)
    decode = tracereport.windows_through(traces)
    chunks = tracereport.windows_through(traces, chunks=True)
    # every window sent came back and was traced on both stages, as a chunk or a decode window
    assert sorted(decode + chunks) == list(range(1, sent + 1)) and decode and chunks
    for w in decode + chunks:
        c = tracereport.chain(traces, w)
        parts = [v for k, v in c.items() if k != "wall"]
        assert all(v >= 0 for v in parts), (w, c)          # causal: each step after the last
        assert sum(parts) == pytest.approx(c["wall"], abs=1e-6)
        for st in tracereport.stage_overheads(traces, w):
            assert st["gpu"] > 0 and st["overhead"] >= 0
            assert st["wall"] == pytest.approx(st["gpu"] + st["overhead"])
    summary = tracereport.summarize(tmp_path)
    assert summary["windows"] == len(decode) and len(summary["stages"]) == 2
    assert all(0 < b <= 1 for b in summary["busy"])
    drafted = [w for w in decode if "drafted" in traces["stage1"]["marks"][w]]
    assert summary["drafter"]["windows"] == len(drafted) and bool(drafted) == bool(drafts)
    for w in drafted:   # past the device, then the proposals, then the Result sent
        m = traces["stage1"]["marks"][w]
        assert m["synced"] <= m["drafted"] <= m["sent"]
    assert len(tracereport.format_summary(summary)) == 3 + bool(drafts)
    events = tracereport.chrome(tmp_path)
    assert {e["pid"] for e in events} == {0, 1, 2}
    json.dumps(events)  # serializable as written by --chrome-out
