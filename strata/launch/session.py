"""One launch: the model file, the stage processes and the coordinator's pipeline, started
together and torn down together on any failure (a context manager)."""
from __future__ import annotations

import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from strata.coordinator.stages.pipeline import Expect, Pipeline
from strata.launch.joins import StageJoins
from strata.launch.plan import StagePlan
from strata.launch.processes import StageProcesses
from strata.model.gguf_file import ModelFile
from strata.protocol.keys import COORDINATOR, CurveKeys


@dataclass
class Launched:
    file: ModelFile
    pipe: Pipeline
    procs: StageProcesses
    plan: list[StagePlan]
    slots: int
    ctx: int


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def launch_stages(file: ModelFile, plan: list[StagePlan], *, slots: int = 1, ctx: int = 2048,
                  log_dir: Path | None = None, external: set[int] = frozenset(),
                  hello_timeout: float = 300.0, graph_cache: int | None = None,
                  link: str | None = None, trace_dir: Path | None = None,
                  transport: str = "unix", mtp_head: Path | None = None,
                  stage_timeout: float | None = None, keys: Path | None = None,
                  insecure: bool = False, listen: tuple[str, int] | None = None,
                  join_timeout: float | None = None, cluster=None,
                  weights: str | None = None, activations: str = "float",
                  say=print) -> Iterator[Launched]:
    """Spawn the stages, wait for every hello, yield; always shut everything down after.
    log_dir: where each stage writes stage<K>.log; without it the logs live in the run directory,
    which is removed after a clean run and kept (its path on stderr) after a failure.
    trace_dir: every process writes its timeline there (strata/trace.py) when it stops.
    transport: unix (Unix sockets, protocol/unixsock.py) or zmq (ZeroMQ ipc) between them.
    mtp_head: a sidecar NextN head the last stage loads for its drafter.
    stage_timeout: seconds after which a stage that does not answer is taken for hung
    (coordinator/stages/liveness.py; None: its default).
    keys: a keys directory (strata-keys) for CURVE on the ZeroMQ sockets (transport zmq, or
    listen); insecure: without keys, the tcp endpoints of a listen launch may be bound beyond
    loopback.
    listen: (this host's address, port): the external stages join from other hosts there
    (joins.py), within join_timeout seconds (None: no limit); every endpoint is then tcp.
    cluster: a ray_cluster.RayCluster that places every stage (all external, with listen).
    weights: --weights of the CUDA stages (quantized or bf16; None: the worker's default);
    activations: their --activations (float or int8)."""
    coordinator_keys = CurveKeys.load(keys, COORDINATOR) if keys else None
    processes = StageProcesses if cluster is None else cluster.processes
    procs = processes(file.path, plan, slots=slots, ctx=ctx, log_dir=log_dir,
                      external=external, graph_cache=graph_cache, link=link,
                      trace_dir=trace_dir, transport=transport, mtp_head=mtp_head,
                      keys=keys, insecure=insecure, listen_host=listen and listen[0],
                      weights=weights, activations=activations)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    pipe = joins = None
    outcome = "failed"
    def open_pipeline() -> Pipeline:
        return Pipeline(procs.endpoints.inbox, procs.endpoints.stages[0], procs.check_alive,
                        trace=trace_dir and Path(trace_dir) / "coordinator.json",
                        stage_timeout=stage_timeout, keys=coordinator_keys,
                        insecure=insecure)

    try:
        fingerprint = file.fingerprint()
        if listen is not None:   # the local stages' --next (and stage 0's endpoint) wait for these
            joins = StageJoins(procs, listen[1], fingerprint, keys=coordinator_keys, say=say)
            if 0 not in external:
                # the inbox is bound while the others join: a joined stage that has connected
                # to it sees the launcher go, should it go before they all have
                pipe = open_pipeline()
            if cluster is not None:   # each stage joins from the node Ray places it on
                procs.place(joins.endpoint, timeout=join_timeout, say=say)
            joins.wait(join_timeout, check=procs.check_alive, by_hand=cluster is None)
        if pipe is None:
            pipe = open_pipeline()
        procs.start(say=say)
        expected = [Expect(p.index, p.layer_start, p.layer_end, fingerprint, slots, ctx)
                    for p in plan]
        last_note = [time.monotonic()]

        def note(waited: float) -> None:
            if external and joins is None and time.monotonic() - last_note[0] > 30:
                say(f"still waiting for stage(s) {sorted(external)} to join ({waited:.0f}s)")
                last_note[0] = time.monotonic()

        # a stage started by hand takes its time; one that joined has started
        pipe.wait_for_hellos(expected, timeout=None if external and joins is None
                             else hello_timeout, on_wait=note)
        yield Launched(file, pipe, procs, plan, slots, ctx)
        outcome = "done"
    except KeyboardInterrupt:  # Ctrl-C (which the stages get too) or SIGTERM: not a failure
        outcome = "interrupted"
        raise
    finally:
        if pipe is not None:
            pipe.shutdown()
        stopped_cleanly = procs.stop()
        if pipe is not None:
            pipe.close()
        if joins is not None:
            joins.close()
        signal.signal(signal.SIGTERM, previous)
        failed = outcome == "failed" or (outcome == "done" and not stopped_cleanly)
        kept = procs.remove_run_dir(keep_logs=failed)
        if kept is not None:
            print(f"strata: the stage logs are kept in {kept}", file=sys.stderr)
