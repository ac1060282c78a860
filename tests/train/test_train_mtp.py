"""strata-train-mtp: the prompts, the training forward against what strata's stages and drafter
compute, the sidecar it writes, a whole run on a tiny model, and the head shipped for SmolLM2."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

from strata.model.gguf_file import ModelError, ModelFile
from strata.model.mkmodel import SHAPES, write_nextn_sidecar
from strata.model.nextn import SHIPPED_HEADS, find_head, open_head, shipped_head
from strata.stage_worker.drafter import Drafter
from strata.stage_worker.model import KVCache, Rows, StageModel
from strata.train import cli
from strata.coordinator.sampling_params import SamplingParams
from strata.train.data import Sample, split_kept, teacher_states
from strata.train.export import write_head
from strata.train.fit import FitConfig, acceptance, fit, soft_loss
from strata.train.head import NextNHead
from strata.train.prompts import (Prompt, heldout, read_conversations, read_prompts,
                                  user_turns, write_prompts)
from strata.train.run import Job

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_conversations_are_read_one_by_one_until_the_cut():
    items = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}]}
             for i in range(3)]
    text = json.dumps(items, indent=2)
    assert [c["id"] for c in read_conversations(text)] == ["0", "1", "2"]
    cut = text[:text.index('"2"') + 5]   # the last conversation is cut short
    assert [c["id"] for c in read_conversations(cut)] == ["0", "1"]


def test_the_held_out_share_is_stable_and_near_its_fraction():
    ids = [f"conv{i}" for i in range(4000)]
    share = sum(heldout(i, 0.05) for i in ids) / len(ids)
    assert 0.03 < share < 0.07
    assert [heldout(i, 0.05) for i in ids] == [heldout(i, 0.05) for i in ids]


def test_a_prompts_file_is_checked_line_by_line(tmp_path):
    with pytest.raises(ValueError, match="no such file; give a JSONL file"):
        read_prompts(tmp_path / "none.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "split": "train"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match="line 2 is not a JSON object"):
        read_prompts(bad)
    bad.write_text('{"prompt": "a", "split": "test"}\n')
    with pytest.raises(ValueError, match='line 1 is not a JSON object .* "split" of'):
        read_prompts(bad)


def test_a_prompt_may_hold_any_line_separator(tmp_path):
    """ShareGPT prompts hold U+2028 and the like: written by write_prompts or by hand, a
    line of the file is still one prompt (str.splitlines would cut it)."""
    texts = ["a\u2028b", "c\x85d\re", "f\u2029g"]
    ours, raw = tmp_path / "ours.jsonl", tmp_path / "raw.jsonl"
    write_prompts(ours, [Prompt(t, "heldout") for t in texts])
    raw.write_text("".join(json.dumps({"prompt": t, "split": "heldout"}, ensure_ascii=False)
                           + "\n" for t in texts), encoding="utf-8")
    for path in (ours, raw):
        assert [p.text for p in read_prompts(path)] == texts


def test_later_turns_come_with_the_conversation_before_them(tmp_path):
    """--turns: each user turn after the turns before it, while the speakers alternate and the
    chat fits max_chars; from the first human turn on, which is all that --turns 1 takes."""
    chat = [{"from": "system", "value": "be brief"}, {"from": "human", "value": "a"},
            {"from": "gpt", "value": "b "}, {"from": "human", "value": " c"},
            {"from": "gpt", "value": "d"}, {"from": "human", "value": "e"}]
    a_b = (("user", "a"), ("assistant", "b"))
    assert list(user_turns(chat, 1, 100)) == [("a", ())]
    assert list(user_turns(chat, 5, 100)) == [
        ("a", ()), ("c", a_b), ("e", a_b + (("user", "c"), ("assistant", "d")))]
    assert list(user_turns(chat, 5, 3)) == [("a", ()), ("c", a_b)]         # "e" would pass 3
    twice = chat[:2] + [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]
    assert list(user_turns(twice, 5, 100)) == [("a", ())]                  # out of order: stop
    # the file keeps them, the chat renders them, and a bad history is a sentence
    later = Prompt("c", "train", a_b)
    assert later.messages() == [{"role": "user", "content": "a"},
                                {"role": "assistant", "content": "b"},
                                {"role": "user", "content": "c"}]
    path = tmp_path / "turns.jsonl"
    write_prompts(path, [Prompt("a", "train"), later])
    assert read_prompts(path) == [Prompt("a", "train"), later]
    path.write_text('{"prompt": "c", "split": "train", "history": [["assistant", "b"]]}\n')
    with pytest.raises(ValueError, match="line 1's \"history\" is not a list"):
        read_prompts(path)


def test_the_target_writes_prompts_of_its_own(smollm2):
    """--self-prompts: SmolLM2 continues its chat template's open user turn until the turn
    ends; the prompts are training prompts, seeded (the same again), and each ended its turn
    within max_prompt_tokens / 2 tokens."""
    from strata.train.data import open_user_turn
    job = Job(model=str(smollm2), devices="cpu", batch=4, batch_groups="1",
              max_prompt_tokens=96, answer_tokens=16)
    assert open_user_turn(job.tok).endswith("<|im_end|>\n<|im_start|>user\n")
    own = job.self_prompts(4, 1.0)
    assert 1 <= len(own) <= 4 and len({p.text for p in own}) == len(own)
    assert all(p.split == "train" and p.text.strip() == p.text != "" and not p.history
               for p in own)
    assert all(len(job.tok.encode(p.text)) <= 48 for p in own)
    assert job.self_prompts(4, 1.0) == own


def test_the_benchmarks_refuse_a_later_turn(tmp_path):
    from strata.bench.harness import read_prompts as bench_prompts
    path = tmp_path / "turns.jsonl"
    write_prompts(path, [Prompt("a", "train"), Prompt("c", "train", (("user", "a"),
                                                                     ("assistant", "b")))])
    with pytest.raises(ValueError, match="prompt 2 is a later turn"):
        bench_prompts(str(path), "all")


@pytest.fixture(scope="module", params=["model-width", "wider"])
def varied_with_head(varied_model, tmp_path_factory, request):
    """The varied tiny model and a random NextN sidecar for it (std 0.2: lively logits): a
    block of the model's shapes, or one with a feed-forward layer three times as wide."""
    shape = SHAPES["tiny"]
    if request.param == "wider":
        shape = replace(shape, d_ffn=3 * shape.d_ffn)
    path = tmp_path_factory.mktemp("heads") / "head.gguf"
    write_nextn_sidecar(path, varied_model, shape, seed=3, std=0.2)
    return varied_model, path


def test_the_training_forward_computes_what_the_stages_and_the_drafter_do(varied_with_head):
    """Target.hidden equals a one-stage StageModel's hidden states, and every pass of
    NextNHead equals the drafter's rows: its NextN rows on those states, and the rows it
    chains from a row's output with the next token (positions 2 and 3)."""
    model, sidecar = varied_with_head
    job = Job(model=str(model), devices="cpu", max_prompt_tokens=40, answer_tokens=20)
    file, cfg = job.file, job.file.config
    torch.manual_seed(0)
    t = 24
    tokens = torch.randint(0, cfg.vocab, (1, t))
    h = job.target.hidden(tokens)
    stage = StageModel(file, 0, cfg.n_layers, ctx=64)
    cache = KVCache(cfg.n_layers, 1, cfg, 64, stage.device, stage.dtype)
    ref = stage(tokens[0], Rows([0] * t, list(range(t))), cache, chunk=True)
    torch.testing.assert_close(h[0], ref, atol=2e-4, rtol=1e-4)

    outs = job.head(str(sidecar)).passes(tokens, h, 3)
    source = find_head(file, sidecar)
    for j in (0, 7, 20):
        drafter = Drafter(source, file, stage, 1, 64)
        x = drafter._rows([0] * (t - 1), list(range(1, t)), tokens[0, 1:], h[0, :-1])
        torch.testing.assert_close(drafter.logits(x), outs[0][0], atol=1e-4, rtol=1e-4)
        x = x[j:j + 1]
        for k in (2, 3):
            if j + k >= t:
                break
            x = drafter._rows([0], [j + k], tokens[0, j + k:j + k + 1], x)
            torch.testing.assert_close(drafter.logits(x)[0], outs[k - 1][0, j],
                                       atol=1e-4, rtol=1e-4)


def test_the_sidecar_holds_the_trained_tensors_and_fits_only_its_model(varied_with_head,
                                                                       tiny_model, tmp_path):
    model, sidecar = varied_with_head
    job = Job(model=str(model), devices="cpu", max_prompt_tokens=40, answer_tokens=20)
    head = job.head(str(sidecar))
    with torch.no_grad():
        head.w["eh_proj"].add_(0.5)   # tensors of its own, not the random head's
    trained = head.tensors()
    for weight_type, tol in (("F32", 0.0), ("Q8_0", 0.02)):
        out = write_head(tmp_path / f"h_{weight_type}.gguf", trained, job.file, weight_type)
        again = job.head(str(out)).tensors()
        assert again.keys() == trained.keys()
        for name, t in trained.items():
            torch.testing.assert_close(again[name], t, atol=tol * t.abs().max().item(), rtol=0)
    with pytest.raises(ModelError, match="was made for another model"):
        find_head(ModelFile(tiny_model), out)


def test_a_wider_head_starts_computing_what_it_widens(varied_model):
    """--head-ffn adds feed-forward units that change nothing until trained (their ffn_down
    columns are zero; their gate and up rows are not, so training moves them); narrower than
    the block it starts from is refused."""
    job = Job(model=str(varied_model), devices="cpu", max_prompt_tokens=40, answer_tokens=20)
    d_ffn = job.file.config.d_ffn
    torch.manual_seed(0)
    tokens = torch.randint(0, job.file.config.vocab, (2, 16))
    h = job.target.hidden(tokens)
    plain, wide = NextNHead(job.target), NextNHead(job.target, ffn=4 * d_ffn)
    assert wide.w["ffn_gate"].shape[0] == wide.w["ffn_down"].shape[1] == 4 * d_ffn
    assert wide.w["ffn_up"][d_ffn:].abs().min() > 0
    for a, b in zip(plain.passes(tokens, h, 3), wide.passes(tokens, h, 3)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="narrower than the head it starts from"):
        NextNHead(job.target, plain.tensors(), ffn=d_ffn // 2)


def test_training_fits_the_targets_answers(varied_model):
    """On the varied model (whose text depends on the whole context), a head trained on the
    target's greedy answers predicts them far better than the head it starts from."""
    job = Job(model=str(varied_model), devices="cpu", max_prompt_tokens=32, answer_tokens=24)
    g = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(24):   # the target's greedy continuations of random prompts
        tokens = torch.randint(3, job.file.config.vocab, (6,), generator=g).tolist()
        for _ in range(14):
            h = job.target.hidden(torch.tensor([tokens]))
            tokens.append(int(job.target.logits(h[0, -1]).argmax()))
        samples.append(Sample(tokens, 6, "train"))
    head = job.head()
    states = teacher_states(job.target, samples)
    before = acceptance(head, samples, states, 1)[0]
    fit(head, samples, states, FitConfig(epochs=40, lr=3e-3, batch_tokens=256, passes=2))
    after = acceptance(head, samples, states, 1)[0]
    assert after[1] / after[0] > max(0.6, 2 * before[1] / before[0]), (before, after)


def test_the_soft_loss_compares_the_distributions_at_its_temperature():
    g = torch.Generator().manual_seed(3)
    teacher, student = torch.randn(2, 5, 40, generator=g, dtype=torch.float64) * 3
    for t in (0.7, 1.0):
        p, q = torch.softmax(teacher / t, -1), torch.softmax(student / t, -1)
        want = (p * (p.log() - q.log())).sum(-1).mean()
        torch.testing.assert_close(soft_loss(student, teacher, t), want)
        assert soft_loss(teacher, teacher, t).abs() < 1e-12
    assert abs(soft_loss(student, teacher, 0.7) - soft_loss(student, teacher, 1.0)) > 0.01


def test_the_tv_soft_loss_is_the_total_variation_and_trains_toward_the_teacher():
    g = torch.Generator().manual_seed(4)
    teacher, student = torch.randn(2, 6, 30, generator=g, dtype=torch.float64) * 2
    p, q = torch.softmax(teacher / 0.7, -1), torch.softmax(student / 0.7, -1)
    want = torch.minimum(p, q).sum(-1).neg().add(1).mean()    # TV = 1 - the overlap
    torch.testing.assert_close(soft_loss(student, teacher, 0.7, "tv"), want)
    assert soft_loss(teacher, teacher, 0.7, "tv").abs() < 1e-12
    x = student.clone().requires_grad_()
    before = float(soft_loss(x.detach(), teacher, 0.7, "tv"))
    opt = torch.optim.Adam([x], lr=0.1)
    for _ in range(200):
        opt.zero_grad()
        soft_loss(x, teacher, 0.7, "tv").backward()
        opt.step()
    assert float(soft_loss(x.detach(), teacher, 0.7, "tv")) < before / 3
    with pytest.raises(ValueError, match="'kl' or 'tv'"):
        soft_loss(student, teacher, 0.7, "js")


def test_a_whole_run_writes_a_head_that_fits_and_its_figures(varied_model, tmp_path,
                                                            one_launch):
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(24):
            f.write(json.dumps({"prompt": f"question {i}: " + "word " * (i % 5),
                                "split": "heldout" if i % 6 == 0 else "train"}) + "\n")
    out, report = tmp_path / "head.gguf", tmp_path / "report.json"
    res = CliRunner().invoke(cli.main, [
        "--model", str(varied_model), "--out", str(out), "--prompts", str(prompts),
        "--answer-tokens", "8", "--max-prompt-tokens", "48", "--devices", "cpu", "--batch", "4",
        "--epochs", "1", "--batch-tokens", "1024", "--report", str(report)])
    assert res.exit_code == 0, res.output
    assert "held-out, teacher-forced: proposal 1:" in res.output
    figures = json.loads(report.read_text())["teacher_forced"]
    assert [f["position"] for f in figures] == [1, 2, 3] and figures[0]["reached"] > 0
    source = find_head(ModelFile(varied_model), out)
    trained = open_head(source, ModelFile(varied_model))   # every tensor, the model's shapes
    # --init starts from a head's weights: with no learning rate they stay as they were, and
    # --head-ffn widens its block (the sidecar says how wide; the drafter reads it so)
    again = tmp_path / "again.gguf"
    d_ffn = ModelFile(varied_model).config.d_ffn
    res = CliRunner().invoke(cli.main, [
        "--model", str(varied_model), "--out", str(again), "--prompts", str(prompts),
        "--answer-tokens", "8", "--max-prompt-tokens", "48", "--devices", "cpu", "--batch", "4",
        "--epochs", "1", "--batch-tokens", "1024", "--lr", "0", "--init", str(out),
        "--head-ffn", str(2 * d_ffn), "--weight-type", "F32"])
    assert res.exit_code == 0, res.output
    kept = open_head(find_head(ModelFile(varied_model), again), ModelFile(varied_model))
    assert kept.config.d_ffn == 2 * d_ffn
    b = source.block
    for name in ("nextn.eh_proj", "nextn.enorm", "nextn.hnorm", "attn_q", "ffn_gate"):
        key = f"blk.{b}.{name}.weight"
        torch.testing.assert_close(kept.tensor(key)[:len(trained.tensor(key))],
                                   trained.tensor(key), atol=0, rtol=0)
    assert not kept.tensor(f"blk.{b}.ffn_down.weight")[:, d_ffn:].any()
    # narrower than the head it starts from: refused before any answer is generated
    res = CliRunner().invoke(cli.main, [
        "--model", str(varied_model), "--out", str(tmp_path / "narrow.gguf"), "--prompts",
        str(prompts), "--devices", "cpu", "--init", str(out), "--head-ffn", str(d_ffn // 2),
        "--samples", str(tmp_path / "none.jsonl")], standalone_mode=False)
    assert isinstance(res.exception, SystemExit) and res.exception.code == 2
    assert "narrower than the head it starts from" in res.output
    assert not (tmp_path / "none.jsonl").exists()
    assert len(one_launch) == 2   # the two runs that generate answers, on one launch


def test_kept_answers_stand_for_the_work_they_did():
    """Each kept answer stands for one item of the same prompt, temperature and seed; repeated
    prompts count one by one, and answers nothing asks for are not used."""
    hi, other = Prompt("hi", "train"), Prompt("other", "train")
    greedy = SamplingParams(max_tokens=4)
    work = [([1], hi, greedy), ([1], hi, greedy), ([2], other, greedy),
            ([1], hi, SamplingParams(temperature=0.7, seed=5, max_tokens=4)),
            ([2], other, SamplingParams(temperature=0.7, seed=6, max_tokens=4))]
    kept = [Sample([1, 9], 1, "train"), Sample([2, 9], 1, "train", 0.7, 6),
            Sample([2, 8], 1, "train", 0.7, 7), Sample([3, 9], 1, "train")]
    used, todo = split_kept(work, kept)
    assert used == kept[:2]
    assert todo == [work[1], work[2], work[3]]
    assert split_kept(work, [])[1] == work


def test_a_run_adds_to_the_kept_answers_only_what_they_lack(varied_model, tmp_path,
                                                           one_launch):
    """A second run with one more --sampled pass generates that pass alone and leaves the
    answers kept before as they were; --answer-seconds 0 generates none."""
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"ask {i}", "split": "heldout" if i < 2 else "train"})
                    + "\n")
    kept = tmp_path / "samples.jsonl"
    base = ["--model", str(varied_model), "--prompts", str(prompts), "--answer-tokens", "6",
            "--max-prompt-tokens", "48", "--devices", "cpu", "--batch", "4", "--samples",
            str(kept), "--sampled", "0.7"]
    head = ["--out", str(tmp_path / "head.gguf"), "--epochs", "1", "--batch-tokens", "1024"]

    def run(*more):
        res = CliRunner().invoke(cli.main, base + head + list(more))
        assert res.exit_code == 0, res.output
        return kept.read_text().splitlines(), res.output

    first, _ = run()
    assert [json.loads(s)["temperature"] for s in first].count(0.7) == 6 and len(first) == 14
    again, said = run("--sampled", "0.7", "--answer-seconds", "0")
    assert again == first and "14 of the 20 answers asked for" in said
    more, _ = run("--sampled", "0.7")
    assert more[:14] == first and len(more) == 20
    # --epochs 0 only generates: the answers a third pass adds are kept, and no head written
    (tmp_path / "head.gguf").unlink()
    res = CliRunner().invoke(cli.main, base + ["--sampled", "0.7", "--sampled", "0.9",
                                               "--epochs", "0"])
    assert res.exit_code == 0, res.output
    assert "train on them with --samples" in res.output and not (tmp_path / "head.gguf").exists()
    assert kept.read_text().splitlines()[:20] == more and len(kept.read_text().splitlines()) == 26
    seeds = [json.loads(s)["seed"] for s in more]
    assert len(set(seeds[8:])) == 12 and None not in seeds[8:]
    assert len(one_launch) == 3   # --answer-seconds 0 launches nothing; the others share one


def test_the_cli_says_what_is_missing(tmp_path):
    res = CliRunner().invoke(cli.main, ["--model", "x.gguf"])
    assert res.exit_code == 2 and "give --out HEAD.gguf" in res.output
    head = tmp_path / "head.gguf"
    head.write_bytes(b"")
    res = CliRunner().invoke(cli.main, ["--model", "x.gguf", "--eval", str(head),
                                        "--init", str(head)])
    assert res.exit_code == 2 and "give one" in res.output
    res = CliRunner().invoke(cli.main, ["--model", "x.gguf", "--eval", str(head),
                                        "--head-ffn", "4096"])
    assert res.exit_code == 2 and "leave --head-ffn out" in res.output
    res = CliRunner().invoke(cli.main, ["--model", "x.gguf", "--epochs", "0"])
    assert res.exit_code == 2 and "give --samples FILE" in res.output
    res = CliRunner().invoke(cli.main, ["--model", "x.gguf", "--eval", str(head),
                                        "--self-prompts", "8"])
    assert res.exit_code == 2 and "train nothing: leave it out" in res.output
    res = CliRunner().invoke(cli.main, ["--model", "x.gguf", "--prompts", "p.jsonl", "--turns",
                                        "2", "--out", "h.gguf"])
    assert res.exit_code == 2 and "leave out one of them" in res.output
    res = CliRunner().invoke(cli.main, ["--model", "x.gguf", "--epochs", "0", "--samples",
                                        "s.jsonl", "--out", "h.gguf"])
    assert res.exit_code == 2 and "--epochs 0 trains no head" in res.output


def test_smollm2_comes_with_its_head(smollm2):
    """The default model's shipped head is found by its fingerprint and fits the model."""
    file = ModelFile(smollm2)
    source = find_head(file)
    assert source is not None and source.sidecar and source.path.parent == SHIPPED_HEADS
    open_head(source, file)


def test_without_drafts_the_last_stage_gets_no_head(smollm2):
    """The shipped head is the launch's to hand over, and only when it drafts: without
    --draft-tokens no sidecar goes to the last stage, and a stage does not find the shipped
    head by itself (it would run a drafter after every window for nothing)."""
    from strata.launch.options import choose_drafter
    file = ModelFile(smollm2)
    assert choose_drafter(file, 0, None, None)[1] is None
    assert find_head(file, None, shipped=False) is None
    assert choose_drafter(file, 2, None, None) == ("mtp", shipped_head(file).path)
