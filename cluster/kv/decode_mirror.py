"""Contiguous copies of the decode batch's contexts, kept from one decode step to the next.

Gathering every sequence's context out of the paged pool costs a copy of the batch's whole KV per layer per
step (measured here: ~10% of a batch-8 decode step of SmolLM2 on the CPU backend). While the decode batch
keeps the same sequences, the mirror keeps their contexts left-aligned in per-layer buffers
[B, kv_heads, cap, head_dim] (as mlx-lm's BatchKVCache does) and appends one column per step; the pool
stays the storage of record (every token is still scattered into its block). Any change of the batch
(a sequence joins, leaves, is preempted) rebuilds the mirror with one gather.

Worked example: rows ("a", "b") with contexts of 5 and 3 tokens -> width 5; row b's tokens sit in columns
2..4 and columns 0..1 are masked; the new tokens go to column 5 for both, at rope positions 5 and 3.

The mirror duplicates the running batch's KV, so it is used only while B x cap tokens fit `budget_bytes`;
past that, steps fall back to gathering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import mlx.core as mx
import numpy as np


def context_slots(block_table: Sequence[int], num_tokens: int, block_size: int) -> np.ndarray:
    """Slots of positions [0, num_tokens) of a sequence: int32 [num_tokens] (see cluster/kv/store.py)."""
    nb = -(-num_tokens // block_size)
    table = np.asarray(block_table[:nb], dtype=np.int32)
    return (table[:, None] * block_size + np.arange(block_size, dtype=np.int32)).ravel()[:num_tokens]


@dataclass
class MirrorStep:
    """What one decode step does to the mirror: write column `width` (after rebuilding from
    `rebuild_slots` [B, width] when set, into buffers of `cap` columns)."""

    width: int
    cap: int
    rebuild_slots: Optional[mx.array]
    mask: Union[None, mx.array]
    offset: Union[int, mx.array]


class DecodeMirror:
    """Per-layer left-aligned context buffers for the current decode batch (see the module docstring)."""

    step = 256  # columns added at a time (mlx-lm's cache step)

    def __init__(self, bytes_per_token: int, budget_bytes: int):
        self.bytes_per_token, self.budget_bytes = bytes_per_token, budget_bytes
        self.reset()

    def reset(self) -> None:
        """Forget the batch; the next decode step rebuilds (or gathers)."""
        self.rows: tuple = ()
        self.lengths: list[int] = []
        self.width = self.cap = 0
        self.buffers: dict = {}

    def plan(self, rows: Sequence[str], block_tables: Sequence[Sequence[int]], starts: Sequence[int],
             block_size: int) -> Optional[MirrorStep]:
        """Plan a decode step (one new token per row, at positions `starts`); None = too big, gather instead."""
        rows, starts = tuple(rows), list(starts)
        rebuild = None
        if rows != self.rows or starts != self.lengths or self.width >= self.cap:
            width = max(starts)
            cap = -(-(width + 1) // self.step) * self.step
            if len(rows) * cap * self.bytes_per_token > self.budget_bytes:
                self.reset()
                return None
            slots = np.zeros((len(rows), width), dtype=np.int32)
            for b, (table, start) in enumerate(zip(block_tables, starts)):
                slots[b, width - start:] = context_slots(table, start, block_size)
            rebuild = mx.array(slots) if width else None
            self.rows, self.width, self.cap, self.buffers = rows, width, cap, {}
        width = self.width
        if len(rows) == 1:
            offset: Union[int, mx.array] = starts[0]
            mask = None if starts[0] == width else (mx.arange(width + 1) >= width - starts[0])[None, None, None]
        else:
            offset = mx.array(starts, dtype=mx.int32)
            first = mx.array([width - s for s in starts], dtype=mx.int32)[:, None, None, None]
            mask = mx.arange(width + 1)[None, None, None, :] >= first
        self.lengths = [s + 1 for s in starts]
        self.width += 1
        return MirrorStep(width, self.cap, rebuild, mask, offset)

    def fetch(self, name: tuple, pool, new: mx.array, step: MirrorStep, gather) -> mx.array:
        """Append `new` [B, H, d] (one token per row) to buffer `name`; return its context [B, H, width+1, d].

        `pool` is read, through `gather(pool, slots) -> [B, H, width, d]`, only when the step rebuilds.
        The buffer has `new`'s dtype."""
        buf = self.buffers.get(name)
        if buf is None:
            B, H, d = new.shape
            buf = mx.zeros((B, H, step.cap, d), new.dtype)
            if step.rebuild_slots is not None:
                buf[:, :, :step.width, :] = gather(pool, step.rebuild_slots)
        buf[:, :, step.width, :] = new.astype(buf.dtype)
        self.buffers[name] = buf
        return buf[:, :, :step.width + 1, :]
