"""The parts of a join, in-process: the launch's answers to joining stages (StageJoins), the
join sockets (JoinDesk, ask) with keys and without, and strata-worker's own mistakes with
--join. test_join.py runs the processes."""
from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from strata.launch.joins import StageJoins
from strata.launch.plan import StagePlan
from strata.launch.processes import StageProcesses
from strata.protocol import transport
from strata.protocol.join import JoinDesk, JoinHandshakeError, ask
from strata.protocol.keys import COORDINATOR, CurveKeys, make_keys
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


def test_every_stage_meets_at_the_rendezvous_the_launcher_hosts(tiny_model):
    """--stage-link gloo with stages 0 and 1 joining and stage 2 spawned: the launcher hosts
    the link's TCPStore on its --listen address, and on no other (a TCPStore binds every
    interface unless handed a socket), and every stage is given it as --link-init, the joined
    ones in their JoinPlan; without a link, no store and no --link."""
    plan = [StagePlan(0, 0, 1, "cpu"), StagePlan(1, 1, 3, "cpu"), StagePlan(2, 3, 4, "cpu")]
    inits = {}
    for link in ("gloo", "zmq"):
        procs = StageProcesses(tiny_model, plan, slots=2, ctx=64, external={0, 1},
                               listen_host="127.0.0.1", link=link)
        joins = StageJoins(procs, 0, "f1ngerpr1nt", say=lambda text: None)
        try:
            args = {k: joins.answer(JoinConfirm(k, "f1ngerpr1nt",
                                                f"tcp://127.0.0.1:{7600 + k}")).args
                    for k in (1, 0)}
            args[2] = procs.command(2)
            inits[link] = {k: (_arg(a, "--link"), _arg(a, "--link-init"), _arg(a, "--link-world"))
                           for k, a in args.items()}
            if link == "gloo":
                port = joins.store.port
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection(("127.0.0.2", port), timeout=5)
            else:
                assert joins.store is None
        finally:
            joins.close()
            procs.remove_run_dir(keep_logs=False)
    assert inits["gloo"] == {k: ("gloo", f"tcp://127.0.0.1:{port}", "3") for k in (0, 1, 2)}
    assert inits["zmq"] == {k: (None, None, None) for k in (0, 1, 2)}


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
    (JoinConfirm(2, "f1ngerpr1nt", "tcp://0.0.0.0:5002"), ["does not say where the other "
                                                            "stages reach it"]),
    (JoinConfirm(2, "f1ngerpr1nt", "tcp://*:5002"), ["give --listen tcp://ADDRESS:PORT"]),
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


def test_a_launch_host_that_does_not_resolve_gets_a_sentence():
    from strata.stage_worker.main import main
    r = CliRunner().invoke(main, ["--stage", "1", "--join", "tcp://nosuchhost.invalid:7600",
                                  "--insecure", "--join-timeout", "2"])
    assert r.exit_code == 2, r.output
    assert ("strata-worker: stage 1: cannot reach the launch at tcp://nosuchhost.invalid:7600"
            in r.output), r.output
    assert "check its host and port" in r.output and isinstance(r.exception, SystemExit)


def test_the_launch_says_what_it_waits_for_then_gives_up(three_stages, monkeypatch):
    import strata.launch.joins as joins_module
    from strata.coordinator.stages.pipeline import PipelineError
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


# --- keys ----------------------------------------------------------------------------------------

@pytest.fixture
def hosts_keys(tmp_path) -> tuple[Path, Path]:
    """The keys directories of a launch's host (the coordinator's and stage 0's secrets) and of
    a joining stage 1's host (its own secret), each with every public key."""
    made = tmp_path / "made"
    make_keys(made, [COORDINATOR, "stage0", "stage1"])
    dirs = []
    for host, own in (("launch", [COORDINATOR, "stage0"]), ("stage1", ["stage1"])):
        d = tmp_path / host
        d.mkdir(mode=0o700)
        for f in made.iterdir():
            if f.suffix == ".key" or f.stem in own:
                shutil.copy2(f, d)
        dirs.append(d)
    return dirs[0], dirs[1]


def said_within(condition, seconds: float = 5.0) -> bool:
    """Whether condition() holds within `seconds` (the desk hears of a failed handshake in
    its own thread, after the stage has)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_keyed_desk_answers_only_a_stage_with_a_trusted_key(hosts_keys, tmp_path):
    launch_dir, stage_dir = hosts_keys
    refused = []
    desk = JoinDesk("tcp://127.0.0.1:0", lambda msg: JoinWait(msg.stage, "later"),
                    keys=CurveKeys.load(launch_dir, COORDINATOR),
                    on_refused=lambda: refused.append(1))
    try:
        stage1 = CurveKeys.load(stage_dir, "stage1")
        assert ask(desk.endpoint, JoinAsk(PROTOCOL_VERSION, 1), 10, stage1) == JoinWait(1, "later")
        assert not refused
        with pytest.raises(JoinHandshakeError):   # no keys
            ask(desk.endpoint, JoinAsk(PROTOCOL_VERSION, 1), 10)
        make_keys(tmp_path / "stranger", ["stage1"])   # a pair the launch never made
        shutil.copy(launch_dir / f"{COORDINATOR}.key", tmp_path / "stranger")
        with pytest.raises(JoinHandshakeError):
            ask(desk.endpoint, JoinAsk(PROTOCOL_VERSION, 1), 10,
                CurveKeys.load(tmp_path / "stranger", "stage1"))
        assert said_within(lambda: len(refused) >= 2)
    finally:
        desk.close()


def test_a_keyed_stage_gets_no_answer_from_a_desk_without_keys(hosts_keys):
    refused = []
    desk = JoinDesk("tcp://127.0.0.1:0", lambda msg: JoinWait(msg.stage, "later"),
                    on_refused=lambda: refused.append(1))
    try:
        with pytest.raises(JoinHandshakeError):
            ask(desk.endpoint, JoinAsk(PROTOCOL_VERSION, 1), 10,
                CurveKeys.load(hosts_keys[1], "stage1"))
        assert said_within(lambda: refused)
    finally:
        desk.close()


def test_the_launch_says_when_a_join_fails_its_handshake(tiny_model, hosts_keys):
    launch_dir = hosts_keys[0]
    procs = StageProcesses(tiny_model, [StagePlan(0, 0, 2, "cpu"), StagePlan(1, 2, 4, "cpu")],
                           slots=1, ctx=64, external={1}, keys=launch_dir,
                           listen_host="127.0.0.1")
    said: list[str] = []
    joins = StageJoins(procs, 0, "f1ngerpr1nt", keys=CurveKeys.load(launch_dir, COORDINATOR),
                       say=said.append)
    try:
        for _ in range(2):
            with pytest.raises(JoinHandshakeError):
                ask(joins.endpoint, JoinAsk(PROTOCOL_VERSION, 1), 10)
        assert said_within(lambda: joins.refused >= 2)
    finally:
        joins.close()
        procs.remove_run_dir(keep_logs=False)
    assert said == [f"strata-launch: refused a join whose CurveZMQ handshake failed; start the "
                    f"stage with --keys and a copy of {launch_dir} (its own secret, this "
                    f"launch's coordinator.key)"]   # once, however often it is tried
    assert not joins.joined


@pytest.mark.parametrize("security", ["keys", "insecure"])
def test_the_hand_over_carries_no_keys_of_the_launcher(tiny_model, hosts_keys, security):
    """The spawned stage 0 gets the launcher's --keys (or --insecure); the joining stage 1's
    arguments carry neither (it gives its own), and the command printed for it names them."""
    launch_dir = hosts_keys[0]
    plan = [StagePlan(0, 0, 2, "cpu"), StagePlan(1, 2, 4, "cpu")]
    keyed = security == "keys"
    procs = StageProcesses(tiny_model, plan, slots=1, ctx=64, external={1},
                           keys=launch_dir if keyed else None, insecure=not keyed,
                           listen_host="127.0.0.1")
    joins = StageJoins(procs, 0, "f1ngerpr1nt",
                       keys=CurveKeys.load(launch_dir, COORDINATOR) if keyed else None,
                       say=lambda text: None)
    try:
        assert joins.answer(JoinAsk(PROTOCOL_VERSION, 1)) == JoinModel(1, str(tiny_model),
                                                                        "f1ngerpr1nt")
        plan1 = joins.answer(JoinConfirm(1, "f1ngerpr1nt", "tcp://10.0.0.9:5001"))
        assert isinstance(plan1, JoinPlan)
        assert "--keys" not in plan1.args and "--insecure" not in plan1.args
        stage0 = procs.command(0)
        own = ["--keys", str(launch_dir)] if keyed else ["--insecure"]
        assert stage0[-len(own):] == own
        assert joins.command(1).endswith(" ".join(own))
    finally:
        joins.close()
        procs.remove_run_dir(keep_logs=False)


def test_a_worker_that_would_listen_openly_beyond_loopback_is_refused_before_it_asks():
    from strata.stage_worker.main import main
    r = CliRunner().invoke(main, ["--stage", "1", "--join", "tcp://127.0.0.1:9", "--listen",
                                  "tcp://10.0.0.9:5001"])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("strata-worker: stage 1: tcp://10.0.0.9:5001 would take windows "
                               "from any host that reaches it; give --keys DIR"), r.output
    assert "--insecure" in r.output and "no launch answered" not in r.output


@pytest.mark.parametrize("side", ["launch", "stage"])
def test_keys_on_one_side_of_a_join_get_a_sentence(hosts_keys, side):
    """A stage without keys joining a keyed launch, and a keyed stage joining a launch
    without: strata-worker says what to give instead of waiting out --join-timeout."""
    from strata.stage_worker.main import main
    launch_dir, stage_dir = hosts_keys
    desk = JoinDesk("tcp://127.0.0.1:0", lambda msg: JoinWait(msg.stage, "later"),
                    keys=CurveKeys.load(launch_dir, COORDINATOR) if side == "launch" else None)
    try:
        keys = ["--keys", str(stage_dir)] if side == "stage" else []
        r = CliRunner().invoke(main, ["--stage", "1", "--join", desk.endpoint, *keys])
    finally:
        desk.close()
    assert r.exit_code == 2, r.output
    said = r.output.strip().splitlines()
    assert len(said) == 1, r.output
    if side == "launch":
        assert said[0] == (f"strata-worker: stage 1: the handshake with {desk.endpoint} failed: "
                           f"the launch there wants CurveZMQ keys (give --keys with a copy of "
                           f"its keys directory), or what listens there is no strata launch "
                           f"(check the address)")
    else:
        assert said[0].startswith(f"strata-worker: stage 1: the CurveZMQ handshake with "
                                  f"{desk.endpoint} failed: give --keys with a copy")


def test_a_join_to_what_is_no_strata_launch_says_so():
    """Something else listens at the address (it greets and hangs up, as an ssh server does):
    the sentence names that possibility, not only missing keys."""
    import socket
    import threading
    from strata.stage_worker.main import main
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def greet():
        for _ in range(5):
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
            conn.close()
    threading.Thread(target=greet, daemon=True).start()
    try:
        r = CliRunner().invoke(main, ["--stage", "1", "--join", f"tcp://127.0.0.1:{port}",
                                      "--join-timeout", "5"])
    finally:
        server.close()
    assert r.exit_code == 2, r.output
    assert "is no strata launch (check the address)" in r.output, r.output
