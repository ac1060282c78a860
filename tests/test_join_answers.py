"""The parts of a join, in-process: the launch's answers to joining stages (StageJoins), the
join sockets (JoinDesk, ask), and strata-worker's own mistakes with --join. test_join.py runs
the processes."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from strata.launch.joins import StageJoins
from strata.launch.plan import StagePlan
from strata.launch.processes import StageProcesses
from strata.protocol import transport
from strata.protocol.join import JoinDesk, ask
from strata.protocol.messages import (PROTOCOL_VERSION, Heartbeat, JoinAsk, JoinConfirm,
                                      JoinModel, JoinPlan, JoinRefused, JoinWait)


# --- the launch's answers ----------------------------------------------------------------------

@pytest.fixture
def three_stages(tiny_model):
    """The answers of a 3-stage launch whose stages 1 and 2 join; what it says is in .said."""
    plan = [StagePlan(0, 0, 1, "cpu"), StagePlan(1, 1, 3, "cpu"), StagePlan(2, 3, 4, "cpu")]
    procs = StageProcesses(tiny_model, plan, slots=2, ctx=64, external={1, 2},
                           listen_host="127.0.0.1")
    said: list[str] = []
    joins = StageJoins(procs, 0, "f1ngerpr1nt", say=said.append)
    joins.said = said
    yield joins
    joins.close()
    procs.remove_run_dir(keep_logs=False)


def _arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_a_stage_waits_for_its_next_stage_to_join_first(three_stages):
    joins = three_stages
    wait = joins.answer(JoinAsk(PROTOCOL_VERSION, 1))
    assert wait == JoinWait(1, "stage 2 joins first: stage 1 sends to it")
    assert joins.answer(JoinConfirm(1, "f1ngerpr1nt", "tcp://10.0.0.9:5001")) == wait
    assert joins.answer(JoinAsk(PROTOCOL_VERSION, 2)) == JoinModel(2, str(joins.procs.model),
                                                                    "f1ngerpr1nt")
    last = joins.answer(JoinConfirm(2, "f1ngerpr1nt", "tcp://10.0.0.8:5002"))
    assert isinstance(last, JoinPlan) and _arg(last.args, "--next") is None
    assert _arg(last.args, "--listen") == "tcp://10.0.0.8:5002"
    assert _arg(last.args, "--layers") == "3:4" and _arg(last.args, "--slots") == "2"
    assert not joins.all_joined.is_set()
    middle = joins.answer(JoinConfirm(1, "f1ngerpr1nt", "tcp://10.0.0.9:5001"))
    assert _arg(middle.args, "--next") == "tcp://10.0.0.8:5002"
    assert _arg(middle.args, "--coordinator") == joins.procs.endpoints.inbox
    assert joins.procs.endpoints.inbox.startswith("tcp://127.0.0.1:")
    assert joins.all_joined.is_set()
    # stage 0, which the launcher spawns, sends to the stage that joined
    assert _arg(joins.procs.command(0), "--next") == "tcp://10.0.0.9:5001"
    assert joins.said == ["stage 2 joined from tcp://10.0.0.8:5002",
                          "stage 1 joined from tcp://10.0.0.9:5001"]


@pytest.mark.parametrize("question, words", [
    (JoinAsk(PROTOCOL_VERSION + 1, 2), [f"this launch speaks protocol {PROTOCOL_VERSION}"]),
    (JoinAsk(PROTOCOL_VERSION, 3), ["this launch has stages 0..2", "join as stage 1 or 2"]),
    (JoinConfirm(2, "0ther", "tcp://10.0.0.8:5002"), ["fingerprint 0ther",
                                                     "this launch's f1ngerpr1nt"]),
    (JoinConfirm(2, "f1ngerpr1nt", "ipc:///tmp/x"), ["'ipc:///tmp/x' is not a tcp://HOST:PORT"]),
    (Heartbeat(1), ["a Heartbeat is no question a joining stage asks"]),
])
def test_a_join_that_cannot_be_placed_is_refused(three_stages, question, words):
    answer = three_stages.answer(question)
    assert isinstance(answer, JoinRefused), answer
    for w in words:
        assert w in answer.message, answer.message
    assert not three_stages.joined


def test_the_desk_answers_each_question_and_survives_a_malformed_one():
    desk = JoinDesk("tcp://127.0.0.1:0", lambda msg: JoinWait(msg.stage, "later"))
    try:
        assert ask(desk.endpoint, JoinAsk(PROTOCOL_VERSION, 4), 10) == JoinWait(4, "later")
        import zmq
        ctx = zmq.Context()
        sock = ctx.socket(zmq.REQ)
        sock.connect(desk.endpoint)
        sock.send(b"\xc1 not msgpack")
        assert sock.poll(10_000)
        answer, _ = transport.recv(sock)
        sock.close(linger=0)
        ctx.term()
        assert isinstance(answer, JoinRefused) and "could not read the question" in answer.message
        assert ask(desk.endpoint, JoinAsk(PROTOCOL_VERSION, 5), 10) == JoinWait(5, "later")
    finally:
        desk.close()


# --- strata-worker --join's own mistakes -------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["--stage", "1"], ["--model --layers --listen --coordinator missing", "--join"]),
    (["--stage", "1", "--join", "tcp://127.0.0.1:9", "--layers", "0:2", "--next", "x"],
     ["--layers --next: with --join the launch gives these"]),
])
def test_a_worker_mistake_gets_a_usage_sentence(args, words):
    from strata.stage_worker.main import main
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    for w in words:
        assert w in r.output, r.output


def test_a_worker_with_no_launch_to_join_gives_up():
    from strata.stage_worker.main import main
    desk = JoinDesk("tcp://127.0.0.1:0", lambda msg: msg)   # a free port, then nobody there
    desk.close()
    r = CliRunner().invoke(main, ["--stage", "1", "--join", desk.endpoint, "--join-timeout",
                                  "0.5"])
    assert r.exit_code == 2, r.output
    assert (f"strata-worker: stage 1: no launch answered at {desk.endpoint} within 0.5s; start "
            f"strata-launch --external-stage 1 --listen HOST:PORT") in r.output


def test_the_launch_says_what_it_waits_for_then_gives_up(three_stages, monkeypatch):
    import strata.launch.joins as joins_module
    from strata.coordinator.pipeline import PipelineError
    monkeypatch.setattr(joins_module, "NOTE_S", 0.5)
    joins = three_stages
    joins.answer(JoinAsk(PROTOCOL_VERSION, 2))
    joins.answer(JoinConfirm(2, "f1ngerpr1nt", "tcp://10.0.0.8:5002"))
    with pytest.raises(PipelineError) as failed:
        joins.wait(timeout=1.8)
    command = f"strata-worker --join {joins.endpoint} --stage 1 --model {joins.procs.model}"
    assert str(failed.value) == (f"no stage 1 joined at {joins.endpoint} within 1.8s; run "
                                 f"`{command}` on its host, or raise --join-timeout")
    assert joins.said[1:3] == [f"stage 1 is external: waiting for it to join at "
                               f"{joins.endpoint}; on its host run:\n  {command}",
                               f"stage 2 is external: waiting for it to join at "
                               f"{joins.endpoint}; on its host run:\n  "
                               f"{command.replace('--stage 1', '--stage 2')}"]
    reminders = [s for s in joins.said if s.startswith("still waiting")]
    assert reminders and all(s.startswith(f"still waiting for stage(s) [1] to join at "
                                          f"{joins.endpoint} (") and s.endswith(
                                              f"s); on its host run: {command}")
                             for s in reminders), joins.said
