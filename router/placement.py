"""Placement: which decode worker (and which prefill worker, if any) runs a request.

Policies (topology `[routing] policy`):
- `least_loaded`: the live worker of each role with the fewest requests in flight from this router, ties
  broken by the most free KV blocks in its last heartbeat;
- `round_robin`: live workers of each role in turn.

Conditional disaggregation: a prompt with fewer than `local_prefill_max_tokens` tokens to compute is
prefilled by its decode worker itself (no prefill worker, no transfer), as is every prompt when no prefill
worker is alive.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Optional

from cluster.engine_client import EngineError
from cluster.request import GenerateRequest
from cluster.topology import RoutingSection, WorkerSpec


@dataclass(eq=False)
class WorkerState:
    """The router's view of one worker: liveness from heartbeats, its last stats, requests in flight."""

    spec: WorkerSpec
    sock: Any = None
    alive: bool = False
    last_pong: float = 0.0
    stats: dict = field(default_factory=dict)
    inflight: set = field(default_factory=set)


def _pick(workers: list[WorkerState], policy: str, counter: "itertools.count") -> WorkerState:
    if policy == "round_robin":
        return workers[next(counter) % len(workers)]
    return min(workers, key=lambda w: (len(w.inflight), -w.stats.get("kv_blocks_free", 0)))


def place(workers: list[WorkerState], request: GenerateRequest, routing: RoutingSection,
          counter: "itertools.count") -> tuple[Optional[WorkerState], WorkerState]:
    """(prefill worker or None, decode worker) for `request`. Raises EngineError when no decode worker is
    alive."""
    decode = [w for w in workers if w.alive and w.spec.role == "decode"]
    if not decode:
        raise EngineError("no decode worker is alive", retry_after=routing.dead_after_s)
    chosen = _pick(decode, routing.policy, counter)
    prefill = [w for w in workers if w.alive and w.spec.role == "prefill"]
    if not prefill or len(request.prompt_token_ids) < routing.local_prefill_max_tokens:
        return None, chosen
    return _pick(prefill, routing.policy, counter), chosen
