"""The MTP drafter of the last stage: a NextN head (strata/model/nextn.py) asked by
`Window.propose` for a slot's next k tokens, argmax or coupled to the slot's own draws. Every
window's hidden states and tokens are kept; a slot's NextN rows are written only when it is
asked, so a window that asks nothing runs no NextN row. How the rows sit in their cache,
when they are caught up and what coupled proposals are: docs/DESIGN.md, "Draft tokens" (the
MTP drafter's rows).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from strata.kernels.device import to_device
from strata.kernels.fused import linear_rows, norm_head_rows
from strata.kernels.norms import rms_norm
from strata.kernels.policy import MAX_DECODE_ROWS
from strata.kernels.quant.ops import dense_weight, embed_rows
from strata.kernels.quant.weight import QuantWeight
from strata.kernels.sampling.proposal_pick import pick_proposals
from strata.kernels.sampling.sample import pick_unfiltered
from strata.model.gguf_file import ModelFile
from strata.model.nextn import HeadSource, open_head
from strata.protocol.acceptance import kept_rows
from strata.protocol.messages import Window
from strata.protocol.rows import SamplingRow
from strata.stage_worker.graphs import Captured
from strata.stage_worker.model import KVCache, Layer, RowTensors, StageModel, WindowMeta

GRAPH_ROWS = (8, 16, 32, MAX_DECODE_ROWS)   # the row counts the drafter's steps are captured at
# the NextN rows a window writes at most: a slot that lacks more (it went long without drafting)
# catches up over several windows and proposes once it has them all
CATCH_UP = 4 * MAX_DECODE_ROWS


@dataclass
class _Plan:
    """A window's rows as the drafter keeps them: the store index (slot * ctx + position) and
    window row of each live row, and each slot's next token where its last accepted row was
    sampled (slot -> (position, token))."""
    at: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    tops: dict[int, tuple[int, int]] = field(default_factory=dict)


class Drafter:
    """A NextN head bound to the last stage's model: its output head (unless the head has its
    own shared_head_head) and the token embedding (unless it has embed_tokens; loaded here when
    the stage does not hold it). `run(window, hidden, tokens)` after every window."""

    def __init__(self, source: HeadSource, file: ModelFile, model: StageModel, slots: int,
                 ctx: int, graphs: bool = False):
        assert model.last, "the drafter lives on the last stage"
        head = open_head(source, file)
        cfg, dtype, device = file.config, model.dtype, model.device
        self.cfg, self.ctx, self.device, self.policy = cfg, ctx, device, model.policy
        # the head's tensors as the model's are held (quantized or not), counted with them
        mine = dataclasses.replace(model.weights, file=head)
        n = f"blk.{source.block}.nextn."
        self.eh_proj = mine.matrix(n + "eh_proj.weight")           # [D, 2D]
        self.shared_norm = mine.vector(n + "shared_head_norm.weight")
        self.enorm, self.hnorm = mine.vector(n + "enorm.weight"), mine.vector(n + "hnorm.weight")
        self.head = (mine.matrix(n + "shared_head_head.weight")
                     if n + "shared_head_head.weight" in head.tensors else model.head)
        if n + "embed_tokens.weight" in head.tensors:
            self.embed = mine.matrix(n + "embed_tokens.weight")
        elif model.first:
            self.embed = model.embed
        elif cfg.tied_head:
            self.embed = model.head   # the tied head is the token embedding
        else:
            self.embed = model.weights.matrix("token_embd.weight")
        self.block = Layer(mine, source.block, model.policy, chunks=False)  # decode rows only
        self.cache = KVCache(1, slots, cfg, ctx, device, dtype)
        self.cos, self.sin = model.cos, model.sin
        # every slot's main hidden states and tokens by position (+ a zero row and token 0,
        # read by pad rows), and on the host the tokens and the NextN rows written: rows
        # 1..filled[s] of slot s are in the cache for the sequence the slot holds
        self.hidden = torch.zeros(slots * ctx + 1, cfg.d_model, dtype=dtype, device=device)
        self.tokens = torch.zeros(slots * ctx + 1, dtype=torch.long, device=device)
        self.known = np.full((slots, ctx), -1, dtype=np.int64)
        self.filled = np.zeros(slots, dtype=np.int64)
        # a pad row (slot, index, length) and a step's move of a chained row, on the device
        self._constants = (torch.tensor([[self.cache.trash], [0], [0]], device=device),
                           torch.tensor([[0], [1], [1]], device=device))
        # on CUDA with graphs: the block's rows, and the proposals' chain of head and rows,
        # captured per row count (GRAPH_ROWS) when first needed: a replay each, not hundreds
        # of launches. They share one memory pool (they run one at a time, and none is
        # dropped): chains of several lengths and picks reuse one another's memory.
        self.graphs: dict[tuple[str, int], Captured] | None = (
            {} if graphs and device.type == "cuda" else None)
        self.pool = torch.cuda.graph_pool_handle() if self.graphs is not None else None

    def run(self, w: Window, hidden: torch.Tensor, tokens: list[int]) -> list[list[int]]:
        """After window w (its rows, `hidden` [R, D] the main model's final hidden states
        before the norm, `tokens` the sampled tokens of w.sample_rows): keeps the rows' hidden
        states and tokens, and returns [slot, d1, ..., dk] for each [slot, k] of w.propose it
        can serve (a slot whose last accepted row was sampled; proposals stop at the
        context's end), writing first the NextN rows the asked slots lack."""
        plan = self._plan(w, tokens)
        ctx, zero = self.ctx, len(self.tokens) - 1
        # the rows each asked slot lacks: from the one after its last written to the row of
        # its next token (the last of them, `ends`, starts its proposals), CATCH_UP at most:
        # a slot that gets only some of them proposes nothing this window
        catch_up, ends, asks = [], [], []
        for ask in self._asks(w, plan):
            s, top = ask[0], ask[2]
            lack = range(max(self.filled[s], 0) + 1, top + 1)
            take = lack[:CATCH_UP - len(catch_up)]
            catch_up += [(s, p) for p in take]
            if len(take) == len(lack):
                asks.append(ask)
                ends.append(len(catch_up) - 1)
            elif take:
                self.filled[s] = take[-1]
        # the tokens kept: the live rows', then the asked slots' next tokens
        written = dict(zip(plan.at, (w.tokens[r] for r in plan.rows)))
        for s, _, top, _ in asks:
            written[s * ctx + top] = self.known[s, top] = plan.tops[s][1]
            self.filled[s] = top
        k, m, n = len(plan.at), len(written), len(catch_up)
        n2 = n + (self._padded(n) - n if n else 0)
        # one copy to the device: where the rows' hidden states go and from which rows, where
        # tokens go and which, the rows' sources (h at p - 1) and tokens (pad rows: the zero
        # row and token 0), and each asked slot's last row (padded as the chains take them)
        ints = to_device(plan.at + plan.rows + list(written) + list(written.values())
                         + [s * ctx + p - 1 for s, p in catch_up] + [zero] * (n2 - n)
                         + [s * ctx + p for s, p in catch_up] + [zero] * (n2 - n)
                         + ends + [0] * (self._padded(len(ends)) - len(ends) if ends else 0),
                         self.device)
        self.hidden.index_copy_(0, ints[:k], hidden[ints[k:2 * k]].to(self.hidden.dtype))
        self.tokens.index_copy_(0, ints[2 * k:2 * k + m], ints[2 * k + m:2 * k + 2 * m])
        if not catch_up:
            return []
        at = 2 * k + 2 * m
        out = self._rows([s for s, _ in catch_up], [p for _, p in catch_up],
                         self.tokens[ints[at + n2:at + 2 * n2]], self.hidden[ints[at:at + n2]])
        return self._propose(asks, out[ints[at + 2 * n2:]]) if asks else []

    def nbytes(self) -> int:
        """Its KV cache and the slots' hidden states and tokens."""
        return (self.cache.nbytes() + self.hidden.numel() * self.hidden.element_size()
                + self.tokens.numel() * self.tokens.element_size())

    def _padded(self, n: int) -> int:
        """Rows n as this device takes them: on CUDA graph_rows(n), on a CPU n."""
        return graph_rows(n) if self.device.type == "cuda" else n

    def _plan(self, w: Window, tokens: list[int]) -> _Plan:
        """The window's live rows and each slot's next token (see _Plan), given the tokens of
        its sampled rows; forgets the NextN rows the window's rows change: a row at p reads h
        at p - 1 and the token at p, so a slot's first row at p0 leaves rows up to p0 (its
        token as before) or p0 - 1. A window of one row a slot (a decode window without
        drafts, every window where none are drafted) in array operations, others by the
        acceptance rule (_plan_runs)."""
        live = [r for r, s in enumerate(w.slots) if s >= 0]
        slots = np.asarray(w.slots)[live]
        if len(live) < 2 or len(np.unique(slots)) < len(live):
            return self._plan_runs(w, tokens)
        rows = np.asarray(live)
        p, given = np.asarray(w.positions)[rows], np.asarray(w.tokens)[rows]
        again = self.filled[slots] >= p   # slots whose NextN rows reach past p0: keep up to
        if again.any():                   # p0 where its token is the one written, else p0 - 1
            s, p0 = slots[again], p[again]
            self.filled[s] = np.where(self.known[s, p0] == given[again], p0, p0 - 1)
        self.known[slots, p] = given
        plan = _Plan((slots * self.ctx + p).tolist(), live)
        for r, token in zip(w.sample_rows, tokens):   # each slot's one row is its last kept
            if w.slots[r] >= 0:
                plan.tops[w.slots[r]] = (w.positions[r] + 1, token)
        return plan

    def _plan_runs(self, w: Window, tokens: list[int]) -> _Plan:
        """_plan for any window: one pass of the acceptance rule over the rows, then one over
        the slots."""
        positions, given = w.positions, w.tokens
        by_slot: dict[int, list[int]] = {}   # slot -> its rows, in position order
        for r, s in enumerate(w.slots):
            if s >= 0:
                by_slot.setdefault(s, []).append(r)
        order, first = [], []   # the rows slot by slot, and where a slot's begin
        for rows in by_slot.values():
            if len(rows) > 1:
                rows.sort(key=positions.__getitem__)
            order += rows
            first += [True] + [False] * (len(rows) - 1)
        sampled = {p.row: t for p, t in zip(w.sampled, tokens)}  # row -> its token
        counted = kept_rows([given[r] for r in order], [sampled.get(r, -1) for r in order],
                            first, [positions[r] for r in order])   # rows 0..a of each slot
        plan, at = _Plan(), 0   # at: the slot's first row in `order`
        for s, rows in by_slot.items():
            a = sum(counted[at:at + len(rows)]) - 1   # the rows that count are a prefix
            at += len(rows)
            p0 = positions[rows[0]]
            if self.filled[s] >= p0:
                self.filled[s] = p0 if self.known[s, p0] == given[rows[0]] else p0 - 1
            for r in rows:
                plan.at.append(s * self.ctx + positions[r])
                plan.rows.append(r)
                self.known[s, positions[r]] = given[r]
            last = rows[a]
            if last in sampled:
                plan.tops[s] = (positions[last] + 1, sampled[last])
        return plan

    def _asks(self, w: Window, plan: _Plan) -> list[tuple]:
        """(slot, k, position of the token its first proposal follows, coupling) of each
        [slot, k] of w.propose that the window's rows can serve (a slot whose last accepted row
        was sampled; proposals stop at the context's end)."""
        asks = []
        couplings = _couplings(w) if w.propose else {}
        for s, k in w.propose:
            if s in plan.tops:
                top = plan.tops[s][0]
                k = min(k, self.ctx - 1 - top)   # a proposal for position top + i < ctx
                if k >= 1:
                    asks.append((s, k, top, couplings.get(s)))
        return asks

    def _propose(self, asks: list[tuple], x: torch.Tensor) -> list[list[int]]:
        """Chained proposals for `asks` from x, the block's outputs of each asked slot's row
        at P_a + 1 (padded as _padded pads): argmax, or coupled (the module's docstring) where
        the window sends the slot's draws. Every step of every slot in one call (_chain: on
        CUDA one graph replay per MAX_DECODE_ROWS slots), each with one copy of its proposals
        to the host."""
        steps, vocab = max(k for _, k, _, _ in asks), self.head.shape[0]
        # per ask and step: the target's sampling of the proposal's position, or None (argmax)
        draws = [[c.row(top + i) if c and i <= k else None for i in range(1, steps + 1)]
                 for _, k, top, c in asks]
        every = [r for row in draws for r in row if r is not None]
        mode = ("filtered" if any(r.filtered(vocab) for r in every) else
                "coupled" if every else "argmax")
        pad = x.shape[0] - len(asks)   # x's pad rows: pad rows here too (no steps)
        params = (torch.tensor([[_params(r, mode) for r in row] for row in draws]
                               + [[_params(None, mode)] * steps] * pad, dtype=torch.float64)
                  if mode != "argmax" else None)
        # the rows of step 2: each slot's NextN row at top + 1 (index top), then one further
        # a step; k: the steps a slot takes (past them its rows are pad rows)
        trash = self.cache.trash
        packed = torch.tensor([[s for s, _, _, _ in asks] + [trash] * pad,
                               [top for _, _, top, _ in asks] + [0] * pad,
                               [top + 1 for _, _, top, _ in asks] + [0] * pad,
                               [k for _, k, _, _ in asks] + [0] * pad], dtype=torch.long)
        fn = lambda *inputs: self._chain(mode, steps, *inputs)  # noqa: E731
        d = []   # [asks][steps]
        for i in range(0, len(asks), MAX_DECODE_ROWS):
            block = slice(i, i + MAX_DECODE_ROWS)
            # the inputs a chain reads: rows past its first step, draws unless it takes argmaxes
            inputs = ([x[block]] + ([packed[:, block]] if steps > 1 else [])
                      + ([params[block]] if mode != "argmax" else []))
            d += self._graphed(f"chain-{mode}-{steps}", fn, *inputs)[0].tolist()
        return [[s] + d[a][:k] for a, (s, k, _, _) in enumerate(asks)]

    def _rows(self, slots: list[int], positions: list[int], tokens: torch.Tensor,
              h: torch.Tensor) -> torch.Tensor:
        """NextN rows at `positions` (each >= 1; a slot's rows in position order): inputs
        tokens [N'] and h [N', D] (N' >= N: pad rows after them, in no slot); writes their
        KV, returns the block's outputs [N', D]. Taken in decode windows of at most
        MAX_DECODE_ROWS rows, in order, so a row reads the rows before it."""
        pad = tokens.shape[0] - len(slots)
        packed = torch.tensor([slots + [self.cache.trash] * pad,
                               [p - 1 for p in positions] + [0] * pad, positions + [0] * pad],
                              dtype=torch.long)   # slot, index, length
        outs = []
        for i in range(0, tokens.shape[0], MAX_DECODE_ROWS):
            block = slice(i, i + MAX_DECODE_ROWS)
            x, = self._graphed("rows", self._block_rows, tokens[block], h[block],
                               packed[:, block])
            outs.append(x.clone())
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _block_rows(self, tokens: torch.Tensor, h: torch.Tensor,
                    packed: torch.Tensor) -> tuple[torch.Tensor]:
        eps = self.cfg.rms_eps
        e = embed_rows(tokens, self.embed, h.dtype, self.policy)
        x = self._linear(torch.cat([rms_norm(e, self.enorm, eps), rms_norm(h, self.hnorm, eps)],
                                   -1), self.eh_proj)
        meta = WindowMeta(self.cos, self.sin, RowTensors.unpack(packed.to(self.device)))
        return (self.block(x, meta, self.cache, 0),)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head's logits [N, V] of the block's outputs x [N, D]."""
        if isinstance(self.head, QuantWeight):   # fp32 logits from the quantized kernel
            out = norm_head_rows(x, self.shared_norm, self.cfg.rms_eps, self.head, self.policy)
            if out is not None:
                return out
        head = dense_weight(self.head, x.dtype, self.policy)
        return F.linear(rms_norm(x, self.shared_norm, self.cfg.rms_eps), head)

    def _linear(self, x: torch.Tensor, w: torch.Tensor | QuantWeight) -> torch.Tensor:
        """x @ w^T: a quantized w through its decode kernels (the rows are at most a decode
        window's)."""
        if isinstance(w, QuantWeight):
            return linear_rows(x, w, policy=self.policy, decode=True)
        return F.linear(x, w)

    def _chain(self, mode: str, steps: int, x: torch.Tensor, *rest: torch.Tensor
               ) -> tuple[torch.Tensor]:
        """`steps` chained proposals [N, steps] for N slots from the block's outputs x [N, D]
        of their rows at P_a + 1: at each step the head's pick (mode "argmax"; "coupled":
        pick_unfiltered with params [N, steps, 2] = (temperature, u), a temperature of 0 for
        the argmax; "filtered": params [N, steps, 5] = (temperature, top_k, top_p, min_p, u),
        pick_proposals for the rows that filter), then the NextN row of that proposal, one
        position further. rest: packed [4, N] (not for one step): slot, index and length of
        the step-2 rows, and the steps each slot takes, past which (and in pad rows, 0 steps)
        its rows are pad rows; then params (not for the argmax). No step waits for the host,
        so a CUDA graph holds them all."""
        packed = rest[0].to(self.device) if steps > 1 else None
        params = rest[-1].to(self.device) if mode != "argmax" else None
        trash, step = self._constants   # made before any capture: no copy inside one
        picks = []
        for i in range(steps):
            if i > 0:   # the row of proposal i (position top + i, index top + i - 1)
                rows = torch.where(packed[3] > i, packed[:3] + (i - 1) * step, trash)
                x, = self._block_rows(picks[-1], x, rows)
            logits = self.logits(x)
            if mode == "argmax":
                picks.append(logits.argmax(-1))
                continue
            p = params[:, i]
            every = pick_unfiltered(logits, p[:, :1], p[:, -1:])
            if mode == "filtered":
                vocab = logits.shape[-1]
                cuts = ((p[:, 1] > 0) & (p[:, 1] < vocab)) | (p[:, 2] < 1.0) | (p[:, 3] > 0.0)
                every = torch.where(cuts, pick_proposals(logits, p), every)
            picks.append(every)
        return (torch.stack(picks, 1),)

    def _graphed(self, name: str, fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """fn(*inputs): on the CPU as given; on CUDA the inputs' rows are a GRAPH_ROWS size
        (the callers pad them, _padded), and with graphs fn is the replay of its capture at
        that size, else it runs eagerly (the same shapes, so the same bits). With graphs the
        outputs are views of the graph's buffers, which its next replay overwrites (callers
        copy what they keep)."""
        if self.device.type != "cuda" or self.graphs is None:
            return fn(*inputs)
        size = inputs[0].shape[0]
        assert size in GRAPH_ROWS, f"{size} rows: pad them to a graph's rows (graph_rows)"
        graph = self.graphs.get((name, size))
        if graph is None:
            graph = self.graphs[(name, size)] = Captured(fn, list(inputs), self.pool)
        return graph(*inputs)


def graph_rows(n: int) -> int:
    """n rows as the graphs take them: whole MAX_DECODE_ROWS blocks, the rest padded to a
    GRAPH_ROWS size."""
    whole, rest = divmod(n, MAX_DECODE_ROWS)
    return whole * MAX_DECODE_ROWS + (next(r for r in GRAPH_ROWS if r >= rest) if rest else 0)


def _params(row: SamplingRow | None, mode: str) -> list[float]:
    """A proposal's sampling as _chain takes it in `mode` (none: the argmax)."""
    if mode == "filtered":
        return [row.temperature, row.top_k, row.top_p, row.min_p, row.u] if row else [0.0] * 5
    return [row.temperature, row.u] if row else [0.0, 0.0]


@dataclass
class _Coupling:
    """A slot's sampling parameters and the draws of the positions its proposals can take."""
    params: tuple[float, int, float, float]   # temperature, top_k, top_p, min_p
    draws: dict[int, float]                   # position -> u

    def row(self, position: int) -> SamplingRow | None:
        """The target's sampling of `position`, or None where its draw is unknown (argmax)."""
        u = self.draws.get(position)
        return None if u is None else SamplingRow(*self.params, u)


def _couplings(w: Window) -> dict[int, _Coupling]:
    """slot -> its coupling, for each propose entry that sends draws for a slot sampling with
    a temperature: the parameters of its last sampled row, and the draws of the window's own
    sampled rows (the row at p samples position p + 1) with those of propose_u after them."""
    if not w.propose_u:
        return {}
    params: dict[int, tuple[float, int, float, float]] = {}
    draws: dict[int, dict[int, float]] = {}
    for p in w.sampled:
        s = w.slots[p.row]
        params[s] = (p.temperature, p.top_k, p.top_p, p.min_p)
        draws.setdefault(s, {})[w.positions[p.row] + 1] = p.u
    end: dict[int, int] = {}   # slot -> the position its last row samples
    for s, p in zip(w.slots, w.positions):
        end[s] = max(end.get(s, 0), p + 1)
    out = {}
    for (s, _), us in zip(w.propose, w.propose_u):
        if us and s in params and params[s][0] > 0.0:
            draws[s].update((end[s] + j, u) for j, u in enumerate(us, 1))
            out[s] = _Coupling(params[s], draws[s])
    return out
