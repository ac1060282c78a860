"""strata.kernels (attention, RoPE, norms, sampling) against plain references, and the
row-independence that DESIGN.md's exactness contract rests on (points 1-3)."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from strata.coordinator.sampling_params import SamplingParams, draw_uniform
from strata.kernels.attention.window import SPAN, attend, attend_reference, span_of
from strata.kernels.norms import rms_norm, swiglu
from strata.kernels.rope import apply_rope, rope_table
from strata.kernels.sampling.sample import (SamplingRow, gumbel_noise, sample_row, sample_rows,
                                            sample_rows_on_device)
from strata.model.gguf_file import ModelFile
from strata.stage_worker.model import KVCache, Rows, StageModel

# attention test geometry: 4 query heads over 2 kv heads (GQA group 2), several spans of keys
N_SLOTS, N_HEADS, N_KV, HD, CTX = 5, 4, 2, 16, 4 * SPAN
WINDOW = 8  # the fixed row count of decode windows and prompt chunks in these tests


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def caches():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(N_SLOTS, N_KV, CTX, HD, generator=g)
    v = torch.randn(N_SLOTS, N_KV, CTX, HD, generator=g)
    return k, v


def _q(n_rows: int, seed: int) -> torch.Tensor:
    return torch.randn(n_rows, N_HEADS, HD, generator=torch.Generator().manual_seed(seed))


# --- attention ------------------------------------------------------------------------------

def test_span_of():
    assert span_of(0, CTX) == SPAN and span_of(SPAN - 1, CTX) == SPAN
    assert span_of(SPAN, CTX) == 2 * SPAN
    assert span_of(CTX - 1, CTX) == CTX
    assert span_of(100, 80) == 80  # never past the cache


def test_attend_matches_reference(caches):
    k, v = caches
    # slots and positions spanning every SPAN boundary; pad rows (slot -1) between them
    slots = [0, 1, -1, 2, 3, 4, 0, -1, 1, 2, 3, 4, 0, 1]
    positions = [0, 1, 5, SPAN - 1, SPAN, SPAN + 1, 2 * SPAN - 1, 0, 2 * SPAN, 3 * SPAN - 2,
                 3 * SPAN, CTX - 1, 17, 130]
    q = _q(len(slots), 1)
    out = attend(q, k, v, slots, positions)
    ref = attend_reference(q, k, v, slots, positions)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    for r, s in enumerate(slots):
        if s < 0:
            assert torch.equal(out[r], torch.zeros_like(out[r])), f"pad row {r} is not zero"
        else:
            assert out[r].abs().sum() > 0


def test_attend_reference_is_a_real_reference(caches):
    # position 0 attends only to its own key: the output is exactly that value (per kv group)
    k, v = caches
    q = _q(1, 2)
    out = attend_reference(q, k, v, [3], [0])
    expected = v[3, :, 0].repeat_interleave(N_HEADS // N_KV, dim=0)
    torch.testing.assert_close(out[0], expected, rtol=0, atol=1e-6)
    # a row with all-equal keys averages its values uniformly
    k2 = torch.zeros_like(k)
    out = attend_reference(q, k2, v, [1], [9])
    expected = v[1, :, :10].mean(1).repeat_interleave(N_HEADS // N_KV, dim=0)
    torch.testing.assert_close(out[0], expected, rtol=0, atol=1e-6)


def test_attend_ignores_keys_after_the_position(caches):
    k, v = caches
    q = _q(WINDOW, 3)
    slots, positions = [2] * WINDOW, [40 + i for i in range(WINDOW)]
    out = attend(q, k, v, slots, positions)
    k2, v2 = k.clone(), v.clone()
    k2[2, :, 48:] = 1e3  # keys and values past every row's position (same span)
    v2[2, :, 48:] = -7.0
    assert torch.equal(attend(q, k2, v2, slots, positions), out)


# Rows whose output is checked for independence: (slot, position), over several spans
TARGETS = [(0, 0), (1, 5), (2, SPAN - 1), (3, SPAN), (4, 130), (0, 200), (1, CTX - 1)]


def _window_with(target_q, target, neighbours, at, size, seed):
    """A window of `size` rows: the target row at index `at`, neighbour rows elsewhere (then
    pad rows). Neighbour queries are random."""
    q = _q(size, seed)
    slots, positions = [-1] * size, [0] * size
    others = iter(neighbours)
    for r in range(size):
        if r == at:
            q[r] = target_q
            slots[r], positions[r] = target
        else:
            nb = next(others, None)
            if nb is not None:
                slots[r], positions[r] = nb
    return q, slots, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_row_independence(caches, dtype):
    """A row's attention output is bit-identical alone (beside pad rows) and beside other rows
    of other slots and positions (in the same span or not), in windows of different sizes."""
    k, v = (c.to(dtype) for c in caches)
    rng = np.random.default_rng(0)
    for i, target in enumerate(TARGETS):
        tq = _q(1, 100 + i)[0].to(dtype)
        alone_q, s, p = _window_with(tq, target, [], 0, WINDOW, 0)
        alone = attend(alone_q.to(dtype), k, v, s, p)[0]
        # the same row as the single row of a 1-row window
        one = attend(tq[None], k, v, [target[0]], [target[1]])[0]
        assert torch.equal(one, alone)
        same_span = [(x, target[1] + d) for x, d in ((3, 1), (4, 0), (0, -1), (2, 0))
                     if 0 <= target[1] + d < CTX and span_of(target[1] + d, CTX)
                     == span_of(target[1], CTX)]
        for trial, size in enumerate([WINDOW, WINDOW, 3, 16, 32]):
            neighbours = same_span + [(int(rng.integers(N_SLOTS)), int(rng.integers(CTX)))
                                      for _ in range(size)]
            at = int(rng.integers(size))
            wq, s, p = _window_with(tq, target, neighbours, at, size, seed=10 * i + trial)
            out = attend(wq.to(dtype), k, v, s, p)
            assert torch.equal(out[at], alone), (target, size, at)


# --- RoPE and norms -------------------------------------------------------------------------

def _rope_complex(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, base: float):
    """Reference: adjacent pairs (2i, 2i+1) as complex numbers times e^{i p theta_i}."""
    xd = x.double()
    pairs = torch.complex(xd[..., :rope_dim:2], xd[..., 1:rope_dim:2])   # [R, H, rope_dim/2]
    theta = base ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angle = positions.double()[:, None] * theta[None, :]                  # [R, rope_dim/2]
    rotated = pairs * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    out = xd.clone()
    out[..., :rope_dim:2], out[..., 1:rope_dim:2] = rotated.real, rotated.imag
    return out


@pytest.mark.parametrize("rope_dim, base", [(16, 10000.0), (16, 500000.0), (8, 10000.0)])
def test_apply_rope_matches_complex_reference(rope_dim, base):
    hd, max_pos = 16, 300
    cos, sin = rope_table(rope_dim, base, max_pos)
    assert cos.shape == (max_pos, rope_dim // 2) and cos.dtype == torch.float32
    positions = torch.tensor([0, 1, 2, 7, 63, 64, 100, 255, 299])
    x = torch.randn(len(positions), 3, hd, generator=torch.Generator().manual_seed(4))
    out = apply_rope(x, cos[positions], sin[positions])
    ref = _rope_complex(x, positions, rope_dim, base)
    assert out.shape == x.shape and out.dtype == x.dtype
    # fp32 angles lose ~p * 6e-8 rad; values are O(1)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=5e-5)
    assert torch.equal(out[0], x[0])                       # position 0: no rotation
    assert torch.equal(out[..., rope_dim:], x[..., rope_dim:])  # partial RoPE leaves the tail
    # a rotation keeps each pair's length
    norms = lambda t: t[..., :rope_dim].unflatten(-1, (-1, 2)).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(norms(out), norms(x), rtol=1e-5, atol=1e-6)


def test_rope_preserves_relative_position_scores():
    # q.k after RoPE depends on the position difference only
    cos, sin = rope_table(16, 10000.0, 200)
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 1, 16, generator=g), torch.randn(1, 1, 16, generator=g)
    rot = lambda x, p: apply_rope(x, cos[[p]], sin[[p]])  # noqa: E731
    s1 = (rot(q, 10) * rot(k, 3)).sum()
    s2 = (rot(q, 110) * rot(k, 103)).sum()
    torch.testing.assert_close(s1, s2, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_float64(dtype):
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(7, 96, generator=g) * 3 + 0.5).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    eps = 1e-5
    out = rms_norm(x, w, eps)
    xd = x.double()
    ref = w.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    assert out.dtype == dtype and out.shape == x.shape
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    # eps matters for a zero row: the output is zero, not NaN
    assert torch.equal(rms_norm(torch.zeros(1, 96, dtype=dtype), w, eps),
                       torch.zeros(1, 96, dtype=dtype))


def test_swiglu_matches_float64():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 32, generator=g)
    wg, wu, wd = (torch.randn(*s, generator=g) * 0.2 for s in ((48, 32), (48, 32), (32, 48)))
    xd, a = x.double(), x.double() @ wg.double().T
    ref = ((a * torch.sigmoid(a)) * (xd @ wu.double().T)) @ wd.double().T
    torch.testing.assert_close(swiglu(x, wg, wu, wd).double(), ref, rtol=1e-5, atol=1e-5)


# --- the stage model: row independence of prompt chunks and decode windows ------------------

@pytest.fixture(scope="module")
def tiny_stage(tiny_model):
    file = ModelFile(tiny_model)
    return StageModel(file, 0, file.config.n_layers, ctx=CTX)


def _cache(stage: StageModel, n_slots: int) -> KVCache:
    return KVCache(len(stage.layers), n_slots, stage.cfg, CTX, torch.device("cpu"), torch.float32)


def _run(stage, cache, rows: list[tuple[int, int, int]], size: int = WINDOW) -> torch.Tensor:
    """One window: rows (slot, position, token), padded to `size` rows. Returns hidden [size, D]."""
    rows = rows + [(-1, 0, 0)] * (size - len(rows))
    with torch.inference_mode():
        hidden = stage(torch.tensor([t for _, _, t in rows]),
                       Rows([s for s, _, _ in rows], [p for _, p, _ in rows]), cache)
    for s, p, _ in rows:
        if s >= 0:
            cache.filled[s] = max(cache.filled[s], p + 1)
    return hidden


def _read_prompt(stage, cache, slot, tokens, first_chunk=WINDOW) -> torch.Tensor:
    """Reads the prompt in WINDOW-row chunks, the first one `first_chunk` rows (padded).
    Returns the hidden state of every position [len(tokens), D]."""
    out, start = [], 0
    bounds = [0, first_chunk] + list(range(first_chunk + WINDOW, len(tokens), WINDOW))
    bounds = sorted(set(b for b in bounds if b < len(tokens))) + [len(tokens)]
    for a, b in zip(bounds, bounds[1:]):
        assert b - a <= WINDOW
        hidden = _run(stage, cache, [(slot, p, tokens[p]) for p in range(a, b)])
        out.append(hidden[: b - a])
        start = b
    assert start == len(tokens)
    return torch.cat(out)


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 320, size=n).tolist()


def _kv(cache: KVCache, slot: int, n: int):
    return [t[slot, :, :n].clone() for t in cache.k + cache.v]


@pytest.mark.parametrize("first_chunk", [1, 3, 7])
def test_prompt_chunk_alignment_gives_identical_kv(tiny_stage, first_chunk):
    """DESIGN.md exactness 2: a prompt gives the same KV and hidden states whether its chunks
    start at 0 or are offset (as when it is resumed from a cache at any point)."""
    tokens = _prompt(150, seed=1)  # 150 positions: three SPANs of keys
    a = _cache(tiny_stage, 2)
    ref_hidden = _read_prompt(tiny_stage, a, 0, tokens)
    b = _cache(tiny_stage, 2)
    hidden = _read_prompt(tiny_stage, b, 1, tokens, first_chunk)   # another slot, too
    assert torch.equal(hidden, ref_hidden)
    for x, y in zip(_kv(a, 0, len(tokens)), _kv(b, 1, len(tokens))):
        assert torch.equal(x, y)
    assert ref_hidden.abs().sum() > 0 and a.k[0][0, :, : len(tokens)].abs().sum() > 0


def test_prompt_resumed_from_a_cache_gives_identical_kv(tiny_stage):
    """Read 37 positions, keep 21 of them (a commit), and read the rest again from 21: the
    result equals reading the prompt straight through."""
    tokens = _prompt(90, seed=2)
    a = _cache(tiny_stage, 1)
    ref_hidden = _read_prompt(tiny_stage, a, 0, tokens)
    b = _cache(tiny_stage, 1)
    _read_prompt(tiny_stage, b, 0, tokens[:37] + _prompt(3, seed=9))  # 3 stray positions
    b.trim(0, 21)   # positions 21-39 keep stray values, never read: each is written again first
    assert b.filled[0] == 21 and b.k[0][0, :, 21:40].abs().sum() > 0
    rest, start = [], 21
    while start < len(tokens):
        end = min(start + WINDOW, len(tokens))
        rest.append(_run(tiny_stage, b, [(0, p, tokens[p]) for p in range(start, end)])
                    [: end - start])
        start = end
    assert torch.equal(torch.cat(rest), ref_hidden[21:])
    for x, y in zip(_kv(a, 0, len(tokens)), _kv(b, 0, len(tokens))):
        assert torch.equal(x, y)


def test_decode_row_alone_equals_row_among_other_slots(tiny_stage):
    """DESIGN.md exactness 1: in a fixed WINDOW-row decode window, slot 0's row gives the same
    hidden state and KV alone (beside pad rows) as beside 7 other slots' rows, at any index."""
    n_slots = WINDOW
    prompts = [_prompt(20 + 9 * s, seed=20 + s) for s in range(n_slots)]
    alone, together = _cache(tiny_stage, n_slots), _cache(tiny_stage, n_slots)
    for cache in (alone, together):
        for s, pr in enumerate(prompts):
            _read_prompt(tiny_stage, cache, s, pr)
    for step, at in enumerate([0, 5, 7]):
        next_tokens = _prompt(n_slots, seed=50 + step)
        rows = [(s, len(prompts[s]) + step, next_tokens[s]) for s in range(n_slots)]
        h_alone = _run(tiny_stage, alone, [rows[0]])[0]
        # slot 0's row at index `at` among the others
        others = rows[1:]
        order = others[:at] + [rows[0]] + others[at:]
        h_together = _run(tiny_stage, together, order)[at]
        assert torch.equal(h_alone, h_together), f"step {step}, index {at}"
        p = rows[0][1]
        for x, y in zip(alone.k + alone.v, together.k + together.v):
            assert torch.equal(x[0, :, : p + 1], y[0, :, : p + 1])
        # catch the other slots up in `alone`, one at a time, so both caches stay equal
        for r in rows[1:]:
            _run(tiny_stage, alone, [r])
    # and the logits (head in fixed-shape blocks) then agree too
    torch.testing.assert_close(tiny_stage.logits(h_alone[None]),
                               tiny_stage.logits(h_together[None]), rtol=0, atol=0)


# --- sampling (the last stage) --------------------------------------------------------------

def _logits(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_greedy_is_argmax_first_index_on_ties():
    assert sample_row(_logits([0.1, 3.0, -2.0, 2.9]), SamplingRow()) == 1
    assert sample_row(_logits([1.0, 5.0, 2.0, 5.0, 5.0]), SamplingRow(u=0.99)) == 1
    assert sample_row(_logits([7.0, 7.0]), SamplingRow(temperature=0.0, u=0.9)) == 0
    assert sample_row(_logits([1.0, 5.0, 2.0]).to(torch.bfloat16), SamplingRow()) == 1


LOGITS = _logits([0.5, 2.0, -1.0, 1.0, 0.0, 1.5, -0.5, 0.25])  # distinct values
BY_PROB = torch.argsort(LOGITS, descending=True).tolist()       # [1, 5, 3, 0, 7, 4, 6, 2]


def _picked(logits, n: int = 512, **kw) -> set[int]:
    """The tokens sample_row picks over n draws spread over [0, 1)."""
    return {sample_row(logits, SamplingRow(u=(i + 0.5) / n, **kw)) for i in range(n)}


def test_every_kept_token_can_be_picked():
    for t in (1.0, 3.0):
        assert _picked(LOGITS, 4000, temperature=t) == set(range(8))
    assert _picked(LOGITS, temperature=1.0, top_k=3) == set(BY_PROB[:3])


def test_ties_are_ordered_by_token_id():
    """Four tokens tie for the top; top_k 3 keeps the three of lowest id."""
    logits = _logits([1.0, 3.0, 3.0, 3.0, 3.0, -10.0])
    assert _picked(logits, temperature=1.0, top_k=3) == {1, 2, 3}


def test_top_k_one_is_greedy_for_any_u():
    for u in np.linspace(0, 1, 21, endpoint=False):
        for t in (0.3, 1.0, 10.0):
            assert sample_row(LOGITS, SamplingRow(temperature=t, top_k=1, u=float(u))) == 1


def test_tiny_top_p_keeps_one_token():
    for u in (0.0, 0.3, 0.999999):
        assert sample_row(LOGITS, SamplingRow(temperature=1.0, top_p=1e-6, u=u)) == 1


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # probabilities 0.5, 0.3, 0.2 at T=1
    logits = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    kept = lambda **kw: _picked(logits, temperature=1.0, **kw)  # noqa: E731
    assert kept(top_p=0.45) == {1}          # 0.5 alone reaches 0.45
    assert kept(top_p=0.7) == {1, 2}        # 0.5 + 0.3 reaches 0.7
    assert kept(top_p=0.9) == {0, 1, 2}     # all three
    assert kept(top_p=1.0) == {0, 1, 2}


def test_min_p_filters_tokens_below_a_fraction_of_the_top():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15]))
    kept = lambda mp: _picked(logits, temperature=1.0, min_p=mp)  # noqa: E731
    assert kept(0.0) == {0, 1, 2, 3}   # nothing filtered
    assert kept(0.2) == {1, 2, 3}      # keeps p >= 0.1: 0.5, 0.3, 0.15
    assert kept(0.5) == {1, 2}         # keeps p >= 0.25
    assert kept(0.9) == {1}            # keeps only the top
    assert kept(1.0) == {1}


def _empirical(logits, row: SamplingRow, n: int = 40000) -> np.ndarray:
    """The share of each token over n draws spread over [0, 1) (the window's sampler, whose
    tokens are sample_row's: tests/kernels/test_sampling.py)."""
    rows = [SamplingRow(row.temperature, row.top_k, row.top_p, row.min_p, u=(i + 0.5) / n)
            for i in range(n)]
    picks = sample_rows_on_device(logits.expand(n, -1), rows)
    return np.bincount(picks.numpy(), minlength=logits.numel()) / n


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_distribution_matches_softmax(temperature):
    got = _empirical(LOGITS, SamplingRow(temperature=temperature))
    want = torch.softmax(LOGITS.double() / temperature, 0).numpy()
    np.testing.assert_allclose(got, want, atol=0.01)   # 4 standard errors


def test_distribution_with_top_k_is_renormalised():
    got = _empirical(LOGITS, SamplingRow(temperature=1.0, top_k=3))
    want = np.zeros(LOGITS.numel())
    top = BY_PROB[:3]
    want[top] = torch.softmax(LOGITS[top].double(), 0).numpy()
    np.testing.assert_allclose(got, want, atol=0.01)


def test_sampling_is_deterministic():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 320, generator=g) * 3
    rows = [SamplingRow(0.8, 50, 0.9, 0.02, u=draw_uniform(123, p)) for p in range(4)]
    first = sample_rows(logits, rows)
    assert first == sample_rows(logits.clone(), rows)
    assert first == [sample_row(logits[i], r) for i, r in enumerate(rows)]
    # sample_rows takes the first len(rows) rows of a padded block
    padded = torch.cat([logits, torch.zeros(4, 320)])
    assert sample_rows(padded, rows) == first


# --- the coordinator's uniform draws and parameters -----------------------------------------

def test_draw_uniform_depends_only_on_seed_and_position():
    seeds, positions = [0, 1, 123456789, 2**63 + 5, 2**64 - 1], [0, 1, 2, 100, 8191, 10**6]
    table = {(s, p): draw_uniform(s, p) for s in seeds for p in positions}
    assert all(0.0 <= u < 1.0 for u in table.values())
    # any order of calls, repeated: the same numbers
    for s, p in reversed(list(table)):
        assert draw_uniform(s, p) == table[(s, p)]
    assert len(set(table.values())) == len(table)  # different keys give different draws
    # spread: draws over many positions look uniform
    us = np.array([draw_uniform(7, p) for p in range(2000)])
    assert abs(us.mean() - 0.5) < 0.03 and us.min() < 0.01 and us.max() > 0.99


@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=-0.1), ["temperature", "use 0 for greedy"]),
    (dict(top_k=-1), ["top_k", "use 0 to turn it off"]),
    (dict(top_p=0.0), ["top_p", "(0, 1]", "use 1 to turn it off"]),
    (dict(top_p=1.5), ["top_p", "use 1 to turn it off"]),
    (dict(min_p=-0.1), ["min_p", "use 0 to turn it off"]),
    (dict(min_p=1.1), ["min_p", "[0, 1]"]),
    (dict(max_tokens=0), ["max_tokens", "below 1"]),
    (dict(seed=-1), ["seed", "[0, 2**64)"]),
    (dict(seed=2**64), ["seed", "[0, 2**64)"]),
])
def test_sampling_params_errors_say_what_to_change(kwargs, words):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    for w in words:
        assert w in str(info.value)


def test_sampling_params_with_seed():
    p = SamplingParams(temperature=0.7, top_k=5)
    a = p.with_seed()
    assert a.seed is not None and 0 <= a.seed < 2**64
    assert (a.temperature, a.top_k) == (0.7, 5)
    fixed = SamplingParams(seed=42)
    assert fixed.with_seed() is fixed


def _sample_row_full_sort(logits: torch.Tensor, row: SamplingRow) -> int:
    """sample_row as first written: the whole vocabulary stably sorted, then cut to top_k."""
    scaled = logits.double() / row.temperature
    order = torch.argsort(scaled, descending=True, stable=True)
    if 0 < row.top_k < order.numel():
        order = order[: row.top_k]
    probs = torch.softmax(scaled[order], dim=0)
    keep = probs.numel()
    if row.top_p < 1.0:
        cum = torch.cumsum(probs, dim=0)
        keep = min(keep, int(torch.searchsorted(cum, torch.tensor(row.top_p, dtype=cum.dtype))) + 1)
    if row.min_p > 0.0:
        keep = min(keep, max(1, int((probs >= row.min_p * probs[0]).sum())))
    kept = order[:keep]
    u = torch.tensor([[row.u]], dtype=torch.float64)
    score = scaled[kept] + gumbel_noise(u, kept[None])[0]   # the Gumbel-max pick
    score = torch.where(torch.isnan(score), float("-inf"), score)
    return int(kept[int(score.argmax())])


@pytest.mark.parametrize("vocab,levels", [(1000, 0), (1000, 7), (128256, 0), (49152, 40)])
def test_top_k_without_a_full_sort_picks_the_same_tokens(vocab, levels):
    """levels > 0 rounds logits to few values, so ties at the k-th value are everywhere."""
    g = torch.Generator().manual_seed(vocab + levels)
    for trial in range(12):
        logits = torch.randn(vocab, generator=g) * 3
        if levels:
            logits = torch.round(logits * levels / 3) / levels
        for top_k in (1, 2, 20, 50, vocab - 1, vocab, 0):
            for u in (0.0, 0.37, 0.999999):
                row = SamplingRow(temperature=0.5 + trial / 8, top_k=top_k,
                                  top_p=(1.0, 0.9, 0.5)[trial % 3],
                                  min_p=(0.0, 0.05)[trial % 2], u=u)
                if top_k == 0 and vocab > 50_000 and trial > 1:
                    continue  # the full sort is the path itself here: two trials suffice
                assert sample_row(logits, row) == _sample_row_full_sort(logits, row), (top_k, u)


def test_top_k_with_nan_logits_picks_what_the_full_sort_picks():
    logits = torch.tensor([1.0, float("nan"), 2.0, 0.0, float("-inf"), 2.0])
    for top_k in (1, 2, 3, 5):
        for u in (0.0, 0.5, 0.99):
            row = SamplingRow(temperature=0.8, top_k=top_k, u=u)
            assert sample_row(logits, row) == _sample_row_full_sort(logits, row)
