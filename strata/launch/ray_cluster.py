"""strata-launch --cluster ray[://ADDRESS]: Ray places the stage workers, strata runs them.

Every stage of such a launch is an external stage that joins (joins.py): the launch waits at
its join desk, and for each stage Ray starts an actor (ray_stage.StageHost) with the stage's
resources, one bundle of a SPREAD placement group (a GPU per CUDA stage, else a CPU), which
runs `strata-worker --join tcp://LAUNCH:PORT --stage K` as a subprocess on its node. The
stages then talk over strata's own protocol, as joined stages do; the coordinator runs where
the launch runs. Ray only places, starts and stops them.

`--cluster ray` connects to the cluster RAY_ADDRESS names, else to one started on this host
(`ray start --head`), else starts a local one for the launch and stops it at its end;
`--cluster ray://HOST:PORT` connects through Ray client (`ray start --head` serves it on port
10001). Every node needs strata installed and every file the launch names (the model,
--mtp-head, --keys) at the same path as on the launch's host.
"""
from __future__ import annotations

import logging
import os
import socket
import textwrap
import time
from dataclasses import replace
from pathlib import Path

from strata.coordinator.stages.pipeline import PipelineError
from strata.launch.joins import NOTE_S, parse_listen
from strata.launch.options import Prepared, prepare
from strata.launch.plan import PlanError, StagePlan, resolve_link
from strata.launch.processes import StageProcesses, _signal_name
from strata.launch.ray_stage import StageHost
from strata.protocol.join import address_toward, free_ports, parse_tcp

INSTALL = "pip install 'strata[ray]'"
REACH_S = 5.0   # how long a cluster's address has to take a TCP connection
STOP_S = 20.0   # beyond a stage's grace: how long the launch waits for a node to answer
# the coordinator checks the stages between windows, and asking Ray costs ~0.1 ms: at most
# this often (a stage that dies is also seen by its closed socket and its heartbeats)
CHECK_S = 0.1


def parse_cluster(text: str) -> str | None:
    """--cluster ray -> None (the cluster of this host, see connect); ray://HOST:PORT -> it."""
    if text == "ray":
        return None
    try:
        if text.startswith("ray://") and parse_tcp("tcp://" + text[len("ray://"):]):
            return text
    except ValueError:
        pass
    raise PlanError(f"--cluster {text!r} is not ray (this host's Ray cluster) or "
                    f"ray://HOST:PORT (a Ray client address, e.g. ray://10.0.0.5:10001)")


def import_ray():
    try:
        import ray
    except ImportError:
        raise PlanError(f"--cluster ray needs Ray, which is not installed; run {INSTALL}, "
                        f"or leave --cluster out") from None
    return ray


class RayCluster:
    """The launch's connection to a Ray cluster (made by connect); close() ends it, and stops
    the local cluster it started, if it did."""

    def __init__(self, ray, address: str | None):
        self.ray, self.address = ray, address

    @classmethod
    def connect(cls, address: str | None, say=print) -> "RayCluster":
        """address: ray://HOST:PORT, or None: RAY_ADDRESS's cluster, else this host's, else a
        local one started here. Says on stderr which. Ray's own exit hook disconnects (and stops
        a local cluster) should the launch end before close()."""
        ray = import_ray()
        quiet = dict(logging_level=logging.WARNING, log_to_driver=False)
        where = address or os.environ.get("RAY_ADDRESS") or "auto"
        if where.startswith("ray://"):   # RAY_ADDRESS may name a Ray client address too
            address = where
        _check_reachable(where)
        try:
            if address is not None:
                ray.init(address=address, logging_level=logging.WARNING)
            else:
                try:
                    ray.init(address="auto", **quiet)
                except ConnectionError:
                    if where != "auto":
                        raise
                    ray.init(include_dashboard=False, **quiet)
                    say("strata: no Ray cluster runs on this host; started a local one for "
                        "this launch (stopped at its end)")
                    return cls(ray, None)
        except ImportError as e:   # Ray client wants grpcio: ray[client]
            raise PlanError(f"--cluster {address} needs Ray client ({e}); run {INSTALL}") \
                from None
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise PlanError(f"cannot reach the Ray cluster at {where} ({_first_line(e)}); "
                            f"check the address (ray status on its head node shows it)") \
                from None
        resources = ray.cluster_resources()
        say(f"strata: on the Ray cluster at {where} ({len(alive_nodes(ray))} nodes, "
            f"{resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs)")
        return cls(ray, address)

    @property
    def gpus(self) -> int:
        return int(self.ray.cluster_resources().get("GPU", 0))

    def join_host(self) -> tuple[str, str]:
        """(the address the stages join at, why): loopback when every node is on this host,
        else this host's address toward the cluster."""
        if self.address is not None:   # Ray client: this host is no node of the cluster
            host, port = parse_tcp("tcp://" + self.address[len("ray://"):])
            mine = address_toward(host, port)
        else:
            mine = self.ray.util.get_node_ip_address()
        nodes = {n["NodeManagerAddress"] for n in alive_nodes(self.ray)}
        if nodes <= {mine}:
            return "127.0.0.1", "every Ray node is on this host"
        return mine, "this host's address toward the Ray cluster"

    def processes(self, *args, **kwargs) -> "RayStageProcesses":
        return RayStageProcesses(self, *args, **kwargs)

    def close(self) -> None:
        self.ray.shutdown()


def _check_reachable(where: str) -> None:
    """PlanError when nothing takes a TCP connection at a HOST:PORT or ray://HOST:PORT
    address (Ray itself retries a cluster that is not there for minutes)."""
    try:
        host, port = parse_tcp("tcp://" + where.removeprefix("ray://"))
    except ValueError:
        return   # auto, or a form Ray reads itself
    try:
        socket.create_connection((host, port), timeout=REACH_S).close()
    except OSError as e:
        raise PlanError(f"cannot reach the Ray cluster at {where} ({e.strerror or e}); check "
                        f"the address (ray status on its head node shows it)") from None


def alive_nodes(ray) -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def prepare_on_cluster(cluster: str, listen: str | None, join_timeout: float | None,
                       launch: dict, say=print) -> tuple[Prepared, dict]:
    """--cluster: connect, plan the stages with the cluster's GPUs (every one external, joining
    from the node Ray places it on), and choose where they join. Returns the prepared launch
    and the keyword arguments of its prep.launch."""
    resolve_link(launch["stage_link"], [], across_hosts=True)   # before Ray starts
    address = parse_cluster(cluster)
    listen = parse_listen(listen) if listen is not None else None
    cluster_ = RayCluster.connect(address, say=say)
    try:
        if cluster_.gpus == 0 and "cuda" in launch["devices"]:
            raise PlanError(f"--devices {launch['devices']}: the Ray cluster has no GPU; use "
                            f"--devices cpu, or add GPU nodes to the cluster")
        # a node's memory is the node's to check: a stage that does not fit says so in its log
        prep = prepare(**launch, cuda_devices=cluster_.gpus, check_memory=False)
        prep = replace(prep, link=resolve_link(launch["stage_link"], prep.plan,
                                               across_hosts=True))
        if listen is None:
            host, why = cluster_.join_host()
            free_ports(host)   # an address of this host
            listen = (host, 0)
            say(f"strata: the stages join at {host} ({why}; --listen HOST:PORT sets it)")
    except BaseException:
        cluster_.close()
        raise
    return prep, dict(external=set(range(len(prep.plan))), listen=listen,
                      join_timeout=join_timeout, cluster=cluster_)


def bundle(p: StagePlan) -> dict[str, float]:
    """A stage's resources in the placement group: a CUDA stage a GPU of its own."""
    return {"CPU": 1.0, "GPU": 1.0} if p.device.startswith("cuda") else {"CPU": 1.0}


def node_device(p: StagePlan) -> str:
    """A stage's device on its node: Ray gives a CUDA stage one GPU, the only one its process
    sees, cuda:0 there."""
    return "cuda:0" if p.device.startswith("cuda") else "cpu"


def join_args(p: StagePlan, endpoint: str, keys: Path | None, insecure: bool) -> list[str]:
    """strata-worker's arguments on the node, to join (its keys directory at the launch's
    path)."""
    args = ["--join", endpoint, "--stage", str(p.index), "--device", node_device(p)]
    if keys is not None:
        args += ["--keys", str(keys)]
    elif insecure:
        args += ["--insecure"]
    return args


def node_args(args: list[str], p: StagePlan) -> list[str]:
    """A stage's strata-worker arguments as the launch would spawn it, with its device on the
    node."""
    args = list(args)
    args[args.index("--device") + 1] = node_device(p)
    return args


class RayStageProcesses(StageProcesses):
    """The stages of a --cluster launch: every one external, joined from the node Ray placed it
    on (place), watched (check_alive) and stopped (stop) through its actor. The stages' logs
    come back to the launch's log directory when they stop."""

    def __init__(self, cluster: RayCluster, *args, **kwargs):
        super().__init__(*args, **kwargs)
        assert self.listen_host is not None and self.external == set(range(len(self.plan)))
        self.cluster, self.ray = cluster, cluster.ray
        self.group = None   # the placement group
        self.actors: list = []
        self.ends: list = []   # per stage: its actor's wait() call, done when the worker exits
        self.where: list[dict] = []   # per stage: StageHost.start's answer
        self.checked = 0.0   # when check_alive last asked Ray (time.monotonic())

    def node(self, stage: int) -> str:
        w = self.where[stage]
        return f"node {w['node_id'][:8]} ({w['address']}, {w['host']})"

    def place(self, endpoint: str, timeout: float | None = None, say=print) -> None:
        """Have Ray place every stage and start its strata-worker, joining at `endpoint`;
        PipelineError when the cluster cannot hold them (within `timeout` s, None: no limit)."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundles = [bundle(p) for p in self.plan]
        self._check_room(bundles)
        # SPREAD: stages on different nodes where there are enough, packed where there are not
        self.group = placement_group(bundles, strategy="SPREAD")
        self._wait_ready(timeout, say)
        host = self.ray.remote(StageHost)
        for k, b in enumerate(bundles):
            self.actors.append(host.options(
                num_cpus=b["CPU"], num_gpus=b.get("GPU", 0), max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=k)).remote())
        env = {"OMP_WAIT_POLICY": self.env["OMP_WAIT_POLICY"]}
        starts = [a.start.remote(join_args(p, endpoint, self.keys, self.insecure), env)
                  for a, p in zip(self.actors, self.plan)]
        for p, start in zip(self.plan, starts):
            try:
                self.where.append(self.ray.get(start))
            except self.ray.exceptions.RayError as e:
                raise PipelineError(f"Ray could not start stage {p.index} on its node "
                                    f"({_first_line(e)}); every node needs strata installed, "
                                    f"the launch's version") from None
        self.ends = [a.wait.remote() for a in self.actors]
        for p in self.plan:
            say(f"stage {p.index}: placed by Ray on {self.node(p.index)}, strata-worker pid "
                f"{self.where[p.index]['pid']}")

    def restart(self, stage: int, grace: float = 0.0) -> None:
        """Stop `stage`'s worker if it runs (after `grace` seconds, terminate, then kill), and
        start it again through the same actor, so on the same node, with the arguments its join
        gave it: the same endpoint, where its neighbour's --next points, and no second join."""
        assert self.endpoints.stages[stage], "a stage restarts once it has joined"
        actor = self.actors[stage]
        self.ray.get(actor.stop.remote(grace), timeout=grace + STOP_S)
        args = node_args(self.command(stage)[1:], self.plan[stage])
        env = {"OMP_WAIT_POLICY": self.env["OMP_WAIT_POLICY"]}
        self.where[stage] = self.ray.get(actor.start.remote(args, env), timeout=STOP_S)
        self.ends[stage] = actor.wait.remote()

    def _check_room(self, bundles: list[dict]) -> None:
        total = self.ray.cluster_resources()
        for kind in ("GPU", "CPU"):
            need = sum(b.get(kind, 0) for b in bundles)
            if need > total.get(kind, 0):
                raise PlanError(f"{len(bundles)} stages need {need:g} {kind}s of the Ray "
                                f"cluster and it has {total.get(kind, 0):g}; add nodes, or "
                                f"use fewer stages (--layer-split)")

    def _wait_ready(self, timeout: float | None, say) -> None:
        start = time.monotonic()
        ready = self.group.ready()
        while not self.ray.wait([ready], timeout=NOTE_S)[0]:
            waited = time.monotonic() - start
            if timeout is not None and waited > timeout:
                raise PipelineError(f"the Ray cluster did not place the {len(self.plan)} "
                                    f"stages within {timeout:g}s (free now: "
                                    f"{self.ray.available_resources()}); free its resources, "
                                    f"or raise --join-timeout")
            say(f"still waiting for the Ray cluster to place the stages ({waited:.0f}s; "
                f"free now: {self.ray.available_resources()})")

    def check_alive(self) -> None:
        """Raise PipelineError naming the first stage whose worker has exited (or whose actor
        is gone with its node), and the node."""
        if not self.ends or time.monotonic() - self.checked < CHECK_S:
            return
        self.checked = time.monotonic()
        done, _ = self.ray.wait(self.ends, num_returns=len(self.ends), timeout=0)
        for k, end in enumerate(self.ends):
            if end not in done:
                continue
            try:
                code = self.ray.get(end)
            except self.ray.exceptions.RayError as e:
                raise PipelineError(f"stage {k}'s Ray actor on {self.node(k)} has gone "
                                    f"({_first_line(e)}); its strata-worker went with it")
            try:
                tail = self.ray.get(self.actors[k].log_tail.remote(), timeout=10)
            except self.ray.exceptions.RayError:
                tail = "(no log)"
            how = f", killed by {_signal_name(-code)}" if code < 0 else f" with code {code}"
            # 2: strata-worker's own sentence; before the join, most likely about the file
            hint = ("" if code != 2 or self.endpoints.stages[k] else
                    f" (before it joined: a stage placed by Ray opens {self.model}, so every "
                    f"node needs that file at that path)")
            raise PipelineError(f"stage {k} on {self.node(k)} exited{how}{hint}; last lines "
                                f"of its log there ({self.where[k]['log']}):\n"
                                f"{textwrap.indent(tail, '  | ')}")

    def stop(self, grace: float = 5.0) -> bool:
        """Stop every worker (the Shutdown sent, then terminate, then kill, on its node), bring
        its log here, end every actor and the placement group, disconnect. False when a stage
        exited by itself with an error code."""
        ray = self.ray
        clean = True
        try:
            stops = [a.stop.remote(grace) for a in self.actors]
            for k, stop in enumerate(stops):
                try:
                    code, forced = ray.get(stop, timeout=grace + STOP_S)
                    clean &= forced or code == 0
                    self.log_path(k).write_text(
                        ray.get(self.actors[k].take_log.remote(), timeout=STOP_S))
                except ray.exceptions.RayError:
                    clean = False   # its node or actor has gone: so has its worker
        finally:
            try:
                for actor in self.actors:
                    ray.kill(actor)
                if self.group is not None:
                    from ray.util.placement_group import remove_placement_group
                    remove_placement_group(self.group)
            finally:   # should the cluster not answer: Ray ends a driver's actors and
                self.cluster.close()   # placement groups when it disconnects
        return clean

    @property
    def started(self) -> bool:
        """Whether a stage was placed (its log came back to the run directory in stop)."""
        return bool(self.where)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
