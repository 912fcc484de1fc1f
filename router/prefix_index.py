"""PrefixIndex: which worker's prefix cache holds which block hashes, fed by the workers' KV events.

Layout: `holders[block_hash]` is a bitmask of worker slots (bit i = worker i holds it), plus each worker's own
set of hashes (to clear or replace it at once). `match(hashes)` walks the prompt's chained hashes in order,
AND-ing the masks, and gives every worker the number of leading blocks it holds: O(prompt blocks), whatever
the number of workers or indexed blocks. Example: workers 0 and 1 hold blocks [a, b] and [a] of a prompt
[a, b, c]: masks a=0b11, b=0b01, c=0 -> worker 0 matches 2 blocks, worker 1 matches 1.

Restore points: a worker serving a model with recurrent layers can restore a prefix only up to a block with a
state snapshot (cluster/kv/snapshots.py). Its snapshot reply lists those blocks (`restore_points`) and its
events add and drop them ("restorable" / "unrestorable"; a removed block is none either); `match` cuts such a
worker's count back to its last restore point, so routing counts only prefixes the worker can restore.
Window layers: a worker serving a model with sliding-window layers beside full ones (cluster/kv/groups.py)
keeps their blocks in a second pool, and a prefix of k blocks is usable there only where the window blocks
before position k x block_size are cached too. Its snapshot reply names its window and those blocks, its
events of group 1 follow them, and `match_prompt` cuts its count back to the longest prefix whose last window
is intact (`cluster.kv.groups.window_first_block`).

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

from cluster.kv.hashing import block_hashes
from cluster.kv.groups import window_first_block


@dataclass
class _WorkerEntries:
    slot: int
    hashes: set = field(default_factory=set)
    boot_id: str = ""
    last_seq: int = 0
    stale: bool = True  # nothing trustworthy yet: ask for a snapshot
    restore_points: set = field(default_factory=set)  # used only when the worker needs them
    window: Optional[int] = None  # window layers beside full ones: their window, in positions
    window_hashes: set = field(default_factory=set)  # the blocks its window pool holds


class PrefixIndex:
    """Block hash -> workers holding it, for placement. Not thread-safe (the router's event loop owns it)."""

    def __init__(self, workers: Sequence[str]):
        self.workers = {name: _WorkerEntries(i) for i, name in enumerate(workers)}
        self.holders: dict[int, int] = defaultdict(int)
        self.restorers: dict[int, int] = defaultdict(int)  # block hash -> workers with a restore point there
        self.needs_restore = 0  # bitmask of the workers whose prefixes need a restore point
        self.names = list(workers)

    # -- updates -------------------------------------------------------------------------------------------------

    def apply_events(self, worker: str, boot_id: str, events: Iterable) -> bool:
        """Apply one batch of events ((seq, kind, hashes) objects with those attributes). Returns False (and
        marks the worker stale) on a new boot or a gap in sequence numbers; the batch is then not applied."""
        w = self.workers.get(worker)
        if w is None:
            return True
        events = [e for e in events if not (boot_id == w.boot_id and e.seq <= w.last_seq)]  # already seen
        if not events:
            return True
        if boot_id != w.boot_id or events[0].seq != w.last_seq + 1 or w.stale:
            w.stale = True
            return False
        bit = 1 << w.slot
        for e in events:
            if getattr(e, "group", 0) == 1:  # the window pool's blocks
                if e.kind == "stored":
                    w.window_hashes.update(e.block_hashes)
                elif e.kind == "removed":
                    w.window_hashes.difference_update(e.block_hashes)
                elif e.kind == "cleared":
                    w.window_hashes.clear()
            elif e.kind == "stored":
                for h in e.block_hashes:
                    if h not in w.hashes:
                        w.hashes.add(h)
                        self.holders[h] |= bit
            elif e.kind == "removed":
                for h in e.block_hashes:
                    self._drop(w, h)
            elif e.kind == "restorable":
                for h in e.block_hashes:
                    self._add_restore_point(w, h)
            elif e.kind == "unrestorable":
                for h in e.block_hashes:
                    self._drop_restore_point(w, h)
            else:  # cleared
                self._clear(w)
            w.last_seq = e.seq
        return True

    def apply_snapshot(self, worker: str, boot_id: str, last_event_seq: int, hashes: Iterable[int],
                       restore_points: Optional[Iterable[int]] = None, window: Optional[int] = None,
                       window_hashes: Iterable[int] = ()) -> None:
        """Replace a worker's entries with a snapshot taken at `last_event_seq` of boot `boot_id`;
        `restore_points` (None: the worker needs none) are the blocks its prefixes can be restored up to;
        `window` (None: no window pool) and `window_hashes` the window layers' window and cached blocks."""
        w = self.workers.get(worker)
        if w is None:
            return
        self._clear(w)
        bit = 1 << w.slot
        for h in hashes:
            w.hashes.add(h)
            self.holders[h] |= bit
        self.needs_restore = self.needs_restore & ~bit if restore_points is None else self.needs_restore | bit
        for h in restore_points or ():
            self._add_restore_point(w, h)
        w.window, w.window_hashes = window, set(window_hashes)
        w.boot_id, w.last_seq, w.stale = boot_id, last_event_seq, False

    def forget(self, worker: str) -> None:
        """Drop every entry of a worker (dead or restarting); it is stale until its next snapshot."""
        w = self.workers.get(worker)
        if w is not None:
            self._clear(w)
            w.stale, w.boot_id, w.last_seq = True, "", 0

    def needs_snapshot(self) -> list[str]:
        return [name for name, w in self.workers.items() if w.stale]

    # -- queries -------------------------------------------------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of `hashes` each worker holds (only workers with at least one); for a worker that
        needs restore points, up to the last held block that is one."""
        out: dict[str, int] = {}
        alive = (1 << len(self.names)) - 1
        for i, h in enumerate(hashes):
            mask = alive & self.holders.get(h, 0)
            dropped = alive & ~mask & ~self.needs_restore
            if dropped and i:
                self._credit(out, dropped, i)
            alive = mask
            if not alive:
                return out
            restorable = alive & self.needs_restore & self.restorers.get(h, 0)
            if restorable:
                self._credit(out, restorable, i + 1)
        self._credit(out, alive & ~self.needs_restore, len(hashes))
        return out

    def match_prompt(self, token_ids: Sequence[int], block_size: int, first_key: int) -> dict[str, int]:
        """Leading blocks of a prompt each worker holds: its full blocks hashed as the workers hash them
        (`first_key` from cluster.kv.hashing.first_block_key), then `match_hashes`."""
        return self.match_hashes(block_hashes(token_ids, block_size, first_key), block_size)

    def match_hashes(self, hashes: Sequence[int], block_size: int) -> dict[str, int]:
        """Leading blocks of a prompt each worker holds, from the chained hashes of its full blocks (of
        `block_size` tokens, as the workers hash them): `match`, cut back where a worker's window blocks
        are gone."""
        out = self.match(hashes)
        for name, k in list(out.items()):
            w = self.workers[name]
            if w.window is not None:
                k = self._window_intact(w, hashes, k, block_size)
                if k:
                    out[name] = k
                else:
                    del out[name]
        return out

    def num_blocks(self, worker: str) -> int:
        return len(self.workers[worker].hashes)

    def __len__(self) -> int:
        return len(self.holders)

    # -- internals -----------------------------------------------------------------------------------------------

    def _credit(self, out: dict[str, int], mask: int, n: int) -> None:
        while mask:
            low = mask & -mask
            out[self.names[low.bit_length() - 1]] = n
            mask ^= low

    @staticmethod
    def _window_intact(w: _WorkerEntries, hashes: Sequence[int], k: int, block_size: int) -> int:
        """The longest prefix of at most `k` blocks whose last window's blocks `w`'s window pool holds."""
        while k and not all(h in w.window_hashes
                            for h in hashes[window_first_block(k * block_size, w.window, block_size):k]):
            k -= 1
        return k

    def _add_restore_point(self, w: _WorkerEntries, h: int) -> None:
        w.restore_points.add(h)
        self.restorers[h] |= 1 << w.slot

    def _drop_restore_point(self, w: _WorkerEntries, h: int) -> None:
        if h in w.restore_points:
            w.restore_points.discard(h)
            _unset(self.restorers, h, 1 << w.slot)

    def _drop(self, w: _WorkerEntries, h: int) -> None:
        self._drop_restore_point(w, h)
        if h in w.hashes:
            w.hashes.discard(h)
            _unset(self.holders, h, 1 << w.slot)

    def _clear(self, w: _WorkerEntries) -> None:
        for h in list(w.hashes):
            self._drop(w, h)
        for h in list(w.restore_points):
            self._drop_restore_point(w, h)
        w.window_hashes.clear()


def _unset(masks: dict[int, int], h: int, bit: int) -> None:
    """Clear `bit` in `masks[h]`, dropping the entry when no bit is left (the index stays bounded)."""
    left = masks[h] & ~bit
    if left:
        masks[h] = left
    else:
        del masks[h]
