"""`strata-launch` as a user runs it: every mistake ends with a non-zero exit code and one
sentence that says what to change (no traceback), and no stage process outlives the launcher,
whether it ends normally, on an error, on SIGTERM/SIGINT, or killed with SIGKILL."""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from strata.model.mkmodel import SHAPES, write_random_gguf

# The console script next to this interpreter (a pyenv shim elsewhere on PATH would add a shell).
LAUNCH = (shutil.which("strata-launch", path=os.path.dirname(sys.executable))
          or shutil.which("strata-launch"))
START_S = 90.0  # longest wait for the stages to say hello (a shared 2-core machine)
LONG_CTX = 32768  # generation until the signal: ~30k tokens is minutes even for the tiny model


def launch(args: list[str], log_dir: Path | None, env: dict | None = None,
           timeout: float = 120.0):
    assert LAUNCH, "strata-launch is not installed"
    logs = ["--log-dir", str(log_dir)] if log_dir else []
    return subprocess.run([LAUNCH, *args, *logs], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})})


def assert_no_traceback(stderr: str) -> None:
    """No traceback of the launcher; quoted stage-log lines ('  | ...') may hold a stage's."""
    own = [line for line in stderr.splitlines() if not line.startswith("  | ")]
    for line in own:
        assert "Traceback" not in line and not line.lstrip().startswith('File "'), stderr


def assert_one_sentence(stderr: str, *words: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    assert lines[0].startswith("strata-launch: "), stderr
    for w in words:
        assert w.lower() in lines[0].lower(), f"{w!r} not in {lines[0]!r}"
    assert_no_traceback(stderr)


# --- mistakes found before any stage starts --------------------------------------------------

def _corrupt_files(tiny: Path, where: Path) -> dict[str, Path]:
    rnd = where / "random.gguf"
    rnd.write_bytes(os.urandom(64 << 10))
    data = tiny.read_bytes()
    cut = where / "truncated.gguf"          # the header is whole, the tensor data is cut short
    cut.write_bytes(data[: len(data) // 2])
    return {"random": rnd, "truncated": cut}


LONG_PROMPT = "a prompt of many more than sixteen byte-level tokens, surely"

# id: (arguments after --model, words the sentence must hold); "MODEL" is the tiny model.
EARLY = {
    "missing-model": (["--model", "/nonexistent.gguf"],
                      ["/nonexistent.gguf", "does not exist", "--model"]),
    "random-bytes": (["--model", "random"], ["random.gguf", "is not a readable GGUF file"]),
    "truncated": (["--model", "truncated"], ["truncated.gguf", "is not a readable GGUF file"]),
    "split-decreasing": (["--layer-split", "3,2"], ["--layer-split 3,2", "must increase"]),
    "split-zero": (["--layer-split", "0,2"], ["boundary 0", "out of range", "between 1 and 3"]),
    "split-at-end": (["--layer-split", "4"], ["boundary 4", "out of range", "between 1 and 3"]),
    "split-past-end": (["--layer-split", "2,9"], ["boundary 9", "out of range",
                                                  "between 1 and 3"]),
    "split-not-numeric": (["--layer-split", "two"],
                          ["--layer-split 'two'", "list of layer numbers"]),
    "devices-more-than-layers": (["--devices", "cpu,cpu,cpu,cpu,cpu"],
                                 ["5 stages", "4 layers", "use fewer devices"]),
    "split-more-than-layers": (["--layer-split", "1,2,3,4"],
                               ["5 stages", "4 layers", "at most 3 boundaries"]),
    "devices-not-matching-split": (["--layer-split", "2", "--devices", "cpu,cpu,cpu"],
                                   ["3 devices for 2 stages", "one per stage"]),
    "unknown-device": (["--devices", "gpu:0"], ["unknown device 'gpu:0'", "cpu or cuda:N"]),
    "absent-cuda-device": (["--devices", "cuda:7"], ["'cuda:7' does not exist", "CUDA device"]),
    "prompt-longer-than-ctx": (["--ctx-size", "16", "--prompt", LONG_PROMPT],
                               ["prompt has", "context of 16", "raise --ctx-size"]),
    "ctx-beyond-training": (["--ctx-size", "4096"], ["--ctx-size 4096", "2048 positions",
                                                     "use --ctx-size 2048 or less"]),
    "external-stage-absent": (["--layer-split", "2", "--external-stage", "2"],
                              ["--external-stage 2 does not exist", "stages are 0..1"]),
    "groups-not-dividing-batch": (["--batch", "6", "--batch-groups", "4"],
                                  ["--batch-groups 4 does not divide --batch 6", "or auto"]),
    "groups-not-numeric": (["--batch-groups", "many"], ["--batch-groups 'many'", "auto"]),
    "window-rows-zero": (["--window-rows", "0"], ["--window-rows 0 is not a multiple of 8",
                                                  "use 8 or auto"]),
    "batch-zero": (["--batch", "0"], ["--batch 0", "below 1"]),
    "decode-ahead-two-stages": (["--layer-split", "2", "--decode-ahead", "on"],
                                ["--decode-ahead on", "the launch has 2 stages",
                                 "use --decode-ahead auto or off"]),
    "decode-ahead-drafts": (["--draft-tokens", "2", "--decode-ahead", "on"],
                            ["--decode-ahead on", "--draft-tokens is 2"]),
    "restart-with-prompt": (["--restart-stages"], ["--restart-stages", "--prompt",
                                                   "leave one of them out"]),
    "restart-external": (["--layer-split", "2", "--restart-stages", "--external-stage", "1"],
                         ["--restart-stages", "stage 1", "--external-stage"]),
    "restart-gloo": (["--layer-split", "2", "--restart-stages", "--stage-link", "gloo"],
                     ["--stage-link gloo", "use --stage-link zmq"]),
    "served-name-with-prompt": (["--served-model-name", "m"], ["--served-model-name",
                                                              "--prompt", "leave one"]),
    "batch-beyond-memory": (["--batch", "100000000"],
                            ["--batch 100000000", "of KV cache", "slot(s) fit", "use --batch"]),
}


def launch_in_process(args: list[str]) -> subprocess.CompletedProcess:
    """strata-launch's command run in this process (click's CliRunner), for mistakes it refuses
    before any stage starts: the same code as the console script, without a second's start of
    a Python process. An exception that escaped it would end with exit code 1, not 2."""
    from click.testing import CliRunner

    from strata.launch.cli import main
    r = CliRunner().invoke(main, args, prog_name="strata-launch")
    return subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)


@pytest.fixture(scope="module")
def early_files(tiny_model, tmp_path_factory) -> dict[str, Path]:
    return _corrupt_files(tiny_model, tmp_path_factory.mktemp("early"))


@pytest.mark.parametrize("case", list(EARLY))
def test_mistake_gets_one_sentence(case, tiny_model, early_files, tmp_path, no_stage_left):
    """In-process; test_a_refused_flag_imports_neither_torch_nor_aiohttp runs cases of them
    as the console script does."""
    args = [str(early_files.get(a, a)) for a in EARLY[case][0]]
    if "--model" not in args:
        args = ["--model", str(tiny_model), *args]
    if "--prompt" not in args:
        args += ["--prompt", "hi"]
    result = launch_in_process([*args, "--max-tokens", "4", "--log-dir", str(tmp_path)])
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert_one_sentence(result.stderr, *EARLY[case][1])
    assert result.stdout == ""
    # found before spawning: no stage ever started, so none wrote a log
    assert not any(tmp_path.glob("stage*.log"))


@pytest.mark.parametrize("case", ["batch-zero", "split-decreasing", "batch-beyond-memory",
                                  "prompt-longer-than-ctx"])
def test_a_refused_flag_imports_neither_torch_nor_aiohttp(case, tiny_model):
    """The launcher reads the model's configuration and checks the flags without torch (over a
    second to import) or the HTTP stack: only a stage's weights need torch, only serving aiohttp.
    The launcher runs as its console script does; at exit it prints which of them it loaded."""
    args, words = EARLY[case]
    code = ("import atexit, sys; atexit.register(lambda: print(sorted({'torch', 'aiohttp'} & "
            "set(sys.modules)))); from strata.launch.cli import main; main()")
    prompt = [] if "--prompt" in args else ["--prompt", "hi"]
    r = subprocess.run([sys.executable, "-c", code, "--model", str(tiny_model), *args, *prompt],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, r.stderr
    assert_one_sentence(r.stderr, *words)  # refused, and where the console script refuses it
    assert r.stdout == "[]\n"


# --- stage processes: a crash, a clean run, signals ------------------------------------------

def children(pid: int) -> list[int]:
    """Pids whose parent is pid."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def writing_to(log_dir: Path) -> list[int]:
    """Live pids whose stdout is a file in log_dir: the stage workers of one launch (precise,
    where no_stage_left also counts the workers of other test runs on a shared machine)."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.readlink(f"/proc/{entry}/fd/1").startswith(f"{log_dir}/"):
                out.append(int(entry))
        except OSError:
            continue
    return [p for p in out if alive(p)]


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_stage_crash_at_start_names_the_stage(tiny_model, tmp_path, no_stage_left):
    r = launch(["--model", str(tiny_model), "--layer-split", "2", "--prompt", "hi"], tmp_path,
               env={"STRATA_FAULT": "crash-at-start:1"})
    assert r.returncode == 1, (r.returncode, r.stderr)
    first, *quoted = r.stderr.splitlines()
    assert first.startswith("strata-launch: stage 1 exited with code 1; last lines of "), r.stderr
    assert str(tmp_path / "stage1.log") in first
    assert quoted and all(line.startswith("  | ") for line in quoted), r.stderr
    assert quoted[-1] == "  | RuntimeError: stage 1: crash at start requested by STRATA_FAULT"
    assert_no_traceback(r.stderr)
    assert (tmp_path / "stage0.log").exists()  # stage 0 had started ...
    assert writing_to(tmp_path) == []           # ... and is gone


def run_dirs(tmp: str) -> list[Path]:
    """The run directories strata left in the temporary directory `tmp` (TMPDIR)."""
    return sorted(Path(tmp).glob("strata-*"))


@pytest.fixture(scope="module")
def run_with_logs(tiny_model, tmp_path_factory):
    """One clean two-stage run with --log-dir, its TMPDIR a directory of its own:
    (its result, the log directory, the TMPDIR)."""
    log_dir = tmp_path_factory.mktemp("clean") / "logs"
    tmp = tempfile.mkdtemp(prefix="st", dir="/tmp")  # short: ipc paths are limited to 107 bytes
    r = launch(["--model", str(tiny_model), "--layer-split", "2", "--prompt", "hello",
                "--max-tokens", "4", "--seed", "1"], log_dir, env={"TMPDIR": tmp})
    yield r, log_dir, tmp
    shutil.rmtree(tmp, ignore_errors=True)


def test_two_stage_run_succeeds_and_shuts_down(run_with_logs):
    r, log_dir, _ = run_with_logs
    assert r.returncode == 0, r.stderr
    # each stage's line says what its hello says it made of the weights (an F32 file, fp32)
    for line in ("stage 0: layers [0, 2) on cpu; kept quantized: none; loaded as float32: F32 x",
                 "stage 1: layers [2, 4) on cpu; kept quantized: none; loaded as float32: F32 x"):
        assert line in r.stderr, r.stderr
    assert re.search(r"^\[\d+ prompt tokens, 4 generated, finish: length, seed 1\]$", r.stderr,
                     re.MULTILINE), r.stderr
    assert_no_traceback(r.stderr)
    assert r.stdout.strip()
    assert writing_to(log_dir) == []
    for stage in (0, 1):  # each stage left by the Shutdown message, not by a signal
        log = (log_dir / f"stage{stage}.log").read_text()
        assert f"stage {stage}: shutting down (coordinator exit)" in log, log


def test_clean_run_leaves_no_run_directory(tiny_model, run_with_logs, no_stage_left):
    """Without --log-dir, a clean run removes its run directory, logs and all; with it, the
    logs stay where --log-dir asked, and nothing else."""
    r = launch(["--model", str(tiny_model), "--layer-split", "2", "--prompt", "hello",
                "--max-tokens", "4"], None)
    assert r.returncode == 0, r.stderr
    assert run_dirs(no_stage_left) == [], r.stderr
    r, log_dir, tmp = run_with_logs
    assert r.returncode == 0, r.stderr
    assert run_dirs(tmp) == [], r.stderr
    assert sorted(p.name for p in log_dir.iterdir()) == ["stage0.log", "stage1.log"]
    assert "the stage logs are kept" not in r.stderr


def test_failed_run_keeps_its_logs_and_says_where(tiny_model, no_stage_left):
    r = launch(["--model", str(tiny_model), "--layer-split", "2", "--prompt", "hi"], None,
               env={"STRATA_FAULT": "crash-at-start:1"})
    assert r.returncode == 1, (r.returncode, r.stderr)
    (kept,) = run_dirs(no_stage_left)
    assert f"strata: the stage logs are kept in {kept}" in r.stderr.splitlines(), r.stderr
    assert f"last lines of {kept / 'stage1.log'}" in r.stderr  # the path the error names
    assert sorted(p.name for p in kept.iterdir()) == ["stage0.log", "stage1.log"]  # no socket
    assert "crash at start requested by STRATA_FAULT" in (kept / "stage1.log").read_text()
    assert_no_traceback(r.stderr)


def _sigint_default():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory) -> Path:
    """The tiny model, trained (so it says) for LONG_CTX positions."""
    path = tmp_path_factory.mktemp("long") / "tiny-long.gguf"
    return write_random_gguf(path, dataclasses.replace(SHAPES["tiny"], ctx_len=LONG_CTX), seed=1)


class Running:
    """strata-launch generating for minutes, its stage workers known by pid."""

    def __init__(self, model: Path, log_dir: Path):
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.proc = subprocess.Popen(
            [LAUNCH, "--model", str(model), "--layer-split", "2", "--prompt", "hi", "--ctx-size",
             str(LONG_CTX), "--max-tokens", str(LONG_CTX), "--log-dir", str(log_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            text=True, start_new_session=True,  # its own process group, as a terminal gives
            preexec_fn=_sigint_default)  # pytest run in the background would pass SIGINT ignored
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            if line.startswith("stage 1: layers"):  # printed once every stage said hello
                self.ready.set()

    def wait_generating(self) -> list[int]:
        assert self.ready.wait(START_S), f"stages not ready:\n{''.join(self.lines)}"
        time.sleep(0.5)  # into the decode loop (the prompt is one chunk)
        assert self.proc.poll() is None, "".join(self.lines)
        workers = children(self.proc.pid)
        assert len(workers) == 2, workers
        return workers

    def stderr(self) -> str:
        """All of stderr, once the launcher has exited (the pipe closes with it)."""
        self.reader.join(timeout=5)
        return "".join(self.lines)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.mark.parametrize("sig, group", [(signal.SIGTERM, False), (signal.SIGINT, False),
                                        (signal.SIGINT, True)],
                         ids=["SIGTERM", "SIGINT", "ctrl-c-to-group"])
def test_signal_while_generating_stops_everything(sig, group, long_tiny, tmp_path,
                                                  no_stage_left):
    """group: the signal goes to the launcher and its stages at once, as Ctrl-C in a terminal."""
    run = Running(long_tiny, tmp_path)
    try:
        workers = run.wait_generating()
        t0 = time.monotonic()
        if group:
            os.killpg(run.proc.pid, sig)
        else:
            run.proc.send_signal(sig)
        code = run.proc.wait(timeout=20)
        took = time.monotonic() - t0
    finally:
        run.kill()
    stderr = run.stderr()
    assert code == 130, (code, stderr)
    assert took < 12, f"took {took:.1f}s to stop"
    assert stderr.rstrip().endswith("strata-launch: interrupted; stages stopped"), stderr
    assert_no_traceback(stderr)
    assert wait_gone(workers, 1.0) == []  # the launcher waited for them


def test_sigkill_of_launcher_takes_the_stages_down(long_tiny, tmp_path, no_stage_left):
    run = Running(long_tiny, tmp_path)
    workers, run_dirs = [], set()
    try:
        workers = run.wait_generating()
        for pid in workers:  # the run directory of the ipc sockets, to clean up after
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            listen = argv[argv.index(b"--listen") + 1].decode()
            run_dirs.add(Path(listen.removeprefix("ipc://")).parent)
        run.proc.kill()
        assert run.proc.wait(timeout=10) == -signal.SIGKILL
        left = wait_gone(workers, 10.0)  # PR_SET_PDEATHSIG: SIGTERM when the parent dies
    finally:
        run.kill()
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for d in run_dirs:
            shutil.rmtree(d, ignore_errors=True)
    assert left == [], f"stage workers {left} outlived a SIGKILLed launcher"


def test_a_server_whose_console_is_gone_still_stops_on_sigterm(tiny_model, tmp_path,
                                                              no_stage_left):
    """The launcher's stderr closes under it (its terminal or pipe gone): SIGTERM still stops
    the server and its stages; saying "stopping" to a closed pipe had kept it serving."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "strata.launch.cli", "--model", str(tiny_model), "--layer-split",
         "2", "--devices", "cpu", "--ctx-size", "256", "--port", "0", "--log-dir",
         str(tmp_path)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if line.startswith("strata: serving"):
                break
        else:
            pytest.fail(f"strata-launch never served (exit code {proc.wait()})")
        workers = children(proc.pid)
        assert len(workers) == 2, workers
        proc.stderr.close()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0
    assert wait_gone(workers, 5.0) == []
