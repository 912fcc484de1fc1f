"""A worker group's KV as other workers see it: whole blocks, whatever the group's shape.

Under tensor parallelism each rank's pool holds its slice of the KV heads (rank r heads [r*h, (r+1)*h), as
mlx-lm's `shard` splits the projections), or, for a family whose cache is a latent (multi-head latent
attention, `kv_lora_rank` in its config), the whole latent on every rank. Blocks leave and enter the group
through its leader (`cluster.kv.store.read_shipped_blocks` / `write_received_blocks`, which the KV transfer uses):

- shipping: every rank joins one all-gather of its heads of the blocks over the group's collective, and the
  leader ships whole blocks (a latent: the leader's own copy);
- receiving: the leader keeps its heads and sends each follower its own (a latent: all of it) over the
  follower's step socket, in order with the forwards that will read them.

So a prefill group and a decode group of any tensor-parallel sizes (1 included) exchange the same wire format.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from cluster.parallel import step_wire


def splits_kv_heads(config: dict, local_kv_heads: int, size: int) -> bool:
    """Whether `size` tensor-parallel ranks of a model with `config` each hold `local_kv_heads` of its KV
    heads (False: each holds the whole cache, as latent attention does)."""
    text = config.get("text_config") or config
    if text.get("kv_lora_rank"):
        return False
    whole = text.get("num_key_value_heads") or text.get("num_attention_heads")
    return whole is not None and local_kv_heads * size == whole


def gather_heads(group, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """All ranks' heads of `arrays` ([layers, slots, h, d] each, this rank's), joined in rank order:
    [layers, slots, size * h, d]. Every rank of `group` must call it with arrays of the same shapes."""
    import mlx.core as mx

    size = group.size()
    gathered = [mx.distributed.all_gather(mx.array(a), group=group) for a in arrays]
    mx.eval(gathered)
    out = []
    for a, g in zip(arrays, gathered):
        whole = np.array(g, copy=False).reshape(size, *a.shape)
        out.append(np.ascontiguousarray(whole.transpose(1, 2, 0, 3, 4)).reshape(
            a.shape[0], a.shape[1], size * a.shape[2], a.shape[3]))
    return out


def rank_heads(arrays: Sequence[np.ndarray], rank: int, size: int) -> list[np.ndarray]:
    """Rank `rank`'s heads of whole-block arrays ([layers, slots, size * h, d] -> [layers, slots, h, d])."""
    out = []
    for a in arrays:
        h = a.shape[2] // size
        out.append(np.ascontiguousarray(a[:, :, rank * h:(rank + 1) * h]))
    return out


class GroupKV:
    """The leader's link between its KV cache group `index`'s store and the followers' (see the module
    docstring). `split`: the ranks hold slices of the heads (else each holds all of them). `group`: the
    collective's `mx.distributed.Group`; `leader`: the `GroupLeader`."""

    def __init__(self, leader, group, index: int, split: bool):
        self.leader, self.group, self.index, self.split = leader, group, index, split
        self.size = group.size()
        self.head_factor = self.size if split else 1

    def gather(self, block_ids: Sequence[int], layers: range, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Whole blocks from the leader's own `arrays` (its `read_blocks`)."""
        if not self.split:
            return arrays
        self.leader.send_all(step_wire.Gather(self.index, list(block_ids), layers.start, layers.stop))
        return gather_heads(self.group, arrays)

    def scatter(self, block_ids: Sequence[int], layers: range, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Hand each follower its share of whole blocks `arrays`; returns the leader's share."""
        for rank in range(1, self.size):
            share = rank_heads(arrays, rank, self.size) if self.split else list(arrays)
            self.leader.send_to(rank, step_wire.WriteBlocks(
                self.index, list(block_ids), layers.start, layers.stop, [a.dtype.str for a in share],
                [list(a.shape) for a in share], [a.tobytes() for a in share]))
        return rank_heads(arrays, 0, self.size) if self.split else list(arrays)
