"""The router's recent history for the dashboard (`GET /dashboard`): a ring buffer of per-interval samples.

The router observes every sequence itself (`router.metrics.SequenceTimer` calls `record` with each delta's
tokens and latencies; `router.streams.ChoiceStreams` calls `begin` and `end` around each engine generator), so
the history needs nothing from the workers but their counters. Time is cut into intervals of `interval_s`
(default 2 s); when one ends, its sample goes into a ring of `span_s / interval_s` samples (default 10 min):

    t               the interval's end, seconds since the epoch
    requests_per_s  sequences begun per second (each choice of an n > 1 request counts)
    finished_per_s  sequences that delivered their finishing delta, per second
    tokens_per_s    tokens delivered to clients per second
    inflight        sequences in flight at the interval's end
    ttft, tpot, itl, e2e   {"p50", "p90", "p99", "count"} of the values observed in the interval (seconds;
                    the percentiles are None when count is 0)
    workers         {name: {"tokens_per_s", "kv_bytes_per_s", "ssd_blocks_written_per_s",
                    "ssd_blocks_loaded_per_s"}}: each worker's counter deltas (WORKER_RATES: `tokens_out`,
                    `kv_bytes_sent` + `kv_bytes_received`, and its SSD tier's `ssd_blocks_written` and
                    `ssd_blocks_loaded`) between two readings of its reports, per second

Intervals roll lazily: every call first closes the intervals that ended (an idle stretch becomes zero samples),
so no task or thread runs. Not thread-safe: the router's event loop makes every call.
"""

from __future__ import annotations

import collections
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

logger = logging.getLogger(__name__)

LATENCIES = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))
RESERVOIR = 4096  # values kept per latency per interval; past it a uniform sample of them
BASELINE_RETRY_S = 0.25  # until a worker has reported, the first reading is tried at most this often
# each worker's rates: (the rate's name, the counters of its report whose sum it is the delta of, per second)
WORKER_RATES = (("tokens_per_s", ("tokens_out",)), ("kv_bytes_per_s", ("kv_bytes_sent", "kv_bytes_received")),
                ("ssd_blocks_written_per_s", ("ssd_blocks_written",)),
                ("ssd_blocks_loaded_per_s", ("ssd_blocks_loaded",)))


def percentile(ordered: list[float], q: float) -> Optional[float]:
    """The `q` quantile (0..1) of the ascending `ordered`, linearly interpolated between ranks (numpy's
    default); None for an empty list."""
    if not ordered:
        return None
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Iterable[float], count: int) -> dict:
    """{"p50", "p90", "p99", "count"} of `values` (seconds), `count` the number observed (values may be a
    sample of them)."""
    ordered = sorted(values)
    return {**{name: percentile(ordered, q) for name, q in PERCENTILES}, "count": count}


@dataclass
class _Reservoir:
    """At most RESERVOIR values of a stream, a uniform sample once more came (reservoir sampling)."""

    values: list = field(default_factory=list)
    seen: int = 0

    def add(self, value: float, times: int = 1) -> None:
        for _ in range(times):
            self.seen += 1
            if len(self.values) < RESERVOIR:
                self.values.append(value)
            else:
                slot = random.randrange(self.seen)
                if slot < RESERVOIR:
                    self.values[slot] = value


@dataclass
class _Interval:
    """What the router observed in one interval."""

    begun: int = 0
    finished: int = 0
    tokens: int = 0
    latency: dict = field(default_factory=lambda: {name: _Reservoir() for name in LATENCIES})


@dataclass
class _InFlight:
    """One sequence between `begin` and `end`."""

    arrival: float  # time.monotonic()
    tokens: int = 0
    first_token_s: Optional[float] = None  # its TTFT, once the first token came


class DashboardHistory:
    """Per-interval samples of the router's observations over the last `span_s` seconds, the sequences in flight,
    and each worker's recent rates.

    `worker_reports` returns the workers' latest reports (dicts with "name" and the counters of WORKER_RATES;
    `router.dashboard.worker_reports`), read once per interval; None leaves the samples' `workers` empty.
    `clock` is time.monotonic (tests pass their own)."""

    def __init__(self, interval_s: float = 2.0, span_s: float = 600.0, summary_s: float = 60.0,
                 worker_reports: Optional[Callable[[], list[dict]]] = None,
                 clock: Callable[[], float] = time.monotonic):
        if not interval_s > 0 or not span_s >= interval_s or not summary_s >= interval_s:
            raise ValueError(f"interval_s={interval_s!r}, span_s={span_s!r}, summary_s={summary_s!r}: need "
                             "interval_s > 0 and span_s, summary_s >= interval_s")
        self.interval_s, self.span_s, self.summary_s = interval_s, span_s, summary_s
        self.worker_reports = worker_reports
        self._clock = clock
        self.samples: collections.deque = collections.deque(maxlen=max(1, round(span_s / interval_s)))
        # the closed intervals inside the summary window, with their raw values
        self._recent: collections.deque = collections.deque(maxlen=max(1, round(summary_s / interval_s)))
        self._start = clock()
        self._wall = time.time() - self._start  # clock -> seconds since the epoch (fixed: samples stay evenly spaced)
        self._open = _Interval()
        self._inflight: dict[str, _InFlight] = {}
        self._readings: dict[str, tuple[float, tuple]] = {}  # name -> (time, its WORKER_RATES counters)
        self._baseline_tried = -math.inf
        self.worker_rates: dict[str, dict] = {}  # name -> its rates over the last interval
        self.requests_total = 0
        self.tokens_total = 0

    # -- observations (the router's streams) -------------------------------------------------------------------

    def begin(self, request_id: str, arrival: float) -> None:
        """A sequence went to the engine; `arrival` is the HTTP request's time.monotonic()."""
        self.roll()
        self._open.begun += 1
        self.requests_total += 1
        self._inflight[request_id] = _InFlight(arrival)

    def record(self, request_id: str, now: float, tokens: int, *, ttft: Optional[float] = None,
               itl: Optional[float] = None, tpot: Optional[float] = None, e2e: Optional[float] = None,
               finished: bool = False) -> None:
        """One delta of a sequence at `now` (time.monotonic()) carrying `tokens` tokens, with the latencies it
        completed (seconds; `itl` counts once per token of the delta); `finished` for its finishing delta."""
        self.roll(now)
        interval = self._open
        interval.tokens += tokens
        self.tokens_total += tokens
        for name, value in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
            if value is not None:
                interval.latency[name].add(value)
        if itl is not None and tokens:
            interval.latency["itl"].add(itl, tokens)
        if finished:
            interval.finished += 1
        seq = self._inflight.get(request_id)
        if seq is not None:
            seq.tokens += tokens
            if ttft is not None:
                seq.first_token_s = ttft

    def end(self, request_id: str) -> None:
        """The sequence's engine generator closed (finished, failed or aborted); unknown ids are ignored."""
        self._inflight.pop(request_id, None)

    # -- reading ---------------------------------------------------------------------------------------------

    def inflight(self, now: Optional[float] = None) -> list[dict]:
        """The sequences in flight, oldest first: {"request_id", "age_s", "tokens", "ttft_s"} (tokens delivered
        so far; ttft_s None before the first token)."""
        now = self._clock() if now is None else now
        rows = [{"request_id": rid, "age_s": max(0.0, now - s.arrival), "tokens": s.tokens,
                 "ttft_s": s.first_token_s} for rid, s in self._inflight.items()]
        return sorted(rows, key=lambda r: -r["age_s"])

    def summary(self) -> dict:
        """The last `summary_s` seconds (closed intervals plus the open one): "window_s", "requests_per_s",
        "tokens_per_s" and the latencies' percentiles, as in a sample."""
        self.roll()
        intervals = [*self._recent, self._open]
        window = len(self._recent) * self.interval_s + (self._clock() - self._start)
        per_s = 1.0 / max(window, self.interval_s)  # a young window would inflate the first requests' rate
        out = {"window_s": window, "requests_per_s": sum(i.begun for i in intervals) * per_s,
               "tokens_per_s": sum(i.tokens for i in intervals) * per_s}
        for name in LATENCIES:
            out[name] = summarize((v for i in intervals for v in i.latency[name].values),
                                  sum(i.latency[name].seen for i in intervals))
        return out

    # -- intervals -------------------------------------------------------------------------------------------

    def roll(self, now: Optional[float] = None) -> None:
        """Close every interval that ended by `now` (time.monotonic()); an idle stretch adds zero samples (at
        most the ring's length)."""
        now = self._clock() if now is None else now
        if not self._readings and now - self._baseline_tried >= BASELINE_RETRY_S:
            self._baseline_tried = now  # the workers' first readings as soon as they report: the rates' baseline
            self._read_workers(now)
        ended = int((now - self._start) // self.interval_s)
        if ended <= 0:
            return
        wall = self._wall
        self._read_workers(now)
        # the open interval, then the idle ones after it; of a stretch longer than the ring only its last ones
        for k in range(max(0, ended - self.samples.maxlen), ended):
            self._close(self._open if k == 0 else _Interval(), self._start + (k + 1) * self.interval_s + wall)
        self._start += ended * self.interval_s
        self._open = _Interval()

    def _close(self, interval: _Interval, t: float) -> None:
        self.samples.append(self._sample(interval, t))
        self._recent.append(interval)

    def _sample(self, interval: _Interval, t: float) -> dict:
        per_s = 1.0 / self.interval_s
        return {"t": t, "requests_per_s": interval.begun * per_s, "finished_per_s": interval.finished * per_s,
                "tokens_per_s": interval.tokens * per_s, "inflight": len(self._inflight),
                **{name: summarize(r.values, r.seen) for name, r in interval.latency.items()},
                "workers": {name: dict(rates) for name, rates in self.worker_rates.items()}}

    def _read_workers(self, now: float) -> None:
        """Each worker's rates since its previous reading (a counter that went down, a restarted worker, counts
        from zero)."""
        if self.worker_reports is None:
            return
        try:
            reports = self.worker_reports()
        except Exception:  # the dashboard must never break a stream
            logger.warning("reading the workers' reports for the dashboard failed", exc_info=True)
            return
        rates = {}
        for report in reports:
            name = report.get("name")
            if not name:
                continue
            if "tokens_out" not in report:  # nothing reported (a dead worker): its reading waits for it
                rates[name] = {rate: 0.0 for rate, _ in WORKER_RATES}
                continue
            counts = tuple(sum(float(report.get(c) or 0) for c in counters) for _, counters in WORKER_RATES)
            before = self._readings.get(name)
            self._readings[name] = (now, counts)
            if before is None or now <= before[0]:
                rates[name] = {rate: 0.0 for rate, _ in WORKER_RATES}
                continue
            dt = now - before[0]
            rates[name] = {rate: (count - prev if count >= prev else count) / dt
                           for (rate, _), count, prev in zip(WORKER_RATES, counts, before[1])}
        self.worker_rates = rates
