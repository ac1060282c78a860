"""The server's Prometheus metrics, in a registry of their own (never the process-global one,
so two servers in one process, or a test, don't collide). prometheus_client's metrics are
thread-safe: the engine thread observes windows and tokens, the event loop counts requests."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from strata.coordinator.speculation.drafts import DraftCounts

# a CPU window of a small model takes milliseconds, a prompt chunk of a big one seconds
WINDOW_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ROW_BUCKETS = tuple(range(8, 65, 8))   # decode windows are multiples of 8 rows, up to 64
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("strata_requests", "HTTP requests by endpoint and status code "
                                "(499: the client went away first)", ["endpoint", "status"],
                                registry=r)
        self.finished = Counter("strata_finished_requests", "Generation requests by how they "
                                "ended (stop, length, cancelled, error)", ["reason"], registry=r)
        self.prompt_tokens = Counter("strata_prompt_tokens", "Prompt tokens of submitted "
                                     "requests", registry=r)
        self.generated_tokens = Counter("strata_generated_tokens", "Tokens generated", registry=r)
        self.queue_depth = Gauge("strata_queue_depth", "Requests waiting for a slot", registry=r)
        self.slots_busy = Gauge("strata_slots_busy", "Slots holding a request", registry=r)
        self.slots = Gauge("strata_slots", "Slots in all (--batch)", registry=r)
        self.stage_window = Histogram("strata_stage_window_seconds", "Compute time of one window "
                                      "on one stage", ["stage", "kind"], buckets=WINDOW_BUCKETS,
                                      registry=r)
        self.window = Histogram("strata_window_seconds", "One window from submit to its result, "
                                "as the coordinator sees it (all stages and transfers)", ["kind"],
                                buckets=WINDOW_BUCKETS, registry=r)
        self.window_rows = Histogram("strata_window_rows", "Rows of each decode window sent: "
                                     "counted=size, all its rows; counted=live, those of "
                                     "requests (the rest are padding)", ["counted"],
                                     buckets=ROW_BUCKETS, registry=r)
        self.ttft = Histogram("strata_time_to_first_token_seconds", "From submit to the first "
                              "generated token", buckets=REQUEST_BUCKETS, registry=r)
        self.request_seconds = Histogram("strata_request_seconds", "From submit to the end of "
                                         "generation", buckets=REQUEST_BUCKETS, registry=r)
        self.drafts_proposed = Counter("strata_draft_tokens_proposed", "Draft tokens put in "
                                       "decode windows (either drafter)", registry=r)
        self.drafts_accepted = Counter("strata_draft_tokens_accepted", "Draft tokens kept: "
                                       "equal to the token sampled at their position",
                                       registry=r)
        self.drafts_proposed_at = Counter("strata_draft_position_tokens_proposed", "Draft "
                                          "tokens put in decode windows, by draft position "
                                          "(1 = a slot's first draft in its window)",
                                          ["position"], registry=r)
        self.drafts_accepted_at = Counter("strata_draft_position_tokens_accepted", "Draft "
                                          "tokens kept, by draft position: the draft at "
                                          "position j and every one before it equal to the "
                                          "token sampled at their positions", ["position"],
                                          registry=r)
        self.stage_restarts = Counter("strata_stage_restarts", "Stages started again after "
                                      "they died or hung (strata-launch --restart-stages)",
                                      ["stage"], registry=r)
        self.up = Gauge("strata_up", "1 while every stage and the engine thread are alive",
                        registry=r)

    def watch(self, queue_depth: Callable[[], float], slots_busy: Callable[[], float],
              up: Callable[[], float], slots: int) -> None:
        """Gauges read at scrape time."""
        self.queue_depth.set_function(queue_depth)
        self.slots_busy.set_function(slots_busy)
        self.up.set_function(up)
        self.slots.set(slots)

    def observe_window(self, kind: str, seconds: float, stage_ms: list[float]) -> None:
        """stage_ms: one compute time per stage, in stage order (Result.stage_ms)."""
        self.window.labels(kind).observe(seconds)
        for stage, ms in enumerate(stage_ms):
            self.stage_window.labels(str(stage), kind).observe(ms / 1e3)

    def observe_decode_window(self, rows: int, live: int) -> None:
        self.window_rows.labels("size").observe(rows)
        self.window_rows.labels("live").observe(live)

    def observe_drafts(self, counts: DraftCounts) -> None:
        """Draft tokens verified since the last call: put in windows, and kept of them; the
        same per draft position."""
        if counts.drafted:
            self.drafts_proposed.inc(counts.drafted)
        if counts.accepted:
            self.drafts_accepted.inc(counts.accepted)
        for counter, at in ((self.drafts_proposed_at, counts.drafted_at),
                            (self.drafts_accepted_at, counts.accepted_at)):
            for j, n in enumerate(at, 1):
                if n:
                    counter.labels(str(j)).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
