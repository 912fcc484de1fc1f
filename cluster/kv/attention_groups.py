"""The attention kinds of KV cache group: full attention and sliding window (cluster/kv/groups.py).

Both keep K/V per position in a `KVStore`'s blocks, listed by a request's block table (its entry). Full
attention keeps every block while the request runs; a finished request's blocks stay cached until evicted. A
sliding-window group (a model with sliding-window layers beside full ones: gemma3_text, gpt_oss, llama with
sliding `layer_types`) has its own pool: every new block is allocated in it too (new tokens are inside every
window), and after each step a block whose positions all lie before the window of the request's next query is
released (`computed`) and its entry set to 0, the null block, which the window mask never shows. Released window
blocks stay in the window pool's prefix cache until evicted; a prefix hit of k blocks is usable only where the
window blocks from the window of position k * block_size on are still cached (`longest_hit`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from cluster.kv.block_pool import BlockPool
from cluster.kv.groups import GroupHit, KVCacheGroup, StepRequest, window_first_block
from cluster.kv.layout import BatchLayout
from cluster.kv.store import KVStore


class FullAttentionGroup(KVCacheGroup):
    """Full-attention layers `layers` (KV-layer numbering) over `store`'s blocks, booked in `pool`."""

    name = "full"

    def __init__(self, pool: Optional[BlockPool], store: KVStore, layers: Sequence[int]):
        self.pool, self.store, self.layers = pool, store, tuple(layers)
        self.block_size = store.block_size

    @classmethod
    def over(cls, store: KVStore, pool: Optional[BlockPool] = None) -> "FullAttentionGroup":
        """Every layer of `store` as one group (`pool`: its blocks' bookkeeping; None for a runner or a sender
        that only reads and writes the store)."""
        return cls(pool, store, range(store.spec.num_layers))

    def new_entry(self) -> list[int]:
        return []

    def table(self, entry: list[int]) -> list[int]:
        return entry

    def allocate(self, entry: list[int], n: int) -> list[int]:
        entry.extend(self.pool.allocate(n))
        return entry

    def free(self, entry: list[int]) -> list[int]:
        self.pool.free([b for b in entry if b])
        return []

    def longest_hit(self, hashes, token_ids, k, state_shipped) -> int:
        n = 0
        while n < k and self.pool.lookup(hashes[n], token_ids[n * self.block_size:(n + 1) * self.block_size]) \
                is not None:
            n += 1
        return n

    def hit(self, hashes, token_ids, k, state_shipped) -> GroupHit:
        bs = self.block_size
        return GroupHit(tuple(self.pool.lookup(hashes[i], token_ids[i * bs:(i + 1) * bs]) for i in range(k)))

    def take(self, entry: list[int], hit: GroupHit) -> list[int]:
        assert not entry, "a prefix is taken into an empty block table only"
        self.pool.touch([b for b in hit.blocks if b])
        entry.extend(hit.blocks)
        return entry

    def cache_block(self, entry, i, block_hash, token_ids, parent) -> None:
        if entry[i]:
            self.pool.cache_block(entry[i], block_hash, token_ids, parent)

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    def views(self, entries, starts, num_new, mask_rank, mirror_rows) -> list:
        if mirror_rows is not None and max(num_new) == 1:
            layout = BatchLayout.build_decode(self.store, mirror_rows, entries, starts, mask_rank)
        else:
            layout = BatchLayout.build(entries, starts, num_new, self.block_size, mask_rank)
        return self.store.views(layout)

    def arrays(self) -> list:
        return [a for part in (self.store.keys, self.store.values) for a in part]

    def first_to_ship(self, num_tokens: int, num_blocks: int) -> int:
        return 0


class SlidingWindowGroup(FullAttentionGroup):
    """Sliding-window layers `layers` whose largest window is `window` positions, in a pool of their own."""

    name = "sliding_window"

    def __init__(self, pool: BlockPool, store: KVStore, layers: Sequence[int], window: int):
        super().__init__(pool, store, layers)
        self.window = window
        self.reach_tokens = window - 1

    def first_block(self, num_computed: int) -> int:
        """The first block the next query (at position `num_computed`) can see (`window_first_block`)."""
        return window_first_block(num_computed, self.window, self.block_size)

    def longest_hit(self, hashes, token_ids, k, state_shipped) -> int:
        for n in range(k, 0, -1):
            if all(b is not None for b in self._cached(hashes, token_ids, n)):
                return n
        return 0

    def _cached(self, hashes, token_ids, k: int) -> list[Optional[int]]:
        bs = self.block_size
        return [self.pool.lookup(hashes[i], token_ids[i * bs:(i + 1) * bs])
                for i in range(self.first_block(k * bs), k)]

    def hit(self, hashes, token_ids, k, state_shipped) -> GroupHit:
        first = self.first_block(k * self.block_size)
        return GroupHit((0,) * first + tuple(self._cached(hashes, token_ids, k)))

    def computed(self, entry: list[int], step: StepRequest) -> None:
        """Free the blocks no later query can see. The released entries are always a prefix of the table, so
        this walks back from the window's first block over the newly released ones only."""
        i = min(self.first_block(step.num_computed_tokens), len(entry)) - 1
        released = []
        while i >= 0 and entry[i]:
            released.append(entry[i])
            entry[i] = 0
            i -= 1
        if released:
            self.pool.free(released)

    def first_to_ship(self, num_tokens: int, num_blocks: int) -> int:
        return min(self.first_block(num_tokens), num_blocks)
