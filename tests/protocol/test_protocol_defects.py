"""Three protocol defects, each with the case that showed it: a Unix-socket sender facing a
peer that stops reading, a window header that a stage k > 0 cannot parse while its activations
come over the link, and an Error about no window while the scheduler has windows in flight."""
from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq

from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import Scheduler, SchedulerConfig
from strata.protocol import transport, unixsock
from strata.protocol.messages import Error, ProtocolError, Result, Window
from strata.stage_worker.worker import StageWorker, WorkerConfig

HWM = 4           # the high-water mark these tests give UnixPush
MESSAGES = 64     # sent to a peer that does not read: far past HWM and the kernel's buffer
PAYLOAD = 1 << 16


def _wait_until_still(count, settle_s: float = 0.5, limit_s: float = 10.0) -> int:
    """count() once it has not changed for settle_s (or limit_s has passed)."""
    deadline = time.monotonic() + limit_s
    last, since = count(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            break
    return last


def test_unix_push_blocks_at_its_high_water_mark(tmp_path, monkeypatch):
    """As ZeroMQ's PUSH at SNDHWM: with HWM messages queued for a peer that does not read, a
    send blocks (the queue stays bounded), and goes on when the peer reads; every message
    then arrives whole and in order."""
    monkeypatch.setattr(unixsock.UnixPush, "SNDHWM", HWM, raising=False)
    endpoint = f"unix://{tmp_path}/in"
    pull = unixsock.UnixPull(endpoint)   # bound, but reads nothing until later
    push = unixsock.UnixPush(endpoint)
    sent: list[int] = []

    def sender():
        for i in range(MESSAGES):
            push.send_multipart([i.to_bytes(4, "little"), bytes([i]) * PAYLOAD])
            sent.append(i)

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    blocked_at = _wait_until_still(lambda: len(sent))
    assert thread.is_alive() and blocked_at < MESSAGES, \
        f"all {len(sent)} sends returned to a peer that reads nothing: the queue is unbounded"
    assert len(push.backlog) <= HWM
    for i in range(MESSAGES):   # reading lets the sender go on
        assert pull.poll(10_000), f"message {i} never came"
        index, body = pull.recv_multipart()
        assert int.from_bytes(index, "little") == i
        assert bytes(body) == bytes([i]) * PAYLOAD
    thread.join(10)
    assert not thread.is_alive() and sent == list(range(MESSAGES))
    push.close(linger=100)
    pull.close()


def test_a_send_blocked_at_the_high_water_mark_ends_when_the_socket_closes(tmp_path,
                                                                            monkeypatch):
    """A sender blocked for a peer that never binds is released by close, with an OSError
    (which transport.send turns into a TransportError), not left waiting for ever."""
    monkeypatch.setattr(unixsock.UnixPush, "SNDHWM", HWM, raising=False)
    push = unixsock.UnixPush(f"unix://{tmp_path}/nobody")
    outcome: list = []

    def sender():
        try:
            for i in range(HWM + 1):
                push.send_multipart([bytes([i])])
            outcome.append("returned")
        except OSError as e:
            outcome.append(e)

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive(), "the send past the high-water mark did not block"
    push.close(linger=0)
    thread.join(5)
    assert not thread.is_alive() and len(outcome) == 1 and isinstance(outcome[0], OSError), \
        outcome


# --- a header stage 1 cannot parse, its activations on a gloo link ---------------------------

D = 64      # the tiny model's hidden size
ROWS = 8
RANK0 = """
import sys
import numpy as np
import torch
import torch.distributed as dist
dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=2)
dist.send(torch.zeros(1, {d}), 1)   # the link's warm-up exchange
for x in np.load(sys.argv[2]):       # one [rows, d] tensor per window, in order
    dist.send(torch.from_numpy(x), 1)
dist.destroy_process_group()
"""


def _window(id: int, slot: int) -> Window:
    """A fresh prompt chunk of ROWS rows in `slot`, its last row sampled, logits wanted."""
    return Window(id, [slot] * ROWS, list(range(ROWS)), [0] * ROWS, commits=[[slot, 0]],
                  sample_rows=[ROWS - 1], temperature=[0.0], top_k=[0], top_p=[1.0],
                  min_p=[0.0], u=[0.0], want_logits=True, chunk=True)


def test_a_header_stage_1_cannot_parse_keeps_its_link_in_step(tiny_model, tmp_path):
    """Stage 1 of two takes activations over gloo; the previous stage (here a process of the
    test's) sends a window's activations, then a header stage 1 cannot parse (with its own
    activations, sent as any window's are), then the next window's. Stage 1 answers the bad
    header with an Error naming its window and drops its activations: the next window, read
    from the same activations in another fresh slot, gives the first one's logits bit for bit.
    A header whose row count cannot be read stops the stage (its link is out of step)."""
    rng = np.random.default_rng(0)
    x, junk = (rng.standard_normal((ROWS, D), dtype=np.float32) for _ in range(2))
    np.save(tmp_path / "sends.npy", np.stack([x, junk, x]))
    init = f"file://{tmp_path}/link"
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0.format(d=D), init,
                              str(tmp_path / "sends.npy")])
    run = Path(tempfile.mkdtemp(prefix="strata-l-"))   # short: ipc paths are limited
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(f"ipc://{run}/inbox")
    worker = None
    try:
        worker = StageWorker(WorkerConfig(
            model=str(tiny_model), stage=1, layer_start=2, layer_end=4, listen=f"ipc://{run}/s1",
            coordinator=f"ipc://{run}/inbox", next=None, slots=2, ctx=64, link="gloo",
            link_init=init, link_world=2))
        out = ctx.socket(zmq.PUSH)
        out.connect(f"ipc://{run}/s1")
        bad = msgpack.unpackb(transport.pack(_window(2, 1))[0])
        bad["top_k"] = ["forty"]   # ill-typed: the header does not decode; id and rows do
        answers = []
        for frames in (transport.pack(_window(1, 0)), [msgpack.packb(bad)],
                       transport.pack(_window(3, 1))):
            out.send_multipart(frames)
            with torch.inference_mode():
                assert worker.step()
            assert inbox.poll(20_000), "stage 1 answered nothing"
            answers.append(transport.recv(inbox))
        # a header whose rows cannot be read: what the link carries no longer matches, so
        # the stage says so and stops
        out.send_multipart([msgpack.packb({"type": "Window", "id": 4, "slots": "eight"})])
        with torch.inference_mode():
            assert not worker.step()
        assert inbox.poll(20_000)
        stop, _ = transport.recv(inbox)
        out.close(linger=0)
        assert isinstance(stop, Error) and stop.window == 4 and "stage 1 stops" in stop.message
        (first, first_logits), (error, _), (again, again_logits) = answers
        assert isinstance(first, Result) and isinstance(again, Result), answers
        assert np.array_equal(again_logits[0], first_logits[0]), \
            "the window after the bad header computed from other activations"
        assert again.tokens == first.tokens
        assert isinstance(error, Error) and error.window == 2 and "top_k" in error.message, error
        assert rank0.wait(20) == 0
    finally:
        if worker is not None:
            worker.close()
        if rank0.poll() is None:
            rank0.kill()
        rank0.wait()
        inbox.close(linger=0)
        ctx.term()
        shutil.rmtree(run, ignore_errors=True)


# --- an Error about no window, and a window a stage cannot decode, under the scheduler -------

PROMPT = [72, 101, 108, 108, 111, 44]


def _scheduler(run) -> Scheduler:
    return Scheduler(run.pipe, SchedulerConfig(slots=2, groups=1, ctx=256, chunk_rows=32,
                                               window_rows=8), frozenset())


def _finish(sched: Scheduler) -> None:
    """Run the scheduler until it has nothing to do; a window lost for ever fails the test."""
    while sched.step(timeout=20):
        pass


def test_a_window_a_stage_cannot_decode_ends_its_request_only(_tiny_stages):
    """A coordinator of one's own submits a prompt of floats: the window carrying it reaches
    stage 0, which cannot decode it. Its Error names the window, so the scheduler ends that
    request (and counts its group's window as landed) while the other one goes on to give
    the tokens it gives alone, instead of waiting for ever on a window nobody computes."""
    _, run = _tiny_stages
    greedy = SamplingParams(max_tokens=6)
    sched = _scheduler(run)
    alone = sched.submit(PROMPT, greedy)
    _finish(sched)
    sched = _scheduler(run)
    floats = sched.submit([float(t) for t in PROMPT[::-1]], greedy)
    other = sched.submit(PROMPT, greedy)
    _finish(sched)
    assert floats.seq.finish_reason == "error" and "tokens" in floats.error, floats.error
    assert other.seq.finish_reason == alone.seq.finish_reason
    assert other.seq.generated == alone.seq.generated and len(alone.seq.generated) == 6
    assert sched.idle and not any(g.flights for g in sched.groups)


def test_an_error_about_no_window_changes_no_group(_tiny_stages, caplog):
    """Stage 0 answers a message it cannot read with an Error about window -1 while the
    scheduler's windows are in flight: the scheduler logs it, counts no window as landed or
    failed, and its request ends with the tokens it gives alone."""
    _, run = _tiny_stages
    greedy = SamplingParams(max_tokens=6)
    sched = _scheduler(run)
    alone = sched.submit(PROMPT, greedy)
    _finish(sched)
    sched = _scheduler(run)
    req = sched.submit(PROMPT, greedy)
    assert sched.step(timeout=20)   # the prompt's chunk
    run.pipe.to_first.send_multipart([b"\xc1 not a message"])
    assert run.pipe.inbox.poll(20_000)   # stage 0's Error is there before the next result
    with caplog.at_level(logging.ERROR, logger="strata.scheduler"):
        assert sched.step(timeout=20)    # the first decode window goes; the Error comes
    assert any("no window in flight" in r.getMessage() for r in caplog.records), caplog.text
    assert [g.flights for g in sched.groups] == [1] and len(sched.in_flight) == 1
    _finish(sched)
    assert req.seq.generated == alone.seq.generated and req.seq.finish_reason != "error"
    assert sched.idle and not any(g.flights for g in sched.groups)


@pytest.mark.parametrize("kind", [[1], {"a": 1}, None, 3.5, "Bogus"])
def test_a_header_of_any_type_field_is_refused_as_malformed(kind):
    """What unpack reads of a failed header must not fail itself (a 'type' that is a list or
    a map cannot be looked up in a dict): it is a ProtocolError about no window."""
    with pytest.raises(ProtocolError) as info:
        transport.unpack([msgpack.packb({"type": kind, "id": 3, "slots": [0]})])
    assert (info.value.window, info.value.rows) == (-1, None)
