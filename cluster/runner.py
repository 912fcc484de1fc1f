"""One forward pass over a batch of sequences, shared by every worker role.

A batch item is (block_table, start, token_ids): compute `token_ids` at positions [start, start + T_b)
of a sequence whose KV lives in the blocks of `block_table`. The runner pads the items into one
[B, T] token array (T = max T_b), runs the unmodified mlx-lm model over the paged KV cache, and
returns logits at the positions the caller asks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from cluster.kv_cache import BatchLayout, KVStore


@dataclass(frozen=True)
class BatchItem:
    """One sequence's share of a step. `want_all_logits` asks for logits at every new position."""

    block_table: Sequence[int]
    start: int
    token_ids: Sequence[int]
    want_all_logits: bool = False


class ModelRunner:
    """Runs `model` over `store`. Not thread-safe: one engine thread owns it (MLX runs on that thread)."""

    def __init__(self, model, store: KVStore):
        self.model, self.store = model, store

    def forward(self, items: Sequence[BatchItem]) -> list[mx.array]:
        """Run one step; returns per item float32 logits: [T_b, vocab] if `want_all_logits`, else [vocab]
        for the item's last new token. The arrays are lazy; the caller evaluates them."""
        num_new = [len(it.token_ids) for it in items]
        T = max(num_new)
        tokens = mx.array([list(it.token_ids) + [0] * (T - len(it.token_ids)) for it in items], dtype=mx.int32)
        layout = BatchLayout.build([it.block_table for it in items], [it.start for it in items], num_new,
                                   self.store.block_size)
        logits = self.model(tokens, cache=self.store.views(layout))
        out = []
        for b, (it, n) in enumerate(zip(items, num_new)):
            out.append(logits[b, :n].astype(mx.float32) if it.want_all_logits
                       else logits[b, n - 1].astype(mx.float32))
        return out
