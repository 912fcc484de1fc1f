"""A worker group's KV as other workers see it: whole blocks, whatever the group's shape.

Each rank's pool holds its shard of every KV cache group (`KVShard`):
- tensor parallelism: its slice of the KV heads (rank r heads [r*h, (r+1)*h), as mlx-lm's `shard` splits the
  projections), or, for a family whose cache is a latent (multi-head latent attention, `kv_lora_rank` in its
  config), the whole latent on every rank;
- pipeline parallelism: all heads of its range of layers (mlx-lm's `pipeline`: rank size-1 the first layers,
  rank 0 the last), numbered from 0 in its own pool.

Blocks leave and enter the group through its leader (`cluster.kv.store.read_shipped_blocks` /
`write_received_blocks`, which the KV transfer uses), numbered by the whole model's layers:
- shipping: every rank joins one all-gather of its share of the blocks over the group's collective
  (`gather_whole`), and the leader ships whole blocks (a latent: the leader's own copy);
- receiving: the leader keeps its share and sends each follower its own over the follower's step socket, in
  order with the forwards that will read them.

So prefill and decode groups of any shapes (tensor or pipeline, 1 rank included) exchange the same wire format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from cluster.parallel import step_wire


@dataclass(frozen=True)
class KVShard:
    """How one KV cache group's blocks are spread over the `size` ranks of a worker group, seen from `rank`.
    `head_ranks`: how many ranks split the heads (1: each holds them all). `layer_counts`: under pipeline
    parallelism, rank r's number of this KV cache group's layers (empty: every rank holds every layer); the
    whole model's layers are rank size-1's first, then size-2's, ..., rank 0's last."""

    rank: int
    size: int
    head_ranks: int = 1
    layer_counts: tuple[int, ...] = ()

    @property
    def whole(self) -> bool:
        """Whether every rank holds the whole blocks (nothing to gather or to split)."""
        return self.head_ranks == 1 and not self.layer_counts

    def num_layers(self, local: int) -> int:
        """The whole model's layers of this KV cache group, given a rank's own (`local`)."""
        return sum(self.layer_counts) if self.layer_counts else local

    def layers_of(self, rank: int, layers: range) -> tuple[range, range]:
        """(the part of the whole model's `layers` that `rank` holds, the same numbered in its pool)."""
        if not self.layer_counts:
            return layers, layers
        first = sum(self.layer_counts[rank + 1:])
        start, stop = max(layers.start, first), min(layers.stop, first + self.layer_counts[rank])
        if start >= stop:
            return range(0), range(0)
        return range(start, stop), range(start - first, stop - first)

    def share(self, rank: int, layers: range, arrays: Sequence[np.ndarray]) -> tuple[range, list[np.ndarray]]:
        """Rank `rank`'s share of whole-block arrays ([len(layers), slots, heads, d] each) of the whole model's
        `layers`: (its pool's layers, its arrays); an empty range when it holds none of them."""
        held, local = self.layers_of(rank, layers)
        if not len(held):
            return local, []
        rows = slice(held.start - layers.start, held.stop - layers.start)
        out = []
        for a in arrays:
            h = a.shape[2] // self.head_ranks
            part = a[rows, :, rank * h:(rank + 1) * h] if self.head_ranks > 1 else a[rows]
            out.append(np.ascontiguousarray(part))
        return local, out


def splits_kv_heads(config: dict, local_kv_heads: int, size: int) -> bool:
    """Whether `size` tensor-parallel ranks of a model with `config` each hold `local_kv_heads` of its KV
    heads (False: each holds the whole cache, as latent attention does)."""
    text = config.get("text_config") or config
    if text.get("kv_lora_rank"):
        return False
    whole = text.get("num_key_value_heads") or text.get("num_attention_heads")
    return whole is not None and local_kv_heads * size == whole


def gather_whole(shard: KVShard, group, store, block_ids: Sequence[int], layers: range) -> list[np.ndarray]:
    """Whole blocks `block_ids` of the whole model's `layers`, shaped as `KVStore.block_array_specs` (on every
    rank; the leader ships them). Every rank of `group` calls it at once, with the same arguments: each reads its
    share from `store` and joins one all-gather per array (padded to the largest share: shapes must agree)."""
    import mlx.core as mx

    size = group.size()
    held = [shard.layers_of(r, layers)[0] for r in range(size)]
    rows = max(len(h) for h in held)
    local = shard.layers_of(shard.rank, layers)[1]
    if len(local):
        own = store.read_blocks(block_ids, local)
    else:  # this rank holds none of these layers: zeros of the others' shape
        own = [np.zeros((0,) + tuple(s[1:]), np.dtype(d if d != "bfloat16" else "uint16"))
               for _, d, s in store.block_array_specs(len(block_ids), 1)]
    padded = [a if a.shape[0] == rows else np.concatenate([a, np.zeros((rows - a.shape[0],) + a.shape[1:], a.dtype)])
              for a in own]
    gathered = [mx.distributed.all_gather(mx.array(a), group=group) for a in padded]
    mx.eval(gathered)
    out = []
    for a, g in zip(padded, gathered):
        ranks = np.array(g, copy=False).reshape(size, *a.shape)  # [size, rows, slots, h, d]
        if shard.layer_counts:  # the whole model's layer order: rank size-1's first
            out.append(np.ascontiguousarray(np.concatenate(
                [ranks[r, :len(held[r])] for r in reversed(range(size))])))
        else:  # rank r's heads [r*h, (r+1)*h)
            out.append(np.ascontiguousarray(ranks.transpose(1, 2, 0, 3, 4)).reshape(
                a.shape[0], a.shape[1], size * a.shape[2], a.shape[3]))
    return out


class GroupKV:
    """The leader's link between its KV cache group `index`'s store and the followers' (see the module
    docstring): `shard` says how the group spreads the blocks. `group`: the collective's
    `mx.distributed.Group`; `leader`: the `GroupLeader`."""

    def __init__(self, leader, group, index: int, shard: KVShard):
        self.leader, self.group, self.index, self.shard = leader, group, index, shard
        self.head_factor = shard.head_ranks

    def read(self, store, block_ids: Sequence[int], layers: range) -> list[np.ndarray]:
        """Whole blocks of the whole model's `layers`, as `read_shipped_blocks` returns them."""
        if self.shard.whole:
            return store.read_blocks(block_ids, layers)
        self.leader.send_all(step_wire.Gather(self.index, list(block_ids), layers.start, layers.stop))
        return gather_whole(self.shard, self.group, store, block_ids, layers)

    def write(self, store, block_ids: Sequence[int], layers: range, arrays: Sequence[np.ndarray]) -> None:
        """Hand each follower its share of whole blocks `arrays` (of the whole model's `layers`), then store the
        leader's own."""
        for rank in range(1, self.shard.size):
            local, share = self.shard.share(rank, layers, arrays)
            if len(local):
                self.leader.send_to(rank, step_wire.WriteBlocks(
                    self.index, list(block_ids), local.start, local.stop, [a.dtype.str for a in share],
                    [list(a.shape) for a in share], [a.tobytes() for a in share]))
        local, share = self.shard.share(0, layers, arrays)
        if len(local):
            store.write_blocks(block_ids, local, share)
