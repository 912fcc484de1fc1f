"""Placement: which decode worker (and which prefill worker, if any) runs a request.

Policies (topology `[routing] policy`):
- `prefix_aware` (default): for each live worker of a role, the number of leading prompt blocks its prefix
  cache holds (router.prefix_index) against its load; the score, lower is better, is

      requests in flight - cache_weight x cached blocks

  where a block only the worker's SSD tier holds (loaded from disk on a hit) counts as much of a block in RAM as
  loading it saves over computing it: 1 - load time / compute time, which the worker measures and reports
  (`ssd_block_worth`; `disk_cache_weight` until it has), so RAM wins over disk, disk over nothing,
  except that a worker with more than `spill_margin` requests in flight above the least loaded one gets no
  cache credit (a hot prefix spills to the others instead of queueing on its holder). Ties go to the worker
  placed least often, so prompts with nothing cached spread evenly.
- `least_loaded`: fewest requests in flight, then fewest placed, then most free KV blocks.
- `round_robin`: live workers of each role in turn (the one placed least often so far, in topology order).

Conditional disaggregation: when the chosen decode worker would have fewer than `local_prefill_max_tokens`
prompt tokens left to compute (after its cached blocks), it prefills them itself (no prefill worker, no
transfer), as it does every prompt when no prefill worker is alive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from cluster.engine_client import EngineError
from cluster.request import GenerateRequest
from cluster.stats import WorkerStats
from cluster.topology import RoutingSection, WorkerSpec


@dataclass(eq=False)
class WorkerState:
    """The router's view of one worker: liveness from heartbeats, its last stats, requests in flight."""

    spec: WorkerSpec
    sock: Any = None
    sub: Any = None  # its KV events (SUB), when it publishes them
    snapshot_asked: float = 0.0
    alive: bool = False
    last_pong: float = 0.0
    stats: Optional[WorkerStats] = None  # its last report (None: none yet, or since it died)
    inflight: set = field(default_factory=set)
    placed: int = 0  # requests placed here so far (tie-break: spread evenly)


def _free_blocks(w: WorkerState) -> int:
    """Free KV blocks in `w`'s last report (0 without one)."""
    return w.stats.kv_blocks_free if w.stats is not None else 0


def _disk_worth(w: WorkerState, routing: RoutingSection) -> float:
    """What a block only on `w`'s SSD tier is worth, as a share of one in RAM: its own measure (load time against
    compute time, `EngineStats.ssd_block_worth`), or `routing.disk_cache_weight` until it has one."""
    worth = w.stats.ssd_block_worth if w.stats is not None else None
    return routing.disk_cache_weight if worth is None else worth


def _pick(workers: list[WorkerState], routing: RoutingSection, cached: Optional[dict[str, int]],
          on_disk: Optional[dict[str, int]] = None) -> WorkerState:
    if routing.policy == "round_robin":  # per role: each role's workers take turns on their own
        return min(workers, key=lambda w: w.placed)
    if routing.policy == "least_loaded" or cached is None:
        return min(workers, key=lambda w: (len(w.inflight), w.placed, -_free_blocks(w)))
    least = min(len(w.inflight) for w in workers)

    def score(w: WorkerState) -> tuple:
        blocks = 0.0
        if len(w.inflight) <= least + routing.spill_margin:
            disk = (on_disk or {}).get(w.spec.name, 0)
            blocks = cached.get(w.spec.name, 0) - disk * (1.0 - _disk_worth(w, routing))
        return (len(w.inflight) - routing.cache_weight * blocks, w.placed, -_free_blocks(w))

    return min(workers, key=score)


def place(workers: list[WorkerState], request: GenerateRequest, routing: RoutingSection,
          cached: Optional[dict[str, int]] = None, block_size: int = 1,
          on_disk: Optional[dict[str, int]] = None) -> tuple[Optional[WorkerState], WorkerState]:
    """(prefill worker or None, decode worker) for `request`. `cached`: leading prompt blocks of
    `block_size` tokens each worker holds (PrefixIndex.match; None = unknown); `on_disk`: how many of those
    only its SSD tier holds (PrefixIndex.on_disk). Raises EngineError when no decode worker is alive."""
    decode = [w for w in workers if w.alive and w.spec.role == "decode"]
    if not decode:
        raise EngineError("no decode worker is alive", retry_after=routing.dead_after_s)
    chosen = _pick(decode, routing, cached, on_disk)
    chosen.placed += 1
    prefill = [w for w in workers if w.alive and w.spec.role == "prefill"]
    left = len(request.prompt_token_ids) - (cached or {}).get(chosen.spec.name, 0) * block_size
    if not prefill or left < routing.local_prefill_max_tokens:
        return None, chosen
    picked = _pick(prefill, routing, cached, on_disk)
    picked.placed += 1
    return picked, chosen
