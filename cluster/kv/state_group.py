"""The recurrent-state kind of KV cache group (cluster/kv/groups.py): Gated DeltaNet in qwen3_next, Mamba in
falcon_h1.

A recurrent layer carries no per-position KV but one fixed-size state per request (cluster/kv/recurrent_state.py),
updated by every token. The group keeps each request's state in its entry (`StateEntry`); a step stacks the rows'
states into the layers' views and writes the states after the step back (`views`, `collect`). A prefix hit also
needs the state after its last block, which only a snapshot holds (cluster/kv/snapshots.py): a hit is usable up to
the last block that has one (`longest_hit`; a block with a snapshot is a *restore point* of the anchor pool, the
first attention group's, so an evicted block takes its snapshot with it), unless the state arrives with a
transfer. A transfer ships the state after the prompt with its last message (`ships_state`). In a worker group,
the leader's group journals its decisions and each follower's replays them on its shares
(cluster/kv/state_replica.py).
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from cluster.kv.block_pool import RESTORE_POINT_GROUP, BlockPool
from cluster.kv.groups import GroupHit, KVCacheGroup, StateEntry, StepRequest
from cluster.kv.recurrent_state import StateShapes, split_states, stack_states, state_nbytes
from cluster.kv.snapshots import StateSnapshots
from cluster.kv.disk_tier import STATE
from cluster.kv.state_replica import CLEAR, RESTORE, StateJournal, StateReplica
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
        self._ids = itertools.count(1)
        self.journal: Optional[StateJournal] = None  # a worker group's leader: what its followers replay
        self.replica = StateReplica()  # a worker group's follower: its shares of the leader's states
        self.tier = None  # the SSD tier (`attach_tier`)

    def new_entry(self) -> StateEntry:
        return StateEntry(id=next(self._ids))

    def free(self, entry: StateEntry) -> StateEntry:
        """Drop the state and the pending snapshot (a preempted request recomputes both); the chunk-end
        snapshots it made stay listed for thinning when it finishes."""
        entry.state = entry.pending = None
        if self.journal is not None:
            self.journal.record(CLEAR, entry.id)
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
        if hit.key is not None:  # restore: the snapshot becomes the most recently used (or the tier's state)
            entry.state = hit.state if hit.tier else self.snapshots.get(hit.key)
            if self.journal is not None:
                self.journal.record(RESTORE, entry.id, hit.key)
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
        if self.journal is not None:  # refused where a group's worker starts (cluster/parallel/rank.py)
            raise ValueError("a worker group cannot take a recurrent state from a transfer: its followers' shares "
                             "would not arrive")
        entry.state = state

    # -- the SSD tier (cluster/kv/disk_tier.py) ------------------------------------------------------------------

    def attach_tier(self, tier) -> None:
        """Every snapshot kept is written to `tier` too (its arrays as the tier's `STATE` file of its block), and
        a hit whose blocks the tier holds restores the state after its last block from there."""
        self.tier = tier
        if self.snapshots is not None:
            self.snapshots.on_kept = self._write_state if tier is not None else None

    def _write_state(self, block_hash: int, state) -> None:
        arrays = [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a) for layer in state for a in layer]
        self.tier.put(block_hash, (), arrays, STATE)

    def tier_hit(self, hashes, start, end, state_shipped=False):
        """The longest hit up to `end` whose last block's state the tier holds, that state read (a bad file is
        passed over); `start` (none) when there is none. With `state_shipped` the blocks are all it needs."""
        if state_shipped:
            return end, None
        tier = self.tier
        while tier is not None and end > start:
            arrays = tier.load(hashes[end - 1], (), STATE) if tier.has(hashes[end - 1], STATE) else None
            if arrays is not None:
                flat = iter(arrays)
                state = tuple(tuple(mx.array(next(flat)).view(mx.bfloat16) if dtype == mx.bfloat16
                                    else mx.array(next(flat)) for _, dtype in layer) for layer in self.shapes)
                return end, GroupHit(state=state, key=hashes[end - 1], tier=True)
            end -= 1
        return start, None

    # -- a worker group (cluster/kv/state_replica.py) --------------------------------------------------------------

    def replicate(self) -> None:
        self.journal = StateJournal()
        if self.snapshots is not None:
            self.snapshots.journal = self.journal

    def replica_ops(self) -> list:
        return [] if self.journal is None else self.journal.take()

    def replay(self, ops: list) -> None:
        self.replica.replay(ops)

    def entry_bytes(self) -> int:
        return state_nbytes(self.shapes)

    def reserved_bytes(self, max_num_seqs: int) -> int:
        kept = 0 if self.snapshots is None else self.snapshots.budget_bytes
        return max_num_seqs * self.entry_bytes() + kept

    def charge_entries(self, nbytes: int) -> None:
        if self.snapshots is not None:
            self.snapshots.charge_bytes = nbytes

    def wire_entry(self, entry: StateEntry) -> list[int]:
        return [entry.id]

    def replica_entry(self, wire: list[int]) -> StateEntry:
        return self.replica.entry(wire[0])
