"""Recurrent layers' per-sequence state (Gated DeltaNet in qwen3_next, Mamba in falcon_h1): its shapes, and
the mlx-lm cache view a step's recurrent layers run over.

A recurrent layer carries no per-token KV: it carries a fixed-size state per sequence (a short convolution
window and the SSM/delta-rule matrix), which every new token updates in place. A sequence's state is a
`State`: per recurrent layer, a tuple of arrays [1, *shape] in the order mlx-lm's `ArraysCache` holds them
(conv state, then SSM state). It lives in the request's entry of the recurrent-state group
(cluster/kv/state_group.py); None means "no token computed yet" (all zeros).

A batched step stacks its rows' states into [B, *shape] arrays and hands each recurrent layer a
`RecurrentStateView` with `lengths` = each row's number of new tokens. mlx-lm's recurrent layers read
`lengths` the way its own batch generator sets it (`ArraysCache.prepare(lengths=...)`): the padding after a
row's tokens is masked out of the state update (`make_mask`), and the convolution window is taken at the
row's last real token. So padding never touches a row's state, and each row's state after the step is
exactly its solo state (checked against mlx-lm's own generation in tests/test_recurrent_layers.py).
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

# per recurrent layer, the state arrays [1, *shape]
State = tuple[tuple[mx.array, ...], ...]
# per recurrent layer, per array: (shape without the batch axis, dtype)
StateShapes = tuple[tuple[tuple[tuple[int, ...], mx.Dtype], ...], ...]


class RecurrentStateView(ArraysCache):
    """mlx-lm's `ArraysCache` protocol for one recurrent layer and one step (mlx_lm/models/cache.py):
    `cache[i]` get/set, `lengths`, `left_padding`, `advance`, `make_mask`. It is an `ArraysCache` (a subclass),
    because some mixers write their state back only into one (`isinstance(cache, ArraysCache)`, mlx-lm's mamba).

    `arrays`: the layer's state arrays [B, *shape], stacked from the rows; `lengths`: int32 [B], each row's
    new tokens, or None when no row is padded. The layer replaces `arrays[i]` with the state after the step.
    """

    def __init__(self, arrays: list[mx.array], lengths: Optional[mx.array]):
        self.cache, self.lengths, self.left_padding = arrays, lengths, None

    def __getitem__(self, idx: int) -> mx.array:
        return self.cache[idx]

    def __setitem__(self, idx: int, value: mx.array) -> None:
        self.cache[idx] = value

    def advance(self, n: int) -> None:
        """After a layer consumed `n` positions (what `ArraysCache.advance` does with `lengths`)."""
        if self.lengths is not None:
            self.lengths = self.lengths - n

    def make_mask(self, n: int) -> Optional[mx.array]:
        """bool [B, n]: position t of row b is a real token (t < lengths[b]); None when no row is padded."""
        if self.lengths is None:
            return None
        return mx.arange(n)[None] < self.lengths[:, None]


def state_nbytes(shapes: StateShapes) -> int:
    """Bytes of one sequence's state across all recurrent layers."""
    total = 0
    for layer in shapes:
        for shape, dtype in layer:
            n = 1
            for d in shape:
                n *= d
            total += n * dtype.size
    return total


def stack_states(shapes: StateShapes, states: Sequence[Optional[State]],
                 num_new: Sequence[int]) -> list[RecurrentStateView]:
    """One view per recurrent layer over the rows' states (None: zeros, nothing computed yet) stacked
    [B, *shape]; `num_new` are the rows' new-token counts (their `lengths` when they differ)."""
    padded = len(set(num_new)) > 1
    lengths = mx.array(list(num_new), dtype=mx.int32) if padded else None
    views = []
    for r, layer in enumerate(shapes):
        arrays = []
        for i, (shape, dtype) in enumerate(layer):
            rows = [mx.zeros((1, *shape), dtype) if s is None else s[r][i] for s in states]
            arrays.append(rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=0))
        views.append(RecurrentStateView(arrays, lengths))
    return views


def split_states(views: Sequence[RecurrentStateView], num_rows: int) -> list[State]:
    """The rows' states after a step, from the views `stack_states` made (each row's arrays [1, *shape])."""
    return [tuple(tuple(a[b:b + 1] for a in v.cache) for v in views) for b in range(num_rows)]
