"""A stage that is both first and last reads a window's `follows` rows from the picks of the
window it computed before (Window.follows, decoding ahead): the tokens are those of the same
windows sent with their tokens, on a CPU (picks on the host) and on CUDA (on the device, read
before the earlier window is answered, graphed and eager); and it refuses, with a sentence,
a window that follows picks it does not hold."""
from __future__ import annotations

import pytest
import torch

from inprocess import in_process_worker
from strata.model.mkmodel import SHAPES, write_random_gguf
from strata.protocol.messages import Error, Result, Window

CTX = 64
PROMPTS = ([72, 101, 108, 108], [40, 41, 300, 12, 9], [7, 8, 9])
# the slots of each decode window after the prompts, in row order: windows of 3, 2 and 1 rows
# (other graphs), a row's sampled row in the window before not its own index
SCHEDULE = ([0, 1, 2], [0, 2], [2, 0], [0], [0])


@pytest.fixture(scope="module")
def nextn_model(tmp_path_factory):
    """The varied model with a NextN layer: the last stage's drafter keeps every window's
    rows and tokens, so it must see the picks a window followed."""
    return write_random_gguf(tmp_path_factory.mktemp("ahead") / "nextn.gguf", SHAPES["tiny"],
                             seed=1, std=0.2, tied=False, nextn=True)


def window(id: int, rows, *, temperature=0.0, chunk=False, after=-1, follows=(),
           penalty=(), propose=()) -> Window:
    """rows: (slot, position, token); every row of a decode window samples, a chunk's last."""
    sample = [len(rows) - 1] if chunk else list(range(len(rows)))
    m = len(sample)
    slots, positions, tokens = (list(c) for c in zip(*rows))
    return Window(id, slots, positions, tokens, sample_rows=sample,
                  temperature=[temperature] * m, top_k=[0] * m, top_p=[1.0] * m,
                  min_p=[0.0] * m, u=[0.37] * m, chunk=chunk, after=after, follows=list(follows),
                  propose=[list(p) for p in propose],
                  penalty=[list(penalty)] * m if penalty else [],
                  output_start=[0] * m if penalty else [])


def chunk(s: int) -> Window:
    """Slot s's prompt in one chunk, whose last row samples."""
    return window(1 + s, [(s, p, t) for p, t in enumerate(PROMPTS[s])], chunk=True)


def prompts(stage) -> list[int]:
    """The prompts read, one chunk each; the first token of each slot."""
    return [stage.ask(chunk(s)).tokens[0] for s in range(len(PROMPTS))]


def decode(stage, ahead: bool, temperature: float) -> list:
    """The prompts, the SCHEDULE's decode windows, then one more (given its tokens) that asks
    the drafter, if there is one, for proposals. Given their tokens, each is sent once the one
    before is answered; ahead, the last prompt's chunk and every decode window are sent before
    the stage takes the first of them (so on CUDA none is answered when the next comes), each
    decode window's rows reading the picks of the window before (the first, slot 2's first
    token from its chunk). Returns the last chunk's token, each decode window's tokens and
    the last one's proposals."""
    last, position = prompts(stage), [len(p) for p in PROMPTS]   # by slot
    out = []
    if ahead:
        stage.send(chunk(2))   # read again from position 0, as its slot's commit-free twin
    for i, slots in enumerate(SCHEDULE):
        before = SCHEDULE[i - 1] if i else [2]
        rows = [(s, position[s], last[s] if not ahead or (i == 0 and s != 2) else 0)
                for s in slots]
        if not ahead:
            out.append(stage.ask(window(10 + i, rows, temperature=temperature)).tokens)
            last = last[:]
            for s, t in zip(slots, out[-1]):
                last[s] = t
        else:
            follows = [before.index(s) if s in before else -1 for s in slots]
            stage.send(window(10 + i, rows, temperature=temperature, after=9 + i if i else 3,
                              follows=follows))
        for s in slots:
            position[s] += 1
    if ahead:
        for _ in range(len(SCHEDULE) + 1):
            stage.step()
        first, *windows = stage.answers(len(SCHEDULE) + 1)
        assert first.tokens == [last[2]]   # the chunk read again samples the same token
        out = [r.tokens for r in windows]
    slots = SCHEDULE[-1]
    end = stage.ask(window(10 + len(SCHEDULE), [(s, position[s], t)
                                                for s, t in zip(slots, out[-1])],
                           temperature=temperature, propose=[(s, 2) for s in slots]))
    return out + [end.tokens, end.proposals]


CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
# a graph cache of 1 evicts each window's graph for the next shape's
DEVICES = [pytest.param("cpu", 0, id="cpu"),
           pytest.param("cuda:0", 16, id="cuda-graphs", marks=CUDA),
           pytest.param("cuda:0", 1, id="cuda-one-graph", marks=CUDA),
           pytest.param("cuda:0", 0, id="cuda-eager", marks=CUDA)]


@pytest.mark.parametrize("device,graphs", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
@pytest.mark.parametrize("drafter", [False, True], ids=["plain", "nextn"])
def test_rows_that_follow_the_picks_get_the_tokens_of_rows_given_them(
        varied_model, nextn_model, device, graphs, temperature, drafter):
    """The same tokens, and with a NextN layer the same proposals after them (its drafter
    kept the picks the rows followed)."""
    def run(ahead: bool) -> list:
        with in_process_worker(nextn_model if drafter else varied_model, layer_end=4, ctx=CTX,
                               slots=3, device=device, graph_cache=graphs) as stage:
            return decode(stage, ahead, temperature)

    given = run(ahead=False)
    assert run(ahead=True) == given
    assert len({t for r in given[:-1] for t in r}) > 3   # varied text: a wrong token shows
    assert [len(p) for p in given[-1]] == ([3] if drafter else [])


def test_a_window_following_picks_the_stage_lacks_is_refused(varied_model):
    with in_process_worker(varied_model, layer_end=4, ctx=CTX, slots=3) as stage:
        first = prompts(stage)
        ok = stage.ask(window(10, [(0, 4, first[0]), (1, 5, first[1])]))
        assert isinstance(ok, Result) and len(ok.tokens) == 2
        cases = [
            (window(11, [(0, 5, 0)], after=3, follows=[0]), "last window this stage computed"),
            (window(12, [(0, 5, 0)], after=10, follows=[2]), "which sampled 2"),
            (window(13, [(0, 5, 0)], after=10, follows=[0], penalty=(1.2, 0.0, 0.0)),
             "penalties"),
        ]
        for w, words in cases:
            answer = stage.ask(w)
            assert isinstance(answer, Error) and words in answer.message, answer
        # refused windows change nothing, and are no window computed: 10's picks still stand
        again = stage.ask(window(14, [(0, 5, 0), (1, 6, 0)], after=10, follows=[0, 1]))
        given = stage.ask(window(15, [(0, 5, ok.tokens[0]), (1, 6, ok.tokens[1])]))
        assert isinstance(again, Result) and again.tokens == given.tokens
        pad = stage.ask(Window(16, [-1], [0], [0]))   # a window that samples nothing
        assert isinstance(pad, Result) and pad.tokens == []
        answer = stage.ask(window(17, [(0, 6, 0)], after=16, follows=[0]))
        assert isinstance(answer, Error) and "which sampled 0" in answer.message, answer


def test_only_a_stage_that_is_first_and_last_takes_follows(varied_model):
    with in_process_worker(varied_model, layer_end=2, ctx=CTX, slots=1) as stage:
        answer = stage.ask(window(1, [(0, 0, 5)], after=0, follows=[0]))
        assert isinstance(answer, Error) and "both first and last" in answer.message, answer
