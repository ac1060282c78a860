"""The choices of one generation request (n of each prompt) as engine jobs: submitted together,
their events merged into one queue as (position, event), read back whole or as a stream whose
chunks each name their choice's index.

Each choice is a job of its own, in a slot of its own, with its own seed (openai_api.choice_seed):
the scheduler's exactness makes choice j the tokens the same request with that seed and n=1
gets alone. A choice that fails ends the request: the others are cancelled.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from strata.coordinator.api import openai_api as api
from strata.coordinator.engine.engine import Engine, EngineDown, Finished, Job, Token
from strata.coordinator.api.openai_logprobs import Logprobs, Spelling
from strata.coordinator.api.request_fields import ApiError


class _Tagged:
    """Where a choice's job posts its events (Job.events): the request's queue, tagged."""

    def __init__(self, queue: asyncio.Queue, position: int):
        self.queue, self.position = queue, position

    def put_nowait(self, item) -> None:
        self.queue.put_nowait((self.position, item))


def failure(fin: Finished) -> ApiError:
    if fin.reason == "cancelled" or fin.down:
        why = fin.error or "the server is stopping"
        return ApiError(503, f"{why}; the request was not completed, retry it once the "
                             f"server is back", code="unavailable")
    if fin.grammar:
        return ApiError(400, fin.error, code="invalid_grammar")
    return ApiError(500, f"this request's window failed: {fin.error}", code="stage_error")


def ended_well(fin: Finished) -> bool:
    return fin.reason in ("stop", "length")


class Choices:
    """The jobs of request `request_id`, one per choice of `p`, submitted to `engine`."""

    def __init__(self, engine: Engine, request_id: str, p: api.Parsed):
        self.engine, self.id, self.p = engine, request_id, p
        self.events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        one = len(p.choices) == 1   # its job is the request (/v1/status names it so)
        self.jobs = [Job(request_id if one else f"{request_id}-{c.index}", c.prompt, c.params,
                         loop, _Tagged(self.events, i), c.grammar)
                     for i, c in enumerate(p.choices)]
        self.ends: list[Finished | None] = [None] * len(self.jobs)

    def submit(self) -> None:
        try:
            for job in self.jobs:
                self.engine.submit(job)
        except EngineDown as e:
            self.cancel()
            raise ApiError(503, f"{e}; restart strata-launch", code="unavailable") from None

    def cancel(self) -> None:
        """Every job not yet finished ends at its slot's next window."""
        for job, end in zip(self.jobs, self.ends):
            if end is None:
                self.engine.cancel(job)

    @property
    def done(self) -> bool:
        return all(end is not None for end in self.ends)

    async def next_events(self) -> list[tuple[int, object]]:
        """Every event here now (at least one): Tokens and Finished, by choice position."""
        batch = [await self.events.get()]
        while not self.events.empty():
            batch.append(self.events.get_nowait())
        for position, ev in batch:
            if isinstance(ev, Finished):
                self.ends[position] = ev
        return batch

    async def whole(self) -> list[Finished]:
        """Every choice's end; raises the first failure's ApiError (the others cancelled)."""
        while not self.done:
            for _, ev in await self.next_events():
                if isinstance(ev, Finished) and not ended_well(ev):
                    raise failure(ev)
        return self.ends

    def answers(self, decode, spelling: Spelling) -> list[tuple[str, str, int, dict | None]]:
        """Each finished choice's (text, finish reason, generated tokens, logprobs object), as
        api.response takes them; with echo, the prompt (and its logprobs) comes first."""
        out = []
        for c, fin in zip(self.p.choices, self.ends):
            tokens, entries, text = fin.generated, fin.logprobs, fin.text
            if self.p.echo:
                text = _echo_text(c, decode) + text
                if fin.prompt_logprobs is not None:
                    tokens, entries = c.prompt + tokens, fin.prompt_logprobs + entries
            logprobs = Logprobs(spelling, self.p.chat, c.params.logprobs is not None)
            out.append((text, fin.reason, len(fin.generated),
                        logprobs.of(tokens, entries, whole=True)))
        return out

    async def stream(self, send: Callable[[dict], Awaitable[None]], decode, spelling: Spelling,
                     model: str, log) -> None:
        """Each choice's text deltas (with their logprobs), then its finish, as they come;
        after every finish the usage (with include_usage). With echo, a choice's prompt comes
        first, once it is read (its logprobs come then). A failure: its error object instead,
        the others cancelled."""
        p, created = self.p, api.now()
        texts = [api.TextStream(decode, c.params.stop) for c in p.choices]
        logprobs = [Logprobs(spelling, p.chat, c.params.logprobs is not None)
                    for c in p.choices]
        echo = [p.echo] * len(p.choices)

        def chunk(position: int, **kw) -> dict:
            return api.chunk(self.id, model, p, created, p.choices[position].index, **kw)

        if p.chat:
            for position in range(len(p.choices)):
                await send(chunk(position, role=True))
        while not self.done:
            tokens: dict[int, list[Token]] = {}   # every token already here: one chunk
            ended: list[int] = []
            for position, ev in await self.next_events():
                tokens.setdefault(position, [])
                if isinstance(ev, Finished):
                    ended.append(position)
                else:
                    tokens[position].append(ev)
            for position, got in tokens.items():
                fin = self.ends[position] if position in ended else None
                c, text = p.choices[position], texts[position]
                if echo[position]:
                    echo[position] = False
                    if fin is None or ended_well(fin):
                        scored = got[0].prompt_logprobs if got else fin.prompt_logprobs
                        await send(chunk(position, text=_echo_text(c, decode), logprobs=(
                            logprobs[position].of(c.prompt, scored or []))))
                delta = "".join(text.push(t.id) for t in got)
                if fin is not None:
                    delta += text.finish(fin.text)
                    if text.sent != fin.text and ended_well(fin):
                        log.warning("%s: streamed text differs from the final text",
                                    self.jobs[position].id)
                lp = logprobs[position].of([t.id for t in got], [t.logprob for t in got])
                if delta or lp:
                    await send(chunk(position, text=delta, logprobs=lp))
            for position in ended:
                fin = self.ends[position]
                if not ended_well(fin):
                    await send(failure(fin).body())
                    return
                await send(chunk(position, finish=fin.reason))
        if p.include_usage:
            await send(api.chunk(self.id, model, p, created, completion_tokens=sum(
                len(fin.generated) for fin in self.ends)))


def _echo_text(c: api.Choice, decode) -> str:
    """Choice c's prompt text, for echo: as given, or its token ids decoded."""
    return c.echo_text if c.echo_text is not None else decode(c.prompt, skip_special=False)
