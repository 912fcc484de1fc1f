"""Prometheus metrics of one router app (its own registry, so several apps can live in one process).

Latencies are per sequence (one choice of one request), in seconds, measured by the router:

    TTFT  arrival of the HTTP request -> first delta carrying a token
    ITL   between deltas carrying tokens, divided by the tokens in the later delta (observed once per token)
    TPOT  (last token time - first token time) / (output tokens - 1), for sequences of 2+ tokens
    e2e   arrival -> the finishing delta

Engine load (running/waiting sequences, KV blocks and KV cache groups, prefix-cache, speculative-decoding and
transfer counters: the workers' stats added up) is read from `engine.stats()` at scrape time, never cached, and
exported under the names of cluster/stats_metrics.py (`mlx_pd_*`, the names the Ray worker actors use).
The router's own `mlxpd_router_prefix_cache_hit_tokens` counts the engine's figure of each sequence's prompt
tokens served from the prefix cache (`RequestOutput.num_cached_tokens`) as its deltas arrive, whatever the
client asked for (streamed or not, with usage or without, gone before the end): what clients were told, where
`mlx_pd_prefix_cache_hit_tokens` counts every lookup of every worker.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Iterator, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cluster.engine_client import EngineClient, EngineStats
from cluster.request import RequestOutput
from cluster.stats_metrics import GROUP_LABEL, GROUP_METRICS, METRICS, samples

logger = logging.getLogger(__name__)

PREFIX = "mlxpd_router_"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
             "/reset_prefix_cache")
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0, 160.0, 640.0)
_STEP = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
         0.75, 1.0, 2.5, 5.0)


class EngineStatsCollector(Collector):
    """Reads `engine.stats()` and `engine.is_healthy()` at each scrape and exports them under the names of the
    stats' metric table (cluster/stats_metrics.py), the same the Ray worker actors use."""

    def __init__(self, engine: EngineClient):
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        """Yield one family per metric of the table (just `healthy` if stats() fails): gauges set to the sum
        over the workers, counters their sum since the workers started, KV cache group figures labelled
        `group`."""
        try:
            healthy = bool(self._engine.is_healthy())
        except Exception:  # a broken engine must not break /metrics
            healthy = False
        try:
            stats: Optional[EngineStats] = dataclasses.replace(self._engine.stats(), healthy=healthy)
        except Exception:
            logger.warning("engine.stats() failed during a /metrics scrape", exc_info=True)
            stats = None
        if stats is None:
            spec = next(m for m in METRICS if m.field == "healthy")
            yield GaugeMetricFamily(spec.name, spec.help, value=1 if healthy else 0)
            return
        families: dict[str, Metric] = {}
        for spec in (*METRICS, *GROUP_METRICS):
            family = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            labels = [GROUP_LABEL] if spec in GROUP_METRICS else None
            families[spec.name] = family(spec.name, spec.help, labels=labels)
        for spec, labels, value in samples(stats):
            families[spec.name].add_metric(list(labels.values()), value)
        yield from families.values()


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
