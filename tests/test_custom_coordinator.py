"""The coordinator is a library: a hand-written greedy loop drives the stage workers and gets
the text strata-launch prints. And a stage started by hand (--external-stage) joins a launch."""
from __future__ import annotations

import shlex
import shutil
import subprocess
import sys

from strata.coordinator.pipeline import Expect, Pipeline
from strata.coordinator.windows import Row, build_window
from strata.coordinator.sampling import SamplingParams
from strata.launch.plan import plan_stages
from strata.launch.processes import StageProcesses
from strata.model.gguf_file import ModelFile
from strata.model.tokenizer import Tokenizer

PROMPT = "The three primary colours are"
N_TOKENS = 16


def launch_cli(*args, env=None, **popen) -> subprocess.Popen:
    return subprocess.Popen([shutil.which("strata-launch"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **popen)


def my_greedy_coordinator(model_path, split: str, ctx: int = 128) -> str:
    """A whole coordinator: start the workers, say hello, read the prompt, decode greedily."""
    file = ModelFile(model_path)
    tok = Tokenizer.from_gguf(file.reader)
    plan = plan_stages(split, ["cpu"], file.config.n_layers)
    procs = StageProcesses(file.path, plan, slots=1, ctx=ctx)
    pipe = Pipeline(procs.endpoints.inbox, procs.endpoints.stages[0], procs.check_alive)
    try:
        procs.start()
        pipe.wait_for_hellos([Expect(p.index, p.layer_start, p.layer_end, file.fingerprint(),
                                     1, ctx) for p in plan])
        greedy = SamplingParams(seed=0)
        ids = tok.encode(PROMPT)
        # the prompt in 32-row chunks; the last row samples the first token
        rows = [Row(0, p, t) for p, t in enumerate(ids)]
        rows[-1] = Row(0, len(ids) - 1, ids[-1], greedy)
        for start in range(0, len(rows), 32):
            pipe.submit(build_window(pipe.new_window_id(), rows[start:start + 32], 32,
                                     commits=[(0, 0)] if start == 0 else []))
            result, _ = pipe.receive(timeout=60)
        out = [result.tokens[0]]
        # then one row per 8-row decode window
        while len(out) < N_TOKENS and out[-1] not in tok.stop_ids:
            row = Row(0, len(ids) + len(out) - 1, out[-1], greedy)
            pipe.submit(build_window(pipe.new_window_id(), [row], 8))
            result, _ = pipe.receive(timeout=60)
            out.append(result.tokens[0])
        return tok.decode([t for t in out if t not in tok.stop_ids])
    finally:
        pipe.shutdown()
        procs.stop()
        pipe.close()


def test_hand_written_coordinator_matches_strata_launch(smollm2, no_stage_left):
    mine = my_greedy_coordinator(smollm2, "15")
    cli = launch_cli("--model", str(smollm2), "--layer-split", "15", "--ctx-size", "128",
                     "--prompt", PROMPT, "--max-tokens", str(N_TOKENS))
    out, err = cli.communicate(timeout=300)
    assert cli.returncode == 0, err
    assert out.rstrip("\n") == mine
    assert len(mine) > 10


def test_external_stage_joins_and_gives_the_same_text(tiny_model, no_stage_left):
    args = ["--model", str(tiny_model), "--layer-split", "2", "--ctx-size", "64",
            "--prompt", "hello there", "--max-tokens", "12"]
    plain = launch_cli(*args)
    expected, err = plain.communicate(timeout=120)
    assert plain.returncode == 0, err

    launch = launch_cli(*args, "--external-stage", "1")
    command = None
    for line in launch.stderr:  # the launcher prints the worker command, then waits
        if line.strip().startswith("strata-worker "):
            command = shlex.split(line.strip())
            break
    assert command is not None, "strata-launch did not print the external stage's command"
    assert "--stage" in command and command[command.index("--stage") + 1] == "1"
    worker = subprocess.Popen([sys.executable, "-m", "strata.stage_worker", *command[1:]],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out, err = launch.communicate(timeout=120)
        assert launch.returncode == 0, err
        assert out == expected
        assert worker.wait(timeout=30) == 0  # the launcher's Shutdown reached it
    finally:
        worker.kill()
        launch.kill()
