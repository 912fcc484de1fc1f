"""The interface the router uses to reach an engine, wherever it runs.

Single-node mode implements it over an in-process channel (`cluster.launch.single_node.InProcessEngineClient`); cluster
mode implements it over ZeroMQ. The router depends on this protocol only.
"""

from __future__ import annotations

from typing import AsyncIterator, Optional, Protocol

from cluster.request import GenerateRequest, RequestOutput
from cluster.stats import EngineStats

__all__ = ["EngineClient", "EngineError", "EngineStats"]


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
