"""Moving blocks between a KV pool and the SSD tier's host arrays (cluster/kv/disk_tier.py): the host copies the
write-behind hands the tier, and the loaded blocks written back into new pool blocks. Shared by a server's
`KVManager` and, in a worker group, by each follower, which does the same with its own shard of the same block
ids (cluster/parallel/group_tier.py). Owner-thread calls (they read and write the pool's arrays)."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np


def host_copies(block_groups: Sequence, tables: Sequence[Sequence[int]], blocks: Sequence[int],
                block_size: int) -> list[list[np.ndarray]]:
    """Host copies of the blocks at positions `blocks` of `tables` (one block table per block group, by the
    order of `block_groups`): per block, its arrays in every block group, in the order of the groups' stores'
    `array_names` (`KVManager.tier_array_names`), each (layers, block_size, ...) as `KVStore.read_blocks`
    gives them (quantized blocks stay packed)."""
    per_group = []
    for g, table in zip(block_groups, tables):
        per_group += g.store.read_blocks([table[i] for i in blocks], range(g.store.spec.num_layers))
    bs = block_size
    return [[np.ascontiguousarray(a[:, j * bs:(j + 1) * bs]) for a in per_group] for j in range(len(blocks))]


def read_run(tier, blocks: Sequence[tuple[int, Sequence[int], int]]) -> list:
    """A hit's blocks past the pool's run, each (block hash, tokens, 0 or the pool block to copy instead), read
    in order up to the first the tier (a `DiskTier`; None: none) cannot give: each file's arrays, or a pool
    block's id. Reads the files (`DiskTier.load_many`)."""
    files = iter(tier.load_many([(h, tokens) for h, tokens, source in blocks if not source]) if tier else [])
    out: list = []
    for _, _, source in blocks:
        got: Optional[object] = source if source else next(files, None)
        if got is None:
            break
        out.append(got)
    return out


def store_loaded(block_groups: Sequence, dests: Sequence[Sequence[int]],
                 loaded: Sequence[Union[int, Sequence[np.ndarray]]]) -> None:
    """Write each `loaded[j]` (a block's arrays from the tier, every block group's as `host_copies` gives them;
    or an int: a pool block to copy) into block `dests[g][j]` of each block group g (0: the group holds no block
    there, as before a reservation's first sent block: skipped)."""
    at = 0
    for g, dest in zip(block_groups, dests):
        store = g.store
        n = len(store.array_names)
        read = [j for j, arrays in enumerate(loaded) if not isinstance(arrays, int) and dest[j]]
        if read:
            stacked = [np.concatenate(parts, axis=1) for parts in zip(*(loaded[j][at:at + n] for j in read))]
            store.write_blocks([dest[j] for j in read], range(store.spec.num_layers), stacked)
        at += n
        for j, source in enumerate(loaded):
            if isinstance(source, int) and dest[j]:  # a block the pool holds: copied as a head hit is
                store.copy_block(source, dest[j])
