"""Activations between neighbouring stages through torch.distributed, headers on ZeroMQ.

With a link, stage k sends its hidden states [R, D] straight to stage k+1 (NCCL: GPU to GPU
over NVLink, no host copy; gloo: between CPU processes, which is how the tests exercise this
path without a GPU), and the window header still travels on ZeroMQ, alone. The receiver reads
the row count from the header, so the tensor needs no description of its own.

Ordering: stage k posts the send before it forwards the header, and stage k+1 posts the
matching receive when the header comes, before it checks anything; both sides handle windows
in the order they arrive, so the n-th send always meets the n-th receive. A window stage k
refuses is neither sent nor forwarded. Every stage of a launch joins one process group
(rank = stage index); only neighbours exchange. The group meets through a file in the
launch's run directory (file://...), or, when stages join from other hosts, through the
launch's TCPStore (tcp://HOST:PORT, hosted by the launcher: joins.py). A stage that cannot
reach that store within RENDEZVOUS_S says so in a sentence naming it; gloo then binds the
stage's address toward the store's host (the one the other stages reach it at), not what
the host name resolves to (often a loopback address).

Sends are asynchronous: the hidden states are copied out of the graph's static buffer first (a
device copy), so the next window may overwrite that buffer while the send is still in flight.
On NCCL a receive only orders the current CUDA stream after the transfer (the host goes on);
on gloo it waits on the host.
"""
from __future__ import annotations

import logging
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from strata.protocol.join import address_toward, parse_tcp

log = logging.getLogger("strata.link")
BACKENDS = ("nccl", "gloo")
MAX_PENDING = 64  # sends kept until they complete (each holds its buffer alive)
RENDEZVOUS_S = 30.0   # how long a stage tries to reach a tcp:// rendezvous


class LinkError(ValueError):
    """The link cannot be set up; the message says what to change."""


class StageLink:
    def __init__(self, backend: str, init: str, stage: int, stages: int,
                 device: torch.device, timeout_s: float = 600.0,
                 connect_s: float = RENDEZVOUS_S):
        """init: file://PATH or tcp://HOST:PORT (a TCPStore someone else hosts); timeout_s
        bounds the wait for every stage and each transfer, connect_s the first reach of a
        tcp:// store."""
        if backend not in BACKENDS:
            raise ValueError(f"--link {backend!r} is not one of {', '.join(BACKENDS)} (or zmq)")
        if backend == "nccl" and device.type != "cuda":
            raise ValueError(f"--link nccl needs a CUDA device, not {device}; use --link gloo "
                             f"or zmq for CPU stages")
        if backend == "gloo" and device.type != "cpu":
            raise ValueError(f"--link gloo carries CPU tensors; use --link nccl for {device}")
        if not 0 <= stage < stages:
            raise ValueError(f"stage {stage} is outside a link of {stages} stages")
        self.backend, self.stage, self.stages, self.device = backend, stage, stages, device
        kwargs = {"device_id": device} if backend == "nccl" else {}
        timeout = timedelta(seconds=timeout_s)
        # group: None = torch.distributed's default group (dist.isend/irecv); a gloo link met
        # over tcp is a group of its own, bound to this stage's address
        self.group: dist.ProcessGroupGloo | None = None
        if init.startswith("tcp://"):
            self.group = meet_over_tcp(backend, init, stage, stages, timeout, connect_s,
                                       kwargs)
        else:
            dist.init_process_group(backend, init_method=init, rank=stage, world_size=stages,
                                    timeout=timeout, **kwargs)
        self.pending: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def warm_up(self, width: int, dtype: torch.dtype) -> None:
        """One exchange down the chain, so the pairs' communicators exist before any window
        (their creation takes a while and needs both sides)."""
        x = torch.zeros(1, width, dtype=dtype, device=self.device)
        if self.stage > 0:
            self.recv(1, width, dtype).wait()
        if self.stage + 1 < self.stages:
            self.send(x)
        self.flush()

    def send(self, hidden: torch.Tensor) -> None:
        """hidden: [R, D] on this stage's device, to the next stage (asynchronous)."""
        buf = hidden.detach().clone()
        work = (dist.isend(buf, self.stage + 1) if self.group is None else
                self.group.send([buf], self.stage + 1, 0))
        self.pending.append((work, buf))
        while self.pending and (len(self.pending) > MAX_PENDING
                                or self.pending[0][0].is_completed()):
            self.pending.popleft()[0].wait()

    def recv(self, rows: int, width: int, dtype: torch.dtype) -> "Receiving":
        """Post the receive of the previous stage's hidden states of a window of `rows` rows;
        `.wait()` on the result gives them."""
        buf = torch.empty(rows, width, dtype=dtype, device=self.device)
        work = (dist.irecv(buf, self.stage - 1) if self.group is None else
                self.group.recv([buf], self.stage - 1, 0))
        return Receiving(work, buf)

    def flush(self) -> None:
        while self.pending:
            self.pending.popleft()[0].wait()

    def close(self) -> None:
        try:
            self.flush()
            if self.group is None:
                dist.destroy_process_group()
        except Exception as e:  # a neighbour already gone: nothing left to deliver
            log.warning("stage %d: closing the link: %s", self.stage, e)


def meet_over_tcp(backend: str, init: str, stage: int, stages: int, timeout: timedelta,
                  connect_s: float, kwargs: dict) -> dist.ProcessGroupGloo | None:
    """Join the link's group at the TCPStore init names (tcp://HOST:PORT): gloo as a group of
    its own, bound to this stage's address toward the store (returned); nccl as the default
    group (None), on the interfaces NCCL picks (NCCL_SOCKET_IFNAME). LinkError with a
    sentence when the store cannot be reached, or the other stages do not come in time."""
    host, port = parse_tcp(init)
    store, address = rendezvous(host, port, stage, timeout, connect_s)
    try:
        if backend == "nccl":
            dist.init_process_group(backend, store=store, rank=stage, world_size=stages,
                                    timeout=timeout, **kwargs)
            return None
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        return dist.ProcessGroupGloo(store, stage, stages, options)
    except dist.DistError as e:   # the store went away, or a stage never came
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LinkError(f"the stages of the link did not all meet at {host}:{port} within "
                        f"{timeout.total_seconds():g}s ({why}); the launch or another stage "
                        f"has failed: their logs say why") from None


def rendezvous(host: str, port: int, stage: int, timeout: timedelta,
               connect_s: float) -> tuple[dist.TCPStore, str]:
    """A client of the TCPStore at host:port and this host's address toward it; LinkError
    with a sentence when it cannot be reached within connect_s seconds."""
    try:
        address = address_toward(host, port)
        store = dist.TCPStore(host, port, is_master=False,
                              timeout=timedelta(seconds=connect_s))
    except (OSError, dist.DistError) as e:   # no route, or nothing answers there in time
        why = getattr(e, "strerror", None) or f"nothing answered within {connect_s:g}s"
        raise LinkError(f"cannot reach the link's rendezvous at {host}:{port} ({why}); check "
                        f"that the launch still runs and that this host reaches that address "
                        f"and port (a firewall), or launch with --stage-link zmq") from None
    store.set_timeout(timeout)   # from here on: waiting for the other stages
    log.info("stage %d: link rendezvous at %s:%d, this stage at %s", stage, host, port, address)
    return store, address


class Receiving:
    """A posted receive: wait() orders the current stream after it (NCCL) or blocks until the
    data is here (gloo), then gives the tensor."""

    def __init__(self, work: dist.Work, buf: torch.Tensor):
        self.work, self.buf = work, buf

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.buf
