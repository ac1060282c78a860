"""How often a NextN head's first proposal could equal the target's token, teacher-forced on
the target's own answers, for greedy decoding and for sampling at a temperature under several
ways of coupling the proposal with the target's draw:

  argmax      the head's most likely token (what --draft-sampling argmax proposes)
  inverse-cdf the head's pick by inverse CDF at the target's draw, each distribution in its own
              order (probability descending): an exact sum over the draw of the overlap of
              the two picks' intervals
  gumbel      argmax of log-probability plus Gumbel noise shared by target and head (the
              Gumbel-max trick, how strata samples and --draft-sampling coupled proposes),
              estimated over --draws noise samples
  1-TV        the most any coupling can reach: 1 - the total variation distance

  python tools/draft_coupling.py --prompts prompts.jsonl [--requests 16] [--tokens 96]
                                 [--answers greedy|sampled] [--temperatures 0.7,1.0]
                                 [--head PATH] [--devices cpu] [--bands 32,96,160]

--bands also prints the greedy agreement in bands of answer positions (the position of the
token proposed, counted from the answer's start): later in an answer it is higher.

The answers come from the target through a strata launch (greedy, or sampled at the first of
--temperatures), to --requests held-out prompts of the prompts file (strata-train-mtp
--write-prompts). Filters (top-k, top-p, min-p) are off.
"""
from __future__ import annotations

from pathlib import Path

import click
import torch
import torch.nn.functional as F

from strata.coordinator.sampling_params import SamplingParams
from strata.launch.options import prepare
from strata.model.nextn import shipped_head
from strata.train import data
from strata.train.fit import padded, targets, valid
from strata.train.prompts import read_prompts
from strata.train.run import Job

ROWS = 256


def overlap(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[N] the chance that inverse CDF at one uniform picks the same token from p and from q,
    each over its own order (probability descending; ties by token id)."""
    def intervals(x):
        order = torch.argsort(x, dim=-1, descending=True, stable=True)
        cum = torch.zeros_like(x).scatter_(1, order, x.gather(1, order).cumsum(-1))
        return cum - x, cum          # each token's [low, high) of the uniform
    (lp, hp), (lq, hq) = intervals(p), intervals(q)
    return (torch.minimum(hp, hq) - torch.maximum(lp, lq)).clamp(min=0).sum(-1)


def rates(p_logits: torch.Tensor, q_logits: torch.Tensor, temperatures: list[float],
          draws: int, gen: torch.Generator) -> dict[str, float]:
    """Summed over the rows: greedy agreement, and per temperature each coupling's chance."""
    out = {"greedy": float((p_logits.argmax(-1) == q_logits.argmax(-1)).sum())}
    for t in temperatures:
        p, q = F.softmax(p_logits / t, -1), F.softmax(q_logits / t, -1)
        out[f"argmax@{t}"] = float(p.gather(1, q.argmax(-1, keepdim=True)).sum())
        out[f"inverse-cdf@{t}"] = float(overlap(p, q).sum())
        hits, log_p, log_q = 0.0, p.log(), q.log()
        for _ in range(draws):
            u = torch.rand(p.shape, generator=gen, dtype=p.dtype, device=p.device)
            u = u.clamp(1e-30, 1.0)
            g = -torch.log(-torch.log(u))
            hits += float(((log_p + g).argmax(-1) == (log_q + g).argmax(-1)).sum())
        out[f"gumbel@{t}"] = hits / draws
        out[f"1-TV@{t}"] = float((1 - 0.5 * (p - q).abs().sum(-1)).sum())
    return out


@click.command()
@click.option("--prompts", "prompts_file", required=True,
              help="A prompts file (strata-train-mtp --write-prompts); its held-out prompts.")
@click.option("--requests", type=int, default=16, show_default=True)
@click.option("--tokens", type=int, default=96, show_default=True, help="Answer tokens.")
@click.option("--answers", type=click.Choice(["greedy", "sampled"]), default="greedy",
              show_default=True, help="The target's answers: greedy, or sampled at the first "
                                      "of --temperatures (seeded).")
@click.option("--temperatures", default="0.7,1.0", show_default=True)
@click.option("--head", default=None, help="A NextN sidecar [default: the shipped head].")
@click.option("--devices", default="cpu", show_default=True)
@click.option("--draws", type=int, default=32, show_default=True,
              help="Gumbel noise samples per position.")
@click.option("--bands", default="", help="Band edges of answer positions, e.g. 32,96,160.")
def main(prompts_file, requests, tokens, answers, temperatures, head, devices, draws, bands):
    temps = [float(t) for t in temperatures.split(",")]
    edges = [0] + [int(b) for b in bands.split(",") if b] + [tokens]
    banded = [[0, 0] for _ in edges[1:]]
    job = Job("smollm2-135m", devices=devices.split(",")[0], max_prompt_tokens=256,
              answer_tokens=tokens)
    shipped = shipped_head(job.file)
    path = head or (shipped.path if shipped else None)
    if path is None:
        raise click.UsageError("no head ships for this model: give --head PATH")
    nextn = job.head(str(path))
    held = [p for p in read_prompts(prompts_file) if p.split == "heldout"][:requests]
    chats = data.chat_prompts(job.tok, held, 256)

    def sampling(i):   # a sampled answer's seed: 5 + the prompt's index
        return (SamplingParams(max_tokens=tokens) if answers == "greedy" else
                SamplingParams(temperature=temps[0], seed=5 + i, max_tokens=tokens))
    prep = prepare(model="smollm2-135m", layer_split="auto", devices=devices,
                   ctx_size=job.ctx, batch=len(chats), batch_groups="1", window_rows="auto",
                   chunk_rows="auto")
    work = [(ids, p, sampling(i)) for i, (ids, p) in enumerate(chats)]
    samples = data.generate(prep, job.tok, work, say=lambda s: None)
    states = data.teacher_states(job.target, samples)
    device = job.target.embed.device
    gen = torch.Generator(device).manual_seed(0)
    total, n = {}, 0
    for index in data.batches(samples, 8192, None):
        tokens_, h, lengths, starts = padded(samples, states, index, device)
        width = tokens_.shape[1] - 1
        with torch.no_grad():
            q_logits = nextn.passes(tokens_, h, 1)[0]
            p_logits = targets(nextn, h, 1, width)
        mask = valid(lengths, width, 1) & valid(lengths, width, 1, starts)
        p_rows, q_rows = p_logits[mask], q_logits[mask]
        right = p_logits.argmax(-1) == q_logits.argmax(-1)
        at = torch.arange(width, device=device)[None, :] + 2 - starts[:, None]   # answer position
        for b, (lo, hi) in enumerate(zip(edges, edges[1:])):
            inside = mask & (at >= lo) & (at < hi)
            banded[b][0] += int((right & inside).sum())
            banded[b][1] += int(inside.sum())
        n += int(mask.sum())
        # a few rows at a time (the vocabulary is wide), on the device of --devices
        for lo in range(0, len(p_rows), ROWS):
            got = rates(p_rows[lo:lo + ROWS].double(), q_rows[lo:lo + ROWS].double(), temps,
                        draws, gen)
            for k, v in got.items():
                total[k] = total.get(k, 0.0) + v
    click.echo(f"# {n} answer positions of {len(samples)} {answers} answers to held-out "
               f"prompts, teacher-forced; the first proposal of {Path(path).name}")
    for k, v in total.items():
        click.echo(f"{k:>18}: {v / n:.3f}")
    if len(edges) > 2:
        for (lo, hi), (right, seen) in zip(zip(edges, edges[1:]), banded):
            click.echo(f"  greedy, answer positions {lo}-{hi - 1}: {right / max(seen, 1):.3f} "
                       f"({right} / {seen})")


if __name__ == "__main__":
    main()
