"""KVManager: the one owner that hands out and frees KV blocks.

Every block a worker uses is held by one request, in exactly one of two places:

- a sequence's `block_table` (the scheduler's running and waiting sequences), or
- a *holding*: blocks kept under a request id outside any sequence. The decode worker's receiver reserves a
  holding when it accepts a transfer (the request may not have arrived yet); the prefill worker's engine
  turns a sequence into a holding when its first token is out, so the blocks stay while they are shipped.

Besides, a cached block can be *pinned* for a moment: the source of a prefix hit on a block's head
(cluster/prefix_match.py), held from the match until the copy so that no allocation evicts it (`pin`,
`unpin`).

Nothing else frees blocks: the scheduler frees a sequence (`free`), a role ends a holding by request id
(`release`), and a holding becomes a sequence's table when the request is admitted (`adopt`). No caller hands
this class a block table to free, so a block is freed exactly once, by the owner of the request that holds it
(vLLM v1 frees through its `KVCacheManager` by request the same way; its connector delays the free with
`request_finished`, which our holdings express). Call it from the engine's owner thread only.

Two groups of layers (`WindowGroup`): a model with sliding-window layers beside full-attention ones keeps its
window layers' KV in a second pool (`window_pool`), in blocks listed by the sequence's `window_table`, index
for index with its `block_table` (vLLM v1's KV cache groups, with a sliding-window manager). Every new block
is allocated in both pools (new tokens are inside every window); after each step, a window block whose
positions all lie before the window of the sequence's next query is released (`release_outside_window`) and
its entry set to 0, the null block, which the window mask never shows. Freed window blocks stay in the window
pool's prefix cache (same hashes) until evicted; a prefix hit of k blocks is valid only where the window
blocks before position k * block_size are still there (`window_hit`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence as Seq

from cluster.kv.block_pool import BlockPool
from cluster.kv.groups import window_first_block
from cluster.sequence import Sequence


@dataclass(frozen=True)
class WindowGroup:
    """The window layers' pool and their (largest) sliding window in positions."""

    pool: BlockPool
    window: int

    def first_block(self, num_computed: int, block_size: int) -> int:
        """The first block the next query (at position `num_computed`) can see (`window_first_block`)."""
        return window_first_block(num_computed, self.window, block_size)


@dataclass(frozen=True)
class Holding:
    """Blocks held for `request_id` outside a sequence: `block_table` covers positions from 0; its first
    `num_cached_tokens` tokens came from the prefix cache; `window_table` as a sequence's (window groups)."""

    request_id: str
    block_table: tuple[int, ...]
    num_cached_tokens: int = 0
    window_table: tuple[int, ...] = ()


class KVManager:
    """Allocation and freeing of `pool`'s blocks (and `window`'s, see the module docstring), by sequence or by
    request id."""

    def __init__(self, pool: BlockPool, window: Optional[WindowGroup] = None):
        self.pool, self.window = pool, window
        self._held: dict[str, Holding] = {}
        self._pinned: dict[int, int] = {}  # block id -> pins

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now: a new block is taken in every group."""
        free = self.pool.num_free_blocks
        return free if self.window is None else min(free, self.window.pool.num_free_blocks)

    # -- sequences ---------------------------------------------------------------------------------------------

    def allocate(self, seq: Sequence, n: int) -> None:
        """Append `n` free blocks to `seq.block_table` (and its window table). Raises ValueError when fewer are
        free (callers check `num_free_blocks` first)."""
        if n > self.num_free_blocks:  # checked in every group before any allocates
            raise ValueError(f"cannot allocate {n} blocks: only {self.num_free_blocks} free")
        if self.window is not None:
            seq.window_table.extend(self.window.pool.allocate(n))
        seq.block_table.extend(self.pool.allocate(n))

    def take_prefix(self, seq: Sequence, block_ids: Seq[int], window_ids: Seq[int] = ()) -> None:
        """Make the cached blocks `block_ids` (a prefix-cache hit) the start of `seq`'s empty block table, and
        `window_ids` (`window_hit`'s, 0 before the window) the start of its window table."""
        assert not seq.block_table, "a prefix is taken into an empty block table only"
        self.pool.touch(block_ids)
        seq.block_table = list(block_ids)
        if self.window is not None:
            self.window.pool.touch([b for b in window_ids if b])
            seq.window_table = list(window_ids)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references to its blocks (cached ones stay findable) and empty its tables (idempotent)."""
        self.pool.free(seq.block_table)
        seq.block_table = []
        if self.window is not None:
            self.window.pool.free([b for b in seq.window_table if b])
            seq.window_table = []

    def cache_block(self, seq: Sequence, i: int, block_hash: int, token_ids: Seq[int],
                    parent: Optional[int] = None) -> None:
        """Register `seq`'s full, computed block `i` under `block_hash` (chained from `parent`,
        `BlockPool.cache_block`) in every group's prefix cache."""
        self.pool.cache_block(seq.block_table[i], block_hash, token_ids, parent)
        if self.window is not None and seq.window_table[i]:
            self.window.pool.cache_block(seq.window_table[i], block_hash, token_ids, parent)

    def pin(self, block_id: int) -> None:
        """Reference the cached block `block_id` (taking it off the free queue) until `unpin`: a head hit's
        source, which the sequence's own block is copied from once it is admitted."""
        self.pool.touch([block_id])
        self._pinned[block_id] = self._pinned.get(block_id, 0) + 1

    def unpin(self, block_id: int) -> None:
        """Drop one `pin` of `block_id`. Raises KeyError when it is not pinned."""
        left = self._pinned.pop(block_id) - 1
        if left:
            self._pinned[block_id] = left
        self.pool.free([block_id])

    def release_outside_window(self, seq: Sequence, block_size: int) -> None:
        """Free the window blocks of `seq` that no later query can see (`WindowGroup.first_block`). The
        released entries are always a prefix of the table, so this walks back from the window's first block
        over the newly released ones only (called after every step of every sequence)."""
        if self.window is None:
            return
        table = seq.window_table
        i = min(self.window.first_block(seq.num_computed_tokens, block_size), len(table)) - 1
        released = []
        while i >= 0 and table[i]:
            released.append(table[i])
            table[i] = 0
            i -= 1
        if released:
            self.window.pool.free(released)

    def window_hit(self, hashes: Seq[int], token_ids: Seq[int], block_size: int,
                   num_blocks: int) -> tuple[int, list[int]]:
        """The longest prefix of at most `num_blocks` cached blocks whose window blocks are cached too, as
        (k, the window table for it: 0 before the window of position k * block_size, then the cached window
        blocks). Without a window group: (num_blocks, [])."""
        if self.window is None:
            return num_blocks, []
        for k in range(num_blocks, 0, -1):
            first = self.window.first_block(k * block_size, block_size)
            ids = [self.window.pool.lookup(hashes[i], token_ids[i * block_size:(i + 1) * block_size])
                   for i in range(first, k)]
            if all(b is not None for b in ids):
                return k, [0] * first + ids
        return 0, []

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash in every group's pool; returns how many the main pool forgot."""
        if self.window is not None:
            self.window.pool.reset_prefix_cache()
        return self.pool.reset_prefix_cache()

    # -- holdings ----------------------------------------------------------------------------------------------

    def reserve(self, request_id: str, cached: Seq[int], num_new: int, num_cached_tokens: int,
                window_cached: Seq[int] = (), window_first: int = 0) -> Holding:
        """Hold the cached blocks `cached` (referenced) plus `num_new` fresh ones for `request_id`; with a window
        group, its window table is 0 before block `window_first`, then the cached window blocks
        `window_cached` (`window_hit`'s, from `window_first` on; 0 entries are skipped) and fresh ones for every
        block after the cached prefix. Raises ValueError when the request already holds blocks or fewer than
        `num_new` are free."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} already holds KV blocks")
        if num_new > self.free_besides(cached, window_cached):
            raise ValueError(f"cannot hold {num_new} new blocks: only {self.num_free_blocks} free")
        self.pool.touch(cached)
        window_table: tuple[int, ...] = ()
        if self.window is not None:
            kept = list(window_cached[window_first:len(cached)])
            self.window.pool.touch([b for b in kept if b])
            fresh = len(cached) + num_new - max(window_first, len(cached))
            window_table = tuple([0] * window_first + kept + self.window.pool.allocate(fresh))
        held = Holding(request_id, tuple(cached) + tuple(self.pool.allocate(num_new)), num_cached_tokens,
                       window_table)
        self._held[request_id] = held
        return held

    def free_besides(self, cached: Seq[int], window_cached: Seq[int] = ()) -> int:
        """Blocks `allocate` could still hand out once the cached blocks `cached` (and `window_cached`) are
        referenced (a free cached block leaves the free list when it is taken)."""
        free = self.pool.num_free_blocks - sum(1 for b in cached if self.pool.blocks[b].ref_cnt == 0)
        if self.window is None:
            return free
        wp = self.window.pool
        return min(free, wp.num_free_blocks - sum(1 for b in window_cached if b and wp.blocks[b].ref_cnt == 0))

    def hold(self, seq: Sequence) -> Holding:
        """Move `seq`'s blocks into a holding under its request id (the sequence leaves the engine, its KV
        stays: a transfer still reads it). `seq.block_table` (and window table) are emptied."""
        if seq.request_id in self._held:
            raise ValueError(f"request {seq.request_id!r} already holds KV blocks")
        held = Holding(seq.request_id, tuple(seq.block_table), seq.num_cached_tokens, tuple(seq.window_table))
        self._held[seq.request_id] = held
        seq.block_table, seq.window_table = [], []
        return held

    def held(self, request_id: str) -> Optional[Holding]:
        """The holding of `request_id`, or None."""
        return self._held.get(request_id)

    def adopt(self, request_id: str, seq: Sequence) -> Holding:
        """Make the holding of `request_id` the block table of `seq` (whose table is empty); the holding ends.
        Raises KeyError when there is none."""
        assert not seq.block_table, "a holding is adopted into an empty block table only"
        held = self._held.pop(request_id)
        seq.block_table, seq.window_table = list(held.block_table), list(held.window_table)
        return held

    def release(self, request_id: str) -> bool:
        """End the holding of `request_id`, freeing its blocks; False when it holds none."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self.pool.free(held.block_table)
        if self.window is not None:
            self.window.pool.free([b for b in held.window_table if b])
        return True
