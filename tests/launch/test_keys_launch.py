"""Stages with CurveZMQ keys give the tokens they give without: strata-launch --keys over
ZeroMQ ipc, and stage workers started by hand on tcp:// endpoints (as on other hosts) driven
by the coordinator's Pipeline. varied_model's text changes with every token of its context,
so a window that went wrong shows."""
from __future__ import annotations

import shlex
import shutil
import subprocess
import sys

import pytest

from strata.coordinator.stages.pipeline import Expect, Pipeline
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.launch.plan import plan_stages
from strata.launch.session import launch_stages
from strata.model.gguf_file import ModelFile
from strata.model.tokenizer import Tokenizer
from strata.protocol.keys import COORDINATOR, CurveKeys, make_keys, stage_name
from test_keys import tcp

CTX = 256
PROMPT = "The history of the lighthouse begins with fires lit on hills to guide ships."
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12),
          SamplingParams(temperature=0.9, seed=7, max_tokens=12)]


def generate(pipe: Pipeline, tok: Tokenizer, prompt: list[int]) -> list[list[int]]:
    sched = Scheduler(pipe, SchedulerConfig(slots=1, ctx=CTX), tok.stop_ids, tok.decode)
    out = []
    for params in PARAMS:
        req = sched.submit(prompt, params)
        sched.run()
        assert req.error is None, req.error
        out.append(req.seq.generated)
    return out


def test_launch_with_keys_gives_the_same_text(varied_model, tmp_path, no_stage_left):
    make_keys(tmp_path / "keys", [COORDINATOR, "stage0", "stage1"])
    args = [shutil.which("strata-launch"), "--model", str(varied_model), "--layer-split", "2",
            "--devices", "cpu", "--ctx-size", str(CTX), "--prompt", PROMPT,
            "--max-tokens", "12", "--transport", "zmq"]
    plain = subprocess.run(args, capture_output=True, text=True, timeout=300)
    keyed = subprocess.run(args + ["--keys", str(tmp_path / "keys")], capture_output=True,
                           text=True, timeout=300)
    assert plain.returncode == 0 and keyed.returncode == 0, (plain.stderr, keyed.stderr)
    assert keyed.stdout == plain.stdout and len(plain.stdout.strip()) > 6

    # an external stage: its printed command names the keys so that it runs from anywhere
    launch = subprocess.Popen(args + ["--keys", "keys", "--external-stage", "1"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    worker, command = None, None
    try:
        for line in launch.stderr:   # the launcher prints the worker command, then waits
            if line.strip().startswith("strata-worker "):
                command = shlex.split(line.strip())
                break
        assert command is not None, "strata-launch did not print the external stage's command"
        assert command[command.index("--keys") + 1] == str(tmp_path / "keys")
        worker = subprocess.Popen([sys.executable, "-m", "strata.stage_worker", *command[1:]],
                                  cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out, err = launch.communicate(timeout=120)
        assert launch.returncode == 0, err
        assert out == plain.stdout
        assert worker.wait(timeout=30) == 0
    finally:
        for p in (launch, worker):
            if p is not None:
                p.kill()
                p.wait()


@pytest.mark.long   # the default run: a keyed launch gives the same text (above)
def test_stages_on_tcp_with_keys_give_the_same_tokens(varied_model, no_stage_left):
    file = ModelFile(varied_model)
    tok = Tokenizer.from_gguf(file.reader)
    prompt = tok.encode(PROMPT)
    plan = plan_stages("2", ["cpu"], file.config.n_layers)
    with launch_stages(file, plan, slots=1, ctx=CTX, say=lambda s: None) as run:
        expected = generate(run.pipe, tok, prompt)

    keys = f"{no_stage_left}/keys"   # in the workers' command lines: no_stage_left finds them
    make_keys(keys, [COORDINATOR] + [stage_name(p.index) for p in plan])
    inbox, listen = tcp(), [tcp() for _ in plan]
    workers = []
    for p in plan:
        nxt = ["--next", listen[p.index + 1]] if p.index + 1 < len(plan) else []
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "strata.stage_worker", "--model", str(varied_model),
             "--stage", str(p.index), "--layers", f"{p.layer_start}:{p.layer_end}",
             "--listen", listen[p.index], "--coordinator", inbox, *nxt,
             "--ctx-size", str(CTX), "--keys", keys],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    pipe = Pipeline(inbox, listen[0], keys=CurveKeys.load(keys, COORDINATOR))
    try:
        pipe.wait_for_hellos([Expect(p.index, p.layer_start, p.layer_end, file.fingerprint(),
                                     1, CTX) for p in plan], timeout=120)
        assert generate(pipe, tok, prompt) == expected
        pipe.shutdown()
        for w in workers:
            assert w.wait(timeout=30) == 0, w.stderr.read()
    finally:
        pipe.close()
        for w in workers:
            w.kill()
            w.wait()
    assert any(expected[0]) and expected[0] != expected[1]
