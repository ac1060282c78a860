"""Training the NextN head on the target's own sequences, and its teacher-forced acceptance.

The teacher: at every position, the target's next-token distribution from its final hidden
state. Pass k's row j learns the target's greedy token at position j + k + 1 (cross-entropy)
and, with soft_weight > 0, its whole distribution there (both distributions at
soft_temperature; soft_loss "kl", the KL divergence, or "tv", the total variation distance),
which is what coupled proposals for sampled requests follow: a request sampled at temperature
t keeps a coupled proposal where the head's distribution at t agrees with the target's, at
most 1 - TV of the time.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strata.train.data import Sample, TeacherStates, batches
from strata.train.head import NextNHead


@dataclass
class FitConfig:
    epochs: int = 4
    lr: float = 1e-3
    batch_tokens: int = 16384
    passes: int = 2                # 1 = first proposals only; 2, 3: chained ones too
    pass_weight: float = 0.5       # pass k's loss weighs pass_weight ** (k - 1)
    soft_weight: float = 0.5       # the soft loss's weight, beside the greedy label's
    soft_temperature: float = 1.0  # both distributions of the soft loss at this temperature
    soft_loss: str = "kl"          # "kl" or "tv"
    seed: int = 0


def padded(samples: list[Sample], states: TeacherStates, index: list[int], device):
    """tokens [B, T], h [B, T, D], lengths [B], prompt lengths [B]."""
    t = max(len(samples[i].tokens) for i in index)
    tokens = torch.zeros(len(index), t, dtype=torch.long)
    for b, i in enumerate(index):
        tokens[b, :len(samples[i].tokens)] = torch.tensor(samples[i].tokens)
    h = torch.stack([F.pad(states.hidden[i], (0, 0, 0, t - states.hidden[i].shape[0]))
                     for i in index])
    lengths = torch.tensor([len(samples[i].tokens) for i in index], device=device)
    prompts = torch.tensor([samples[i].prompt_len for i in index], device=device)
    return tokens.to(device), h.to(device), lengths, prompts


def targets(head: NextNHead, h: torch.Tensor, k: int, width: int):
    """The teacher's logits for pass k's rows (position j + k), [B, width, V]."""
    with torch.no_grad():
        shifted = F.pad(h[:, k:], (0, 0, 0, max(0, width - (h.shape[1] - k))))[:, :width]
        return head.target.logits(shifted).float()


def valid(lengths: torch.Tensor, width: int, k: int, start: torch.Tensor | None = None):
    """[B, width] rows of pass k that predict a real position (j + k + 1 < length), and with
    `start`, only those predicting an answer token (j + k + 1 >= start)."""
    j = torch.arange(width, device=lengths.device)[None, :]
    ok = j + k + 1 < lengths[:, None]
    if start is not None:
        ok &= j + k + 1 >= start[:, None]
    return ok


def loss_of(head: NextNHead, tokens, h, lengths, cfg: FitConfig):
    """(loss, [first-pass accuracy on the greedy label])."""
    width = tokens.shape[1] - 1
    total, acc = 0.0, None
    for k, logits in enumerate(head.passes(tokens, h, cfg.passes), 1):
        mask = valid(lengths, width, k)
        teacher = targets(head, h, k, width)[mask]
        student = logits.float()[mask]
        label = teacher.argmax(-1)
        loss = F.cross_entropy(student, label)
        if cfg.soft_weight:
            soft = soft_loss(student, teacher, cfg.soft_temperature, cfg.soft_loss)
            loss = (1 - cfg.soft_weight) * loss + cfg.soft_weight * soft
        total = total + cfg.pass_weight ** (k - 1) * loss
        if k == 1:
            acc = (student.argmax(-1) == label).float().mean().item()
    return total, acc


def soft_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float,
              kind: str = "kl") -> torch.Tensor:
    """KL(teacher || student) ("kl") or the total variation distance ("tv") of the two
    distributions at `temperature`, averaged over the rows of the logits [N, V]."""
    if kind == "tv":
        p, q = F.softmax(teacher / temperature, -1), F.softmax(student / temperature, -1)
        return 0.5 * (p - q).abs().sum(-1).mean()
    if kind != "kl":
        raise ValueError(f"soft_loss is 'kl' or 'tv', not {kind!r}")
    return F.kl_div(F.log_softmax(student / temperature, -1),
                    F.log_softmax(teacher / temperature, -1),
                    log_target=True, reduction="batchmean")


def fit(head: NextNHead, samples: list[Sample], states: TeacherStates, cfg: FitConfig,
        check=None, say=print, progress=None, on_best=None) -> None:
    """Train in place: AdamW, cosine decay after a short warm-up. With `check` (a function of
    the head giving a score to maximise, on answers not trained on), the head ends with the
    weights of its best epoch, and on_best(head) is called each time an epoch is the best
    so far (to save it)."""
    device = head.target.embed.device
    rng = random.Random(cfg.seed)
    epochs = [batches(samples, cfg.batch_tokens, rng) for _ in range(cfg.epochs)]
    steps = sum(len(e) for e in epochs)
    opt = torch.optim.AdamW(head.w.values(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else _null()
    best, best_state = None, None
    for epoch, plan in enumerate(epochs, 1):
        bar = progress(total=len(plan), desc=f"epoch {epoch}", unit="batch") if progress else None
        for index in plan:
            tokens, h, lengths, _ = padded(samples, states, index, device)
            with autocast:
                loss, acc = loss_of(head, tokens, h, lengths, cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.w.values(), 1.0)
            opt.step()
            sched.step()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}", first=f"{acc:.1%}")
        if bar is not None:
            bar.close()
        if check is not None:
            score = check(head)
            say(f"epoch {epoch}: validation first proposal {score:.1%}")
            if best is None or score > best:
                best, best_state = score, {n: t.clone() for n, t in head.tensors().items()}
                if on_best is not None:
                    on_best(head)
    if best_state is not None:
        with torch.no_grad():
            for n, t in best_state.items():
                head.w[n].copy_(t)


@torch.no_grad()
def acceptance(head: NextNHead, samples: list[Sample], states: TeacherStates, passes: int,
               batch_tokens: int = 16384) -> list[tuple[int, int]]:
    """Teacher-forced acceptance on the answer tokens: per draft position k = 1..passes,
    (chains whose proposals 1..k-1 were all the target's greedy tokens, of them those whose
    proposal k was too). A proposal counts as the target's when it is its greedy token there.
    """
    device = head.target.embed.device
    counts = [[0, 0] for _ in range(passes)]
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else _null()
    for index in batches(samples, batch_tokens, None):
        tokens, h, lengths, prompts = padded(samples, states, index, device)
        width = tokens.shape[1] - 1
        with autocast:
            outs = head.passes(tokens, h, passes)
        alive = None
        for k, logits in enumerate(outs, 1):
            right = logits.argmax(-1) == targets(head, h, k, width).argmax(-1)
            # chains starting at an answer position: pass 1's row j predicts j + 2 >= prompt
            mask = valid(lengths, width, k) & valid(lengths, width, 1, prompts)
            alive = mask if alive is None else alive & mask
            counts[k - 1][0] += int(alive.sum())
            alive = alive & right
            counts[k - 1][1] += int(alive.sum())
    return [tuple(c) for c in counts]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
