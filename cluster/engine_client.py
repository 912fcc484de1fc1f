"""The interface the router uses to reach an engine, wherever it runs.

Single-node mode implements it over an in-process channel (`cluster.launch.single_node.InProcessEngineClient`); cluster
mode implements it over ZeroMQ. The router depends on this protocol only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Iterable, Optional, Protocol

from cluster.request import GenerateRequest, RequestOutput

# the worker-report keys of recurrent-state snapshots, added up over every worker
_SNAPSHOT_KEYS = ("state_snapshots", "state_snapshot_bytes", "state_snapshot_budget_bytes", "state_snapshots_restored")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine's load, for `/metrics`, `/health` and placement.

    Counts are sequences and KV blocks; `kv_block_size` is tokens per block; the state snapshots (models
    with recurrent layers, cluster/kv/snapshots.py) are counts and bytes, added up over every worker.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_free: int = 0
    kv_block_size: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens served from it
    num_draft_tokens: int = 0  # speculative decoding: draft tokens proposed and verified
    num_accepted_tokens: int = 0  # of those, accepted by verification
    state_snapshots: int = 0  # models with recurrent layers: state snapshots kept (their prefix cache)
    state_snapshot_bytes: int = 0  # bytes they hold
    state_snapshot_budget_bytes: int = 0  # their byte budget
    state_snapshots_restored: int = 0  # prefix hits that restored one
    num_constrained_requests: int = 0  # constrained decoding: requests with a grammar (decode workers')
    grammar_mask_seconds: float = 0.0  # seconds computing their grammar masks (every worker's)

    @classmethod
    def from_reports(cls, reports: Iterable[dict]) -> "EngineStats":
        """The stats of the workers whose latest reports (`cluster.worker.Worker.stats`) are `reports`, added
        up: the sequences running, the KV pool, the speculative and constrained-request counters are the
        decode workers' (a prefill worker's sequences and blocks are transient, and a request it hands on
        starts its grammar again on the decode worker), the queue, preemptions, prefix-cache counters and the
        grammar mask time everyone's. Single-node mode reports one decode worker."""
        live = list(reports)
        decode = [s for s in live if s.get("role") == "decode"]
        return cls(
            num_running=sum(s["num_running"] for s in decode), num_waiting=sum(s["num_waiting"] for s in live),
            num_kv_blocks_total=sum(s["kv_blocks_total"] for s in decode),
            num_kv_blocks_free=sum(s["kv_blocks_free"] for s in decode),
            kv_block_size=decode[0]["kv_block_size"] if decode else 0,
            num_preemptions=sum(s["num_preemptions"] for s in live),
            prefix_cache_queries=sum(s["prefix_cache_queries"] for s in live),
            prefix_cache_hits=sum(s["prefix_cache_hits"] for s in live),
            num_draft_tokens=sum(s.get("num_draft_tokens", 0) for s in decode),
            num_accepted_tokens=sum(s.get("num_accepted_tokens", 0) for s in decode),
            num_constrained_requests=sum(s.get("constrained_requests", 0) for s in decode),
            grammar_mask_seconds=sum(s.get("grammar_mask_seconds", 0.0) for s in live),
            **{key: sum(s.get(key, 0) for s in live) for key in _SNAPSHOT_KEYS})

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class EngineError(RuntimeError):
    """The engine cannot take the request now (dead, stopping, or over its queue bound).

    `retry_after` (seconds) is set when the condition is transient (overload): the router answers 503 with
    a `Retry-After` header; otherwise it answers 503 without one.
    """

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class EngineClient(Protocol):
    """What the router needs from an engine.

    Invariants: `generate` yields `RequestOutput` deltas for exactly one request and ends after the delta
    whose `finish_reason` is set; if the consumer stops iterating early (client disconnect: the async
    generator is closed or its task cancelled), the request is aborted and its KV blocks are freed.
    """

    model_name: str
    max_model_len: int
    # The most sequences the engine holds running and queued at once (None: no fixed bound). One request
    # asking for more (`n`) could never be admitted whole: the router answers 400 rather than 503.
    max_sequences: Optional[int]

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Submit `request` and iterate its output deltas.

        Raises `EngineError` when the engine cannot take it now (dead, overloaded) and `ValueError` when
        the request can never run on this engine (prompt too long for the context or the KV pool, token
        ids outside the vocabulary); the message says what to change (the router answers 400)."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort a request; a no-op for unknown or finished ids."""
        ...

    def stats(self) -> EngineStats:
        """The latest load snapshot (cheap, non-blocking)."""
        ...

    def is_healthy(self) -> bool:
        """False once the engine loop has died."""
        ...

    async def clear_prefix_cache(self) -> int:
        """Drop every unreferenced cached block; returns how many were dropped."""
        ...
