"""`strata-bench grammar`: what structured output costs a window, without a model.

S slots each follow a JSON schema (a person: name, age, city, email, tags) through documents of
their own, at different places; each window computes every slot's masks (its last token's row
and one per draft: coordinator/grammar.py's WindowMasks, one bitmask per window on llguidance's
threads), packs them for the header, advances each matcher by one kept token, and the last
stage's masking (stage_worker/head.py's picked) runs over logits of the window's rows on
--device. Prints the median and 90th percentile per window of each step.
"""
from __future__ import annotations

import json
import random
import time
from statistics import median, quantiles

import click
import llguidance
import torch

from strata.bench.harness import machine
from strata.coordinator.grammar import Grammars, WindowMasks, executor
from strata.coordinator.api.grammar_fields import grammar_request
from strata.model.gguf_file import ModelFile
from strata.model.registry import DEFAULT_MODEL, resolve_model
from strata.model.tokenizer import Tokenizer
from strata.protocol.messages import Window
from strata.protocol.rows import SamplingRow
from strata.stage_worker.head import HeadOutput, picked
from strata.stage_worker.history import SlotTokens

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "email", "tags"],
          "properties": {"name": {"type": "string"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"type": "string"},
                         "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
                         "tags": {"type": "array", "items": {"type": "string"},
                                  "maxItems": 4}}}
NAMES = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov",
         "Donald Knuth", "Frances Allen", "John Backus"]
CITIES = ["London", "Paris", "New York", "Zürich", "São Paulo", "Tokyo", "Nairobi", "Oslo"]
TAGS = ["math", "compilers", "logic", "poetry", "engines", "types", "proofs", "networks"]


def documents(n: int, rng: random.Random) -> list[str]:
    """n JSON texts that follow SCHEMA, in a few whitespace styles."""
    out = []
    for i in range(n):
        name = rng.choice(NAMES)
        doc = {"name": name, "age": rng.randrange(20, 99), "city": rng.choice(CITIES),
               "email": name.split()[0].lower() + "@example.org",
               "tags": rng.sample(TAGS, rng.randrange(0, 5))}
        out.append(json.dumps(doc, indent=[None, 2, 4][i % 3], ensure_ascii=False))
    return out


@click.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="Whose vocabulary the masks are over.")
@click.option("--slots", type=int, default=32, show_default=True,
              help="Constrained slots in each window.")
@click.option("--drafts", default="0,3", show_default=True,
              help="Drafts per slot to measure, separated by commas (each adds a masked row).")
@click.option("--windows", type=int, default=200, show_default=True,
              help="Windows timed per draft count (after 20 not timed).")
@click.option("--device", default="cpu", show_default=True,
              help="Where the last stage's masking runs (cpu, cuda).")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
def grammar(model, slots, drafts, windows, device, json_out):
    """The host cost of structured output per window: S slots' token masks for a JSON schema,
    packed for the header, each matcher advanced by a token; and the last stage's masking."""
    tok = Tokenizer.from_gguf(ModelFile(resolve_model(model)).reader)
    vocab = ModelFile(resolve_model(model)).config.vocab
    grammars = Grammars(tok, vocab)
    t0 = time.perf_counter()
    grammars.tokenizer()
    tokenizer_s = time.perf_counter() - t0
    spec = grammar_request({"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA}}})
    compiled, compile_s = [], []
    for _ in range(slots):
        t0 = time.perf_counter()
        compiled.append(grammars.compile(spec.grammar))
        compile_s.append(time.perf_counter() - t0)
    executor()   # llguidance's threads, started before the timing
    rng = random.Random(0)
    docs = [tok.encode(d) for d in documents(slots, rng)]
    print(f"strata-bench grammar: {model} ({vocab} tokens), a JSON schema of 5 fields, "
          f"{slots} slots; llguidance {llguidance.__version__} (its threads: 80% of the "
          f"host's cores, at most 32); {machine()}")
    print(f"vocabulary read by llguidance in {tokenizer_s:.2f} s; a grammar compiled in "
          f"{median(compile_s) * 1e3:.2f} ms (median of {slots})")
    print(f"{'drafts':>6} {'rows':>5} {'masks ms':>14} {'us/row':>7} {'pack ms':>8} "
          f"{'accept ms':>10} {'apply ms':>14}   (median / p90 per window; apply on {device})")
    results = []
    for k in [int(x) for x in drafts.split(",")]:
        at = [rng.randrange(len(d)) for d in docs]   # each slot somewhere in its document
        for c, d, a in zip(compiled, docs, at):
            c.matcher.reset()
            assert c.matcher.consume_tokens(d[:a]), c.error
        steps: dict[str, list[float]] = {"masks": [], "pack": [], "accept": [], "apply": []}
        logits = torch.randn(slots * (1 + k), vocab, device=device)
        history = SlotTokens(1, 1)   # read only for penalties: none here
        for n in range(20 + windows):
            masks, mask_of = WindowMasks(), []
            t0 = time.perf_counter()
            for c, d, a in zip(compiled, docs, at):   # the drafts: the document's next k
                kept = c.drafts(d[a:a + k])
                first = masks.add(c, kept)
                mask_of += range(first, first + 1 + len(kept))
            bits = masks.fill()
            t1 = time.perf_counter()
            packed = bits.astype("<i4", copy=False).tobytes()
            t2 = time.perf_counter()
            for i, (c, d) in enumerate(zip(compiled, docs)):   # each slot keeps one token
                if at[i] >= len(d):
                    c.matcher.reset()
                    at[i] = 0
                assert c.accept(d[at[i]]), c.error
                at[i] += 1
            t3 = time.perf_counter()
            rows = len(mask_of)
            sampled = [SamplingRow(row=j, mask=m) for j, m in enumerate(mask_of)]   # greedy
            w = Window.from_rows(n, list(range(rows)), [0] * rows, [0] * rows, sampled=sampled,
                                 masks=packed)
            head = HeadOutput(logits[:rows], logits[:rows].argmax(-1), list(range(rows)))
            _sync(device)
            t4 = time.perf_counter()
            picked(head, w, history, False)
            _sync(device)
            t5 = time.perf_counter()
            if n >= 20:
                for name, s in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t5 - t4)):
                    steps[name].append(s * 1e3)
        row = {"drafts": k, "rows": rows, **{f"{name}_ms": _stats(v) for name, v in steps.items()}}
        results.append(row)
        m = row["masks_ms"]
        print(f"{k:>6} {rows:>5} {m[0]:>6.3f} / {m[1]:>6.3f} {m[0] / rows * 1e3:>7.1f} "
              f"{row['pack_ms'][0]:>8.3f} {row['accept_ms'][0]:>10.3f} "
              f"{row['apply_ms'][0]:>6.3f} / {row['apply_ms'][1]:>6.3f}")
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"model": model, "vocab": vocab, "slots": slots, "device": device,
                       "machine": machine(), "tokenizer_s": tokenizer_s,
                       "results": results}, f, indent=1)


def _stats(values: list[float]) -> list[float]:
    return [median(values), quantiles(values, n=10)[-1]]


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
