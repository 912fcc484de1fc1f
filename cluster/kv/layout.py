"""Where one engine step's tokens go and which slots each sequence attends to (`BatchLayout`), over the
slot layout of the KV store (cluster/kv/store.py).

One engine step runs a batch of B sequences, each with T_b new tokens (padded to T = max T_b): the new K/V
are scattered into their slots (`write_slots`), then each sequence's whole context ([B, kv_heads, L,
head_dim], L = longest context) is gathered (`gather_slots`) or read from the decode mirror; `mask` hides the
padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from cluster.kv.decode_mirror import MirrorStep, context_slots

if TYPE_CHECKING:
    from cluster.kv.store import KVStore


@dataclass
class BatchLayout:
    """Where this step's tokens go and which slots each sequence attends to.

    write_slots: int32 [B * T], the slot of each new token (padding -> null-block slots).
    gather_slots: int32 [B, L], each sequence's context slots, padded with slot 0.
    offset: the position of the first new token: an int when B == 1, else int32 [B] (rope accepts both).
    mask: None (B == 1, T == 1), "causal" (B == 1), or bool [B, 1, T, L]; with `mask_rank` 5, bool
    [B, 1, 1, T, L], for attention that splits queries into [B, kv_heads, repeats, T, head_dim] (a [B, 1, T, L]
    mask would broadcast sequence b's row onto KV head b there).
    mirror: set for decode steps served from the DecodeMirror (then gather_slots is None).
    mask_rank: the rank `mask` was built at (4 or 5), which `windowed_mask` keeps.
    """

    write_slots: mx.array
    gather_slots: Optional[mx.array]
    offset: Union[int, mx.array]
    mask: Union[None, str, mx.array]
    mirror: Optional[MirrorStep] = None
    mask_rank: int = 4

    def windowed_mask(self, window: int) -> mx.array:
        """The step's mask for a sliding-window layer of `window` positions: bool, broadcastable against the
        scores (rank `mask_rank`). The query at position q sees key position k when q - window < k <= q, as
        mlx-lm's `create_causal_mask(..., window_size=window)` (mlx_lm/models/base.py), on top of the padding
        that `mask` hides. Every context position is still in the pool; the window is applied here.

        Mirror steps: row b's context sits left-aligned so that every row's new token is column `width`
        (cluster/kv/decode_mirror.py), so the window is the columns > width - window for every row."""
        if window < 1:
            raise ValueError(f"a sliding window must hold at least one position, got {window}")
        if self.mirror is not None:
            width = self.mirror.width
            term = (mx.arange(width + 1) > width - window)[None, None, None]
        elif isinstance(self.offset, int):  # one sequence: "causal" or None, positions offset.. on keys 0..L-1
            T, L = self.write_slots.shape[0], self.gather_slots.shape[1]
            q = mx.arange(self.offset, self.offset + T)[:, None]
            k = mx.arange(L)[None]
            return _at_rank(((k <= q) & (k > q - window))[None, None], self.mask_rank)
        else:
            B, L = self.gather_slots.shape
            T = self.write_slots.shape[0] // B
            q = self.offset[:, None, None, None] + mx.arange(T)[None, None, :, None]
            term = mx.arange(L)[None, None, None, :] > q - window
        term = _at_rank(term, self.mask_rank)
        return term if self.mask is None else self.mask & term

    @classmethod
    def build_decode(cls, store: "KVStore", rows: Sequence[str], block_tables: Sequence[Sequence[int]],
                     starts: Sequence[int], mask_rank: int = 4) -> "BatchLayout":
        """Layout for a decode step (one new token per row): from the mirror when it fits, else gathered."""
        bs = store.block_size
        step = store.mirror.plan(rows, block_tables, starts, bs) if store.mirror is not None else None
        if step is None:
            return cls.build(block_tables, starts, [1] * len(starts), bs, mask_rank)
        write = [t[p // bs] * bs + p % bs for t, p in zip(block_tables, starts)]
        return cls(mx.array(write, dtype=mx.int32), None, step.offset, _at_rank(step.mask, mask_rank), step,
                   mask_rank)

    @classmethod
    def build(cls, block_tables: Sequence[Sequence[int]], starts: Sequence[int], num_new: Sequence[int],
              block_size: int, mask_rank: int = 4) -> "BatchLayout":
        """Layout for B sequences; sequence b writes positions [starts[b], starts[b] + num_new[b]).
        `mask_rank` (4 or 5) is the rank of a batched mask (see the class docstring)."""
        B, T = len(starts), max(num_new)
        L = max(s + n for s, n in zip(starts, num_new))
        write = np.zeros((B, T), dtype=np.int32)  # padding lands in the null block (block 0)
        gather = np.zeros((B, L), dtype=np.int32)
        for b, (table, start, n) in enumerate(zip(block_tables, starts, num_new)):
            ctx = start + n
            slots = context_slots(table, ctx, block_size)
            write[b, :n] = slots[start:]
            write[b, n:] = np.arange(T - n) % block_size
            gather[b, :ctx] = slots
        if B == 1:
            offset: Union[int, mx.array] = starts[0]
            mask: Union[None, str, mx.array] = None if T == 1 else "causal"
        else:
            offset = mx.array(list(starts), dtype=mx.int32)
            start_arr = offset[:, None, None, None]
            q = mx.arange(T)[None, None, :, None]
            k = mx.arange(L)[None, None, None, :]
            ctx_arr = mx.array([s + n for s, n in zip(starts, num_new)], dtype=mx.int32)[:, None, None, None]
            mask = _at_rank((k <= start_arr + q) & (k < ctx_arr), mask_rank)
        return cls(mx.array(write.ravel()), mx.array(gather), offset, mask, None, mask_rank)


def _at_rank(mask: Union[None, mx.array], rank: int) -> Union[None, mx.array]:
    """A [B, 1, T, L] mask as [B, 1, 1, T, L] for rank 5 (one more broadcast axis after the batch); else as is."""
    if rank == 4 or mask is None:
        return mask
    return mx.expand_dims(mask, 1)
