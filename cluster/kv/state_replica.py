"""The recurrent-state group across a worker group's ranks (cluster/parallel/): the leader's journal of what
changed outside a forward, and each follower's replica that replays it.

Every rank of a group holds its share of each request's recurrent state (its heads under tensor parallelism, its
layers under pipeline parallelism) and of every snapshot (cluster/kv/snapshots.py), and only the leader decides:
its scheduler restores a snapshot on a prefix hit, saves one at a chunk end or a block boundary, keeps a pending
one when a request finishes, thins them, evicts the least recently used, and frees a preempted request's state.
A forward computes the same rows' states on every rank, so only those decisions travel: the leader's
`StateJournal` records them as small ops in the order they were made, keyed by the leader's entry id
(`StateEntry.id`) and the snapshot's block hash, and hands them out with the next forward (`take`); a follower's
`StateReplica` replays them on its own shares before running that forward. A follower runs no LRU of its own
(its snapshots are shares, of other sizes than the leader's): it keeps exactly the snapshots the leader keeps.

Ops (each a list of ints): [RESTORE, entry, hash] a hit's snapshot becomes the entry's state; [SAVE, entry, hash]
the entry's state is kept as the snapshot of `hash`; [PEND, entry, hash] the entry's state at a block boundary
while decoding, kept if it finishes; [KEEP_PENDING, entry] that state is kept; [DROP, hash] a snapshot goes
(thinned, evicted, replaced, or its block evicted); [CLEAR, entry] the entry's state and pending state go
(preemption, or the request is over).
"""

from __future__ import annotations

from typing import Optional

from cluster.kv.groups import StateEntry

RESTORE, SAVE, PEND, KEEP_PENDING, DROP, CLEAR = range(6)


class StateJournal:
    """The leader's ops since the followers last took them (see the module docstring)."""

    def __init__(self):
        self.ops: list[list[int]] = []

    def record(self, *op: int) -> None:
        self.ops.append(list(op))

    def take(self) -> list[list[int]]:
        """The ops recorded since the last call, oldest first; the journal is empty after."""
        ops, self.ops = self.ops, []
        return ops


class ReplicaError(RuntimeError):
    """A leader's op names an entry state or a snapshot this rank does not hold: the ranks are out of step."""


class StateReplica:
    """A follower's shares of the leader's request states (`entries`, by the leader's entry id) and snapshots
    (`snapshots`, by block hash)."""

    def __init__(self):
        self.entries: dict[int, StateEntry] = {}
        self.snapshots: dict[int, object] = {}

    def entry(self, entry_id: int) -> StateEntry:
        """The entry of the leader's `entry_id` (a new one, no state yet, the first time a forward names it)."""
        entry = self.entries.get(entry_id)
        if entry is None:
            entry = self.entries[entry_id] = StateEntry(id=entry_id)
        return entry

    def replay(self, ops: list[list[int]]) -> None:
        """Apply the leader's `ops` in order. Raises ReplicaError for an op on a state or snapshot this rank
        does not hold (the ranks are out of step; the group must end)."""
        for op in ops:
            code = op[0]
            if code == RESTORE:
                self.entry(op[1]).state = self._snapshot(op[2])
            elif code == SAVE:
                self.snapshots[op[2]] = self._state(op[1])
            elif code == PEND:
                self.entry(op[1]).pending = (op[2], self._state(op[1]))
            elif code == KEEP_PENDING:
                entry = self.entries.get(op[1])
                if entry is None or entry.pending is None:
                    raise ReplicaError(f"the leader keeps entry {op[1]}'s pending state, which this rank lacks")
                self.snapshots[entry.pending[0]] = entry.pending[1]
                entry.pending = None
            elif code == DROP:
                self.snapshots.pop(op[1], None)
            elif code == CLEAR:
                self.entries.pop(op[1], None)
            else:
                raise ReplicaError(f"an op this rank cannot replay: {op}")

    def _state(self, entry_id: int):
        entry: Optional[StateEntry] = self.entries.get(entry_id)
        if entry is None or entry.state is None:
            raise ReplicaError(f"the leader keeps entry {entry_id}'s state, which this rank has not computed")
        return entry.state

    def _snapshot(self, block_hash: int):
        state = self.snapshots.get(block_hash)
        if state is None:
            raise ReplicaError(f"the leader restores the snapshot of block {block_hash:#x}, which this rank lacks")
        return state
