"""One forward pass over a batch of sequences, shared by every worker role.

A batch item is (block_table, start, token_ids): compute `token_ids` at positions [start, start + T_b)
of a sequence whose KV lives in the blocks of `block_table`. The runner pads the items into one
[B, T] token array (T = max T_b), runs the unmodified mlx-lm model over the paged KV cache, and
returns logits only where the caller needs them: the vocabulary projection (lm_head, ~10% of a small
model's prefill FLOPs) runs on the selected rows only, and a chunk that needs no logits evaluates just
the KV writes (the trick mlx-lm's own prefill uses: evaluate the cache, never the logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx

from cluster.kv_layout import BatchLayout
from cluster.kv_store import KVStore
from cluster.model_families import VerifiedModel, verify_model


@dataclass(frozen=True)
class BatchItem:
    """One sequence's share of a step.

    `logits`: "last" (the last new token's row), "all" (every new position: prompt logprobs, or verifying
    speculative drafts) or "none" (a prefill chunk that samples nothing).
    """

    block_table: Sequence[int]
    start: int
    token_ids: Sequence[int]
    logits: str = "last"
    seq_key: Optional[str] = None  # identifies the sequence across decode steps (for the decode mirror)


class ModelRunner:
    """Runs `model` over `store`. Not thread-safe: one engine thread owns it (MLX runs on that thread).

    `verified` is `verify_model(model)`'s result (computed here when None). Raises ValueError for a model
    that `verify_model` refuses, or whose attention cannot read the store's quantized KV as stored.
    """

    def __init__(self, model, store: KVStore, verified: Optional[VerifiedModel] = None):
        self.model, self.store = model, store
        self.verified = verified or verify_model(model)
        if store.kv_bits is not None and not store.dequantize_for_attention and not self.verified.reads_quantized_kv:
            raise ValueError(f"{self.verified.model_type} attention reads float KV only: a KV store with "
                             f"kv_bits={store.kv_bits} must dequantize for attention")
        self._body, self._head, self._mask_rank = self.verified.body, self.verified.head, self.verified.mask_rank

    def forward(self, items: Sequence[BatchItem]) -> list[Optional[mx.array]]:
        """Run one step; returns per item float32 logits: [vocab] for "last", [T_b, vocab] for "all", None
        for "none". The returned arrays are lazy; if none is returned the KV writes are evaluated here."""
        num_new = [len(it.token_ids) for it in items]
        T = max(num_new)
        tokens = mx.array([list(it.token_ids) + [0] * (T - len(it.token_ids)) for it in items], dtype=mx.int32)
        tables, starts = [it.block_table for it in items], [it.start for it in items]
        if T == 1 and all(it.seq_key is not None for it in items):
            layout = BatchLayout.build_decode(self.store, [it.seq_key for it in items], tables, starts,
                                              self._mask_rank)
        else:
            layout = BatchLayout.build(tables, starts, num_new, self.store.block_size, self._mask_rank)
        hidden = self._body(tokens, cache=self.store.views(layout))
        out: list[Optional[mx.array]] = [None] * len(items)
        # one [rows, hidden] x [hidden, vocab] product: the head's weights are read once per step
        batch_rows, positions, spans = [], [], []
        for b, it in enumerate(items):
            if it.logits == "none":
                continue
            first = num_new[b] - 1 if it.logits == "last" else 0
            spans.append((b, len(positions), num_new[b] - first))
            batch_rows += [b] * (num_new[b] - first)
            positions += range(first, num_new[b])
        if positions:
            logits = self._head(hidden[mx.array(batch_rows), mx.array(positions)]).astype(mx.float32)
            for b, at, n in spans:
                out[b] = logits[at] if items[b].logits == "last" else logits[at:at + n]
        else:
            mx.eval(self.store.keys, self.store.values)
        return out
