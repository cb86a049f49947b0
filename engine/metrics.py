"""The server's Prometheus metrics: the names and buckets of ``metric_names``, in one registry.

Per request (when it ends): prompt and generation token histograms, end-to-end latency, token
totals and a request counter by status and finish reason. Per token: TTFT and inter-token latency.
Per engine turn: batch size (only after a step ran), running/waiting requests, free KV blocks, and
the prefix-cache and speculative-decoding counters (the engine reports them cumulatively; the delta
is added here).
``anneal_plan_info{plan_hash}`` is 1 for the plan being served and absent for every other hash.

The registry is private to the server (not the process-global default) so tests and several
servers in one process never share series.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from anneal.engine import metric_names as names

CONTENT_TYPE = CONTENT_TYPE_LATEST
BATCH_BUCKETS = tuple(float(2**i) for i in range(0, 13))  # 1 .. 4096 sequences


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.prompt_tokens = Histogram(
            names.PROMPT_TOKENS, "Prompt tokens per request.", buckets=names.TOKEN_BUCKETS, registry=r
        )
        self.generation_tokens = Histogram(
            names.GENERATION_TOKENS,
            "Generated tokens per request.",
            buckets=names.TOKEN_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            names.TTFT, "Time to first token, from arrival.", buckets=names.LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            names.ITL, "Time between two generated tokens.", buckets=names.LATENCY_BUCKETS, registry=r
        )
        self.latency = Histogram(
            names.REQUEST_LATENCY,
            "End-to-end request latency, from arrival to the last token.",
            buckets=names.LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            names.BATCH_SIZE, "Sequences in one engine step.", buckets=BATCH_BUCKETS, registry=r
        )
        self.running = Gauge(names.NUM_RUNNING, "Requests running in the engine.", registry=r)
        self.waiting = Gauge(names.NUM_WAITING, "Requests waiting in the engine.", registry=r)
        self.free_blocks = Gauge(names.KV_FREE_BLOCKS, "Free KV-cache blocks.", registry=r)
        # Counters the engine reports cumulatively (EngineStats field -> counter): each turn adds the delta.
        self._cumulative = {
            "prefix_queried_tokens": Counter(names.PREFIX_QUERIED, "Prompt tokens looked up in the prefix cache.",
                                             registry=r),
            "prefix_hit_tokens": Counter(names.PREFIX_HIT, "Prompt tokens found in the prefix cache.", registry=r),
            "drafted_tokens": Counter(names.SPEC_DRAFTED, "Tokens drafted by speculative decoding (n-gram drafter).",
                                      registry=r),
            "accepted_tokens": Counter(names.SPEC_ACCEPTED, "Drafted tokens the model agreed with.", registry=r),
        }
        self.prompt_tokens_total = Counter(
            names.PROMPT_TOKENS_TOTAL, "Prompt tokens of ended requests.", registry=r
        )
        self.generation_tokens_total = Counter(
            names.GENERATION_TOKENS_TOTAL, "Generated tokens of ended requests.", registry=r
        )
        self.requests = Counter(
            names.REQUESTS,
            "Requests by status (success, error, aborted) and finish reason.",
            ["status", "finish_reason"],
            registry=r,
        )
        self.plan_info = Gauge(
            names.PLAN_INFO, "1 for the plan being served.", ["plan_hash"], registry=r
        )
        self._lock = threading.Lock()
        self._seen = dict.fromkeys(self._cumulative, 0)
        self._steps_seen = 0

    # Per request.
    def observe_request(
        self,
        *,
        prompt_tokens: int,
        generation_tokens: int,
        latency_s: float,
        finish_reason: str,
        status: str,
    ) -> None:
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generation_tokens)
        self.latency.observe(latency_s)
        self.prompt_tokens_total.inc(prompt_tokens)
        self.generation_tokens_total.inc(generation_tokens)
        self.requests.labels(status=status, finish_reason=finish_reason).inc()

    def observe_rejected(self) -> None:
        """A request refused before it reached the engine (bad input, overload)."""
        self.requests.labels(status="error", finish_reason="").inc()

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)

    # Per engine turn.
    def observe_engine(self, stats: Any, *, stepped: bool) -> None:
        # A batch is counted once per step the engine actually ran (its step counter moved).
        if stepped and stats.steps > self._steps_seen and stats.last_batch_size > 0:
            self.batch_size.observe(stats.last_batch_size)
        self._steps_seen = max(self._steps_seen, stats.steps)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.free_blocks.set(stats.num_free_blocks)
        with self._lock:
            for field, counter in self._cumulative.items():
                value = getattr(stats, field, 0)
                if value > self._seen[field]:
                    counter.inc(value - self._seen[field])
                    self._seen[field] = value

    def set_plan(self, plan_hash: str) -> None:
        """Mark ``plan_hash`` as the plan being served (the previous hash's series goes away)."""
        with self._lock:
            self.plan_info.clear()
            self.plan_info.labels(plan_hash=plan_hash).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
