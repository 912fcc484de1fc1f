"""What a group's leader hands its followers, per forward, over ZeroMQ (msgpack through msgspec).

- `Forward`: one forward's batch items (`cluster.runner.BatchItem`: each KV cache group's entry as
  `KVCacheGroup.wire_entry` names it, positions, input tokens, which logits), the leader's decode mirror key
  before it (`mirror_key`): a follower whose mirror key differs resets its mirror, so both rebuild it alike;
  and, per KV cache group, what changed outside the forwards since the last one (`replays`,
  `KVCacheGroup.replica_ops`: a recurrent state restored, saved or freed), replayed before it runs.
- `CopyBlock`: a prefix hit's block copy (`KVManager.copy_block`).
- `Gather`: blocks to ship to another worker (layers numbered in the whole model); every rank takes part in one
  all-gather of its share of them (its heads, or its layers).
- `WriteBlocks`: blocks that arrived from another worker, this rank's share of them (layers numbered in its own
  pool; the leader keeps its own share).
- `TierWrite` / `TierLoad` / `TierDrop` / `TierClear`: what the leader's SSD tier did, which each rank does
  with its own shard in its own tier (cluster/parallel/group_tier.py): blocks written behind, a hit's blocks
  loaded into new blocks (all ranks agree on how many), files let go of, every file deleted.
- `Hello`: the leader's KV pool size, checked against the follower's own before its first step.
- `Stop`: the group ends; the follower exits.

A decode step's message is its rows' block tables and one token each: about 1 KB for 8 rows of 1k tokens.
"""

from __future__ import annotations

import zlib
from typing import Optional, Sequence, Union

import msgspec

from cluster.runner import BatchItem, Logits


class WireItem(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One `BatchItem`. `entries`: each KV cache group's entry (`KVCacheGroup.wire_entry`: a block table, or
    what names the row's state to a follower)."""

    block_table: list[int]
    start: int
    token_ids: list[int]
    logits: str
    mirror_row: Optional[str]
    entries: list[list[int]]


class Forward(msgspec.Struct, tag="forward", frozen=True, gc=False):
    items: list[WireItem]
    mirror_key: int
    replays: list[list[list[int]]] = []


class CopyBlock(msgspec.Struct, tag="copy_block", frozen=True):
    src: int
    dst: int


class Gather(msgspec.Struct, tag="gather", frozen=True):
    """Blocks `block_ids` of the whole model's layers [layer_start, layer_stop) of KV cache group `group`."""

    group: int
    block_ids: list[int]
    layer_start: int
    layer_stop: int


class WriteBlocks(msgspec.Struct, tag="write_blocks", frozen=True):
    """This rank's share of blocks that arrived, of its own pool's layers [layer_start, layer_stop): one (dtype
    name, shape, bytes) per `KVStore.array_names` entry, shaped as `KVStore.read_blocks` returns them."""

    group: int
    block_ids: list[int]
    layer_start: int
    layer_stop: int
    dtypes: list[str]
    shapes: list[list[int]]
    data: list[bytes]


class TierWrite(msgspec.Struct, tag="tier_write", frozen=True):
    """Blocks the leader's tier took: block `hashes[j]` caching `tokens[j]` is block `tables[g][j]` of each block
    group g (by the order of `KVManager.block_groups`)."""

    hashes: list[int]
    tokens: list[list[int]]
    tables: list[list[int]]


class TierLoad(msgspec.Struct, tag="tier_load", frozen=True):
    """A hit's blocks past the pool's run, in order: block `hashes[j]` caching `tokens[j]`, from the tier
    (`sources[j]` 0) or copied from pool block `sources[j]`, into block `dests[g][j]` of each block group g (0:
    none there)."""

    hashes: list[int]
    tokens: list[list[int]]
    sources: list[int]
    dests: list[list[int]]


class TierDrop(msgspec.Struct, tag="tier_drop", frozen=True):
    """Files the leader's tier let go of: (block hash, kind) each."""

    keys: list[tuple[int, str]]


class TierClear(msgspec.Struct, tag="tier_clear", frozen=True):
    """The leader's prefix cache was reset: every file goes."""


class Hello(msgspec.Struct, tag="hello", frozen=True):
    num_blocks: int
    pool_bytes: int


class Stop(msgspec.Struct, tag="stop", frozen=True):
    reason: str


StepMessage = Union[Forward, CopyBlock, Gather, WriteBlocks, TierWrite, TierLoad, TierDrop, TierClear, Hello, Stop]
BOOT_BYTES = 4  # a message's first frame: the sending leader's boot id (cluster/parallel/leader.py)
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StepMessage)


def encode(msg: StepMessage) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> StepMessage:
    """Raises msgspec.ValidationError / DecodeError for bytes that are no step message."""
    return _decoder.decode(data)


def mirror_key(mirror) -> int:
    """A decode mirror's state as one number (0: no mirror, or an empty one): the rows, their lengths and the
    buffer's width and capacity, which decide what its next step reuses."""
    if mirror is None or not mirror.rows:
        return 0
    return zlib.crc32(repr((mirror.rows, mirror.lengths, mirror.width, mirror.cap)).encode())


def to_wire(items: Sequence[BatchItem], mirror, groups: Sequence = ()) -> Forward:
    """`items` as a `Forward`, with each of the KV cache groups `groups`' replica ops. Raises ValueError for an
    item whose input is a token left on the device."""
    out = []
    for it in items:
        if it.inflight_request is not None:
            raise ValueError("a group's forward cannot take a token in flight on the leader's device")
        entries = [g.wire_entry(e) for g, e in zip(groups, it.entries)]
        out.append(WireItem(list(it.block_table), it.start, list(it.token_ids), it.logits.value, it.mirror_row,
                            entries))
    replays = [g.replica_ops() for g in groups]
    return Forward(out, mirror_key(mirror), replays if any(replays) else [])


def from_wire(msg: Forward, groups: Sequence = ()) -> list[BatchItem]:
    """The `BatchItem`s of a `Forward` over the follower's KV cache groups `groups` (the leader's replica ops
    replayed on them first)."""
    for g, ops in zip(groups, msg.replays):
        if ops:
            g.replay(ops)
    return [BatchItem(w.block_table, w.start, w.token_ids, Logits(w.logits), w.mirror_row,
                      tuple(g.replica_entry(e) for g, e in zip(groups, w.entries)))
            for w in msg.items]
