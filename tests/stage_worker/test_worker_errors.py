"""A stage worker's refusals: every malformed or impossible message gets an Error with a
sentence, the worker keeps serving, a refused window changes nothing. The cases drive a
StageWorker in this process through its sockets, one message a step; one case runs a real
`strata-worker` process that answers an Error, goes on, and ends with exit code 0 on a
Shutdown; one checks that strata-worker takes the model names strata-launch takes."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
from click.testing import CliRunner

from inprocess import in_process_worker

from strata.protocol import transport
from strata.protocol.messages import Error, Hello, Result, Shutdown, Window
from strata.stage_worker.main import main as worker_main

CTX = 64     # --ctx-size of the worker
VOCAB = 320  # the tiny model's vocabulary
STARTUP_S = 60.0  # the machine is shared; loading takes ~2 s when it is idle


def window(id: int, slots, positions, tokens, *, commits=(), sample=()) -> dict:
    """The frames of a Window; sample: the rows sampled greedily."""
    w = Window(id, list(slots), list(positions), list(tokens), commits=[list(c) for c in commits],
               sample_rows=list(sample), temperature=[0.0] * len(sample),
               top_k=[0] * len(sample), top_p=[1.0] * len(sample), min_p=[0.0] * len(sample),
               u=[0.0] * len(sample))
    return transport.pack(w)


def header(fields: dict) -> list:
    return [msgpack.packb(fields, use_bin_type=True)]


class Stage:
    """The worker process and the two sockets a coordinator would hold."""

    def __init__(self, proc: subprocess.Popen, log: Path, inbox: zmq.Socket, out: zmq.Socket):
        self.proc, self.log, self.inbox, self.out = proc, log, inbox, out

    def send_frames(self, frames: list) -> None:
        self.out.send_multipart(frames)

    def recv(self, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while not self.inbox.poll(200):
            if self.proc.poll() is not None:
                pytest.fail(f"worker exited with {self.proc.returncode}:\n{self.log_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no reply within {timeout}s:\n{self.log_text()}")
        msg, tensors = transport.recv(self.inbox)
        return msg

    def ask(self, frames: list, timeout: float = 20.0):
        self.send_frames(frames)
        return self.recv(timeout)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@pytest.fixture
def stage(tiny_model, no_stage_left):
    run = Path(tempfile.mkdtemp(prefix="strata-w-"))  # short: ipc paths are limited to ~100 bytes
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(f"ipc://{run}/inbox")
    out = ctx.socket(zmq.PUSH)
    out.connect(f"ipc://{run}/s0")
    log = run / "stage0.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "strata.stage_worker", "--model", str(tiny_model),
             "--stage", "0", "--layers", "0:4", "--listen", f"ipc://{run}/s0",
             "--coordinator", f"ipc://{run}/inbox", "--ctx-size", str(CTX)],
            stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        yield Stage(proc, log, inbox, out)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        inbox.close(linger=0)
        out.close(linger=0)
        ctx.term()
        shutil.rmtree(run, ignore_errors=True)


def assert_sentence(msg, *words: str, window: int | None = None) -> None:
    """An Error from stage 0 whose one-line message contains every word (case-insensitive)."""
    assert isinstance(msg, Error), f"expected an Error, got {msg!r}"
    assert msg.stage == 0
    if window is not None:
        assert msg.window == window, msg
    text = msg.message
    assert text and "\n" not in text and "Traceback" not in text, text
    for w in words:
        assert w.lower() in text.lower(), f"{w!r} not in {text!r}"


PROMPT = [72, 101, 108, 108]  # 4 tokens at positions 0..3 of slot 0

BAD = [  # (frames, words the sentence must hold, window id of the Error: named when readable)
    ([b"\xc1\xc1 not msgpack"], ["malformed", "not msgpack"], -1),
    ([bytes(range(256))], ["malformed"], -1),
    (header([1, 2, 3]), ["malformed", "type"], -1),
    (header({"type": "Bogus", "id": 3}), ["unknown message type", "Bogus"], -1),
    (header({"type": "Window", "id": 4, "slots": [0], "positions": [4]}),
     ["Window lacks field", "tokens"], 4),
    (header({"type": "Window", "id": 5, "slots": [0], "positions": "4", "tokens": [1]}),
     ["positions", "list[int]"], 5),
    (header({"type": "Window", "id": 6, "slots": [0, 0], "positions": [4], "tokens": [1]}),
     ["differ in length"], 6),
    (header({**msgpack.unpackb(window(7, [0], [4], [1], sample=[0])[0]), "sample_rows": [1]}),
     ["sampled row", "out of range"], 7),
    (header({"type": "Window", "id": 8, "slots": [0], "positions": [4], "tokens": [1],
             "tensors": [["float32", [2]]]}), ["1 tensors but 0 frames"], 8),
    (transport.pack(Hello(1, 0, 0, 4, "cpu", "x", 1, 1, CTX)), ["does not accept Hello"], -1),
    (window(22, [], [], []), ["window 22 has no rows"], 22),
    (window(9, [1], [0], [1]), ["slot 1 does not exist"], 9),
    (window(10, [0], [CTX], [1]), [f"position {CTX}", "outside the context"], 10),
    (window(11, [0], [-2], [1]), ["position -2", "outside the context"], 11),
    (window(12, [0], [9], [1]), ["slot 0 holds 4 positions", "position 9", "gap"], 12),
    (window(13, [0], [4], [VOCAB]), [f"token {VOCAB}", "outside the vocabulary"], 13),
    (window(14, [0], [4], [-1]), ["token -1", "outside the vocabulary"], 14),
    (window(15, [0], [4], [1], commits=[(0, CTX + 1)]), ["commit", "out of range"], 15),
    (window(16, [0], [4], [1], commits=[(2, 0)]), ["commit", "out of range"], 16),
    (header({**msgpack.unpackb(window(17, [0], [4], [1])[0]), "commits": [[0]]}),
     ["commit", "[0]"], 17),
    # A refused window must change nothing: this one would trim slot 0 to 1 position.
    (window(18, [0], [5], [1], commits=[(0, 1)]), ["slot 0 holds 1 positions", "gap"], 18),
]


@pytest.fixture
def in_process(tiny_model):
    with in_process_worker(tiny_model, layer_end=4, ctx=CTX) as stage:
        yield stage


def test_worker_refuses_bad_messages_and_keeps_serving(in_process):
    stage = in_process
    # A reference: the greedy token after the prompt, from a fresh slot.
    ref = stage.ask(window(1, [0] * 4, range(4), PROMPT, commits=[(0, 0)], sample=[3]))
    assert isinstance(ref, Result) and ref.id == 1 and len(ref.tokens) == 1, ref
    assert 0 <= ref.tokens[0] < VOCAB

    for frames, words, window_id in BAD:
        assert_sentence(stage.ask(frames), *words, window=window_id)

    # A window of pad rows only (one that carries commits, say) computes and samples nothing;
    # a pad row's token is not looked up (out of the vocabulary here), nor does it need to be.
    pad = stage.ask(window(19, [-1, -1], [0, 0], [VOCAB + 5, -3]))
    assert isinstance(pad, Result) and pad.id == 19 and pad.tokens == [], pad
    # Slot 0 still holds exactly the prompt: position 4 follows on without a gap ...
    nxt = stage.ask(window(20, [0], [4], ref.tokens, sample=[0]))
    assert isinstance(nxt, Result) and nxt.id == 20 and len(nxt.tokens) == 1, nxt
    # ... and the prompt read again from a fresh slot gives the same token as before.
    again = stage.ask(window(21, [0] * 4, range(4), PROMPT, commits=[(0, 0)], sample=[3]))
    assert isinstance(again, Result) and again.tokens == ref.tokens, (again, ref)

    stage.out.send_multipart(transport.pack(Shutdown("test over")))
    with torch.inference_mode():
        assert not stage.worker.step()


def test_worker_process_answers_an_error_and_goes_on(stage):
    """A real strata-worker: a refused window gets an Error, the next window its Result, and a
    Shutdown ends the process with exit code 0."""
    hello = stage.recv(timeout=STARTUP_S)
    assert isinstance(hello, Hello)
    assert (hello.stage, hello.layer_start, hello.layer_end) == (0, 0, 4)
    assert (hello.pid, hello.slots, hello.ctx) == (stage.proc.pid, 1, CTX)
    assert_sentence(stage.ask(window(9, [1], [0], [1])), "slot 1 does not exist", window=9)
    assert_sentence(stage.ask([b"\xc1\xc1 not msgpack"]), "malformed", window=-1)
    ok = stage.ask(window(1, [0] * 4, range(4), PROMPT, commits=[(0, 0)], sample=[3]))
    assert isinstance(ok, Result) and ok.id == 1 and len(ok.tokens) == 1, ok
    stage.send_frames(transport.pack(Shutdown("test over")))
    assert stage.proc.wait(timeout=20) == 0, stage.log_text()
    assert "shutting down (test over)" in stage.log_text()


def test_worker_takes_the_registry_model_names(smollm2, tmp_path):
    """strata-worker --model smollm2-135m opens the embedded model, as strata-launch does: a
    layer range past its 30 layers is then refused with the model's own count."""
    result = CliRunner().invoke(worker_main, [
        "--model", "smollm2-135m", "--stage", "0", "--layers", "0:99",
        "--listen", f"ipc://{tmp_path}/s0", "--coordinator", f"ipc://{tmp_path}/inbox"])
    assert result.exit_code == 2, result.output
    assert "exceeds the model's 30 layers" in result.output, result.output
