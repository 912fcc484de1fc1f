"""The hybrid prefix cache's other half: snapshots of recurrent state at block boundaries (`StateSnapshots`).

A prefix-cache hit gives a sequence the KV of its first k blocks, but a recurrent layer also needs its state
after those k x block_size tokens, which cannot be rebuilt from KV. So the scheduler saves a copy of a
sequence's state (cluster/kv/recurrent_state.py) at block-aligned positions, keyed by the chained hash of the
block that ends there (cluster/kv/hashing.py), and a hit is cut back to the longest prefix whose last block has a
snapshot: the state is restored from it and the rest computed (llama.cpp's context checkpoints and mlx-lm's
server prompt cache do the same with whole caches).

Where snapshots are taken (`chunk_end`, `save` and `finish`, which the recurrent-state group calls,
cluster/kv/state_group.py): every `state_snapshot_interval` tokens and at every other block-aligned end of a prefill chunk, at the prompt's last
whole block and its end when that is a block boundary, and, when a sequence finishes, at the latest block
boundary it reached (prompt plus answer: where the next turn of a conversation continues). The chunk-end ones
are thinned when the sequence finishes: those at 1, 2, 4, 8, ... intervals stay (a later prompt sharing a long
prefix restores from one; a conversation repeats the same ones turn after turn), the rest go, so a long
conversation holds O(log length) of them plus two or three per turn, not one per chunk.

Snapshots are budgeted in bytes, not counts (one snapshot of a 27B hybrid is ~150 MiB), inside the same
`kv_cache_gb` as the KV blocks: the engine gives `state_cache_gb` of it to snapshots and the rest to the pool.
`put` evicts the least recently used until the new one fits; one larger than the whole budget is not kept.
State arrays are immutable MLX arrays (every step makes new ones), so a snapshot shares them with the sequence
it came from and a restore shares them with the sequence it goes to: no copy either way.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional

from cluster.kv.block_pool import BlockPool
from cluster.kv.groups import StateEntry, StepRequest
from cluster.kv.recurrent_state import State
from cluster.kv.state_replica import DROP, KEEP_PENDING, PEND, SAVE, StateJournal


def state_bytes(state: State) -> int:
    """Bytes of a sequence's state: every array of every recurrent layer."""
    return sum(a.nbytes for layer in state for a in layer)


class StateSnapshots:
    """Recurrent-state snapshots by block hash, LRU within `budget_bytes` (0 keeps none), each one a restore
    point of `pool` while it is kept.

    Kept together with the KV: a snapshot is kept only onto a cached block (`BlockPool.mark_restorable`), and
    when the pool evicts that block (or resets its cache) the snapshot goes with it (`_lost`, the pool's
    `on_restore_point_lost`); when a snapshot is evicted or dropped here, its block stops being a restore
    point, so neither a prefix hit nor the router's prefix index counts on it. Call from the engine's owner
    thread only.
    """

    def __init__(self, budget_bytes: int, pool: BlockPool, block_size: int = 16, interval: Optional[int] = None):
        if budget_bytes < 0:
            raise ValueError(f"a snapshot budget cannot be negative, got {budget_bytes} bytes")
        self.budget_bytes, self.pool = budget_bytes, pool
        self.block_size, self.interval = block_size, interval or block_size
        pool.on_restore_point_lost = self._lost
        # a worker group's leader: every change is journaled for the followers, and each snapshot is charged
        # the bytes of the largest rank's share (pipeline ranks hold different numbers of recurrent layers)
        self.journal: Optional[StateJournal] = None
        self.charge_bytes = 0
        # called with (block hash, state) for every snapshot kept (the SSD tier writes it)
        self.on_kept: Optional[Callable[[int, State], None]] = None
        self.nbytes = 0
        self._by_hash: OrderedDict[int, tuple[State, int]] = OrderedDict()
        self.num_saved = self.num_evicted = self.num_restored = 0

    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    # -- where snapshots are taken (the scheduler's calls) ---------------------------------------------------

    def chunk_end(self, num_tokens: int, start: int, end: int) -> int:
        """Where a prefill chunk from `start` of a request of `num_tokens` tokens that the token budget would end
        at `end` ends instead: at the next multiple of the snapshot interval; on a block boundary inside it when
        it does not finish the request's tokens; at the prompt's last whole block when it would pass it; so each
        of those positions gets a snapshot."""
        bs, total = self.block_size, num_tokens
        end = min(end, (start // self.interval + 1) * self.interval)
        if end < total and end // bs * bs > start:
            end = end // bs * bs
        last = (total - 1) // bs * bs  # the longest prefix a later prompt can restore from this one
        return last if start < last < end else end

    def save(self, entry: StateEntry, step: StepRequest) -> None:
        """After a step, at a block boundary, keep the entry's state as the snapshot of the block ending there:
        at once while the prompt is computed (a chunk end is remembered for thinning; the prompt's last whole
        block, where a repeat of it restores, and its end when that is a block boundary, where its next turn
        restores, are not), else as its pending snapshot (the latest replaces the one before, so a long answer
        holds one, kept when it finishes)."""
        done, bs = step.num_computed_tokens, self.block_size
        if done == 0 or done % bs or len(step.block_hashes) < done // bs:
            return
        block_hash = step.block_hashes[done // bs - 1]
        if done > step.num_prompt_tokens:
            entry.pending = (block_hash, entry.state)
            self._record(PEND, entry.id, block_hash)
        elif block_hash in self:
            self.get(block_hash)  # the same tokens' state is kept already: mark it used
        elif self.put(block_hash, entry.state):
            self._record(SAVE, entry.id, block_hash)
            if done < (step.num_prompt_tokens - 1) // bs * bs:
                entry.chunk_snapshots.append((block_hash, done))

    def finish(self, entry: StateEntry, failed: bool) -> None:
        """As a request finishes: keep its pending snapshot (prompt + answer: where the next turn of a
        conversation continues) unless it `failed`, and thin the chunk-end snapshots it made while its prompt
        was computed: those at 1, 2, 4, 8, ... intervals stay (so a conversation holds O(log length) of them,
        the same ones turn after turn, as its prefix repeats), the rest go."""
        if entry.pending is not None and not failed and self.put(*entry.pending):
            self._record(KEEP_PENDING, entry.id)
        for block_hash, position in entry.chunk_snapshots:
            multiple, rest = divmod(position, self.interval)
            if rest or multiple & (multiple - 1):
                self.drop(block_hash)
        entry.pending, entry.chunk_snapshots = None, []

    # -- the store ---------------------------------------------------------------------------------------------

    def put(self, block_hash: int, state: State) -> bool:
        """Keep `state` as the state after the block `block_hash` (replacing an older one), evicting the least
        recently used snapshots until it fits. False (not kept) when it is larger than the whole budget or
        no block is cached under `block_hash`."""
        size = max(state_bytes(state), self.charge_bytes)
        self.drop(block_hash)
        if size > self.budget_bytes or not self.pool.mark_restorable(block_hash):
            return False
        while self.nbytes + size > self.budget_bytes:
            evicted, _ = next(iter(self._by_hash.items()))
            self.drop(evicted)
            self.num_evicted += 1
        self._by_hash[block_hash] = (state, size)
        self.nbytes += size
        self.num_saved += 1
        if self.on_kept is not None:
            self.on_kept(block_hash, state)
        return True

    def peek(self, block_hash: int) -> Optional[State]:
        """The state after block `block_hash`, or None; changes nothing (a prefix lookup)."""
        entry = self._by_hash.get(block_hash)
        return None if entry is None else entry[0]

    def get(self, block_hash: int) -> Optional[State]:
        """The state after block `block_hash` (now the most recently used), or None."""
        entry = self._by_hash.get(block_hash)
        if entry is None:
            return None
        self._by_hash.move_to_end(block_hash)
        self.num_restored += 1
        return entry[0]

    def drop(self, block_hash: int) -> None:
        """Forget the snapshot of `block_hash`, if any; its block stops being a restore point."""
        if self._forget(block_hash):
            self.pool.unmark_restorable(block_hash)

    def _lost(self, block_hash: int) -> None:
        """The pool evicted the block `block_hash` (or reset its cache): its snapshot restores nothing now."""
        self._forget(block_hash)

    def _forget(self, block_hash: int) -> bool:
        entry = self._by_hash.pop(block_hash, None)
        if entry is not None:
            self.nbytes -= entry[1]
            self._record(DROP, block_hash)
        return entry is not None

    def _record(self, *op: int) -> None:
        if self.journal is not None:
            self.journal.record(*op)
