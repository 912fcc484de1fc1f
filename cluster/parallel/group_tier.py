"""A worker group's SSD tier: each rank keeps its own shard of every block (its heads, or its layers) in a tier
of its own (cluster/kv/disk_tier.py), in a folder of its own: the group's fingerprint (which names the split)
and the rank, `<fingerprint>-r<rank>`; no rank trims another's folder as a stale fingerprint's.

The leader's tier decides, as a server's does: what is written behind, what a hit loads, what the LRU lets go
of, a reset. Each decision reaches the followers as a step message (cluster/parallel/step_wire.py), in order with
the forwards, and each follower does the same with its own shard of the same block ids:
- `TierWrite`: blocks the leader's tier took; the follower copies its share of them to host memory and queues
  them (its tier `follows`: no LRU of its own);
- `TierLoad`: a hit's blocks past the pool's run; every rank reads its own files, and the ranks agree, with one
  all-gather, on the longest run every one of them could load (a file one follower lost, torn or never written,
  its queue or disk full, shortens the hit for all, and the rest is computed); all write that many, and the
  leader drops the rest from its tier, so that the recomputed blocks are written again on every rank;
- `TierDrop`: files the leader's tier let go of (its LRU, a bad file, a failed write), deleted on every rank;
- `TierClear`: a prefix-cache reset.

A model with recurrent layers keeps no tier in a group (its snapshots are a follower's replica, not files).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from cluster.kv.tier_io import host_copies, read_run, store_loaded
from cluster.parallel import step_wire

log = logging.getLogger(__name__)



def tier_shard(parallel: str, size: int) -> str:
    """The split a group's tiers are fingerprinted with; each rank's folder adds its rank (`tier_for`)."""
    return f"{parallel}-of-{size}"


def agree(group, count: int) -> int:
    """The smallest `count` over the ranks of `group` (every rank calls it at once)."""
    counts = mx.distributed.all_gather(mx.array([count], dtype=mx.int32), group=group)
    return int(np.array(counts).min())


class GroupTier:
    """The leader's side (`KVManager.tier_replicas`): hands each decision of its tier to the followers."""

    def __init__(self, leader, group):
        self.leader, self.group = leader, group

    def write(self, hashes: Sequence[int], tokens: Sequence[Sequence[int]], tables: Sequence[Sequence[int]]) -> None:
        """The leader's tier took blocks `hashes` (caching `tokens`), block `tables[g][j]` of each block group g."""
        self.leader.send_all(step_wire.TierWrite(list(hashes), [list(t) for t in tokens],
                                                 [list(t) for t in tables]))

    def load(self, disk: Sequence[tuple], dests: Sequence[Sequence[int]], loaded: int) -> int:
        """A hit's blocks past the pool's run (`PrefixHit.disk` entries), of which the leader loaded the first
        `loaded`, go into blocks `dests[g][j]`: how many every rank loaded (the followers load theirs now)."""
        self.leader.send_all(step_wire.TierLoad([h for h, *_ in disk], [list(t) for _, t, *_ in disk],
                                                [s for *_, s in disk], [list(d) for d in dests]))
        return agree(self.group, loaded)

    def drop(self, keys: Sequence[tuple[int, str]]) -> None:
        self.leader.send_all(step_wire.TierDrop([(int(h), kind) for h, kind in keys]))

    def clear(self) -> None:
        self.leader.send_all(step_wire.TierClear())


def follow(engine, msg, group) -> None:
    """Do on a follower's `engine` (its tier: `engine.tier`, None when it has none) what the leader's tier did
    (`msg`: a `TierWrite`, `TierLoad`, `TierDrop` or `TierClear`); joins the collective of a `TierLoad`."""
    kv, tier = engine.kv, engine.tier
    if isinstance(msg, step_wire.TierLoad):
        loaded = read_run(tier, list(zip(msg.hashes, msg.tokens, msg.sources)))
        taken = agree(group, len(loaded))
        store_loaded(kv.block_groups, [d[:taken] for d in msg.dests], loaded[:taken])
    elif tier is None:
        return
    elif isinstance(msg, step_wire.TierWrite):
        copies = host_copies(kv.block_groups, msg.tables, range(len(msg.hashes)), kv.block_size)
        for block_hash, tokens, arrays in zip(msg.hashes, msg.tokens, copies):
            # a block it cannot take (its queue full, its disk full) is one the leader finds missing on a hit,
            # and drops, so it is written again (`KVManager._write_loaded`)
            tier.put(block_hash, tokens, arrays)
    elif isinstance(msg, step_wire.TierDrop):
        tier.drop([(h, kind) for h, kind in msg.keys])
    elif isinstance(msg, step_wire.TierClear):
        tier.clear()


def open_group_tier(engine, spec, config, parallel: str, rank: int, size: int, group, leader=None) -> Optional[object]:
    """Open rank `rank`'s tier (a follower's `follows` the leader's) per `config`, on every rank at once. The
    leader's `KVManager` then hands its tier's decisions to the followers. Returns this rank's tier, or None
    (logged) when the model keeps none in a group. Raises ValueError on every rank when any rank's folder is in
    use or unusable (as one server refuses it)."""
    from cluster.kv.tier_setup import tier_for

    if not config.ssd_cache_gb:  # the same config on every rank
        return None
    if engine.runner.verified.num_state_layers:  # the same model on every rank
        log.warning("SSD tier off in this worker group: a model with recurrent layers keeps no SSD tier in a "
                    "worker group yet")
        return None
    tier, error = None, None
    try:
        tier = tier_for(engine.kv, spec, config, shard=tier_shard(parallel, size), rank=rank)
    except ValueError as exc:  # the folder in use by another server, or unusable: refused, as one server is
        error = exc
    if not agree(group, int(error is None)):
        if tier is not None:
            engine.kv.detach_tier()
            tier.close()
        raise error or ValueError("SSD tier: another rank of this worker group could not open its folder (its "
                                  "log names why)")
    if tier is None:  # off for a reason every rank shares (logged)
        return None
    if leader is not None:
        engine.kv.tier_replicas = GroupTier(leader, group)
    return tier
