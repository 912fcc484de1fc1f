"""KV block bookkeeping: ids, reference counts, the prefix cache and LRU eviction. No arrays here.

Worked example (block_size 4, 6 blocks; block 0 is the null block that padding writes into, never handed
out): a 10-token prompt needs 3 blocks -> `allocate(3)` returns [1, 2, 3], each with ref_cnt 1. After its
first 8 tokens are computed, blocks 1 and 2 are full and `cache_block` registers their chained hashes.
When the request ends, `free([1, 2, 3])` drops the ref counts to 0 and appends the blocks to the free
queue in reverse (3, 2, 1), so the tail of a sequence is evicted before its head. A second request with
the same first 8 tokens finds [1, 2] with `find_cached_prefix` and `touch`es them (ref_cnt 1, out of the
free queue). A later `allocate` takes blocks in free-queue order, least recently freed first (3 here:
uncached, so nothing is evicted); taking a cached block forgets its hash (eviction). The design is vLLM v1's BlockPool (vllm/v1/core/block_pool.py).

Each cached block given its parent (the hash its own was chained from) is also listed under that parent, so
`find_partial` finds the cached block whose head agrees with a prompt's next tokens past its whole-block hit
(cluster/prefix_match.py).

Restore points (models with recurrent layers): a prefix hit also needs the recurrent state after its last
block, which only a state snapshot holds (cluster/kv/snapshots.py). A pool made with
`needs_restore_points=True` keeps the set of cached hashes that have one (`mark_restorable`), and
`find_cached_prefix` cuts a hit back to its last restore point. A restore point lives only as long as its
block is cached: evicting the block (or resetting the cache) ends it and calls `on_restore_point_lost`, so
the snapshot's owner drops the state with it.

Every change to the set of cached hashes (and of restore points) is recorded as a KV event with a
monotonically increasing sequence number, for the router's prefix index; at most 65536 undrained events are
kept (a consumer that falls behind sees a gap in `seq` and resyncs). The restore points are a KV cache group
of their own there (`RESTORE_POINT_GROUP`): a restore point kept or ended is a "stored" or "removed" event of
that group, and a reset clears it with a "cleared" event.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

# The KV cache group number of a pool's restore points in its KV events: after the main pool's 0 and a window
# pool's 1 (cluster/kv/index_view.py lists every group of a worker)
RESTORE_POINT_GROUP = 2
# ... and of the main pool's blocks that only the SSD tier holds now (not the pool): held all the same (group 0
# announces them), but slower to reach, so the router prefers a worker with them in RAM
DISK_ONLY_GROUP = 3


@dataclass
class Block:
    """One KV block's bookkeeping: who uses it (`ref_cnt`) and what it holds when cached."""

    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[int] = None
    token_ids: tuple[int, ...] = ()
    parent: Optional[int] = None  # the hash its own was chained from (the extra key for block 0), when given


@dataclass(frozen=True)
class KVEvent:
    """A change to the cached set: `kind` is "stored", "removed" or "cleared" (all blocks dropped).
    `group`: the KV cache group whose cached set changed (0: the main pool, 1: a window pool,
    cluster/kv/groups.py; `RESTORE_POINT_GROUP`: the blocks with a state snapshot, in a pool with restore
    points; `DISK_ONLY_GROUP`: the main pool's blocks only its SSD tier holds)."""

    seq: int
    kind: str
    block_hashes: tuple[int, ...] = ()
    group: int = 0


@dataclass
class EventLog:
    """KV events numbered consecutively, shared by the pools of one engine (so one sequence covers every
    group); at most 65536 undrained events are kept."""

    events: "deque[KVEvent]" = field(default_factory=lambda: deque(maxlen=65536))
    last_seq: int = 0

    def emit(self, kind: str, hashes: tuple[int, ...], group: int) -> None:
        self.last_seq += 1
        self.events.append(KVEvent(self.last_seq, kind, hashes, group))


@dataclass
class BlockPool:
    """Block ids 1..num_blocks-1 for sequences; block 0 is the null block (padding target).

    Raises `ValueError` from `allocate` when asked for more blocks than are free (callers check
    `num_free_blocks` first: running out is a scheduling decision, never an exception path).
    """

    num_blocks: int
    enable_caching: bool = True
    needs_restore_points: bool = False
    on_restore_point_lost: Optional[Callable[[int], None]] = None
    event_log: EventLog = field(default_factory=EventLog)  # pass the main pool's to a window pool
    group: int = 0
    # (block hash, KV event group) -> True when another tier (the SSD tier, cluster/kv/disk_tier.py) still holds
    # what the pool lets go of: its removal is then not announced, since a prefix hit still reaches it
    retained: Optional[Callable[[int, int], bool]] = None
    blocks: list[Block] = field(init=False)
    _free: "OrderedDict[int, None]" = field(init=False)
    _cached: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks={self.num_blocks} is invalid: need >= 2 (block 0 is reserved)")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.blocks[0].ref_cnt = 1  # the null block is never freed
        self._free = OrderedDict((i, None) for i in range(1, self.num_blocks))
        self._cached = {}
        self._restorable: set[int] = set()
        # parent hash -> the cached blocks chained from it, oldest first (`find_partial`)
        self._children: dict[int, OrderedDict[int, None]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` can hand out now (free, cached or not)."""
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        """All blocks except the null block."""
        return self.num_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently findable by hash (in use or free)."""
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (least recently freed first), evicting their cached hashes. ref_cnt -> 1."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue, tail first."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_cnt > 0 and block_id != 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def touch(self, block_ids: Sequence[int]) -> None:
        """Add a reference to each (cache-hit) block, taking free ones out of the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def find_cached_prefix(self, hashes: Sequence[int], token_ids: Sequence[int], block_size: int,
                           restorable_only: bool = True) -> list[int]:
        """The longest run of cached blocks from block 0 whose hashes AND token ids match the prompt; with
        restore points, cut back to the last block that has one unless `restorable_only` is False (the
        caller gets the state after the prompt another way, e.g. with a KV transfer)."""
        if not self.enable_caching:
            return []
        hit: list[int] = []
        for i, block_hash in enumerate(hashes):
            block_id = self.lookup(block_hash, token_ids[i * block_size:(i + 1) * block_size])
            if block_id is None:
                break
            hit.append(block_id)
        if self.needs_restore_points and restorable_only:
            while hit and hashes[len(hit) - 1] not in self._restorable:
                hit.pop()
        return hit

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> Optional[int]:
        """The cached block of `block_hash` holding exactly `token_ids`, or None (a hash collision is a miss,
        never a wrong answer)."""
        block_id = self._cached.get(block_hash) if self.enable_caching else None
        if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids):
            return None
        return block_id

    def mark_restorable(self, block_hash: int) -> bool:
        """Make the cached block `block_hash` a restore point (its state snapshot is kept). False when no
        block is cached under that hash (nothing to restore onto)."""
        if block_hash not in self._cached:
            return False
        if block_hash not in self._restorable:
            self._restorable.add(block_hash)
            self.event_log.emit("stored", (block_hash,), RESTORE_POINT_GROUP)
        return True

    def unmark_restorable(self, block_hash: int) -> None:
        """End the restore point `block_hash`, if any (its snapshot was dropped)."""
        if block_hash in self._restorable:
            self._restorable.discard(block_hash)
            self._removed(block_hash, RESTORE_POINT_GROUP)

    def announce_gone(self, block_hash: int, restore_point: bool) -> None:
        """Another tier let go of `block_hash`'s block (`restore_point` False) or of the state after it (True):
        announce its removal from this pool's group or from the restore points, unless this pool still holds it
        or the other tier holds it again (`retained`, which has said it was held until now)."""
        group = RESTORE_POINT_GROUP if restore_point else self.group
        if restore_point and not self.needs_restore_points:
            return
        held = self._restorable if restore_point else self._cached
        if block_hash not in held and (self.retained is None or not self.retained(block_hash, group)):
            self.event_log.emit("removed", (block_hash,), group)
            if not restore_point and self._tracks_disk_only():
                self.event_log.emit("removed", (block_hash,), DISK_ONLY_GROUP)

    def restorable_hashes(self) -> Optional[list[int]]:
        """Every restore point (for a consumer that lost events); None in a pool without restore points."""
        return list(self._restorable) if self.needs_restore_points else None

    def cache_block(self, block_id: int, block_hash: int, token_ids: Sequence[int],
                    parent: Optional[int] = None) -> None:
        """Register a full, computed block under its chained hash (first holder of a hash wins). `parent`: the
        hash it was chained from (`hash_block`'s first argument: the previous block's hash, or the extra key
        for block 0); given, the block is also found by `find_partial`."""
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block_id
        if parent is not None:
            block.parent = parent
            self._children.setdefault(parent, OrderedDict())[block_id] = None
        self._emit("stored", (block_hash,))

    def find_partial(self, parent: int, token_ids: Sequence[int], max_candidates: int = 64
                     ) -> Optional[tuple[int, int]]:
        """A cached block chained from `parent` whose leading tokens equal the longest possible prefix of
        `token_ids` (at most a block's worth), as (block id, length of that common prefix), or None when no
        child of `parent` starts with `token_ids[0]`. Only the `max_candidates` most recently cached children
        are compared (a popular parent, such as a shared system prompt, can have many), so a lookup costs at
        most `max_candidates` token comparisons per position. Token-granular reuse of a block's head (the
        prefix cache proper is whole blocks): SGLang's radix cache and mlx-lm's prompt cache reuse prefixes
        at token granularity the same way."""
        children = self._children.get(parent) if self.enable_caching else None
        if not children or not token_ids:
            return None
        best: Optional[tuple[int, int]] = None
        for n, block_id in enumerate(reversed(children)):
            if n == max_candidates:
                break
            cached = self.blocks[block_id].token_ids
            k = 0
            for a, b in zip(cached, token_ids):
                if a != b:
                    break
                k += 1
            if k and (best is None or k > best[1]):
                best = (block_id, k)
        return best

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (blocks in use stay allocated but are no longer findable)."""
        n = len(self._cached)
        for block_id in self._cached.values():
            block = self.blocks[block_id]
            block.block_hash, block.token_ids, block.parent = None, (), None
        self._cached.clear()
        self._children.clear()
        lost, self._restorable = self._restorable, set()
        self._emit("cleared", ())
        if self.needs_restore_points:
            self.event_log.emit("cleared", (), RESTORE_POINT_GROUP)
        for block_hash in lost:
            self._lose_restore_point(block_hash)
        return n

    @property
    def last_event_seq(self) -> int:
        """The sequence number of the latest event recorded (0 before any)."""
        return self.event_log.last_seq

    def cached_hashes(self) -> list[int]:
        """Every hash currently findable (a snapshot for a consumer that lost events)."""
        return list(self._cached)

    def drain_events(self) -> list[KVEvent]:
        """Return and forget the events recorded since the last call."""
        events = list(self.event_log.events)
        self.event_log.events.clear()
        return events

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            if block.block_hash in self._restorable:  # a removed block is no restore point either
                self._restorable.discard(block.block_hash)
                self._removed(block.block_hash, RESTORE_POINT_GROUP)
                self._lose_restore_point(block.block_hash)
            self._removed(block.block_hash, self.group)
            if block.parent is not None:
                siblings = self._children[block.parent]
                del siblings[block.block_id]
                if not siblings:
                    del self._children[block.parent]
            block.block_hash, block.token_ids, block.parent = None, (), None

    def _lose_restore_point(self, block_hash: int) -> None:
        if self.on_restore_point_lost is not None:
            self.on_restore_point_lost(block_hash)

    def _emit(self, kind: str, hashes: tuple[int, ...]) -> None:
        self.event_log.emit(kind, hashes, self.group)
        if self._tracks_disk_only():
            if kind == "stored":  # in RAM again: not only on disk (whether or not the tier still holds it)
                self.event_log.emit("removed", hashes, DISK_ONLY_GROUP)
            elif kind == "cleared":
                self.event_log.emit("cleared", (), DISK_ONLY_GROUP)

    def _removed(self, block_hash: int, group: int) -> None:
        if self.retained is None or not self.retained(block_hash, group):
            self.event_log.emit("removed", (block_hash,), group)
        elif group == self.group and self._tracks_disk_only():  # left RAM, still on disk
            self.event_log.emit("stored", (block_hash,), DISK_ONLY_GROUP)

    def _tracks_disk_only(self) -> bool:
        """Whether this pool announces which of its group's blocks only the SSD tier holds (the main pool, with a
        tier: `retained` set)."""
        return self.retained is not None and self.group == 0
