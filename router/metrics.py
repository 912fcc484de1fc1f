"""Prometheus metrics of one router app (its own registry, so several apps can live in one process).

Latencies are per sequence (one choice of one request), in seconds, measured by the router:

    TTFT  arrival of the HTTP request -> first delta carrying a token
    ITL   between deltas carrying tokens, divided by the tokens in the later delta (observed once per token)
    TPOT  (last token time - first token time) / (output tokens - 1), for sequences of 2+ tokens
    e2e   arrival -> the finishing delta

Engine load (running/waiting sequences, KV blocks, prefix-cache and speculative-decoding counters) is read from
`engine.stats()` at scrape time, never cached. `prefix_cache_hit_tokens` counts the engine's own figure of each
sequence's prompt tokens served from the prefix cache (`RequestOutput.num_cached_tokens`) as its deltas arrive,
whatever the client asked for (streamed or not, with usage or without, gone before the end).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cluster.engine_client import EngineClient
from cluster.request import RequestOutput

logger = logging.getLogger(__name__)

PREFIX = "mlxpd_router_"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
             "/reset_prefix_cache")
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0, 160.0, 640.0)
_STEP = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
         0.75, 1.0, 2.5, 5.0)


class EngineStatsCollector(Collector):
    """Reads `engine.stats()` and `engine.is_healthy()` at each scrape."""

    def __init__(self, engine: EngineClient):
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        """Yield the engine's gauges and counters (nothing but `engine_healthy` if stats() fails)."""
        try:
            healthy = bool(self._engine.is_healthy())
        except Exception:  # a broken engine must not break /metrics
            healthy = False
        yield GaugeMetricFamily(PREFIX + "engine_healthy", "1 while the engine loop is alive",
                                value=1 if healthy else 0)
        try:
            s = self._engine.stats()
        except Exception:
            logger.warning("engine.stats() failed during a /metrics scrape", exc_info=True)
            return
        gauges = {
            "num_requests_running": ("Sequences in the engine's running batch", s.num_running),
            "num_requests_waiting": ("Sequences queued in the engine", s.num_waiting),
            "kv_blocks_total": ("KV blocks in the engine's pool", s.num_kv_blocks_total),
            "kv_blocks_free": ("KV blocks free", s.num_kv_blocks_free),
            "kv_blocks_used": ("KV blocks in use", s.num_kv_blocks_total - s.num_kv_blocks_free),
            "kv_block_size": ("Tokens per KV block", s.kv_block_size),
            "engine_state_snapshots": ("Recurrent-state snapshots kept (the prefix cache of hybrid models)",
                                       s.state_snapshots),
            "engine_state_snapshot_bytes": ("Bytes of recurrent-state snapshots kept", s.state_snapshot_bytes),
            "engine_state_snapshot_budget_bytes": ("The recurrent-state snapshots' byte budget",
                                                   s.state_snapshot_budget_bytes),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        counters = {
            "engine_preemptions": ("Sequences preempted by the engine", s.num_preemptions),
            "engine_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache",
                                            s.prefix_cache_queries),
            "engine_prefix_cache_hits": ("Prompt tokens served from the prefix cache", s.prefix_cache_hits),
            "engine_draft_tokens": ("Speculative decoding: draft tokens proposed and verified",
                                    s.num_draft_tokens),
            "engine_draft_accepted_tokens": ("Speculative decoding: draft tokens accepted",
                                             s.num_accepted_tokens),
            "engine_state_snapshots_restored": ("Prefix-cache hits that restored a recurrent-state snapshot",
                                                s.state_snapshots_restored),
            "engine_constrained_requests": ("Constrained decoding: requests with a grammar (response_format, "
                                            "tool_choice)", s.num_constrained_requests),
            "engine_grammar_mask_seconds": ("Constrained decoding: seconds spent computing grammar masks",
                                            s.grammar_mask_seconds),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        yield GaugeMetricFamily(PREFIX + "engine_draft_acceptance_rate",
                                "Speculative decoding: accepted / proposed draft tokens since start (0 before any)",
                                value=s.draft_acceptance_rate)


class RouterMetrics:
    """The router's counters and histograms, in a registry of its own."""

    def __init__(self, engine: EngineClient):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of accepted requests",
                                     registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens delivered to clients",
                                         registry=r)
        self.prefix_cache_hit_tokens = Counter(
            PREFIX + "prefix_cache_hit_tokens", "Prompt tokens the engine reported served from its "
            "prefix cache, for every sequence (what usage.prompt_tokens_details.cached_tokens reports)", registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Time per output token after the first", buckets=_STEP, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Inter-token latency",
                             buckets=_STEP, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY, registry=r)
        self.active = Gauge(PREFIX + "active_sequences", "Sequences the router is waiting on",
                            registry=r)
        # every sequence's observations also go here when set (router.dashboard_history.DashboardHistory)
        self.history: Optional[Any] = None
        r.register(EngineStatsCollector(engine))

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def count_request(self, path: str, status: int) -> None:
        """Count one HTTP answer; unknown paths share the label "other"."""
        self.requests.labels(path if path in ENDPOINTS else "other", str(status)).inc()


class SequenceTimer:
    """Latency bookkeeping for one sequence; `observe` is called with every delta in order."""

    __slots__ = ("_m", "_arrival", "_first", "_last", "tokens", "_cached", "_done")

    def __init__(self, metrics: Optional[RouterMetrics], arrival: float):
        self._m = metrics
        self._arrival = arrival  # time.monotonic() at arrival
        self._first: Optional[float] = None
        self._last = 0.0
        self.tokens = 0
        self._cached = 0  # the engine's cached-token figure counted so far
        self._done = False

    def observe(self, out: RequestOutput, now: Optional[float] = None) -> None:
        """Record one delta."""
        m = self._m
        if m is None or self._done:
            return
        now = time.monotonic() if now is None else now
        if out.num_cached_tokens > self._cached:  # the figure arrives with the first delta, or later in a cluster
            m.prefix_cache_hit_tokens.inc(out.num_cached_tokens - self._cached)
            self._cached = out.num_cached_tokens
        count = len(out.token_ids)
        ttft = itl = tpot = e2e = None
        if count:
            m.generation_tokens.inc(count)
            if self._first is None:
                self._first = now
                ttft = now - self._arrival
                m.ttft.observe(ttft)
            else:
                itl = (now - self._last) / count
                for _ in range(count):
                    m.itl.observe(itl)
            self._last = now
            self.tokens += count
        if out.finished:
            self._done = True
            e2e = now - self._arrival
            m.e2e.observe(e2e)
            if self._first is not None and self.tokens > 1:
                tpot = (self._last - self._first) / (self.tokens - 1)
                m.tpot.observe(tpot)
        if m.history is not None:
            m.history.record(out.request_id, now, count, ttft=ttft, itl=itl, tpot=tpot, e2e=e2e,
                             finished=out.finished)


class MetricsMiddleware:
    """Pure ASGI middleware counting each HTTP answer by endpoint and status (500 for a crash)."""

    def __init__(self, app: Any, metrics: RouterMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except BaseException:
            if not status:
                status.append(500)
            raise
        finally:
            self.metrics.count_request(scope.get("path", ""), status[0] if status else 499)
