"""The prefix cache seen from one sequence: the longest cached prefix a sequence takes when it is admitted, and
the blocks it registers as they fill up and are computed (block hashes: cluster/hashing.py; the pools'
bookkeeping: cluster/kv_manager.py)."""

from __future__ import annotations

from typing import Callable, Optional

from cluster.hashing import block_hashes
from cluster.kv_manager import KVManager
from cluster.sequence import Sequence
from cluster.state_snapshots import StateSnapshots


class PrefixMatcher:
    """Matches and registers the cached blocks of the scheduler's sequences.

    `extra_key(cache_salt)` gives the first block's hash key; `snapshots`: a model with recurrent layers'
    state snapshots, from which a hit restores the state. `queries` / `hits` count prompt tokens looked up at
    first admission and those served from the cache."""

    def __init__(self, kv: KVManager, block_size: int, extra_key: Callable[[Optional[str]], int],
                 snapshots: Optional[StateSnapshots] = None):
        self.kv, self.pool, self.block_size, self.extra_key = kv, kv.pool, block_size, extra_key
        self.snapshots = snapshots
        self.queries = 0
        self.hits = 0

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Hash and register the blocks that became full and computed in the last step."""
        full = seq.num_computed_tokens // self.block_size
        if full <= len(seq.block_hashes):
            return
        start = len(seq.block_hashes)
        parent = seq.block_hashes[-1] if start else None
        new = block_hashes(seq.token_ids[:full * self.block_size], self.block_size,
                           self.extra_key(seq.request.cache_salt), start=start, parent=parent)
        for i, h in enumerate(new, start):
            self.kv.cache_block(seq, i, h, seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
        seq.block_hashes.extend(new)

    def match(self, seq: Sequence) -> None:
        """Take the longest cached prefix (whole blocks, leaving at least one token to compute)."""
        if seq.block_table or seq.request.sampling.prompt_logprobs is not None:
            return  # prompt logprobs need every prompt position computed
        hashes = block_hashes(seq.token_ids, self.block_size, self.extra_key(seq.request.cache_salt))
        hashes = hashes[:(len(seq.token_ids) - 1) // self.block_size]
        hit = self.pool.find_cached_prefix(hashes, seq.token_ids, self.block_size)
        k, window_ids = self.kv.window_hit(hashes, seq.token_ids, self.block_size, len(hit))
        hit = hit[:k]  # with window layers: only as far as their window blocks are still cached
        if self.snapshots is not None:  # the pool cut the hit back to its last restore point: restore from it
            seq.recurrent_state = self.snapshots.get(hashes[len(hit) - 1]) if hit else None
            assert not hit or seq.recurrent_state is not None, "a restore point without its snapshot"
        self.kv.take_prefix(seq, hit, window_ids)
        seq.block_hashes = hashes[:len(hit)]
        seq.num_computed_tokens = len(hit) * self.block_size
        if seq.num_output_tokens == 0:  # first admission, not a recompute after preemption
            seq.num_cached_tokens = seq.num_computed_tokens
            self.queries += seq.num_prompt_tokens
            self.hits += seq.num_computed_tokens

    def unmatch(self, seq: Sequence) -> None:
        """Undo `match`'s counts and the sequence's counters for a sequence that is not admitted after all (its
        blocks go back through the block owner, `KVManager.free`)."""
        if seq.num_output_tokens == 0:
            self.queries -= seq.num_prompt_tokens
            self.hits -= seq.num_computed_tokens
        seq.block_hashes, seq.num_computed_tokens, seq.recurrent_state = [], 0, None
