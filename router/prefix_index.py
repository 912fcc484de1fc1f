"""PrefixIndex: which worker's prefix cache holds which block hashes, fed by the workers' KV events.

Layout: `holders[group][block_hash]` is a bitmask of worker slots (bit i = worker i holds it in that KV cache
group), plus each worker's own set of hashes per group (to clear or replace it at once). `match(hashes,
block_size)` walks the prompt's chained hashes in order, AND-ing the masks, and gives every worker the number
of leading blocks it holds: O(prompt blocks), whatever the number of workers or indexed blocks. Example:
workers 0 and 1 hold blocks [a, b] and [a] of a prompt [a, b, c]: masks a=0b11, b=0b01, c=0 -> worker 0
matches 2 blocks, worker 1 matches 1.

KV cache groups: a worker's prefix cache is one or more KV cache groups (cluster/kv/index_view.py), each
with its own set of cached blocks and its reach: how many positions before the end of a prefix hit the group
must still hold (None: every position from 0). A hit of k blocks is usable on a worker when, for every group,
every block from `first_needed_block(k, block_size, reach)` to k - 1 is in that group's set. The worker's
snapshot reply lists its groups and their blocks, and each of its events changes one group's set. `match`
walks the groups that need every block with the bitmasks above, then cuts a worker that has groups of a
bounded reach back to the longest prefix they allow. Example (block size 4): a group of reach 7 needs, for a
hit of 5 blocks (20 positions), blocks (20 - 7) // 4 = 3 and 4; a group of reach 1 only block 4.

Tiers: a worker's groups count the blocks its SSD tier holds as held. One more set per worker, fed by the
events of `DISK_ONLY_GROUP`, names the main group's blocks that only the tier holds (slower to reach);
`on_disk` counts them in a match, so placement can prefer a worker that holds a prefix in RAM.

Consistency: each worker numbers its events consecutively per boot (`boot_id`). A batch from a new boot, or
one whose first sequence number is not the next expected, marks the worker stale: its entries stay until a
snapshot (`apply_snapshot`) replaces them; `needs_snapshot()` lists who to ask. Events at or below the
snapshot's sequence number are ignored. Size: at most the sum of the workers' cached blocks (each worker
reports removals; a snapshot replaces the whole set), and `forget(worker)` drops a dead worker's entries.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from cluster.kv.block_pool import DISK_ONLY_GROUP
from cluster.kv.hashing import block_hashes


def first_needed_block(num_blocks: int, block_size: int, reach_tokens: Optional[int]) -> int:
    """The first block a KV cache group of reach `reach_tokens` (None: every block) must hold for a prefix hit
    of `num_blocks` blocks of `block_size` tokens to be usable."""
    if reach_tokens is None:
        return 0
    return max(0, (num_blocks * block_size - reach_tokens) // block_size)


@dataclass
class _Group:
    reach: Optional[int]  # positions before a hit's end this group must hold; None: every one
    hashes: set = field(default_factory=set)


@dataclass
class _WorkerEntries:
    slot: int
    groups: dict[int, _Group] = field(default_factory=dict)  # its KV cache groups, by number
    disk_only: set = field(default_factory=set)  # its main group's blocks only its SSD tier holds
    boot_id: str = ""
    last_seq: int = 0
    stale: bool = True  # nothing trustworthy yet: ask for a snapshot


class PrefixIndex:
    """Block hash -> workers holding it, per KV cache group, for placement. Not thread-safe (the router's event
    loop owns it)."""

    def __init__(self, workers: Sequence[str]):
        self.workers = {name: _WorkerEntries(i) for i, name in enumerate(workers)}
        self.holders: dict[int, dict[int, int]] = defaultdict(dict)  # group -> block hash -> workers' bitmask
        self.whole: dict[int, int] = {}  # group -> the workers for whom it needs every block (reach None)
        self.bounded = 0  # the workers with a group of bounded reach
        self.indexed = 0  # the workers with at least one group
        self.names = list(workers)

    # -- updates -------------------------------------------------------------------------------------------------

    def apply_events(self, worker: str, boot_id: str, events: Iterable) -> bool:
        """Apply one batch of events ((seq, kind, hashes, group) objects with those attributes; no `group`:
        group 0). Returns False (and marks the worker stale) on a new boot or a gap in sequence numbers; the
        batch is then not applied. Events of a group the worker's snapshot did not list change nothing."""
        w = self.workers.get(worker)
        if w is None:
            return True
        events = [e for e in events if not (boot_id == w.boot_id and e.seq <= w.last_seq)]  # already seen
        if not events:
            return True
        if boot_id != w.boot_id or events[0].seq != w.last_seq + 1 or w.stale:
            w.stale = True
            return False
        for e in events:
            number = getattr(e, "group", 0)
            if number == DISK_ONLY_GROUP:
                self._disk_only_event(w, e)
                w.last_seq = e.seq
                continue
            g = w.groups.get(number)
            if g is not None and e.kind == "stored":
                self._add(w, number, g, e.block_hashes)
            elif g is not None and e.kind == "removed":
                for h in e.block_hashes:
                    self._drop(w, number, g, h)
            elif g is not None:  # cleared
                self._clear_group(w, number, g)
            w.last_seq = e.seq
        return True

    def apply_snapshot(self, worker: str, boot_id: str, last_event_seq: int,
                       groups: Iterable[tuple[int, Optional[int], Iterable[int]]]) -> None:
        """Replace a worker's entries with a snapshot taken at `last_event_seq` of boot `boot_id`: its KV cache
        groups as (group number, reach in positions or None for every block, the block hashes it holds)."""
        w = self.workers.get(worker)
        if w is None:
            return
        self._clear(w)
        for number, reach, hashes in groups:
            if number == DISK_ONLY_GROUP:
                w.disk_only = set(hashes)
                continue
            g = w.groups[number] = _Group(reach)
            self._add(w, number, g, hashes)
        self._set_masks(w)
        w.boot_id, w.last_seq, w.stale = boot_id, last_event_seq, False

    def forget(self, worker: str) -> None:
        """Drop every entry of a worker (dead or restarting); it is stale until its next snapshot."""
        w = self.workers.get(worker)
        if w is not None:
            self._clear(w)
            self._set_masks(w)
            w.stale, w.boot_id, w.last_seq = True, "", 0

    def needs_snapshot(self) -> list[str]:
        """The workers whose entries are not trusted (never synced, a gap or a new boot): ask them for one."""
        return [name for name, w in self.workers.items() if w.stale]

    # -- queries -------------------------------------------------------------------------------------------------

    def match(self, hashes: Sequence[int], block_size: int) -> dict[str, int]:
        """The longest usable prefix of `hashes` (blocks of `block_size` tokens) on each worker, in blocks (only
        workers with at least one): its leading blocks that every group needing every block holds, cut back to
        where its groups of bounded reach hold what they need."""
        out: dict[str, int] = {}
        alive = self.indexed
        whole = [(self.holders.get(number, {}), need) for number, need in self.whole.items()]
        for i, h in enumerate(hashes):
            mask = alive
            for held, need in whole:
                mask &= held.get(h, 0) | ~need
            dropped = alive & ~mask
            if dropped and i:
                self._credit(out, dropped, i)
            alive = mask
            if not alive:
                break
        else:
            self._credit(out, alive, len(hashes))
        if self.bounded:
            for name, k in list(out.items()):
                w = self.workers[name]
                if self.bounded >> w.slot & 1:
                    k = self._usable(w, hashes, k, block_size)
                    if k:
                        out[name] = k
                    else:
                        del out[name]
        return out

    def match_prompt(self, token_ids: Sequence[int], block_size: int, first_key: int) -> dict[str, int]:
        """Leading blocks of a prompt each worker can use: its full blocks hashed as the workers hash them
        (`first_key` from cluster.kv.hashing.first_block_key), then `match_hashes`."""
        return self.match_hashes(block_hashes(token_ids, block_size, first_key), block_size)

    def match_hashes(self, hashes: Sequence[int], block_size: int) -> dict[str, int]:
        """Leading blocks of a prompt each worker can use, from the chained hashes of its full blocks (of
        `block_size` tokens, as the workers hash them): `match`."""
        return self.match(hashes, block_size)

    def on_disk(self, hashes: Sequence[int], matched: dict[str, int]) -> dict[str, int]:
        """Of each worker's usable leading blocks (`matched`, from `match` over `hashes`), how many only its SSD
        tier holds (loaded from disk on a hit, not in RAM); workers with none are left out."""
        out = {}
        for name, k in matched.items():
            disk_only = self.workers[name].disk_only
            n = sum(1 for h in hashes[:k] if h in disk_only) if disk_only else 0
            if n:
                out[name] = n
        return out

    def num_blocks(self, worker: str, group: int = 0) -> int:
        """The blocks a worker's KV cache group (0: the first) holds, as indexed."""
        g = self.workers[worker].groups.get(group)
        return 0 if g is None else len(g.hashes)

    def __len__(self) -> int:
        """Indexed (group, block hash) entries, over every worker."""
        return sum(len(held) for held in self.holders.values())

    # -- internals -----------------------------------------------------------------------------------------------

    def _credit(self, out: dict[str, int], mask: int, n: int) -> None:
        while mask:
            low = mask & -mask
            out[self.names[low.bit_length() - 1]] = n
            mask ^= low

    @staticmethod
    def _usable(w: _WorkerEntries, hashes: Sequence[int], k: int, block_size: int) -> int:
        """The longest prefix of at most `k` blocks that `w`'s groups of bounded reach allow. A block j missing
        from a group rules out every k' in (j, k] (each needs j there too), so the search jumps to k' = j."""
        bounded = [g for g in w.groups.values() if g.reach is not None]
        while k:
            missing = -1
            for g in bounded:
                for j in range(k - 1, first_needed_block(k, block_size, g.reach) - 1, -1):
                    if hashes[j] not in g.hashes:
                        missing = max(missing, j)
                        break
            if missing < 0:
                return k
            k = missing
        return 0

    def _set_masks(self, w: _WorkerEntries) -> None:
        """Record which of `w`'s groups need every block, and whether it has groups of bounded reach."""
        bit = 1 << w.slot
        for number in list(self.whole):
            self.whole[number] &= ~bit
            if not self.whole[number]:
                del self.whole[number]
        for number, g in w.groups.items():
            if g.reach is None:
                self.whole[number] = self.whole.get(number, 0) | bit
        bounded = any(g.reach is not None for g in w.groups.values())
        self.bounded = self.bounded | bit if bounded else self.bounded & ~bit
        self.indexed = self.indexed | bit if w.groups else self.indexed & ~bit

    def _add(self, w: _WorkerEntries, number: int, g: _Group, hashes: Iterable[int]) -> None:
        held, bit = self.holders[number], 1 << w.slot
        for h in hashes:
            if h not in g.hashes:
                g.hashes.add(h)
                held[h] = held.get(h, 0) | bit

    def _drop(self, w: _WorkerEntries, number: int, g: _Group, h: int) -> None:
        if h in g.hashes:
            g.hashes.discard(h)
            _unset(self.holders, number, h, 1 << w.slot)

    def _clear_group(self, w: _WorkerEntries, number: int, g: _Group) -> None:
        for h in list(g.hashes):
            self._drop(w, number, g, h)

    def _clear(self, w: _WorkerEntries) -> None:
        for number, g in w.groups.items():
            self._clear_group(w, number, g)
        w.groups = {}
        w.disk_only = set()

    @staticmethod
    def _disk_only_event(w: _WorkerEntries, e) -> None:
        """Blocks of the main group that left RAM for the SSD tier only ("stored"), came back or went ("removed")."""
        if e.kind == "stored":
            w.disk_only.update(e.block_hashes)
        elif e.kind == "removed":
            w.disk_only.difference_update(e.block_hashes)
        else:
            w.disk_only.clear()


def _unset(holders: dict[int, dict[int, int]], number: int, h: int, bit: int) -> None:
    """Clear `bit` in `holders[number][h]`, dropping the entry (and an empty group) when no bit is left (the
    index stays bounded)."""
    masks = holders[number]
    left = masks[h] & ~bit
    if left:
        masks[h] = left
    else:
        del masks[h]
        if not masks:
            del holders[number]
