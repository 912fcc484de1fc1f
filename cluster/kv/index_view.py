"""What a worker tells the router's prefix index about its KV cache groups (`prefix_index_groups`).

The router sees a worker's prefix cache as a list of KV cache groups, each one number and one set: its reach
(`reach_tokens`: how many positions before the end of a prefix hit the group must still hold for the hit to
be usable; None: every position from 0) and the block hashes it holds. A prefix hit of k blocks of
`block_size` tokens is usable when every group holds every block from max(0, (k x block_size - reach) //
block_size) to k - 1 (router/prefix_index.py).
The groups of today's models, by number (the number the KV events of each carry, `KVEvent.group`):

    0                     the main pool (full attention): every block of the hit, reach None
    1                     a window pool (sliding-window layers beside full ones, cluster/kv/groups.py): the
                          blocks a query at the hit's end still sees, reach window - 1 (a query at position p
                          sees positions > p - window, so this is `window_first_block`)
    RESTORE_POINT_GROUP   (2) the restore points of a model with recurrent layers (cluster/kv/snapshots.py):
                          the hit's last block must have a state snapshot, reach 1

What the SSD tier holds (cluster/kv/disk_tier.py) counts as held: its blocks in groups 0 and 1, its states
as restore points (the pools do not announce the removal of what the tier still holds, `BlockPool.retained`).
Which of group 0's blocks are only on the tier, not in RAM, is one more set, `DISK_ONLY_GROUP` (3): not a
group a hit needs, but what the router weighs (router/placement.py prefers RAM).

Nothing here imports the engine: it reads a `KVManager`'s groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from cluster.kv.manager import KVManager


@dataclass(frozen=True)
class IndexGroup:
    """One KV cache group as the router's prefix index sees it: its number, its reach in positions (None:
    every block from 0) and the hashes of the blocks it holds."""

    group: int
    reach_tokens: Optional[int]
    hashes: list[int]


def prefix_index_groups(kv: "KVManager") -> list[IndexGroup]:
    """Every KV cache group of a worker's prefix cache, with the blocks each holds now (a prefix-index
    snapshot), as each group lists itself (`KVCacheGroup.index_entry`), and what the worker's SSD tier holds
    (its blocks in every block group, its states as restore points): a hit reaches those too; with a tier,
    last, `DISK_ONLY_GROUP`: the main pool's blocks only the tier holds."""
    from cluster.kv.block_pool import DISK_ONLY_GROUP, RESTORE_POINT_GROUP
    from cluster.kv.disk_tier import BLOCK, STATE

    found = [(g.index_entry(), g.reach_tokens) for g in kv.groups]
    tier = kv.tier
    out = []
    for entry, reach in found:
        if entry is None:
            continue
        hashes = entry[1]
        if tier is not None:
            held = set(hashes)
            hashes = hashes + [h for h in tier.hashes(STATE if entry[0] == RESTORE_POINT_GROUP else BLOCK)
                               if h not in held]
        out.append(IndexGroup(entry[0], reach, hashes))
    if tier is not None:
        in_ram = set(kv.pool.cached_hashes())
        out.append(IndexGroup(DISK_ONLY_GROUP, None, [h for h in tier.hashes(BLOCK) if h not in in_ram]))
    return out
