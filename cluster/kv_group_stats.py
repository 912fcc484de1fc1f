"""The per-KV-cache-group figures of a worker's report (`cluster.stats.KVGroupStats`), read from the engine's
KV objects as they are today: the pool (full attention), the window pool (sliding-window layers beside full
ones) and the recurrent-state snapshots (models with recurrent layers). The one place that knows which
groups exist; the stats, the protocol and the exporters only iterate the records.
"""

from __future__ import annotations

from typing import Optional

from cluster.stats import KVGroupStats


def kv_group_stats(engine, transfer=None) -> tuple[KVGroupStats, ...]:
    """One record per KV cache group of `engine` (a `cluster.engine.EngineCore`), the pool every sequence
    allocates from first: "full" (its usable and free blocks), "sliding_window" when the model has window
    layers (the window pool's blocks), "recurrent" when it has recurrent layers (state snapshots kept, their
    bytes and byte budget, prefix hits that restored one, and the state bytes `transfer` moved: a
    `kv_transfer.metrics.TransferMetrics`, "send" or "receive", None for a worker that moves no KV)."""
    pool = engine.pool
    groups = [KVGroupStats("full", blocks_total=pool.num_usable_blocks, blocks_free=pool.num_free_blocks)]
    window = engine.kv.window
    if window is not None:
        groups.append(KVGroupStats("sliding_window", blocks_total=window.pool.num_usable_blocks,
                                   blocks_free=window.pool.num_free_blocks))
    snaps = engine.scheduler.snapshots
    if snaps is not None:
        moved: Optional[float] = None if transfer is None else transfer.value("state_bytes_total")
        sent = moved if transfer is not None and transfer.direction == "send" else None
        received = moved if transfer is not None and transfer.direction == "receive" else None
        groups.append(KVGroupStats("recurrent", entries=len(snaps), bytes_used=snaps.nbytes,
                                   budget_bytes=snaps.budget_bytes, restores=snaps.num_restored,
                                   bytes_sent=sent, bytes_received=received))
    return tuple(groups)
