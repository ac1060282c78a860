"""The MTP drafter of the last stage (strata/stage_worker/drafter.py): its NextN KV and its
proposals against a plain reference that recomputes the NextN block over a whole sequence
without a cache, and a stage worker in process that answers `propose` with proposals (or
ignores it without a head)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from inprocess import InProcess, in_process_worker

from strata.kernels.rope import apply_rope, rope_table
from strata.kernels.sampling.sample import gumbel_noise
from strata.model.gguf_file import ModelFile
from strata.model.mkmodel import SHAPES, write_nextn_sidecar, write_random_gguf
from strata.model.nextn import find_head
from strata.protocol.messages import Result, Window
from strata.stage_worker.drafter import Drafter, graph_rows
from strata.stage_worker.model import KVCache, Rows, StageModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TINY = SHAPES["tiny"]
CTX = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The varied tiny model (std 0.2, untied: its tokens depend on the whole context) with a
    NextN layer, the same model without it, and a sidecar holding the same head."""
    d = tmp_path_factory.mktemp("nextn")
    out = {"nextn": write_random_gguf(d / "nextn.gguf", TINY, seed=1, std=0.2, tied=False,
                                      nextn=True),
           "plain": write_random_gguf(d / "plain.gguf", TINY, seed=1, std=0.2, tied=False)}
    out["sidecar"] = write_nextn_sidecar(d / "head.gguf", out["plain"], TINY, seed=1, std=0.2)
    return out


def window(id, rows, *, sample=(), propose=(), commits=(), chunk=False, t=0.0, top_k=0,
           top_p=1.0) -> Window:
    """rows: (slot, position, token) triples; sample: rows sampled greedily, or with
    temperature t (and top_k, top_p), draws made up from the positions and coupled proposals
    asked for."""
    n = len(sample)
    draws = [(7 * rows[i][1] % 10 + 0.5) / 10 if t else 0.0 for i in sample]
    return Window(id, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                  commits=[list(c) for c in commits], sample_rows=list(sample),
                  temperature=[t] * n, top_k=[top_k] * n, top_p=[top_p] * n, min_p=[0.0] * n,
                  u=draws, chunk=chunk, propose=[list(p) for p in propose],
                  propose_u=[[(3 * j % 10 + 0.5) / 10 for j in range(k)] for _, k in propose]
                  if t else [])


# --- the reference: the NextN block over a whole sequence, plain torch in float64 ----------

class Reference:
    """NextN rows at positions 1..m from inputs [(h_{p-1} or None for zeros, tok_p)]: the
    design's forward with causal attention over rows 1..p, the row of position p rotated as
    position p - 1 (the NextN attention starts at position 1)."""

    def __init__(self, file: ModelFile, ctx: int = CTX):
        cfg, n = file.config, f"blk.{file.config.n_layers}."
        w = lambda name: file.tensor(name).double()  # noqa: E731
        self.cfg, self.w = cfg, {k: w(n + k + ".weight") for k in (
            "nextn.eh_proj", "nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm", "attn_norm",
            "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
            "ffn_down")}
        self.embed, self.head = w("token_embd.weight"), w("output.weight")
        self.cos, self.sin = (t.double() for t in rope_table(cfg.rope_dim, cfg.rope_base, ctx))

    def norm(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_eps) * weight

    def rows(self, inputs: list[tuple[torch.Tensor | None, int]]):
        """-> (outputs [m, D], keys [m, KVH, hd] rotated, values [m, KVH, hd])."""
        c, w, m = self.cfg, self.w, len(inputs)
        h = torch.stack([torch.zeros(c.d_model, dtype=torch.float64) if x is None
                         else x.double() for x, _ in inputs])
        e = self.embed[torch.tensor([t for _, t in inputs])]
        x = torch.cat([self.norm(e, w["nextn.enorm"]), self.norm(h, w["nextn.hnorm"])], -1)
        x = x @ w["nextn.eh_proj"].T
        a = self.norm(x, w["attn_norm"])
        index = torch.arange(m)                  # the row of position p is rotated as p - 1
        q = apply_rope((a @ w["attn_q"].T).view(m, c.n_heads, c.head_dim),
                       self.cos[index], self.sin[index])
        k = apply_rope((a @ w["attn_k"].T).view(m, c.n_kv_heads, c.head_dim),
                       self.cos[index], self.sin[index])
        v = (a @ w["attn_v"].T).view(m, c.n_kv_heads, c.head_dim)
        group = c.n_heads // c.n_kv_heads
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(c.head_dim)
        scores = scores.masked_fill(torch.ones(m, m, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv).reshape(m, -1)
        x = x + o @ w["attn_output"].T
        f = self.norm(x, w["ffn_norm"])
        x = x + (F.silu(f @ w["ffn_gate"].T) * (f @ w["ffn_up"].T)) @ w["ffn_down"].T
        return x, k, v

    def propose(self, inputs, k: int, pick=lambda logits, i: int(logits.argmax())) -> list[int]:
        """k chained proposals after the last input row: pick(logits [V], i) gives proposal i
        (0-based); greedy by default."""
        inputs, out = list(inputs), []
        for i in range(k):
            x = self.rows(inputs)[0][-1]
            d = pick(self.norm(x, self.w["nextn.shared_head_norm"]) @ self.head.T, i)
            out.append(d)
            inputs.append((x, d))
        return out


class Run:
    """The main model (every layer, one stage) and the drafter over windows of two slots,
    with the test's own record of each slot's accepted tokens and hidden states."""

    def __init__(self, path: Path, sidecar: Path | None = None, ctx: int = CTX):
        file = ModelFile(path)
        self.model = StageModel(file, 0, file.config.n_layers, ctx=ctx)
        self.cache = KVCache(file.config.n_layers, 2, file.config, ctx, self.model.device,
                             self.model.dtype)
        self.drafter = Drafter(find_head(file, sidecar), file, self.model, 2, ctx)
        self.tokens = [{}, {}]    # slot -> {position: token} (accepted, and the next sampled)
        self.hidden = [{}, {}]    # slot -> {position: main hidden state} (accepted rows)
        self.top = [0, 0]         # the position of each slot's sampled next token
        self.accepted = self.rejected = 0
        self.ids = iter(range(1, 1000))

    def step(self, rows, *, sample=(), propose=(), commits=(), chunk=False, check=None):
        """Runs one window; returns the sampled tokens. check: a Reference to compare the
        proposals with."""
        w = window(next(self.ids), rows, sample=sample, propose=propose, commits=commits,
                   chunk=chunk)
        for s, length in w.commits:
            self.cache.trim(s, length)
        hidden = self.model(torch.tensor(w.tokens), Rows(w.slots, w.positions), self.cache,
                            chunk=chunk)
        sampled = self.model.logits(hidden[list(sample)]).argmax(-1).tolist() if sample else []
        proposals = self.drafter.run(w, hidden, sampled)
        self._record(w, hidden, dict(zip(sample, sampled)))
        if check is not None:
            want = [[s] + check.propose(self.inputs(s), k) for s, k in propose]
            assert proposals == want, (w.id, proposals, want)
        return sampled, proposals

    def _record(self, w: Window, hidden, sampled: dict[int, int]) -> None:
        """The design's acceptance rule, written out for the test: per slot, rows follow
        while each sampled row's token equals the next row's."""
        for s in set(w.slots):
            rows = sorted((r for r, x in enumerate(w.slots) if x == s),
                          key=lambda r: w.positions[r])
            a = 0
            while a + 1 < len(rows) and sampled.get(rows[a], w.tokens[rows[a + 1]]) == \
                    w.tokens[rows[a + 1]]:
                a += 1
            drafts = sum(1 for r in rows[:-1] if r in sampled)
            self.accepted += min(a, drafts)
            self.rejected += drafts - min(a, drafts)
            for r in rows[:a + 1]:
                self.tokens[s][w.positions[r]] = w.tokens[r]
                self.hidden[s][w.positions[r]] = hidden[r].clone()
            last = rows[a]
            self.top[s] = w.positions[last] + (1 if last in sampled else 0)
            if last in sampled:
                self.tokens[s][self.top[s]] = sampled[last]

    def inputs(self, s: int) -> list:
        """The reference's NextN inputs of slot s: positions 1..top."""
        return [(self.hidden[s][p - 1], self.tokens[s][p]) for p in range(1, self.top[s] + 1)]

    def decode(self, check, k: int | dict[int, int],
               drafts: dict[int, list[int]]) -> dict[int, list[int]]:
        """One decode window: slot s's rows are its next token then drafts[s]; all sampled;
        each slot asks for k proposals (or k[s]; none for 0). Commits drop the rows a slot rejected last
        time."""
        ks = k if isinstance(k, dict) else dict.fromkeys(drafts, k)
        rows, commits = [], []
        for s, d in drafts.items():
            length = self.top[s]     # the row of the next token goes at top
            commits.append((s, length))
            rows += [(s, length + j, t) for j, t in enumerate([self.tokens[s][length]] + d)]
        _, proposals = self.step(rows, sample=range(len(rows)), commits=commits,
                                 propose=[(s, ks[s]) for s in drafts if ks[s]], check=check)
        return {p[0]: p[1:] for p in proposals}


def greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after the prompt, one decode row at a time (the drafts to accept)."""
    file = ModelFile(path)
    model = StageModel(file, 0, file.config.n_layers, ctx=CTX)
    cache = KVCache(file.config.n_layers, 1, file.config, CTX, model.device, model.dtype)
    seq = list(prompt)
    hidden = model(torch.tensor(seq), Rows([0] * len(seq), list(range(len(seq)))), cache)
    for _ in range(n):
        seq.append(int(model.logits(hidden[-1:]).argmax()))
        hidden = model(torch.tensor(seq[-1:]), Rows([0], [len(seq) - 1]), cache)
    return seq[len(prompt):]


@pytest.mark.parametrize("rows_per_call", [None, 1], ids=["default", "one-row-calls"])
def test_drafter_matches_a_full_recompute(models, monkeypatch, rows_per_call):
    """Prompt chunks, decode windows of two slots with drafts partly accepted, commits of the
    rejected rows, and follow-up turns on slot 1 that resume what it holds: every
    proposal equals the reference's, and the NextN KV of each slot's accepted positions the
    reference's keys and values. With rows_per_call 1 the drafter takes its rows and its
    slots' chains one per call, as it does past MAX_DECODE_ROWS of them."""
    if rows_per_call:
        monkeypatch.setattr("strata.stage_worker.drafter.MAX_DECODE_ROWS", rows_per_call)
    file = ModelFile(models["nextn"])
    ref, run = Reference(file), Run(models["nextn"])
    p0, p1 = [5, 77, 120, 33, 250, 8, 91, 64, 200, 17, 3, 140], [40, 41, 300, 12, 99, 7, 61]
    true0, true1 = greedy(models["nextn"], p0, 20), greedy(models["nextn"], p1, 20)

    run.step([(0, p, t) for p, t in enumerate(p0[:5])], chunk=True)
    run.step([(0, p, p0[p]) for p in range(5, 10)], chunk=True)
    run.step([(0, 10, p0[10]), (0, 11, p0[11])], sample=[1], propose=[(0, 3)], chunk=True,
             check=ref)
    run.step([(1, p, t) for p, t in enumerate(p1)], sample=[6], propose=[(1, 2)], chunk=True,
             check=ref)
    assert run.tokens[0][12] == true0[0] and run.tokens[1][7] == true1[0]

    # decode windows: drafts from the true continuation (accepted) with wrong ones (rejected)
    def drafts(s: int, true: list[int], accept: int, wrong: int) -> list[int]:
        have = run.top[s] - (len(p0) if s == 0 else len(p1))   # tokens generated so far
        return true[have + 1:have + 1 + accept] + [(true[have + 1 + accept] + 1) % 320] * wrong
    for accept, wrong, k in ((2, 1, 3), (0, 2, 1), (3, 0, 2), (1, 1, 3)):
        run.decode(ref, k, {0: drafts(0, true0, accept, wrong), 1: drafts(1, true1, wrong, 1)})
    run.decode(ref, 7, {0: [], 1: []})
    # slots asking for different numbers of proposals (chained together, the shorter
    # chain's later rows are pad rows)
    run.decode(ref, {0: 1, 1: 4}, {0: drafts(0, true0, 1, 0), 1: drafts(1, true1, 0, 1)})
    run.decode(ref, {0: 3, 1: 2}, {0: drafts(0, true0, 0, 1), 1: drafts(1, true1, 1, 0)})
    assert run.accepted >= 6 and run.rejected >= 6, (run.accepted, run.rejected)

    # slot 1's request ends; a follow-up keeps its 7 prompt tokens and reads 4 more: the
    # first NextN row of the follow-up reads the kept hidden state of position 6
    follow = [9, 260, 31, 77]
    run.step([(1, 7 + j, t) for j, t in enumerate(follow)], sample=[3], propose=[(1, 3)],
             commits=[(1, 7)], chunk=True, check=ref)
    run.decode(ref, 2, {0: [1, 2], 1: [5]})
    # slot 1 ends at once; a follow-up keeps all it holds but reads another token where the
    # drafter wrote the row of the token it sampled: that row is read again
    top = run.top[1]
    other = (run.tokens[1][top] + 1) % TINY.vocab
    run.step([(1, top, other), (1, top + 1, 4)], sample=[1], propose=[(1, 2)],
             commits=[(1, top)], chunk=True, check=ref)

    for s in (0, 1):
        _, k, v = ref.rows(run.inputs(s))
        m = run.top[s]   # positions 1..m are at indices 0..m-1
        cache = run.drafter.cache
        torch.testing.assert_close(cache.k[0][s, :, :m].transpose(0, 1).double(), k,
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cache.v[0][s, :, :m].transpose(0, 1).double(), v,
                                   rtol=1e-4, atol=1e-4)


def test_nextn_rows_are_written_only_for_the_slots_asked_to_propose(models, monkeypatch):
    """Windows that ask for no proposals run no NextN block (what a server that drafts
    nothing pays is the copy of the rows' hidden states); a slot asked afterwards first writes
    every row it lacks, and proposes what the full recompute does."""
    written = []   # the NextN rows of each call of the block, by slot
    rows = Drafter._rows
    monkeypatch.setattr(Drafter, "_rows", lambda self, slots, *rest: written.append(
        [slots.count(s) for s in (0, 1)]) or rows(self, slots, *rest))
    file = ModelFile(models["nextn"])
    ref, run = Reference(file), Run(models["nextn"])
    p0, p1 = [5, 77, 120, 33, 250, 8, 91, 64, 200, 17], [40, 41, 300, 12, 99]
    true0, true1 = greedy(models["nextn"], p0, 16), greedy(models["nextn"], p1, 16)
    run.step([(0, p, t) for p, t in enumerate(p0)], sample=[len(p0) - 1], chunk=True)
    run.step([(1, p, t) for p, t in enumerate(p1)], sample=[len(p1) - 1], chunk=True)

    def drafts(s: int, true: list[int], accept: int, wrong: int) -> list[int]:
        have = run.top[s] - (len(p0) if s == 0 else len(p1))
        return true[have + 1:have + 1 + accept] + [(true[have + 1 + accept] + 1) % 320] * wrong
    for accept, wrong in ((2, 1), (0, 1), (1, 0)):
        run.decode(None, 0, {0: drafts(0, true0, accept, wrong), 1: drafts(1, true1, 1, 1)})
    assert written == [] and run.accepted >= 4 and run.rejected >= 3
    run.decode(ref, {0: 3, 1: 0}, {0: drafts(0, true0, 1, 1), 1: drafts(1, true1, 0, 1)})
    assert written == [[run.top[0], 0]]       # slot 0's rows at positions 1..top
    top0 = run.top[0]
    run.decode(ref, 2, {0: drafts(0, true0, 2, 0), 1: drafts(1, true1, 1, 0)})
    assert written[1] == [run.top[0] - top0, run.top[1]]   # slot 0 keeps its row at top0


def test_a_slot_far_behind_catches_up_over_several_windows(models, monkeypatch):
    """A window writes CATCH_UP NextN rows at most (here 6), asked slots in turn: a slot asked
    after its prompt and a window without proposals gets none until it has every row, then
    proposes what the full recompute does; a slot asked beside it waits its turn."""
    monkeypatch.setattr("strata.stage_worker.drafter.CATCH_UP", 6)
    written = []
    rows = Drafter._rows
    monkeypatch.setattr(Drafter, "_rows", lambda self, slots, *rest: written.append(
        [slots.count(s) for s in (0, 1)]) or rows(self, slots, *rest))
    file = ModelFile(models["nextn"])
    ref, run = Reference(file), Run(models["nextn"])
    p0, p1 = [5, 77, 120, 33, 250, 8, 91, 64, 200, 17], [40, 41, 300]
    run.step([(0, p, t) for p, t in enumerate(p0)], sample=[len(p0) - 1], chunk=True)
    run.step([(1, p, t) for p, t in enumerate(p1)], sample=[len(p1) - 1], chunk=True)
    run.decode(None, 0, {0: [], 1: []})          # no proposals asked: no rows
    for _ in range(2):                           # slot 0 lacks 12 rows, then 7: 6 a window
        assert run.decode(None, 2, {0: [], 1: []}) == {}
    assert written == [[6, 0], [6, 0]]
    got = run.decode(None, 2, {0: [], 1: []})    # slot 0's last 2; slot 1 4 of its 7
    assert written[2] == [2, 4] and got == {0: ref.propose(run.inputs(0), 2)}
    run.decode(ref, 2, {0: [], 1: []})            # both, every proposal the reference's
    assert written[3] == [1, 4]


@pytest.mark.parametrize("t,filters", [(0.0, {}), (0.8, {}), (0.8, {"top_k": 12, "top_p": 0.9})],
                         ids=["greedy", "coupled", "filtered"])
def test_pad_rows_as_the_graphs_take_them_change_no_token_or_proposal(models, monkeypatch, t,
                                                                      filters):
    """On CUDA the drafter pads its rows and its asked slots to the graphs' row counts (pad
    rows in the trash slot, reading the zero row): on a CPU made to pad alike, the tokens and
    proposals of a conversation are those of the unpadded drafter."""
    assert [graph_rows(n) for n in (1, 8, 9, 33, 64, 65, 130)] == [8, 8, 16, 64, 64, 72, 136]
    with in_process(models["nextn"]) as stage:
        plain = [(r.tokens, r.proposals) for r in conversation(stage.ask, t, **filters)]
    monkeypatch.setattr(Drafter, "_padded", lambda self, n: graph_rows(n))
    with in_process(models["nextn"]) as stage:
        padded = [(r.tokens, r.proposals) for r in conversation(stage.ask, t, **filters)]
    assert padded == plain and plain[0][1] and plain[1][1]


def test_a_chunk_of_more_rows_than_a_decode_window(models):
    """A 100-row prompt chunk gives 100 NextN rows, taken in decode windows of 64 rows: the
    second block reads the first's KV; its proposals near the context's end stop there, while
    another slot's, chained beside them, go on."""
    ctx = 104
    file = ModelFile(models["nextn"])
    ref, run = Reference(file, ctx), Run(models["nextn"], ctx=ctx)
    prompt = [(7 * p + 3) % TINY.vocab for p in range(100)]
    # the token at 100 is sampled: proposals for positions 101..103 fit in the context
    _, proposals = run.step([(0, p, t) for p, t in enumerate(prompt)], sample=[99],
                            propose=[(0, 7)], chunk=True)
    assert proposals == [[0] + ref.propose(run.inputs(0), 3)], proposals
    other = [40, 41, 300, 12, 99]
    run.step([(1, p, t) for p, t in enumerate(other)], sample=[4], chunk=True)
    _, proposals = run.step([(0, 100, run.tokens[0][100]), (1, 5, run.tokens[1][5])],
                            sample=[0, 1], propose=[(0, 7), (1, 7)])
    assert proposals == [[0] + ref.propose(run.inputs(0), 2),
                         [1] + ref.propose(run.inputs(1), 7)], proposals
    _, k, v = ref.rows(run.inputs(0))
    torch.testing.assert_close(run.drafter.cache.k[0][0, :, :101].transpose(0, 1).double(), k,
                               rtol=1e-4, atol=1e-4)


def test_a_sidecar_drafts_as_the_model_files_own_head(models):
    """The sidecar made for the plain model holds the head the nextn model carries: the same
    tokens and the same proposals."""
    outs = []
    for path, sidecar in ((models["nextn"], None), (models["plain"], models["sidecar"])):
        run = Run(path, sidecar)
        outs.append(run.step([(0, p, t) for p, t in enumerate([5, 6, 7, 8, 9])], sample=[4],
                             propose=[(0, 4)], chunk=True))
    assert outs[0] == outs[1] and len(outs[0][1][0]) == 5, outs


@pytest.mark.parametrize("tied", [False, True])
def test_a_last_stage_without_the_embedding_drafts_alike(models, tmp_path, tied):
    """A last stage that is not the first loads the token embedding for the head (a tied
    head: it is the stage's output head): the same proposals as a stage of every layer,
    given the same hidden states and tokens."""
    path = models["nextn"] if not tied else write_random_gguf(
        tmp_path / "tied.gguf", TINY, seed=1, std=0.2, nextn=True)
    file = ModelFile(path)
    whole = StageModel(file, 0, TINY.n_layers, ctx=CTX)
    cache = KVCache(TINY.n_layers, 2, file.config, CTX, whole.device, whole.dtype)
    drafters = [Drafter(find_head(file), file, m, 2, CTX)
                for m in (whole, StageModel(file, 2, TINY.n_layers, ctx=CTX))]
    assert drafters[1].embed.shape == (TINY.vocab, TINY.d_model)
    w = window(1, [(0, p, t) for p, t in enumerate([72, 101, 108, 300, 9])], sample=[4],
               propose=[(0, 3)], chunk=True)
    hidden = whole(torch.tensor(w.tokens), Rows(w.slots, w.positions), cache, chunk=True)
    tokens = whole.logits(hidden[4:]).argmax(-1).tolist()
    got = [d.run(w, hidden, tokens) for d in drafters]
    assert got[0] == got[1] and len(got[0][0]) == 4, got


# --- coupled proposals ---------------------------------------------------------------------

def gumbel_max(logits: torch.Tensor, t: float, top_k: int, top_p: float, min_p: float,
               u: float) -> int:
    """The target's sampling, read plainly: temperature, top-k, top-p, min-p (transformers'
    order, tokens by probability descending, ties by id), then the kept token whose scaled
    logit plus the Gumbel noise of (u, its id) is largest."""
    logits = logits.double()
    order = sorted(range(len(logits)), key=lambda i: (-float(logits[i]), i))
    if 0 < top_k < len(order):
        order = order[:top_k]
    p = torch.softmax(logits[order] / t, 0)
    keep = len(order)
    if top_p < 1.0:
        keep = min(keep, int((p.cumsum(0) < top_p).sum()) + 1)
    if min_p > 0.0:
        keep = min(keep, max(1, int((p >= min_p * p[0]).sum())))
    kept = torch.tensor(order[:keep])
    noise = gumbel_noise(torch.tensor([[u]], dtype=torch.float64), kept[None])[0]
    return int(kept[int((logits[kept] / t + noise).argmax())])


@pytest.mark.parametrize("top_k,top_p,min_p,t1", [(0, 1.0, 0.0, 0.0), (12, 0.9, 0.05, 0.0),
                                                   (12, 0.9, 0.05, 3.0)],
                         ids=["unfiltered", "filtered", "filtered-beside-unfiltered"])
def test_coupled_proposals_are_the_gumbel_max_pick_at_the_targets_draws(models, top_k, top_p,
                                                                          min_p, t1):
    """Slot 0 samples with a temperature and sends draws: each proposal is the Gumbel-max
    pick of the head's own filtered distribution at the draw of its position (the window's
    own draws first: its sampled row at p carries u(p + 1); then propose_u's). Slot 1 is
    greedy (t1 0): the argmax, whatever draws come; or samples at t1 without filters, beside
    slot 0's filtered picks. Without propose_u (an older coordinator), or with an entry [],
    slot 0 gets the argmax too."""
    t = 0.8
    file = ModelFile(models["nextn"])
    ref = Reference(file)
    def pick(us):   # proposal i at the draw us[i]
        return lambda logits, i: gumbel_max(logits, t, top_k, top_p, min_p, us[i])
    def pick1(us):   # slot 1's, sampled at t1 without filters
        return lambda logits, i: gumbel_max(logits, t1, 0, 1.0, 0.0, us[i])
    p0, p1 = [5, 77, 120, 33, 250, 8], [40, 41, 300, 12, 99]
    rows = [(0, p, x) for p, x in enumerate(p0)] + [(1, p, x) for p, x in enumerate(p1)]

    def prompt_window(propose_u):
        return Window(1, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                      sample_rows=[5, 10], temperature=[t, t1], top_k=[top_k, 0],
                      top_p=[top_p, 1.0], min_p=[min_p, 0.0], u=[0.3, 0.5 if t1 else 0.0],
                      propose=[[0, 3], [1, 3]], propose_u=propose_u)

    answers = {}
    for name, propose_u in (("coupled", [[0.93, 0.41, 0.77], [0.2, 0.4, 0.6]]),
                            ("argmax", []), ("entry []", [[], [0.2, 0.4, 0.6]])):
        run = Run(models["nextn"])
        w = prompt_window(propose_u)
        hidden = run.model(torch.tensor(w.tokens), Rows(w.slots, w.positions), run.cache)
        answers[name] = run.drafter.run(w, hidden, [17, 23])   # the tokens at 6 and 5
    inputs = {s: [(hidden[r - 1], rows[r][2]) for r in range(first + 1, first + len(p))]
              + [(hidden[first + len(p) - 1], sampled)]
              for s, first, p, sampled in ((0, 0, p0, 17), (1, 6, p1, 23))}
    greedy = [[s] + ref.propose(inputs[s], 3) for s in (0, 1)]
    slot1 = [1] + ref.propose(inputs[1], 3, pick1([0.2, 0.4, 0.6])) if t1 else greedy[1]
    assert answers["coupled"] == [[0] + ref.propose(inputs[0], 3, pick([0.93, 0.41, 0.77])),
                                  slot1], answers
    assert answers["coupled"][0] != greedy[0]   # the draws moved the proposals
    assert answers["argmax"] == greedy and answers["entry []"] == [greedy[0], slot1], answers

    # a decode window of slot 0 (its token at 6, drafts at 7 and 8, every row sampled): the
    # draft at 7 is kept, the one at 8 is not (the row at 7 samples 99), so the first
    # proposal (position 9) takes the draw of the row at 8, and the next ones (10, 11) the
    # first two of propose_u, which holds the draws of 10, 11, 12
    w = Window(2, [0, 0, 0], [6, 7, 8], [17, 50, 60], sample_rows=[0, 1, 2],
               temperature=[t] * 3, top_k=[top_k] * 3, top_p=[top_p] * 3, min_p=[min_p] * 3,
               u=[0.1, 0.2, 0.66], propose=[[0, 3]], propose_u=[[0.05, 0.88, 0.5]])
    hidden2 = run.model(torch.tensor(w.tokens), Rows(w.slots, w.positions), run.cache)
    got = run.drafter.run(w, hidden2, [50, 99, 4])
    chained = inputs[0] + [(hidden2[0], 50), (hidden2[1], 99)]
    assert got == [[0] + ref.propose(chained, 3, pick([0.66, 0.05, 0.88]))], got


# --- the stage worker, in process -----------------------------------------------------------

class Stage(InProcess):
    """Its answers are Results."""

    def answers(self, n: int) -> list[Result]:
        out = super().answers(n)
        for r in out:
            assert isinstance(r, Result), r
        return out

    results = answers


def in_process(model: Path, mtp_head: Path | None = None, device: str = "cpu"):
    """A one-stage StageWorker of 2 slots in this process."""
    return in_process_worker(model, Stage, layer_end=TINY.n_layers, slots=2, ctx=CTX,
                             device=device, mtp_head=str(mtp_head) if mtp_head else None)


def conversation(ask, t: float = 0.0, **filters) -> list[Result]:
    """A prompt asking for 3 proposals, a decode window of two (fixed) drafts asking for 2,
    and a decode window that asks for none; greedy, or sampled at t (coupled proposals), with
    filters (window's top_k, top_p)."""
    prompt = [(0, p, t) for p, t in enumerate([72, 101, 108, 108, 111])]
    a = ask(window(1, prompt, sample=[4], propose=[(0, 3)], commits=[(0, 0)], chunk=True,
                   t=t, **filters))
    b = ask(window(2, [(0, 5, a.tokens[0]), (0, 6, 1), (0, 7, 2)], sample=[0, 1, 2],
                   propose=[(0, 2)], t=t, **filters))
    c = ask(window(3, [(0, 6, b.tokens[0])], sample=[0], commits=[(0, 6)], t=t, **filters))
    return [a, b, c]


def test_the_last_stage_answers_propose_with_proposals(models):
    with in_process(models["nextn"]) as stage:
        a, b, c = conversation(stage.ask)
    assert [len(p) for p in a.proposals] == [4] and a.proposals[0][0] == 0, a
    assert [len(p) for p in b.proposals] == [3] and b.proposals[0][0] == 0, b
    assert c.proposals == [], c
    assert all(0 <= t < TINY.vocab for r in (a, b) for t in r.proposals[0][1:])


def test_a_stage_without_a_head_ignores_propose_and_a_nextn_layer_changes_no_token(models):
    """The plain model has no head: no proposals. The model with a NextN layer runs its main
    blocks only: the same tokens as the plain model, window for window."""
    with in_process(models["plain"]) as stage:
        plain = conversation(stage.ask)
    with in_process(models["nextn"]) as stage:
        nextn = conversation(stage.ask)
    assert all(r.proposals == [] for r in plain), plain
    assert [r.tokens for r in plain] == [r.tokens for r in nextn]
    assert all(len(r.tokens) >= 1 for r in plain)


def test_a_worker_drafts_with_a_sidecar(models):
    """strata-worker --mtp-head: the plain model with the sidecar proposes what the model
    with the same head in its file proposes."""
    with in_process(models["plain"], models["sidecar"]) as stage:
        side = conversation(stage.ask)
    with in_process(models["nextn"]) as stage:
        own = conversation(stage.ask)
    assert [(r.tokens, r.proposals) for r in side] == [(r.tokens, r.proposals) for r in own]
    assert side[0].proposals


def test_strata_worker_refuses_a_sidecar_for_another_model(models, tmp_path):
    from click.testing import CliRunner

    from strata.stage_worker.main import main as worker_main
    other = write_nextn_sidecar(tmp_path / "other.gguf", write_random_gguf(
        tmp_path / "seed2.gguf", TINY, seed=2), TINY, seed=2)
    res = CliRunner().invoke(worker_main, [
        "--model", str(models["plain"]), "--stage", "0", "--layers", "0:4",
        "--listen", f"ipc://{tmp_path}/s0", "--coordinator", f"ipc://{tmp_path}/inbox",
        "--mtp-head", str(other)])
    assert res.exit_code == 2, res.output
    assert "was made for another model" in res.output and "use a head trained for" in res.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_graphs_the_drafter_reads_each_windows_own_hidden_states(models):
    """A CUDA stage replays one graph for two windows of the same shape and answers the
    first after the second is queued: the drafter of the first must read its own hidden
    states (a copy), so proposals equal those of windows answered one at a time. The
    NextN layer changes no token on CUDA either."""
    def drive(model: Path, queued: bool) -> list[tuple[list[int], list[list[int]]]]:
        with in_process(model, device="cuda:0") as stage:
            out = [stage.ask(window(1, [(0, p, t) for p, t in enumerate([72, 101, 108, 9])],
                                    sample=[3], propose=[(0, 2)], chunk=True)),
                   stage.ask(window(2, [(1, p, t) for p, t in enumerate([40, 41, 300, 12])],
                                    sample=[3], propose=[(1, 2)], chunk=True))]
            decode = [window(3 + s, [(s, 4, out[s].tokens[0])], sample=[0], propose=[(s, 3)])
                      for s in (0, 1)]
            if queued:
                for w in decode:
                    stage.send(w)
                stage.step()
                stage.step()
                out += stage.results(2)
            else:
                out += [stage.ask(w) for w in decode]
        return [(r.tokens, r.proposals) for r in out]

    one_at_a_time = drive(models["nextn"], queued=False)
    assert drive(models["nextn"], queued=True) == one_at_a_time
    assert [len(p[0]) for _, p in one_at_a_time] == [3, 3, 4, 4]
    assert [t for t, _ in drive(models["plain"], queued=True)] == [t for t, _ in one_at_a_time]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t,filters", [(0.0, {}), (0.8, {}), (0.8, {"top_k": 12, "top_p": 0.9})],
                         ids=["greedy", "coupled", "filtered"])
def test_on_cuda_the_drafters_graphs_propose_what_it_does_eagerly(models, t, filters):
    """The drafter's steps replayed from graphs (captured per row count) give the proposals
    of the same steps run eagerly at the same padded shapes, window for window; coupled, the
    picks with the draws (and filters) inside the head's graph too."""
    def drive(graph_cache: int) -> list:
        with in_process_worker(models["nextn"], Stage, layer_end=TINY.n_layers, slots=2,
                               ctx=CTX, device="cuda:0", graph_cache=graph_cache) as stage:
            return [(r.tokens, r.proposals) for r in conversation(stage.ask, t, **filters)]

    graphed = drive(16)
    assert graphed == drive(0)
    assert graphed[0][1] and graphed[1][1]
