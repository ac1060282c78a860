"""strata-launch --cluster ray: Ray places the stages, each a strata-worker that joins the launch.

On a local Ray cluster of three node processes on this machine (a head with no CPU, two nodes
of one CPU each; ray.cluster_utils.Cluster, one for the module): a 2-stage CPU launch (of
varied_model, whose greedy text changes with every token of its context) puts its stages on
the two nodes (Ray's node ids, and each worker a child of its
node's actor), answers a completion with the tokens of a plain launch, and leaves no worker
and no actor after it stops. In-process, the launch's watch over the placed stages names the
stage and its node when a worker exits (killed, or without the model file at the launch's
path), and a killed stage starts again on its node with its endpoint. The mistakes, where the
stages join and the arguments a node gets need no cluster.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from strata.coordinator.stages.pipeline import PipelineError
from strata.launch.joins import StageJoins
from strata.launch.plan import PlanError, StagePlan
from strata.launch.ray_cluster import bundle, import_ray, join_args, parse_cluster
from strata.protocol.join import free_ports
from test_join import address_beyond_loopback
from test_launch_errors import LAUNCH, assert_no_traceback, assert_one_sentence, launch

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed (pip install 'strata[ray]')")
START_S = 120.0   # Ray and two stages on a shared 2-core machine
PROMPT = ["--prompt", "The lighthouse keeper wrote", "--max-tokens", "12"]
SPLIT = ["--layer-split", "2", "--devices", "cpu", "--ctx-size", "64"]


@pytest.fixture(scope="module")
def ray_cluster():
    """(its address, {node id: its raylet's pid} of the two nodes that take stages)."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (pip install 'strata[ray]')")
    from ray.cluster_utils import Cluster

    small = dict(object_store_memory=80 << 20)
    cluster = Cluster(initialize_head=True,
                      head_node_args=dict(num_cpus=0, include_dashboard=False, **small))
    try:
        nodes = [cluster.add_node(num_cpus=1, **small) for _ in range(2)]
        cluster.wait_for_nodes(timeout=START_S)
        yield cluster.address, {n.node_id: n.all_processes["raylet"][0].process.pid
                                for n in nodes}
    finally:
        cluster.shutdown()


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def gone(pids, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(Path(f"/proc/{p}").exists() for p in pids)


class Serving:
    """strata-launch (serving, port 0) with its stderr read as it comes."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.lines: list[str] = []
        self.proc = subprocess.Popen([LAUNCH, *args, "--port", "0"], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **env})
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()

    def wait_for(self, pattern: str) -> re.Match:
        deadline = time.monotonic() + START_S
        while True:
            exited = self.proc.poll() is not None
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            assert not exited and time.monotonic() < deadline, \
                f"no {pattern!r} on stderr:\n{''.join(self.lines)}"
            time.sleep(0.05)

    def post(self, url: str, path: str, body: dict) -> dict:
        request = urllib.request.Request(url + path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=START_S) as r:
            return json.load(r)


@needs_ray
def test_stages_placed_on_two_nodes_give_the_tokens_of_a_plain_launch(ray_cluster, varied_model,
                                                                     no_stage_left):
    address, raylets = ray_cluster
    plain = launch(["--model", str(varied_model), *SPLIT, *PROMPT], None, timeout=START_S)
    assert plain.returncode == 0, plain.stderr
    run = Serving(["--model", str(varied_model), "--cluster", "ray", *SPLIT],
                  env={"RAY_ADDRESS": address})
    try:
        run.wait_for(r"the stages join at 127\.0\.0\.1 \(every Ray node is on this host")
        placed = {}   # worker pid -> its node id's prefix
        for k in (0, 1):
            m = run.wait_for(rf"stage {k}: placed by Ray on node (\w+) .*strata-worker pid (\d+)")
            placed[int(m.group(2))] = m.group(1)
        url = run.wait_for(rf"serving {varied_model.stem} on (http://\S+)/v1").group(1)
        nodes = {prefix: next(n for n in raylets if n.startswith(prefix))
                 for prefix in placed.values()}
        assert len(nodes) == 2, placed   # two nodes, both of those that have CPUs
        actors = {}
        for worker, prefix in placed.items():   # worker -> its actor -> its node's raylet
            actors[worker] = parent(worker)
            assert parent(actors[worker]) == raylets[nodes[prefix]], (worker, prefix)
        status = json.load(urllib.request.urlopen(url + "/v1/status", timeout=30))
        assert sorted(s["pid"] for s in status["stages"]) == sorted(placed)
        answer = run.post(url, "/v1/completions", {
            "model": varied_model.stem, "prompt": PROMPT[1], "max_tokens": 12,
            "temperature": 0})
        assert answer["choices"][0]["text"] == plain.stdout.removesuffix("\n")
        assert len(plain.stdout.strip()) > 6
        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(timeout=60) == 0, "".join(run.lines)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
    assert "every stage has exited" in "".join(run.lines)
    assert_no_traceback("".join(run.lines))
    assert gone([*placed, *actors.values()]), "a stage worker or its actor is left"


@pytest.fixture
def on_cluster(ray_cluster, monkeypatch):
    """connect(plan, model) -> the stages of a launch on the cluster, not placed yet; each
    is stopped afterwards (their workers and actors must be gone)."""
    from strata.launch.ray_cluster import RayCluster

    monkeypatch.setenv("RAY_ADDRESS", ray_cluster[0])
    made = []

    def connect(plan: list[StagePlan], model: Path):
        procs = RayCluster.connect(None, say=lambda text: None).processes(
            model, plan, slots=1, ctx=64, external={p.index for p in plan},
            listen_host="127.0.0.1")
        made.append(procs)
        return procs

    yield connect
    for procs in made:
        pids = [w["pid"] for w in procs.where]
        procs.stop(grace=0.3)
        procs.remove_run_dir(keep_logs=False)
        assert gone(pids), "a stage worker is left"


@needs_ray
def test_a_killed_placed_stage_is_named_with_its_node(on_cluster, ray_cluster, tiny_model):
    procs = on_cluster([StagePlan(0, 0, 4, "cpu")], tiny_model)
    nobody = f"tcp://127.0.0.1:{free_ports('127.0.0.1')[0]}"   # it waits to join there
    said = []
    procs.place(nobody, say=said.append)
    procs.check_alive()   # running
    where = procs.where[0]
    assert where["node_id"] in ray_cluster[1]
    assert said == [f"stage 0: placed by Ray on node {where['node_id'][:8]} ({where['address']}"
                    f", {where['host']}), strata-worker pid {where['pid']}"]
    os.kill(where["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    with pytest.raises(PipelineError) as e:
        while time.monotonic() < deadline:
            procs.check_alive()
            time.sleep(0.1)
    assert str(e.value).startswith(f"stage 0 on node {where['node_id'][:8]} ("
                                   f"{where['address']}, {where['host']}) exited, killed by "
                                   f"SIGKILL; last lines of its log there ({where['log']}):")


@needs_ray
def test_a_node_without_the_model_file_is_told_at_the_join(on_cluster, tmp_path):
    """The launch's model path is where every placed stage opens it: a stage that finds no
    file there exits before it joins, and the launch's wait names the stage, the node and the
    file, with the worker's own sentence quoted from its log."""
    elsewhere = tmp_path / "on-the-launch-host-only.gguf"
    procs = on_cluster([StagePlan(0, 0, 4, "cpu")], elsewhere)
    joins = StageJoins(procs, 0, "f1ngerpr1nt", say=lambda text: None)
    try:
        procs.place(joins.endpoint, say=lambda text: None)
        with pytest.raises(PipelineError) as e:
            joins.wait(START_S, check=procs.check_alive, by_hand=False)
    finally:
        joins.close()
    node = procs.node(0)
    assert str(e.value).startswith(
        f"stage 0 on {node} exited with code 2 (before it joined: a stage placed by Ray "
        f"opens {elsewhere}, so every node needs that file at that path); last lines")
    assert f"model file {elsewhere} does not exist" in str(e.value)


@needs_ray
def test_a_restarted_stage_binds_its_endpoint_again_on_its_node(on_cluster, tiny_model):
    """The hook for restarting a placed stage: no second join, the endpoint its neighbour
    sends to, the same node, the log going on."""
    procs = on_cluster([StagePlan(0, 0, 2, "cpu"), StagePlan(1, 2, 4, "cpu")], tiny_model)
    from strata.model.gguf_file import ModelFile

    joins = StageJoins(procs, 0, ModelFile(tiny_model).fingerprint(), say=lambda text: None)
    try:
        procs.place(joins.endpoint, say=lambda text: None)
        joins.wait(START_S, check=procs.check_alive, by_hand=False)
    finally:
        joins.close()
    before, endpoint = procs.where[1], procs.endpoints.stages[1]
    assert endpoint.startswith("tcp://127.0.0.1:")
    os.kill(before["pid"], signal.SIGKILL)   # a stage that died, as a restart finds it
    assert gone([before["pid"]])
    procs.restart(1)
    after = procs.where[1]
    assert after["pid"] != before["pid"]
    assert after["node_id"] == before["node_id"] and after["log"] == before["log"]
    argv = Path(f"/proc/{after['pid']}/cmdline").read_bytes().decode().split("\0")
    assert "--join" not in argv and argv[argv.index("--listen") + 1] == endpoint
    deadline = time.monotonic() + START_S   # loaded again, its endpoint bound: it runs on
    while (log := procs.ray.get(procs.actors[1].log_tail.remote(lines=1000))).count(
            "INFO stage 1: layers [2, 4) on cpu") < 2:
        assert time.monotonic() < deadline, log
        procs.check_alive()
        time.sleep(0.2)
    time.sleep(0.5)
    procs.check_alive()


@needs_ray
def test_stages_joining_beyond_loopback_need_keys_or_insecure(ray_cluster, tiny_model,
                                                              no_stage_left):
    address = address_beyond_loopback()
    r = launch(["--model", str(tiny_model), "--layer-split", "2", "--devices", "cpu",
                "--prompt", "hi", "--cluster", "ray", "--listen", f"{address}:0"], None,
               env={"RAY_ADDRESS": ray_cluster[0]}, timeout=START_S)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"strata-launch: --listen {address} would take windows from any "
                           f"host that reaches it; give --keys DIR"), r.stderr
    assert "placed by Ray" not in r.stderr
    assert_no_traceback(r.stderr)


# --- without a cluster -------------------------------------------------------------------------

class FakeRay:
    """What RayCluster.join_host asks of Ray: this node's address and the live nodes'."""

    def __init__(self, mine: str, nodes: list[str]):
        self.util = type("util", (), {"get_node_ip_address": staticmethod(lambda: mine)})
        self._nodes = [{"NodeManagerAddress": n, "Alive": True} for n in nodes]
        self._nodes.append({"NodeManagerAddress": "10.9.9.9", "Alive": False})   # gone

    def nodes(self) -> list[dict]:
        return self._nodes


def test_the_stages_join_at_loopback_only_when_every_node_is_on_this_host():
    from strata.launch.ray_cluster import RayCluster

    one_host = RayCluster(FakeRay("10.0.0.5", ["10.0.0.5", "10.0.0.5"]), None)
    assert one_host.join_host()[0] == "127.0.0.1"
    assert RayCluster(FakeRay("10.0.0.5", ["10.0.0.5", "10.0.0.6"]), None).join_host() == (
        "10.0.0.5", "this host's address toward the Ray cluster")
    # through Ray client this host is no node: its address is the one on the route to the head
    client = RayCluster(FakeRay("not asked", ["10.0.0.6"]), "ray://127.0.0.1:10001")
    assert client.join_host() == ("127.0.0.1", "this host's address toward the Ray cluster")


@pytest.mark.parametrize("text", ["ray:", "ray://", "ray://host", "kubernetes", "ray://h:x"])
def test_a_cluster_that_is_not_ray_gets_a_sentence(text):
    with pytest.raises(PlanError, match=r"is not ray \(this host's Ray cluster\) or "
                                        r"ray://HOST:PORT"):
        parse_cluster(text)


def test_cluster_addresses():
    assert parse_cluster("ray") is None
    assert parse_cluster("ray://10.0.0.5:10001") == "ray://10.0.0.5:10001"


def test_without_ray_installed_the_sentence_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)   # import ray raises ImportError
    with pytest.raises(PlanError, match=r"run pip install 'strata\[ray\]', or leave --cluster "
                                        r"out$"):
        import_ray()


def test_a_stage_takes_a_gpu_of_its_own_or_a_cpu():
    assert bundle(StagePlan(0, 0, 2, "cuda:1")) == {"CPU": 1.0, "GPU": 1.0}
    assert bundle(StagePlan(1, 2, 4, "cpu")) == {"CPU": 1.0}
    for keys, insecure, security in ((None, False, []), (None, True, ["--insecure"]),
                                     (Path("/k"), False, ["--keys", "/k"])):
        # Ray makes a stage's one GPU the only one its process sees: cuda:0 there
        assert join_args(StagePlan(0, 0, 2, "cuda:1"), "tcp://h:1", keys, insecure) == [
            "--join", "tcp://h:1", "--stage", "0", "--device", "cuda:0", *security]
        assert join_args(StagePlan(1, 2, 4, "cpu"), "tcp://h:1", keys, insecure)[4:6] == [
            "--device", "cpu"]


@needs_ray
@pytest.mark.parametrize("how", ["client", "RAY_ADDRESS"])
def test_a_cluster_that_is_not_there_gets_one_sentence_at_once(how, tiny_model, no_stage_left):
    """Ray itself retries an address where nothing listens for minutes."""
    nowhere = f"127.0.0.1:{free_ports('127.0.0.1')[0]}"
    cluster, env = (f"ray://{nowhere}", {}) if how == "client" else ("ray", {"RAY_ADDRESS":
                                                                           nowhere})
    r = launch(["--model", str(tiny_model), "--layer-split", "2", "--devices", "cpu",
                "--prompt", "hi", "--cluster", cluster], None, env=env, timeout=30)
    assert r.returncode == 2, r.stderr
    where = cluster if how == "client" else nowhere
    assert_one_sentence(r.stderr, f"cannot reach the Ray cluster at {where} (connection "
                                  f"refused); check the address")


def test_cluster_with_an_external_stage_gets_one_sentence(tiny_model, no_stage_left):
    r = launch(["--model", str(tiny_model), "--layer-split", "2", "--devices", "cpu",
                "--prompt", "hi", "--cluster", "ray", "--external-stage", "1"], None, timeout=60)
    assert r.returncode == 2, r.stderr
    assert_one_sentence(r.stderr, "--cluster places every stage", "leave --external-stage out")
