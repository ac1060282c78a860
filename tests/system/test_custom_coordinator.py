"""The coordinator is a library: examples/custom_coordinator.py starts the stage workers, drives
them with a greedy loop of its own and prints the text strata-launch prints. And a stage started
by hand (--external-stage) joins a launch.

Both run the tiny random models: what they check (the same windows give the same tokens, the
processes start, join and stop) does not depend on the weights, and varied_model's greedy text
changes with every token of its context, so a window the example built wrong shows."""
from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_coordinator.py"
# more than one prompt window of 32 rows (97 tokens), on which varied_model's greedy text runs
# past N_TOKENS without its end-of-text token
PROMPT = "The history of the lighthouse begins with fires lit on hills to guide ships. " * 2
N_TOKENS = 12


def launch_cli(*args, env=None, **popen) -> subprocess.Popen:
    return subprocess.Popen([shutil.which("strata-launch"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **popen)


def test_example_coordinator_matches_strata_launch(varied_model, no_stage_left):
    args = ["--model", str(varied_model), "--layer-split", "2", "--devices", "cpu",
            "--ctx-size", "256", "--prompt", PROMPT, "--max-tokens", str(N_TOKENS)]
    mine = subprocess.Popen([sys.executable, str(EXAMPLE), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    cli = launch_cli(*args)
    out, err = cli.communicate(timeout=300)
    assert cli.returncode == 0, err
    printed, err = mine.communicate(timeout=300)
    assert mine.returncode == 0, err
    assert printed == out and len(out.strip()) > N_TOKENS // 2
    assert not list(Path(no_stage_left).glob("strata-*"))  # its run directory is removed


def test_readme_shows_the_example():
    """The README's "A coordinator of your own" code is the example's loop, line for line."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## A coordinator of your own"):]
    start = section.index("```python\n") + len("```python\n")
    snippet = section[start:section.index("\n```\n", start)]
    assert textwrap.indent(snippet, "    ") in EXAMPLE.read_text()
    assert "python examples/custom_coordinator.py" in section


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
