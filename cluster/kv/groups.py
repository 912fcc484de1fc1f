"""KV cache groups: which KV layers keep their blocks in which pool, and how the KV budget is split.

A model whose KV layers are all full attention (or all one kind) has one group: every layer's K/V lives in
the pool's blocks for as long as the sequence does. A model with sliding-window layers beside full-attention
ones (gemma3_text, gpt_oss, llama with sliding `layer_types`) has two: the full layers in the main pool, the
window layers in a window pool whose blocks are released once they fall out of every future query's window
(cluster/kv/manager.py, vLLM v1's KV cache groups with a sliding-window manager). Both stores are indexed by
their own block ids; a sequence's `block_table` and `window_table` map its positions into each.

The split of `kv_cache_gb` (`pool_sizes`): a running sequence needs at most `window_blocks_per_sequence`
window blocks at once (its window, a prefill chunk, a draft run and partial blocks), so the window pool gets
room for twice that per running sequence (the other half keeps recently released window blocks findable for
prefix hits and holds transfers), and the main pool the rest. When that is no smaller than an even split
(a window as long as the context), both get the same number of blocks and nothing is saved.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

from cluster.model import ModelSpec


@dataclass(frozen=True)
class KVGroups:
    """`full_layers` / `window_layers`: the KV layer indices (as the model's body counts its KV layers) in
    the main and the window store; `window`: the largest sliding window in positions (None: one group)."""

    full_layers: tuple[int, ...]
    window_layers: tuple[int, ...] = ()
    window: Optional[int] = None

    @classmethod
    def of(cls, layer_windows: Sequence[Optional[int]]) -> "KVGroups":
        """Groups from each KV layer's window (None: full attention). Two groups only when both kinds are
        present; a model of window layers alone keeps them in one group (every block kept)."""
        full = tuple(i for i, w in enumerate(layer_windows) if w is None)
        window = tuple(i for i, w in enumerate(layer_windows) if w is not None)
        if not full or not window:
            return cls(tuple(range(len(layer_windows))))
        return cls(full, window, max(w for w in layer_windows if w is not None))

    def num_blocks(self, config, budget_bytes: int, main_block_bytes: int,
                   window_block_bytes: int) -> tuple[int, int]:
        """(main pool blocks, window pool blocks; 0 without a window group), each with its null block, for an
        `EngineConfig` and the bytes left for blocks: `config.num_blocks` for both when set, else the split
        of `pool_sizes` (one pool: the whole budget)."""
        if self.window is None:
            return config.num_blocks or 1 + budget_bytes // main_block_bytes, 0
        if config.num_blocks:
            return config.num_blocks, config.num_blocks
        need = window_blocks_per_sequence(self.window, config.block_size, config.prefill_chunk_size)
        main, window = pool_sizes(budget_bytes, main_block_bytes, window_block_bytes, need, config.max_num_seqs)
        return 1 + main, 1 + window

    def specs(self, spec: ModelSpec) -> tuple[ModelSpec, Optional[ModelSpec]]:
        """The model spec of each store (the same geometry, its own number of layers)."""
        main = dataclasses.replace(spec, num_layers=len(self.full_layers))
        if self.window is None:
            return main, None
        return main, dataclasses.replace(spec, num_layers=len(self.window_layers))


def window_first_block(num_computed: int, window: int, block_size: int) -> int:
    """The first block a query at position `num_computed` can see through a sliding window of `window`
    positions: it attends to positions > num_computed - window (mlx-lm's `create_causal_mask(...,
    window_size)`), so every block before this one is out of every later query's window."""
    return max(0, (num_computed - window + 1) // block_size)


def window_blocks_per_sequence(window: int, block_size: int, prefill_chunk_size: int, max_draft: int = 16) -> int:
    """Window blocks one running sequence can hold at once: its window's, a prefill chunk's (or a draft
    run's, `max_draft` tokens), and two partial blocks."""
    return -(-(window + max(prefill_chunk_size, max_draft)) // block_size) + 2


def pool_sizes(budget_bytes: int, main_block_bytes: int, window_block_bytes: int, window_need: int,
               max_num_seqs: int) -> tuple[int, int]:
    """(main blocks, window blocks) within `budget_bytes` (see the module docstring); each count excludes the
    null block."""
    even = budget_bytes // (main_block_bytes + window_block_bytes)
    window = 2 * max_num_seqs * window_need
    if window >= even:
        return even, even
    return (budget_bytes - window * window_block_bytes) // main_block_bytes, window
