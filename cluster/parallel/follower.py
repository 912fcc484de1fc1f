"""A following rank's loop: take the leader's step messages in order and run each on this rank's shard.

A follower holds an engine built exactly as the leader's (same model shard, config and KV pool), but runs no
scheduler: the leader's decisions reach it as the batch items of each forward (`step_wire.Forward`), which it
runs with its own `ModelRunner` over its own KV pool (the same block ids), evaluating everything the forward
built so that its collectives meet the leader's.
"""

from __future__ import annotations

import logging
from typing import Optional

import mlx.core as mx
import msgspec
import numpy as np
import zmq

from cluster.parallel import step_wire
from cluster.parallel.group_kv import gather_whole
from cluster.parallel.group_tier import follow as follow_tier

log = logging.getLogger(__name__)


class FollowerError(RuntimeError):
    """The leader's messages disagree with this rank (a different KV pool): the group cannot run."""


def run_follower(engine, sock: zmq.Socket, group=None, poll_ms: int = 1000, leader_boot: Optional[int] = None,
                 shards: Optional[dict] = None) -> str:
    """Run the leader's messages from `sock` (a bound PULL socket) on `engine` until a `Stop`; returns its
    reason. `group`: the collective (`mx.distributed.Group`) that a `Gather` joins; `shards`: per KV cache group
    index, how the ranks spread its blocks (`cluster.parallel.group_kv.KVShard`; a `Gather` needs it). `leader_boot`: the boot id of
    the leader this rank formed its group with; a message from any other leader (an old one, whose steps reached
    this rank's socket before it ended) is dropped, unrun (None: every message runs). Liveness is the heartbeat's
    job (cluster/parallel/heartbeat.py): this loop waits for messages without a deadline. Raises FollowerError
    when the leader's pool differs from this rank's, or a message is not a step message."""
    runner = engine.runner
    engine.owner.take()
    dropped = 0
    while True:
        if not sock.poll(poll_ms):
            continue
        frames = sock.recv_multipart()
        if len(frames) != 2 or len(frames[0]) != step_wire.BOOT_BYTES:
            raise FollowerError(f"a step message of {len(frames)} frame(s) this rank cannot read")
        if leader_boot is not None and int.from_bytes(frames[0], "big") != leader_boot:
            dropped += 1
            log.warning("worker group: dropped a step of another leader than this group's (%d so far)", dropped)
            continue
        try:
            msg = step_wire.decode(frames[1])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise FollowerError(f"a step message this rank cannot read: {exc}") from None
        if isinstance(msg, step_wire.Forward):
            mirror = runner.store.mirror
            if mirror is not None and step_wire.mirror_key(mirror) != msg.mirror_key:
                mirror.reset()
            outputs = runner.forward(step_wire.from_wire(msg, runner.groups))
            mx.eval(*[o for o in outputs if o is not None], *[a for g in runner.groups for a in g.arrays()])
        elif isinstance(msg, step_wire.CopyBlock):
            engine.kv.copy_block(msg.src, msg.dst)
        elif isinstance(msg, step_wire.Gather):
            gather_whole(shards[msg.group], group, engine.kv.groups[msg.group].store, msg.block_ids,
                         range(msg.layer_start, msg.layer_stop))
        elif isinstance(msg, step_wire.WriteBlocks):
            arrays = [np.frombuffer(b, dtype=np.dtype(d)).reshape(shape)
                      for b, d, shape in zip(msg.data, msg.dtypes, msg.shapes)]
            engine.kv.groups[msg.group].store.write_blocks(msg.block_ids, range(msg.layer_start, msg.layer_stop),
                                                          arrays)
        elif isinstance(msg, (step_wire.TierWrite, step_wire.TierLoad, step_wire.TierDrop, step_wire.TierClear)):
            follow_tier(engine, msg, group)
        elif isinstance(msg, step_wire.Hello):
            if msg.num_blocks != engine.pool.num_blocks:
                raise FollowerError(f"the leader's KV pool has {msg.num_blocks} blocks, this rank's "
                                    f"{engine.pool.num_blocks}: every rank must run the same engine config")
            log.info("worker group: following; %d KV blocks", msg.num_blocks)
        elif isinstance(msg, step_wire.Stop):
            return msg.reason
