"""KVManager: the one owner of every request's KV, one entry per KV cache group, by request id.

Every block a worker uses is held by one request id, in the entries the manager keeps for it (one per group,
cluster/kv/groups.py: a block table for an attention group, a state for the recurrent group). A request's KV is
either *running* (the engine's sequence of that id computes into it) or *held* (a holding): kept under the id
outside any sequence. The decode worker's receiver reserves a holding when it accepts a transfer (the request may
not have arrived yet); the prefill worker's engine turns a finished sequence's KV into a holding when its first
token is out, so the blocks stay while they are shipped; a holding becomes a sequence's KV again when the request
is admitted (`adopt`).

Nothing else frees blocks: the scheduler frees a request's KV (`free`, on preemption) or finishes it (`finish`,
which keeps it as a holding when the role asks), and a role ends a holding by id (`release`). No caller hands
this class a table to free, so a block is freed exactly once (vLLM v1's `KVCacheManager` frees by request the
same way; its connector delays the free with `request_finished`, which holdings express). Call it from the
engine's owner thread only.

A prefix hit is two calls: `lookup` finds it without side effects (the longest prefix every group can reuse, and
the head of one more block when the full-attention group allows it); once the scheduler knows the request fits,
`commit` takes it, allocates the new blocks and copies a head hit's tokens, in one call. A request that does not
fit changes nothing. Computed and received blocks are registered by one function, `cache_blocks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from cluster.kv.attention_groups import FullAttentionGroup
from cluster.kv.block_pool import BlockPool
from cluster.kv.groups import GroupHit, KVCacheGroup, PrefixHit, StepRequest, reserve_blocks
from cluster.kv.tier_io import host_copies, read_run, store_loaded

# the fewest tokens a head hit must cover, for 32-token blocks (scaled with the block size): a head hit costs a
# block copy and, with the overlapped loop, one wait for the device; a few tokens of prompt cost less
MIN_PARTIAL_TOKENS = 8


@dataclass(frozen=True)
class Holding:
    """KV held for `request_id` outside a sequence: `tables`, each block group's table (by group index; empty
    for a group without blocks), covering positions from 0; its first `num_cached_tokens` tokens came from the
    prefix cache. A reservation's `first_sent`, by group index: the first block a transfer fills (the cached
    prefix and, in a group that reaches back less, what no later query sees are never sent)."""

    request_id: str
    tables: tuple[tuple[int, ...], ...]
    num_cached_tokens: int = 0
    first_sent: tuple[int, ...] = ()

    @property
    def block_table(self) -> tuple[int, ...]:
        """The first group's table (every group has as many blocks)."""
        return self.tables[0]


class KVManager:
    """The entries of every request in every group of `groups` (the first one with blocks is the anchor: its
    pool's events and capacity are the worker's), by request id. `copy_block(src, dst)`: the anchor store's
    block copy, which enables prefix hits on a block's head (when every group allows them)."""

    @classmethod
    def over(cls, pool: BlockPool, store) -> "KVManager":
        """A manager of one full-attention group: `pool`'s blocks over `store` (a `KVStore`; tools and tests)."""
        return cls([FullAttentionGroup.over(store, pool)], store.block_size, store.copy_block)

    def __init__(self, groups: Sequence[KVCacheGroup], block_size: int,
                 copy_block: Optional[Callable[[int, int], None]] = None):
        self.groups = tuple(groups)
        for i, group in enumerate(self.groups):
            group.index = i
        self.block_groups = tuple(g for g in self.groups if g.pool is not None)
        # the groups that act after a step (`KVCacheGroup.computed` overridden)
        self._acting = tuple(g for g in self.groups if type(g).computed is not KVCacheGroup.computed)
        self.pool: BlockPool = self.block_groups[0].pool
        self.block_size = block_size
        # token-granular hits copy the anchor's block: only where the anchor is the only group
        self.head_hits = copy_block is not None and len(self.groups) == 1
        self.copy_block = copy_block
        self.min_partial = max(1, round(MIN_PARTIAL_TOKENS * block_size / 32))
        self._entries: dict[str, list[Any]] = {}
        self._held: dict[str, Holding] = {}
        self.tier = None  # the SSD tier under the pool (`attach_tier`)
        # a worker group leader's followers, each with a tier of its own shard (cluster/parallel/group_tier.py)
        self.tier_replicas = None

    def attach_tier(self, tier) -> None:
        """Keep every cached block in `tier` too (a `cluster.kv.disk_tier.DiskTier` whose arrays are
        `tier_array_names`: written behind as blocks are cached; a group's snapshots too, `tier_state_names`) and
        let prefix hits reach it."""
        from cluster.kv.block_pool import RESTORE_POINT_GROUP
        from cluster.kv.disk_tier import BLOCK, STATE

        self.tier = tier
        for g in self.groups:
            g.attach_tier(tier)
        for g in self.block_groups:  # what the tier still holds stays announced to the router's prefix index
            g.pool.retained = lambda h, group: tier.has(h, STATE if group == RESTORE_POINT_GROUP else BLOCK)

    def detach_tier(self) -> None:
        """Undo `attach_tier` (before any block was cached): no tier under the pool."""
        self.tier = None
        for g in self.groups:
            g.attach_tier(None)
        for g in self.block_groups:
            g.pool.retained = None

    def drain_events(self) -> list:
        """The KV events recorded since the last call (`BlockPool.drain_events`, every group's), after announcing
        what the SSD tier let go of that no pool holds either."""
        from cluster.kv.disk_tier import BLOCK

        if self.tier is not None:
            gone = self.tier.take_gone()
            for block_hash, kind in gone:
                for g in self.block_groups:
                    g.pool.announce_gone(block_hash, restore_point=kind != BLOCK)
            if gone and self.tier_replicas is not None:  # the followers' tiers let go of the same
                self.tier_replicas.drop(gone)
        return self.pool.drain_events()

    def tier_array_names(self) -> tuple[str, ...]:
        """The arrays of one block in the SSD tier: each block group's (`KVStore.array_names`), prefixed with its
        index ("0.k", "0.v", "1.k", ...): a block's file holds it in every group, a sliding window's included."""
        return tuple(f"{g.index}.{name}" for g in self.block_groups for name in g.store.array_names)

    def tier_state_names(self) -> tuple[str, ...]:
        """The arrays of one state after a block in the SSD tier: each recurrent layer's ("2.L.I"), or none."""
        return tuple(f"{g.index}.{layer}.{i}" for g in self.groups if g.ships_state
                     for layer, arrays in enumerate(g.state_shapes()) for i in range(len(arrays)))

    # -- sizes -------------------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now: a new block is taken in every block group."""
        return min(g.num_free_blocks() for g in self.block_groups)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks the request needs to hold `num_tokens` positions."""
        return max(0, -(-num_tokens // self.block_size) - self.num_blocks(request_id))

    # -- a request's entries -----------------------------------------------------------------------------------

    def _entry(self, request_id: str) -> list[Any]:
        """The request's entries, made (empty) on its first allocation, hit or reservation."""
        entries = self._entries.get(request_id)
        if entries is None:
            entries = self._entries[request_id] = [g.new_entry() for g in self.groups]
        return entries

    def _read(self, request_id: str) -> list[Any]:
        """The request's entries to read: empty ones, not kept, for a request that holds nothing here."""
        entries = self._entries.get(request_id)
        return [g.new_entry() for g in self.groups] if entries is None else entries

    def has(self, request_id: str) -> bool:
        """True when the request holds KV here (running or held)."""
        return request_id in self._entries

    def state_shapes(self) -> tuple:
        """Per layer of every group that ships a state, its arrays' (shape, dtype), in shipping order."""
        return tuple(layer for g in self.groups if g.ships_state for layer in g.state_shapes())

    def entries(self, request_id: str) -> tuple[Any, ...]:
        """The request's entry in every group (what a step's views are built from)."""
        return tuple(self._read(request_id))

    def block_table(self, request_id: str) -> list[int]:
        """The anchor group's block table of the request (empty when it holds none)."""
        anchor = self.block_groups[0]
        entries = self._entries.get(request_id)
        return [] if entries is None else anchor.table(entries[anchor.index])

    def tables(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """Every group's block table of the request, by group index (empty for groups without blocks)."""
        entries = self._read(request_id)
        return tuple(tuple(g.table(e)) for g, e in zip(self.groups, entries))

    def num_blocks(self, request_id: str) -> int:
        """Blocks the request holds (in each block group)."""
        return len(self.block_table(request_id))

    def allocate(self, request_id: str, n: int) -> None:
        """Append `n` free blocks to the request's tables in every block group. Raises ValueError when fewer are
        free (callers check `num_free_blocks` first)."""
        if n > self.num_free_blocks:  # checked in every group before any allocates
            raise ValueError(f"cannot allocate {n} blocks: only {self.num_free_blocks} free")
        entries = self._entry(request_id)
        for g in self.block_groups:
            entries[g.index] = g.allocate(entries[g.index], n)

    def free(self, request_id: str) -> None:
        """Drop the request's references (cached blocks stay findable) and empty its entries, as on preemption
        (idempotent; a holding is not touched)."""
        entries = self._entries.get(request_id)
        if entries is not None and request_id not in self._held:
            for i, g in enumerate(self.groups):
                entries[i] = g.free(entries[i])

    def finish(self, request_id: str, failed: bool = False, keep: bool = False,
               num_cached_tokens: int = 0) -> Optional[Holding]:
        """The request's sequence leaves: every group keeps what it leaves cached (`failed`: it ended in an
        error), then its KV is freed, or, with `keep` and blocks to keep, held under its id until `release`
        (returned; `num_cached_tokens` of it came from the prefix cache)."""
        entries = self._entries.get(request_id)
        if entries is None or request_id in self._held:  # a holding stays the role's until `release`
            return None
        for g, e in zip(self.groups, entries):
            g.finish(e, failed)
        if keep and self.num_blocks(request_id):
            return self.hold(request_id, num_cached_tokens)
        self.free(request_id)
        del self._entries[request_id]
        return None

    def computed(self, request_id: str, num_computed_tokens: int, block_hashes: Sequence[int],
                 num_prompt_tokens: int) -> None:
        """After a step computed the request's first `num_computed_tokens` (its full computed blocks hashed as
        `block_hashes`): every group that acts then lets go of what no later query needs and keeps what a later
        hit can use (nothing to do, and nothing built, for a model of full attention alone: the decode step's
        common case)."""
        if not self._acting:
            return
        entries = self._entry(request_id)
        step = StepRequest(num_computed_tokens, block_hashes, num_prompt_tokens)
        for g in self._acting:
            g.computed(entries[g.index], step)

    def group_stats(self, transfer=None) -> tuple:
        """One `cluster.stats.KVGroupStats` per group, the anchor first (`KVCacheGroup.stats`; `transfer`: the
        worker's transfer metrics, None when it moves no KV)."""
        return tuple(g.stats(transfer) for g in self.groups)

    def chunk_end(self, num_tokens: int, start: int, end: int) -> int:
        """Where a prefill chunk from `start` that the budget would end at `end` ends (a group may end it where
        it keeps something, `KVCacheGroup.chunk_end`)."""
        for g in self.groups:
            end = g.chunk_end(num_tokens, start, end)
        return end

    def shipped_state(self, request_id: str) -> Optional[tuple]:
        """What a transfer ships for the request besides blocks: the layers of every group that ships a state,
        in `state_shapes` order (each layer a tuple of arrays [1, *shape]); None when no group ships one."""
        entries = self._read(request_id)
        shipping = [g for g in self.groups if g.ships_state]
        if not shipping:
            return None
        return tuple(layer for g in shipping for layer in g.shipped_state(entries[g.index]))

    def receive_state(self, request_id: str, state: Optional[tuple]) -> None:
        """Set what a transfer brought (`shipped_state`'s layers) in the groups that ship a state."""
        if state is None:
            return
        entries, at = self._entry(request_id), 0
        for g in self.groups:
            if g.ships_state:
                n = len(g.state_shapes())
                g.receive_state(entries[g.index], tuple(state[at:at + n]))
                at += n

    # -- the prefix cache --------------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[int], token_ids: Sequence[int], max_blocks: int,
               state_shipped: bool = False, head_until: int = 0, root: Optional[int] = None,
               tier: bool = False) -> PrefixHit:
        """The longest prefix of at most `max_blocks` whole blocks of `token_ids` (chained `hashes`, from the
        first-block key `root`) that every group can reuse, and, past it, the head of one more cached block
        covering at least `min_partial` of the next tokens and none from position `head_until` on (when head
        hits are on:
        token-granular reuse, as SGLang's radix cache and mlx-lm's prompt cache do). Changes nothing.
        `state_shipped`: the state after the prompt arrives with a transfer (a group that restores state need
        not). `tier`: past the pool's hit, the blocks the SSD tier holds count too (`PrefixHit.disk`; then no
        head hit)."""
        k = min(max_blocks, len(hashes))
        while True:  # each group cuts k back to what it can reuse, until all agree
            cut = k
            for g in self.groups:
                cut = g.longest_hit(hashes, token_ids, cut, state_shipped)
            if cut == k:
                break
            k = cut
        hits = tuple(g.hit(hashes, token_ids, k, state_shipped) for g in self.groups)
        if tier and self.tier is not None and k < min(max_blocks, len(hashes)):
            end, sources = self._tier_run(hashes, token_ids, k, min(max_blocks, len(hashes)))
            shares = list(hits)
            for g in self.groups:  # a group that needs more than blocks (a state after the last) may cut it back
                if end > k:
                    end, share = g.tier_hit(hashes, k, end, state_shipped)
                    shares[g.index] = share or shares[g.index]
            if end > k:
                bs = self.block_size
                disk = tuple((hashes[i], tuple(token_ids[i * bs:(i + 1) * bs]), hashes[i - 1] if i else root,
                              sources[i - k]) for i in range(k, end))
                return PrefixHit(end, tuple(shares), bs, None, tuple(hashes[:end]), disk, hits)
        head = None
        parent = hashes[k - 1] if k else root
        start = k * self.block_size
        limit = min(self.block_size, head_until - start)
        if self.head_hits and limit >= self.min_partial and parent is not None:
            found = self.pool.find_partial(parent, token_ids[start:start + limit])
            if found is not None and found[1] >= self.min_partial:
                head = (found[0], min(found[1], self.block_size - 1))  # a whole equal block would have hit
        return PrefixHit(k, hits, self.block_size, head, tuple(hashes[:k]))

    def _tier_run(self, hashes: Sequence[int], token_ids: Sequence[int], k: int, limit: int
                  ) -> tuple[int, list[int]]:
        """How far past block `k` (at most to `limit`) a hit reaches with the SSD tier, and where each of those
        blocks comes from: 0 for the tier, else the pool's cached block to copy (with one block group, whose
        pool alone decides: a block the pool still holds after one only the tier holds, or past the pool's last
        restore point of a hybrid model). What the router's prefix index counts as held, the pool's blocks and
        the tier's (cluster/kv/index_view.py), is reached."""
        sources, bs = [], self.block_size
        single = len(self.block_groups) == 1
        for i in range(k, limit):
            if self.tier.has(hashes[i]):
                sources.append(0)
                continue
            cached = self.pool.lookup(hashes[i], token_ids[i * bs:(i + 1) * bs]) if single else None
            if cached is None:
                break
            sources.append(cached)
        return k + len(sources), sources

    def free_besides(self, hit: PrefixHit) -> int:
        """Blocks `allocate` could still hand out once `hit` is taken (its blocks from the SSD tier take new
        ones, and a free cached block it copies is held while it is copied)."""
        held = sum(1 for *_, b in hit.disk if b and self.pool.blocks[b].ref_cnt == 0)
        return min(g.free_besides(h) for g, h in zip(self.groups, hit.groups) if g.pool is not None) \
            - len(hit.disk) - held

    def commit(self, request_id: str, hit: PrefixHit, num_new_blocks: int) -> int:
        """Take `hit` as the start of the request's empty entries, allocate `num_new_blocks` more (and one for each
        of its blocks on the SSD tier, loaded into them) and copy a head hit's cached block into the request's
        block that holds its first position to compute. Returns the tokens the request need not compute: the
        hit's, or fewer when a block on the tier could not be loaded (the rest is computed). Raises ValueError
        when fewer than `num_new_blocks` blocks are free besides the hit (checked before anything changes)."""
        if num_new_blocks > self.free_besides(hit):
            raise ValueError(f"cannot allocate {num_new_blocks} blocks: only {self.free_besides(hit)} free")
        loaded, shares = self._read_tier(hit), hit.groups
        if len(loaded) < len(hit.disk) and any(h.tier for h in hit.groups):
            # a state read from the tier follows the hit's last block, which could not be loaded: the pool's hit
            shares, loaded = hit.pool_groups, []
        entries = self._entry(request_id)
        assert not self.num_blocks(request_id), "a prefix is taken into empty entries only"
        for g, h in zip(self.groups, shares):
            entries[g.index] = g.take(entries[g.index], h)
        if hit.head is None:
            reused = self._take_disk(request_id, hit, loaded,
                                     lambda: self.allocate(request_id, num_new_blocks + len(hit.disk)))
            return reused * self.block_size if hit.disk else hit.num_tokens
        source = hit.head[0]
        self.pool.touch([source])  # no allocation may evict it before the copy
        self.allocate(request_id, num_new_blocks)
        self.copy_block(source, self.block_table(request_id)[hit.num_blocks])
        self.pool.free([source])
        self._tier_reused(request_id, hit.hashes[:hit.num_blocks])
        return hit.num_tokens

    def _take_disk(self, request_id: str, hit: PrefixHit, loaded: list, allocate: Callable[[], None]) -> int:
        """`allocate` the request's blocks past the hit's pool blocks (its entries hold those), write `loaded`
        (`_read_tier`) into those that follow the pool's hit and register them; a free pool block the hit copies
        is held until it is copied. Returns the hit's blocks reused."""
        copied = [b for *_, b in hit.disk[:len(loaded)] if b]
        self.pool.touch(copied)  # no allocation may evict a block before it is copied
        allocate()
        taken = self._write_loaded(request_id, hit, loaded) if loaded else 0
        self.pool.free(copied)
        reused = hit.num_blocks - len(hit.disk) + taken
        self._tier_reused(request_id, hit.hashes[:reused])
        return reused

    def _tier_reused(self, request_id: str, hashes: Sequence[int]) -> None:
        """A hit reused the request's first blocks `hashes`: the SSD tier holds them too (those it let go of are
        written again from the pool) and they are its most recently used, the first of them last to go."""
        if self.tier is None or not hashes:
            return
        self._write_behind(request_id, range(len(hashes)), hashes)
        self.tier.touch(hashes)

    def cache_blocks(self, request_id: str, start: int, hashes: Sequence[int], token_ids: Sequence[int],
                     root: int) -> None:
        """Register the request's full, computed blocks `start`.. (`hashes[start:]`, chained from `root`, the
        first-block key, for block 0) in every group's prefix cache: the one registration of computed and of
        received blocks."""
        entries = self._entry(request_id)
        bs = self.block_size
        for i in range(start, len(hashes)):
            parent = hashes[i - 1] if i else root
            for g in self.groups:
                g.cache_block(entries[g.index], i, hashes[i], token_ids[i * bs:(i + 1) * bs], parent)
        if self.tier is not None and start < len(hashes):
            self._write_behind(request_id, range(start, len(hashes)), hashes, token_ids)

    def _write_behind(self, request_id: str, blocks: range, hashes: Sequence[int],
                      token_ids: Optional[Sequence[int]] = None) -> None:
        """Hand the tier host copies of the request's blocks `blocks` that it does not hold yet (a block is
        written with its KV in every block group; one a group no longer holds is not written). `token_ids`: the
        request's tokens (None: each block's own, as the pool cached it)."""
        entries, bs = self._entries[request_id], self.block_size
        tables = [g.table(entries[g.index]) for g in self.block_groups]
        todo = [i for i in blocks if all(t[i] for t in tables) and not self.tier.has(hashes[i])]
        if token_ids is None:
            anchor = tables[0]
            todo = [i for i in todo if self.pool.blocks[anchor[i]].block_hash == hashes[i]]
        if not todo:
            return
        written = []
        for i, arrays in zip(todo, host_copies(self.block_groups, tables, todo, bs)):
            tokens = token_ids[i * bs:(i + 1) * bs] if token_ids is not None else \
                self.pool.blocks[tables[0][i]].token_ids
            if self.tier.put(hashes[i], tokens, arrays):
                written.append((i, tokens))
        self.tier.end_batch()  # listed once written so that the first of them is the last to go
        if self.tier_replicas is not None and written:  # each follower writes its shard of what the tier took
            self.tier_replicas.write([hashes[i] for i, _ in written], [tokens for _, tokens in written],
                                     [[t[i] for i, _ in written] for t in tables])

    def _read_tier(self, hit: PrefixHit) -> list:
        """The hit's blocks on the SSD tier, read in order up to the first it cannot give (`read_run`)."""
        return read_run(self.tier, [(h, tokens, source) for h, tokens, _, source in hit.disk]) if hit.disk else []

    def _write_loaded(self, request_id: str, hit: PrefixHit, loaded: list) -> int:
        """Write blocks read from the SSD tier (and copy those the pool holds) into the request's new blocks that
        follow its pool hit, in every block group, and register them in the prefix cache. In a worker group every
        rank loads its shard of them, and all take as many as the rank that could load the fewest. Returns how many
        of `loaded` were taken."""
        entries = self._entries[request_id]
        first = hit.num_blocks - len(hit.disk)
        tables = [g.table(entries[g.index]) for g in self.block_groups]
        dests = [[table[first + j] for j in range(len(loaded))] for table in tables]
        if self.tier_replicas is not None:
            taken = self.tier_replicas.load(hit.disk[:len(loaded)], dests, len(loaded))
            if taken < len(loaded):  # a rank lacks a file: every rank computes those, and writes them again
                from cluster.kv.disk_tier import BLOCK

                self.tier.drop([(h, BLOCK) for h, _, _, source in hit.disk[taken:len(loaded)] if not source])
            loaded, dests = loaded[:taken], [d[:taken] for d in dests]
        store_loaded(self.block_groups, dests, loaded)
        for g in self.block_groups:
            for j, (block_hash, tokens, parent, _) in enumerate(hit.disk[:len(loaded)]):
                g.cache_block(entries[g.index], first + j, block_hash, tokens, parent)
        return len(loaded)

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash in every group (and delete the SSD tier's blocks); returns how many the anchor
        pool forgot."""
        if self.tier is not None:
            self.tier.clear()
            if self.tier_replicas is not None:
                self.tier_replicas.clear()
        counts = [g.reset_prefix_cache() for g in self.groups]
        return counts[self.block_groups[0].index]

    # -- holdings ----------------------------------------------------------------------------------------------

    def reserve(self, request_id: str, hit: PrefixHit, num_blocks: int, num_tokens: int) -> Holding:
        """Hold `hit`'s cached blocks (referenced) plus fresh ones up to `num_blocks` for `request_id`, whose KV of
        `num_tokens` positions arrives by transfer: in each group, blocks before the first it needs
        (`first_to_ship`) stay 0. The hit's blocks on the SSD tier are loaded into their fresh blocks now (a
        decode worker restores them from its own disk; the transfer skips them), up to the first the tier cannot
        give. Raises ValueError when the request already holds KV or too few blocks are free."""
        if request_id in self._entries:
            raise ValueError(f"request {request_id!r} already holds KV blocks")
        num_new = num_blocks - hit.num_blocks
        if num_new > self.free_besides(hit):
            raise ValueError(f"cannot hold {num_new} new blocks: only {self.num_free_blocks} free")
        loaded = self._read_tier(hit)
        entries, firsts = self._entry(request_id), []
        for g, h in zip(self.groups, hit.groups):
            first = g.first_to_ship(num_tokens, num_blocks) if g.pool is not None else 0
            kept = GroupHit(tuple(b if i >= first else 0 for i, b in enumerate(h.blocks)), h.state, h.key)
            entries[g.index] = g.take(entries[g.index], kept)
            firsts.append(first)

        def fill() -> None:  # every group's table up to num_blocks: 0 before its first needed block
            for g, first in zip(self.groups, firsts):
                if g.pool is not None:
                    entries[g.index] = reserve_blocks(g, entries[g.index], num_blocks, first)

        if hit.disk:
            cached = self._take_disk(request_id, hit, loaded, fill)
        else:
            fill()
            cached = hit.num_blocks
        sent = tuple(max(cached, first) if g.pool is not None else num_blocks for g, first in zip(self.groups, firsts))
        held = Holding(request_id, self.tables(request_id), cached * self.block_size, sent)
        self._held[request_id] = held
        return held

    def hold(self, request_id: str, num_cached_tokens: Optional[int] = None) -> Holding:
        """Keep the request's KV under its id outside any sequence (a transfer still reads it). Raises
        ValueError when it is held already."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} already holds KV blocks")
        held = Holding(request_id, self.tables(request_id), num_cached_tokens or 0)
        self._held[request_id] = held
        return held

    def held(self, request_id: str) -> Optional[Holding]:
        """The holding of `request_id`, or None."""
        return self._held.get(request_id)

    def adopt(self, request_id: str) -> Holding:
        """The holding of `request_id` becomes the KV of its sequence; the holding ends. Raises KeyError when
        there is none."""
        return self._held.pop(request_id)

    def release(self, request_id: str) -> bool:
        """End the holding of `request_id`, freeing its KV; False when it holds none."""
        if self._held.pop(request_id, None) is None:
            return False
        self.free(request_id)
        del self._entries[request_id]
        return True
