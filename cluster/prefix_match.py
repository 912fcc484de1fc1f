"""The prefix cache seen from one sequence: the longest cached prefix a sequence takes when it is admitted, and
the blocks it registers as they fill up and are computed (block hashes: cluster/kv/hashing.py; the pools'
bookkeeping: cluster/kv/manager.py).

A hit is whole blocks, then, token-granular, the head of one more: past its last whole-block hit a prompt's
next tokens often agree with the start of a cached block without filling it (two chats that share a
26-token system prompt and differ after it share no whole 32-token block). When a cached block chained from
the same parent starts with at least `MIN_PARTIAL_TOKENS` of the prompt's next tokens (`BlockPool.find_partial`),
the sequence's own next block starts as a copy of that block (`KVStore.copy_block`, once the sequence is
admitted: `fill`) and its computation starts after the common tokens. The KV of a position depends only on the
tokens up to it, so the copy holds what computing them would write. Not for models with sliding-window layers
(their window blocks would need the same copy) or recurrent layers (the state after the common tokens exists
only at restore points), nor for a request that wants prompt logprobs.
"""

from __future__ import annotations

from typing import Callable, Optional

from cluster.kv.hashing import carried_hashes, extend_block_hashes
from cluster.kv.manager import KVManager
from cluster.sequence import Sequence
from cluster.kv.snapshots import StateSnapshots


# the fewest tokens a head hit must cover, for 32-token blocks (scaled with the block size): a head hit costs a
# block copy and, with the overlapped loop, one wait for the device; a few tokens of prompt cost less
MIN_PARTIAL_TOKENS = 8


class PrefixMatcher:
    """Matches and registers the cached blocks of the scheduler's sequences.

    `extra_key(cache_salt)` gives the first block's hash key; `snapshots`: a model with recurrent layers'
    state snapshots, from which a hit restores the state. `copy_block(src, dst)`: the KV store's block copy,
    for head hits (None: whole blocks only). `queries` / `hits` count prompt tokens looked up at first admission
    and those served from the cache."""

    def __init__(self, kv: KVManager, block_size: int, extra_key: Callable[[Optional[str]], int],
                 snapshots: Optional[StateSnapshots] = None, copy_block: Optional[Callable[[int, int], None]] = None):
        self.kv, self.pool, self.block_size, self.extra_key = kv, kv.pool, block_size, extra_key
        self.snapshots = snapshots
        # token-granular hits need a block copy and neither window blocks nor recurrent state (module docstring)
        self.copy_block = copy_block if kv.window is None and snapshots is None else None
        self.min_partial = max(1, round(MIN_PARTIAL_TOKENS * block_size / 32))
        self._partial: Optional[tuple[Sequence, int]] = None  # matched, not yet filled: (sequence, source block)
        self.queries = 0
        self.hits = 0

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full and computed in the last step (hashed once: `hashes`)."""
        full = seq.num_computed_tokens // self.block_size
        if full <= len(seq.block_hashes):
            return
        start = len(seq.block_hashes)
        root = self.extra_key(seq.request.cache_salt)
        hashes = self.hashes(seq, full)
        for i in range(start, full):
            self.kv.cache_block(seq, i, hashes[i], seq.token_ids[i * self.block_size:(i + 1) * self.block_size],
                                hashes[i - 1] if i else root)
        seq.block_hashes.extend(hashes[start:full])

    def hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chained hashes of the first `num_blocks` full blocks of `seq`'s tokens, each block hashed once for
        the sequence (kept in `seq.token_block_hashes`): the prompt's come with the request when they were
        computed under this engine's first-block key (`carried_hashes`; else they are hashed here at the first
        call), an output block's when it fills."""
        known = seq.token_block_hashes
        if len(known) < num_blocks:
            root = self.extra_key(seq.request.cache_salt)
            if not known:
                r = seq.request
                known.extend(carried_hashes(r.prompt_block_hashes, r.prompt_hash_key, root, len(r.prompt_token_ids),
                                            self.block_size))
            extend_block_hashes(known, seq.token_ids, self.block_size, root, num_blocks)
        return known[:num_blocks]

    def match(self, seq: Sequence) -> None:
        """Take the longest cached prefix (whole blocks, then the head of one more: the module docstring),
        leaving at least one token to compute. A head hit is copied by `fill` once the sequence is admitted, or
        given back by `unmatch`."""
        if seq.block_table:
            return
        hashes = self.hashes(seq, len(seq.token_ids) // self.block_size)  # every full block, for the blocks to come
        if seq.request.sampling.prompt_logprobs is not None:
            return  # prompt logprobs need every prompt position computed
        root = self.extra_key(seq.request.cache_salt)
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
        self._match_head(seq, hashes[len(hit) - 1] if hit else root)
        if seq.num_output_tokens == 0:  # first admission, not a recompute after preemption
            seq.num_cached_tokens = seq.num_computed_tokens
            self.queries += seq.num_prompt_tokens
            self.hits += seq.num_computed_tokens

    def _match_head(self, seq: Sequence, parent: int) -> None:
        """After the whole-block hit: take the head of a cached block chained from `parent` that agrees with
        at least `min_partial` of the next tokens (pinned, `KVManager.pin`, until `fill` or `unmatch`)."""
        self._partial = None
        start = seq.num_computed_tokens
        limit = min(self.block_size, len(seq.token_ids) - 1 - start)  # leave at least one token to compute
        if self.copy_block is None or limit < self.min_partial:
            return
        found = self.pool.find_partial(parent, seq.token_ids[start:start + limit])
        if found is None or found[1] < self.min_partial:
            return
        source, k = found[0], min(found[1], self.block_size - 1)  # a whole equal block would have hit by hash
        self.kv.pin(source)  # no allocation may evict it before the copy
        self._partial = (seq, source)
        seq.num_computed_tokens += k

    def fill(self, seq: Sequence) -> None:
        """Copy the head hit `match` found for `seq` into its block that holds the first position still to
        compute (allocated since), and let go of the cached block it came from. Nothing to do without one."""
        if self._partial is None or self._partial[0] is not seq:
            return
        _, source = self._partial
        self._partial = None
        self.copy_block(source, seq.block_table[seq.num_computed_tokens // self.block_size])
        self.kv.unpin(source)

    def unmatch(self, seq: Sequence) -> None:
        """Undo `match`'s counts and the sequence's counters for a sequence that is not admitted after all (its
        blocks go back through the block owner, `KVManager.free`)."""
        if self._partial is not None and self._partial[0] is seq:
            self.kv.unpin(self._partial[1])
            self._partial = None
        if seq.num_output_tokens == 0:
            self.queries -= seq.num_prompt_tokens
            self.hits -= seq.num_computed_tokens
        seq.block_hashes, seq.num_computed_tokens, seq.recurrent_state = [], 0, None
