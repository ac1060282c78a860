"""Computing one window of a stage: its layers, eagerly or by replaying a CUDA graph, and on the
last stage the head of its sampled rows. `WindowRunner.run` returns what it computed.

A window's layers are one graph per row count (its shape: decode windows of 8, 16, ..., 64
rows, the prompt chunk), captured the first time that shape comes and kept in a bounded LRU
cache (`--graph-cache N`, default 16: the 8 decode sizes, the chunk and the head fit; 0 =
always eager; CPU stages run eagerly). Graphs are captured lazily, each after one eager warm-up
run of the same window; the worker captures the usual shapes before its hello
(worker.warm_up). On the last stage a decode window runs the head (norm, fp32 logits, argmax)
of all its rows in its own graph, which spares a gather, a copy and a replay; a prompt chunk's
sampled rows go through the head in blocks of LOGIT_BLOCK rows, one more graph. A row's bits
do not depend on the window's size (the kernels are batch-invariant), and a shape always runs
the same way whatever else is cached.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np
import torch

from strata.kernels.device import to_device
from strata.stage_worker.graphs import Captured
from strata.stage_worker.head import HeadOutput
from strata.stage_worker.model import KVCache, Rows, RowTensors, StageModel

LOGIT_BLOCK = 8  # sampled rows go through the head in blocks of this many rows (fixed shape)


class WindowRunner:
    """The mechanism a stage worker calls per window: layers, then (last stage) logits."""

    def __init__(self, model: StageModel, cache: KVCache, graph_cache: int = 0):
        self.model, self.cache = model, cache
        self.capacity = graph_cache if model.device.type == "cuda" else 0
        if self.capacity:   # made before any capture: a kernel's last program to arrive adds
            from strata.kernels.arrive import counters   # its tile's parts in the graphs
            counters(model.device, 0)
        self.graphs: OrderedDict[tuple, Captured] = OrderedDict()
        self.captures = 0  # graphs captured so far (evictions make this exceed the capacity)

    def run(self, inputs: torch.Tensor | list[int], rows: Rows, *, chunk: bool = False,
            sample_rows: Sequence[int] = (), logprob_rows: Sequence[int] = (),
            launching: Callable[[], None] = lambda: None,
            follow: Callable[[torch.Tensor], None] | None = None
            ) -> tuple[torch.Tensor, HeadOutput | None]:
        """inputs: token ids (first stage: a list, or a tensor [R]) or hidden states [R, D],
        on any device. chunk: one slot's prompt rows (Window.chunk). sample_rows: the rows
        whose tokens the window wants, logprob_rows those whose log-probabilities it wants
        (last stage). Returns the hidden states [R, D] on the model's device and, on the last
        stage with such rows, the head's output for them (static buffers when graphed: read
        them before the next window). launching() is called when the host work is done and
        the kernels are about to be queued (a trace's GPU span starts there). follow (first
        stage): rewrites some of the rows' tokens on the device, in place, before the layers
        read them (LastStage.follow: a window that decodes ahead)."""
        hidden, window_head = self._layers(inputs, rows, chunk, launching, follow)
        wanted = sorted(set(sample_rows) | set(logprob_rows))
        if not (self.model.last and wanted):
            return hidden, None
        if window_head is not None:   # every row's logits and argmax, from the window's graph
            return hidden, HeadOutput(*window_head, rows=list(sample_rows),
                                      scored=list(logprob_rows))
        # the rows' indices from pinned memory: a pageable copy would wait for the window
        logits, argmax = self.logits(hidden[to_device(wanted, hidden.device)])
        at = {r: i for i, r in enumerate(wanted)}
        return hidden, HeadOutput(logits, argmax, [at[r] for r in sample_rows],
                                  [at[r] for r in logprob_rows])

    # -- layers ----------------------------------------------------------------------------

    def _layers(self, inputs: torch.Tensor | list[int], rows: Rows, chunk: bool,
                launching: Callable[[], None], follow: Callable[[torch.Tensor], None] | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The hidden states [R, D] and, when the window's graph computed them (last stage, a
        decode window), (fp32 logits [R, V], argmax [R]) of every row; else None."""
        m = self.model
        tokens = None
        if m.first:   # a graphed window never makes a tensor of them: they go to its staging
            tokens = inputs if isinstance(inputs, list) else inputs.tolist()
            # a pad row's token is never checked, and the embedding must not see it
            tokens = [t if s >= 0 else 0 for s, t in zip(rows.slots, tokens)]
            if not self.capacity:
                inputs = torch.tensor(tokens, dtype=torch.long)
        if not self.capacity:
            packed = RowTensors.pack(rows, self.cache.trash)
            launching()
            inputs = inputs.to(m.device) if m.first else inputs.to(m.device, m.dtype)
            if follow is not None:
                follow(inputs)
            return m(inputs, RowTensors.unpack(packed.to(m.device)), self.cache, chunk), None
        # the graph's inputs: the first stage's rows and tokens in one host tensor [4, R] (one
        # copy to the device), a later stage's hidden states [R, D] and rows [3, R]; the rows
        # are written straight into the graph's staging buffer

        def fill(out: np.ndarray) -> None:
            RowTensors.fill(out, rows, self.cache.trash, tokens)

        def example() -> list[torch.Tensor]:
            packed = RowTensors.pack(rows, self.cache.trash, tokens)
            return [packed] if m.first else [inputs.to(m.dtype), packed]

        with_head = m.last and not chunk
        if chunk:
            key, fn = ("chunk", len(rows.slots)), self._chunk_fn
        else:
            key = ("layers+head" if with_head else "layers", len(rows.slots))
            fn = self._layers_head_fn if with_head else self._layers_fn
        graph_inputs = [fill] if m.first else [inputs.to(m.dtype), fill]
        graph = self._graph(key, fn, example)
        if follow is not None:   # the tokens' row of the graph's [4, R] input, once copied
            def launch() -> None:
                launching()
                follow(graph.inputs[0][3])
        out = graph(*graph_inputs, launching=launching if follow is None else launch)
        return out[0], (out[1:] if with_head else None)

    def _forward(self, inputs: tuple[torch.Tensor, ...], chunk: bool = False) -> torch.Tensor:
        """The model on a graph's inputs: ([4, R] rows and tokens) or (hidden, [3, R] rows)."""
        if self.model.first:
            (packed,) = inputs
            return self.model(packed[3], RowTensors.unpack(packed), self.cache, chunk)
        hidden, packed = inputs
        return self.model(hidden, RowTensors.unpack(packed), self.cache, chunk)

    def _layers_fn(self, *inputs: torch.Tensor) -> tuple[torch.Tensor]:
        return (self._forward(inputs),)

    def _chunk_fn(self, *inputs: torch.Tensor) -> tuple[torch.Tensor]:
        return (self._forward(inputs, chunk=True),)

    def _layers_head_fn(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden = self._forward(inputs)
        return (hidden,) + self._head_fn(hidden)

    # -- head ------------------------------------------------------------------------------

    def logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [N, D] rows to sample (last stage). Returns (fp32 logits [N, V], argmax [N]),
        computed in blocks of LOGIT_BLOCK rows (one graph shape; a row's logits never depend
        on N)."""
        n = hidden.shape[0]
        blocks = -(-n // LOGIT_BLOCK)
        padded = torch.zeros(blocks * LOGIT_BLOCK, hidden.shape[1], dtype=hidden.dtype,
                             device=hidden.device)
        padded[:n] = hidden
        outs = [self._head(block) for block in padded.split(LOGIT_BLOCK)]
        if len(outs) == 1:
            return outs[0][0][:n], outs[0][1][:n]
        return (torch.cat([o[0] for o in outs])[:n], torch.cat([o[1] for o in outs])[:n])

    def _head(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.capacity:
            return self._head_fn(block)
        graph = self._graph(("head", block.shape[0]), self._head_fn, lambda: [block])
        out = graph(block)
        return out[0].clone(), out[1].clone()  # several blocks may replay this graph

    def _head_fn(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model.logits(block)
        return logits, logits.argmax(-1)

    # -- the cache ---------------------------------------------------------------------------

    def _graph(self, key: tuple, fn: Callable,
               example: Callable[[], list[torch.Tensor]]) -> Captured:
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
            return graph
        while len(self.graphs) >= self.capacity:
            _, evicted = self.graphs.popitem(last=False)  # least recently used
            evicted.staged.synchronize()  # its staging buffers are freed: no copy may be left
        graph = self.graphs[key] = Captured(fn, example())
        self.captures += 1
        return graph
