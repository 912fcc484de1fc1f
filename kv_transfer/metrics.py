"""Prometheus metrics of KV transfer, one set per sender or receiver (in the worker's registry).

`direction` is "send" (prefill worker) or "receive" (decode worker). Latency is offer -> ack on the sender
and offer -> done on the receiver, in seconds.
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "mlxpd_kv_transfer_"
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class TransferMetrics:
    """Counters and a latency histogram for one direction. `registry` None -> a private registry."""

    def __init__(self, direction: str, registry: Optional[CollectorRegistry] = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.direction = direction
        reg, d = self.registry, {"direction": direction}

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, ("direction",) + labels, registry=reg)

        self._bytes = counter("bytes", "KV payload bytes moved")
        self._blocks = counter("blocks", "KV blocks moved (a block split by layers counts once)")
        self._state_bytes = counter("state_bytes", "recurrent-state payload bytes moved (hybrid models: one "
                                    "state per transfer, after its blocks)")
        self._answers = counter("reservations", "handshake answers by outcome (reserved, refused, busy)",
                                ("outcome",))
        self._aborts = counter("aborts", "transfers aborted, by who asked (local, peer)", ("origin",))
        self._timeouts = counter("timeouts", "transfers ended by a deadline")
        self._dropped = counter("dropped_messages", "messages dropped before touching memory "
                                "(late: request or epoch not live; invalid: malformed)", ("reason",))
        self._done = counter("completed", "transfers completed")
        self._latency = Histogram(PREFIX + "latency_seconds", "offer to completion", ("direction",),
                                  buckets=_SECONDS, registry=reg).labels(**d)
        self._inflight = Gauge(PREFIX + "inflight", "transfers in progress", ("direction",),
                               registry=reg).labels(**d)
        self._d = d

    def moved(self, num_bytes: int, num_blocks: int) -> None:
        self._bytes.labels(**self._d).inc(num_bytes)
        self._blocks.labels(**self._d).inc(num_blocks)

    def moved_state(self, num_bytes: int) -> None:
        self._state_bytes.labels(**self._d).inc(num_bytes)

    def answer(self, outcome: str) -> None:
        self._answers.labels(outcome=outcome, **self._d).inc()

    def aborted(self, origin: str) -> None:
        self._aborts.labels(origin=origin, **self._d).inc()

    def timed_out(self) -> None:
        self._timeouts.labels(**self._d).inc()

    def dropped(self, reason: str) -> None:
        self._dropped.labels(reason=reason, **self._d).inc()

    def completed(self, seconds: float) -> None:
        self._done.labels(**self._d).inc()
        self._latency.observe(seconds)

    def set_inflight(self, n: int) -> None:
        self._inflight.set(n)

    def value(self, name: str, **labels) -> float:
        """A sample's current value (tests, `mlx-pd status`): e.g. value("bytes_total")."""
        got = self.registry.get_sample_value(PREFIX + name, {**self._d, **labels})
        return 0.0 if got is None else got
