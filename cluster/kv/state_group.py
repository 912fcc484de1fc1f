"""The recurrent-state kind of KV cache group (cluster/kv/groups.py): Gated DeltaNet in qwen3_next, Mamba in
falcon_h1.

A recurrent layer carries no per-position KV but one fixed-size state per request (cluster/kv/recurrent_state.py),
updated by every token. The group keeps each request's state in its entry (`StateEntry`); a step stacks the rows'
states into the layers' views and writes the states after the step back (`views`, `collect`). A prefix hit also
needs the state after its last block, which only a snapshot holds (cluster/kv/snapshots.py): a hit is usable up to
the last block that has one (`longest_hit`; a block with a snapshot is a *restore point* of the anchor pool, the
first attention group's, so an evicted block takes its snapshot with it), unless the state arrives with a
transfer. A transfer ships the state after the prompt with its last message (`ships_state`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from cluster.kv.block_pool import RESTORE_POINT_GROUP, BlockPool
from cluster.kv.groups import GroupHit, KVCacheGroup, StateEntry, StepRequest
from cluster.kv.recurrent_state import StateShapes, split_states, stack_states
from cluster.kv.snapshots import StateSnapshots
from cluster.stats import KVGroupStats


class RecurrentStateGroup(KVCacheGroup):
    """The recurrent layers `layers` (state-layer numbering) with state `shapes`; `snapshots` (None: prefix
    caching off) keep states at block boundaries as restore points of `anchor` (the pool whose blocks they
    follow)."""

    name = "recurrent"
    layer_space = "state"
    reach_tokens = 1
    ships_state = True

    def __init__(self, shapes: StateShapes, anchor: BlockPool, snapshots: Optional[StateSnapshots]):
        self.shapes, self.anchor, self.snapshots = shapes, anchor, snapshots
        self.layers = tuple(range(len(shapes)))

    def new_entry(self) -> StateEntry:
        return StateEntry()

    def free(self, entry: StateEntry) -> StateEntry:
        """Drop the state and the pending snapshot (a preempted request recomputes both); the chunk-end
        snapshots it made stay listed for thinning when it finishes."""
        entry.state = entry.pending = None
        return entry

    def finish(self, entry: StateEntry, failed: bool) -> None:
        if self.snapshots is not None:
            self.snapshots.finish(entry, failed)

    def longest_hit(self, hashes, token_ids, k, state_shipped) -> int:
        if state_shipped:
            return k
        while k and (self.snapshots is None or self.snapshots.peek(hashes[k - 1]) is None):
            k -= 1
        return k

    def hit(self, hashes, token_ids, k, state_shipped) -> GroupHit:
        if state_shipped or not k:
            return GroupHit()
        return GroupHit(state=self.snapshots.peek(hashes[k - 1]), key=hashes[k - 1])

    def take(self, entry: StateEntry, hit: GroupHit) -> StateEntry:
        if hit.key is not None:  # restore: the snapshot becomes the most recently used
            entry.state = self.snapshots.get(hit.key)
        return entry

    def free_besides(self, hit: GroupHit) -> Optional[int]:
        return None

    def computed(self, entry: StateEntry, step: StepRequest) -> None:
        if self.snapshots is not None:
            self.snapshots.save(entry, step)

    def stats(self, transfer=None) -> KVGroupStats:
        """Snapshots kept, their bytes and budget, prefix hits that restored one, and the state bytes `transfer`
        moved."""
        snaps = self.snapshots
        if snaps is None:
            return KVGroupStats(self.name)
        moved: Optional[float] = None if transfer is None else transfer.value("state_bytes_total")
        sent = moved if transfer is not None and transfer.direction == "send" else None
        received = moved if transfer is not None and transfer.direction == "receive" else None
        return KVGroupStats(self.name, entries=len(snaps), bytes_used=snaps.nbytes, budget_bytes=snaps.budget_bytes,
                            restores=snaps.num_restored, bytes_sent=sent, bytes_received=received)

    def index_entry(self):
        """The restore points (blocks with a snapshot), as the anchor pool's events number them."""
        hashes = self.anchor.restorable_hashes()
        return None if hashes is None else (RESTORE_POINT_GROUP, hashes)

    def chunk_end(self, num_tokens: int, start: int, end: int) -> int:
        return end if self.snapshots is None or end == start else self.snapshots.chunk_end(num_tokens, start, end)

    def views(self, entries: Sequence[StateEntry], starts, num_new, mask_rank, mirror_rows) -> list:
        return stack_states(self.shapes, [e.state for e in entries], num_new)

    def collect(self, entries: Sequence[StateEntry], views: list) -> None:
        states = split_states(views, len(entries))
        mx.eval(states)
        for entry, state in zip(entries, states):
            entry.state = state

    def state_shapes(self) -> StateShapes:
        return self.shapes

    def shipped_state(self, entry: StateEntry):
        return entry.state

    def receive_state(self, entry: StateEntry, state) -> None:
        entry.state = state
