"""KV cache groups: each kind of layer keeps its KV behind one interface (`KVCacheGroup`).

A group serves some of the model's cache slots (`layers`) and answers, for every request, the same questions
whatever its kind: what to hold while a request runs (`allocate`, `free`), what
a prefix hit can reuse (`longest_hit`, `hit`, `take`), what a computed block leaves cached (`cache_block`), what
to let go of after a step (`computed`) and when a request finishes (`finish`), the mlx-lm cache objects a step's
layers run over (`views`, `collect`), and what to ship to a decode worker (`first_to_ship`). The manager
(cluster/kv/manager.py) drives every group the same way, keeping one per-request entry per group (vLLM v1's
`KVCacheBlocks` and its coordinator over single-type managers); nothing outside this package names a kind.

The kinds (each in its own module):
- full attention (`FullAttentionGroup`, cluster/kv/attention_groups.py): every position's K/V in the pool's
  blocks for as long as the request holds them; MLA is full attention with other shapes;
- sliding window (`SlidingWindowGroup`, the same module): its own pool, whose blocks are released once they fall
  out of every future query's window;
- recurrent state (`RecurrentStateGroup`, cluster/kv/state_group.py): one fixed-size state per request, and
  snapshots of it at block boundaries that make a prefix hit restorable.

Entries: a block group's entry is the request's block table (a list of block ids, 0 where a block was released);
the state group's is a `StateEntry`. A `PrefixHit` carries each group's share of a hit (`GroupHit`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from cluster.kv.block_pool import BlockPool
from cluster.stats import KVGroupStats


@dataclass(frozen=True)
class StepRequest:
    """What a group needs to know of one request after a step (`KVCacheGroup.computed`): tokens whose KV is
    computed, the chained hashes of its full computed blocks, and its prompt length."""

    num_computed_tokens: int
    block_hashes: Sequence[int]
    num_prompt_tokens: int


@dataclass(frozen=True)
class GroupHit:
    """One group's share of a prefix hit: `blocks`, the cached blocks its entry starts with (0 where nothing is
    needed), or `state` for a group that restores a state instead, kept under the block hash `key`."""

    blocks: tuple[int, ...] = ()
    state: Any = None
    key: Optional[int] = None
    tier: bool = False  # `state` was read from the SSD tier (not a snapshot in RAM)


@dataclass(frozen=True)
class PrefixHit:
    """A prefix hit found without side effects (`KVManager.lookup`): `num_blocks` whole blocks (the last
    `len(disk)` of them on the SSD tier, the rest in the pool), one `GroupHit` per group, and optionally the head of one more block (`head`: (cached source block, tokens it covers)),
    copied into the request's own block when the hit is taken. `num_tokens` is what the request need not
    compute."""

    num_blocks: int
    groups: tuple[GroupHit, ...]
    block_size: int
    head: Optional[tuple[int, int]] = None
    hashes: tuple[int, ...] = ()  # the hashes of the hit's whole blocks
    # the hit's last whole blocks, past the pool's run, that the SSD tier holds (cluster/kv/disk_tier.py), loaded
    # into new blocks when the hit is taken: (block hash, its tokens, the hash it was chained from, 0 or the
    # pool's cached block to copy instead when the tier lacks it), counted in `num_blocks`
    disk: tuple[tuple[int, tuple[int, ...], int, int], ...] = ()
    pool_groups: tuple[GroupHit, ...] = ()  # with `disk`: the groups' shares of the pool's hit alone

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size + (self.head[1] if self.head else 0)


class KVCacheGroup:
    """One kind of layer's KV (see the module docstring). Subclasses override what their kind needs; the defaults
    are those of a group that holds nothing per block.

    `name`: the kind's name in stats and logs; `layers`: the cache slots it serves, numbered in `layer_space`
    ("kv": the model's KV layers; "state": its recurrent layers, `VerifiedModel.caches`); `pool`: its block
    pool (None: no blocks); `reach_tokens`: positions before a hit's end that the group must still hold for the
    hit to be usable (None: all of them, from position 0); `index`: its place in the manager's groups."""

    name = "group"
    layer_space = "kv"
    layers: tuple[int, ...] = ()
    pool: Optional[BlockPool] = None
    reach_tokens: Optional[int] = None
    index: int = 0
    # the state a transfer ships with the last message (None: nothing beyond blocks)
    ships_state = False

    # -- a request's entry -------------------------------------------------------------------------------------

    def new_entry(self) -> Any:
        """A new request's (empty) entry."""
        return None

    def num_free_blocks(self) -> Optional[int]:
        """Blocks `allocate` can hand out now; None when the group has no blocks."""
        return None if self.pool is None else self.pool.num_free_blocks

    def free_besides(self, hit: GroupHit) -> Optional[int]:
        """Blocks still free once `hit`'s cached blocks are referenced (a free cached block leaves the free list
        when it is taken); None without blocks."""
        if self.pool is None:
            return None
        pool = self.pool
        return pool.num_free_blocks - sum(1 for b in hit.blocks if b and pool.blocks[b].ref_cnt == 0)

    def allocate(self, entry: Any, n: int) -> Any:
        """Append `n` new blocks to `entry` (the manager checks `num_free_blocks` first); returns the entry."""
        return entry

    def free(self, entry: Any) -> Any:
        """Drop the entry's references (cached blocks stay findable); returns the emptied entry. Idempotent."""
        return self.new_entry()

    def finish(self, entry: Any, failed: bool) -> None:
        """The request finishes (`failed`: with an error): keep what it leaves cached. `free` follows."""

    def table(self, entry: Any) -> Sequence[int]:
        """The entry's block ids by block index (empty without blocks)."""
        return ()

    # -- the prefix cache --------------------------------------------------------------------------------------

    def longest_hit(self, hashes: Sequence[int], token_ids: Sequence[int], k: int, state_shipped: bool) -> int:
        """The largest k' <= k such that a prefix hit of k' blocks is usable for this group (`hashes`: the
        prompt's chained block hashes). `state_shipped`: the state after the prompt arrives with a transfer."""
        return k

    def hit(self, hashes: Sequence[int], token_ids: Sequence[int], k: int, state_shipped: bool) -> GroupHit:
        """This group's share of a usable hit of `k` blocks (`longest_hit` said so), without side effects."""
        return GroupHit()

    def take(self, entry: Any, hit: GroupHit) -> Any:
        """Make `hit` the start of the empty `entry` (referencing its blocks); returns the entry."""
        return entry

    def cache_block(self, entry: Any, i: int, block_hash: int, token_ids: Sequence[int], parent: int) -> None:
        """Register the entry's full, computed block `i` under `block_hash` (chained from `parent`)."""

    def computed(self, entry: Any, step: StepRequest) -> None:
        """After a step computed up to `step.num_computed_tokens`: let go of what no later query needs, keep
        what a later prefix hit can use."""

    def reset_prefix_cache(self) -> int:
        """Forget every cached entry; returns how many."""
        return 0

    def attach_tier(self, tier) -> None:
        """Keep what this group caches beyond blocks in the SSD tier too (`cluster.kv.disk_tier.DiskTier`)."""

    def tier_hit(self, hashes: Sequence[int], start: int, end: int, state_shipped: bool = False
                 ) -> tuple[int, Optional[GroupHit]]:
        """A hit that the pool holds up to block `start` and the SSD tier's block files up to `end`: the largest
        end' <= `end` this group can use (start: none past the pool's) and its share of that hit when it differs
        from the pool's (None: the same). `state_shipped`: as in `longest_hit`. The default: blocks are all it
        needs."""
        return end, None

    def stats(self, transfer=None) -> KVGroupStats:
        """This group's figures for the worker's report (`cluster.stats.KVGroupStats`, labelled by `name`);
        `transfer`: the worker's `kv_transfer.metrics.TransferMetrics` (None: it moves no KV)."""
        if self.pool is None:
            return KVGroupStats(self.name)
        return KVGroupStats(self.name, blocks_total=self.pool.num_usable_blocks, blocks_free=self.pool.num_free_blocks)

    def index_entry(self) -> Optional[tuple[int, list[int]]]:
        """What the router's prefix index learns of this group (cluster/kv/index_view.py): (its number in the KV
        events, the block hashes it holds), or None when it tells nothing."""
        return None if self.pool is None else (self.pool.group, self.pool.cached_hashes())

    def chunk_end(self, num_tokens: int, start: int, end: int) -> int:
        """Where a prefill chunk from `start` of a request of `num_tokens` tokens, which the token budget would
        end at `end`, ends for this group (a group that keeps something at certain positions ends it there)."""
        return end

    # -- a step ------------------------------------------------------------------------------------------------

    def views(self, entries: Sequence[Any], starts: Sequence[int], num_new: Sequence[int], mask_rank: int,
              mirror_rows: Optional[Sequence[str]]) -> list:
        """The mlx-lm cache objects of this group's layers (one per `layers` entry) for a step over B rows:
        row b writes positions [starts[b], starts[b] + num_new[b]). `mirror_rows`: the rows' names on a decode
        step that may use the decode mirror, else None."""
        return []

    def collect(self, entries: Sequence[Any], views: list) -> None:
        """After the step's forward: write what the layers left in `views` back into the rows' entries."""

    def arrays(self) -> list:
        """The group's arrays a step writes (evaluated together with a forward's logits)."""
        return []

    # -- transfer ----------------------------------------------------------------------------------------------

    def first_to_ship(self, num_tokens: int, num_blocks: int) -> int:
        """The first block of a prompt of `num_tokens` tokens in `num_blocks` blocks that a decode worker needs
        (`num_blocks`: none)."""
        return num_blocks

    def state_shapes(self) -> tuple:
        """Per layer, the (shape without the batch axis, dtype) of each array of the state it ships."""
        return ()

    def shipped_state(self, entry: Any) -> Any:
        """The state a transfer ships for `entry` (`ships_state` groups), else None."""
        return None

    def receive_state(self, entry: Any, state: Any) -> None:
        """Set the state a transfer brought (`ships_state` groups)."""

    # -- a worker group's followers (cluster/parallel/) ----------------------------------------------------------

    def replicate(self) -> None:
        """This group leads a worker group: from now on keep what its followers must replay (`replica_ops`)."""

    def replica_ops(self) -> list:
        """On a leader: what changed in the rows' entries and the prefix cache outside a forward since the last
        call, oldest first, for the followers to `replay` before the next forward ([] for a group whose content
        lives in blocks, which the forwards and block copies keep alike on every rank)."""
        return []

    def replay(self, ops: list) -> None:
        """On a follower: apply the leader's `replica_ops`."""

    def entry_bytes(self) -> int:
        """Bytes of one request's content beyond blocks that this rank keeps copies of (a recurrent state); 0
        for a group of blocks alone."""
        return 0

    def reserved_bytes(self, max_num_seqs: int) -> int:
        """Bytes this group keeps at most beside its blocks: `max_num_seqs` running requests' content and the
        copies it keeps (0 for a group of blocks alone)."""
        return 0

    def charge_entries(self, nbytes: int) -> None:
        """On a leader: charge each kept copy of a request's content `nbytes` against its budget, the largest
        rank's `entry_bytes` (ranks holding more than the leader must stay within theirs)."""

    def wire_entry(self, entry: Any) -> list[int]:
        """What names `entry` to a follower in a forward: its block table (ints)."""
        return list(self.table(entry))

    def replica_entry(self, wire: list[int]) -> Any:
        """On a follower: its own entry for what `wire_entry` sent."""
        return wire


def window_first_block(num_computed: int, window: int, block_size: int) -> int:
    """The first block a query at position `num_computed` can see through a sliding window of `window`
    positions: it attends to positions > num_computed - window (mlx-lm's `create_causal_mask(...,
    window_size)`), so every block before this one is out of every later query's window."""
    return max(0, (num_computed - window + 1) // block_size)


@dataclass
class StateEntry:
    """A request's entry in a state group: its state after its computed tokens (None: none computed yet),
    the state at the latest block boundary reached while decoding (block hash, state), saved when it finishes,
    and the (block hash, position) of the snapshots it saved at prefill chunk ends, thinned when it finishes.
    `id` names it to a worker group's followers (cluster/kv/state_replica.py)."""

    id: int = 0
    state: Any = None
    pending: Optional[tuple[int, Any]] = None
    chunk_snapshots: list[tuple[int, int]] = field(default_factory=list)


def reserve_blocks(group: KVCacheGroup, entry, num_blocks: int, first: int):
    """Fill `entry` (already holding its cached start) up to `num_blocks` blocks: 0 before block `first` (never
    shipped, out of every later query's reach), new blocks from there on. Returns the entry."""
    table = group.table(entry)
    if len(table) < first:
        table.extend([0] * (first - len(table)))
    return group.allocate(entry, num_blocks - len(table))
