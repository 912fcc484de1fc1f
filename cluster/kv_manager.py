"""KVManager: the one owner that hands out and frees KV blocks.

Every block a worker uses is held by one request, in exactly one of two places:

- a sequence's `block_table` (the scheduler's running and waiting sequences), or
- a *holding*: blocks kept under a request id outside any sequence. The decode worker's receiver reserves a
  holding when it accepts a transfer (the request may not have arrived yet); the prefill worker's engine
  turns a sequence into a holding when its first token is out, so the blocks stay while they are shipped.

Nothing else frees blocks: the scheduler frees a sequence (`free`), a role ends a holding by request id
(`release`), and a holding becomes a sequence's table when the request is admitted (`adopt`). No caller hands
this class a block table to free, so a block is freed exactly once, by the owner of the request that holds it
(vLLM v1 frees through its `KVCacheManager` by request the same way; its connector delays the free with
`request_finished`, which our holdings express). Call it from the engine's owner thread only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence as Seq

from cluster.block_pool import BlockPool
from cluster.sequence import Sequence


@dataclass(frozen=True)
class Holding:
    """Blocks held for `request_id` outside a sequence: `block_table` covers positions from 0; its first
    `num_cached_tokens` tokens came from the prefix cache."""

    request_id: str
    block_table: tuple[int, ...]
    num_cached_tokens: int = 0


class KVManager:
    """Allocation and freeing of `pool`'s blocks, by sequence or by request id (see the module docstring)."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self._held: dict[str, Holding] = {}

    # -- sequences ---------------------------------------------------------------------------------------------

    def allocate(self, seq: Sequence, n: int) -> None:
        """Append `n` free blocks to `seq.block_table`. Raises ValueError when fewer are free (callers check
        `pool.num_free_blocks` first)."""
        seq.block_table.extend(self.pool.allocate(n))

    def take_prefix(self, seq: Sequence, block_ids: Seq[int]) -> None:
        """Make the cached blocks `block_ids` (a prefix-cache hit) the start of `seq`'s empty block table."""
        assert not seq.block_table, "a prefix is taken into an empty block table only"
        self.pool.touch(block_ids)
        seq.block_table = list(block_ids)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references to its blocks (cached ones stay findable) and empty its table (idempotent)."""
        self.pool.free(seq.block_table)
        seq.block_table = []

    # -- holdings ----------------------------------------------------------------------------------------------

    def reserve(self, request_id: str, cached: Seq[int], num_new: int, num_cached_tokens: int) -> Holding:
        """Hold the cached blocks `cached` (referenced) plus `num_new` fresh ones for `request_id`. Raises
        ValueError when the request already holds blocks or fewer than `num_new` are free."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} already holds KV blocks")
        if num_new > self.free_besides(cached):
            raise ValueError(f"cannot hold {num_new} new blocks: only {self.pool.num_free_blocks} free")
        self.pool.touch(cached)
        held = Holding(request_id, tuple(cached) + tuple(self.pool.allocate(num_new)), num_cached_tokens)
        self._held[request_id] = held
        return held

    def free_besides(self, cached: Seq[int]) -> int:
        """Blocks `allocate` could still hand out once the cached blocks `cached` are referenced (a free cached
        block leaves the free list when it is taken)."""
        return self.pool.num_free_blocks - sum(1 for b in cached if self.pool.blocks[b].ref_cnt == 0)

    def hold(self, seq: Sequence) -> Holding:
        """Move `seq`'s blocks into a holding under its request id (the sequence leaves the engine, its KV
        stays: a transfer still reads it). `seq.block_table` is emptied."""
        if seq.request_id in self._held:
            raise ValueError(f"request {seq.request_id!r} already holds KV blocks")
        held = Holding(seq.request_id, tuple(seq.block_table), seq.num_cached_tokens)
        self._held[seq.request_id] = held
        seq.block_table = []
        return held

    def held(self, request_id: str) -> Optional[Holding]:
        """The holding of `request_id`, or None."""
        return self._held.get(request_id)

    def adopt(self, request_id: str, seq: Sequence) -> Holding:
        """Make the holding of `request_id` the block table of `seq` (whose table is empty); the holding ends.
        Raises KeyError when there is none."""
        assert not seq.block_table, "a holding is adopted into an empty block table only"
        held = self._held.pop(request_id)
        seq.block_table = list(held.block_table)
        return held

    def release(self, request_id: str) -> bool:
        """End the holding of `request_id`, freeing its blocks; False when it holds none."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self.pool.free(held.block_table)
        return True
