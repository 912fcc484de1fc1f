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
from typing import Callable, Optional, Sequence

import mlx.core as mx

from cluster.kv_cache import BatchLayout, KVStore


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


def split_head(model) -> Optional[tuple[Callable, Callable]]:
    """(body, head) for mlx-lm models shaped `Model.model` + `lm_head` or tied embeddings, else None.

    body(tokens[B, T], cache) -> hidden[B, T, hidden_size]; head(hidden[..., hidden_size]) -> logits.
    """
    inner = getattr(model, "model", None)
    args = getattr(model, "args", None)
    if inner is None or args is None or not callable(inner):
        return None
    if getattr(args, "tie_word_embeddings", False) and hasattr(getattr(inner, "embed_tokens", None), "as_linear"):
        return inner, inner.embed_tokens.as_linear
    if hasattr(model, "lm_head") and not getattr(args, "tie_word_embeddings", False):
        return inner, model.lm_head
    return None


class ModelRunner:
    """Runs `model` over `store`. Not thread-safe: one engine thread owns it (MLX runs on that thread)."""

    def __init__(self, model, store: KVStore):
        self.model, self.store = model, store
        self._split = split_head(model)

    def forward(self, items: Sequence[BatchItem]) -> list[Optional[mx.array]]:
        """Run one step; returns per item float32 logits: [vocab] for "last", [T_b, vocab] for "all", None
        for "none". The returned arrays are lazy; if none is returned the KV writes are evaluated here."""
        num_new = [len(it.token_ids) for it in items]
        T = max(num_new)
        tokens = mx.array([list(it.token_ids) + [0] * (T - len(it.token_ids)) for it in items], dtype=mx.int32)
        tables, starts = [it.block_table for it in items], [it.start for it in items]
        if T == 1 and all(it.seq_key is not None for it in items):
            layout = BatchLayout.build_decode(self.store, [it.seq_key for it in items], tables, starts)
        else:
            layout = BatchLayout.build(tables, starts, num_new, self.store.block_size)
        views = self.store.views(layout)
        if self._split is None:
            hidden, head = self.model(tokens, cache=views), (lambda x: x)
        else:
            body, head = self._split
            hidden = body(tokens, cache=views)
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
            logits = head(hidden[mx.array(batch_rows), mx.array(positions)]).astype(mx.float32)
            for b, at, n in spans:
                out[b] = logits[at] if items[b].logits == "last" else logits[at:at + n]
        else:
            mx.eval(self.store.keys, self.store.values)
        return out
