"""The prefix cache seen from one sequence: the longest cached prefix a sequence takes when it is admitted, and
the blocks it registers as they fill up and are computed (block hashes: cluster/kv/hashing.py; what each KV cache
group can reuse and the commit: cluster/kv/manager.py).

A hit is whole blocks, then, token-granular, the head of one more: past its last whole-block hit a prompt's
next tokens often agree with the start of a cached block without filling it (two chats that share a
26-token system prompt and differ after it share no whole 32-token block). The sequence's own next block then
starts as a copy of that block and its computation starts after the common tokens. The KV of a position depends
only on the tokens up to it, so the copy holds what computing them would write. Not for a request that wants
prompt logprobs (every prompt position is computed for them).

A hit is found without side effects (`lookup`) and taken in one call (`commit`) once the scheduler knows the
sequence fits, so a sequence that does not fit leaves the pool, the pins and the counters as they were.
"""

from __future__ import annotations

from typing import Callable, Optional

from cluster.kv.groups import PrefixHit
from cluster.kv.hashing import carried_hashes, extend_block_hashes
from cluster.kv.manager import KVManager
from cluster.sequence import Sequence


class PrefixMatcher:
    """Matches and registers the cached blocks of the scheduler's sequences.

    `extra_key(cache_salt)` gives the first block's hash key. `queries` / `hits` count prompt tokens looked up at
    first admission and those served from the cache."""

    def __init__(self, kv: KVManager, block_size: int, extra_key: Callable[[Optional[str]], int],
                 recompute_seconds: Optional[Callable[[int, int], float]] = None):
        self.kv, self.block_size, self.extra_key = kv, block_size, extra_key
        # predicted seconds to compute prompt positions [start, end) (0.0 before any prompt step was timed)
        self.recompute_seconds = recompute_seconds
        self.queries = 0
        self.hits = 0

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full and computed in the last step (each hashed once, `hashes`)."""
        full = seq.num_computed_tokens // self.block_size
        if full <= len(seq.block_hashes):
            return
        start = len(seq.block_hashes)
        root = self.extra_key(seq.request.cache_salt)
        hashes = self.hashes(seq, full)
        seq.block_hashes.extend(hashes[start:full])
        self.kv.cache_blocks(seq.request_id, start, seq.block_hashes, seq.token_ids, root)

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

    def lookup(self, seq: Sequence) -> Optional[PrefixHit]:
        """The longest cached prefix `seq` can take (whole blocks, then the head of one more), leaving at least
        one token to compute; changes nothing in the KV. None when `seq` holds its KV already (admitted after a
        transfer, then queued)."""
        if self.kv.num_blocks(seq.request_id):
            return None
        hashes = self.hashes(seq, len(seq.token_ids) // self.block_size)  # every full block, for the blocks to come
        if seq.request.sampling.prompt_logprobs is not None:  # prompt logprobs need every position computed
            return self.kv.lookup((), seq.token_ids, 0)
        root = self.extra_key(seq.request.cache_salt)
        hashes = hashes[:(len(seq.token_ids) - 1) // self.block_size]
        hit = self.kv.lookup(hashes, seq.token_ids, len(hashes), head_until=len(seq.token_ids) - 1, root=root,
                             tier=True)
        if hit.disk and not self._worth_loading(hit):
            return self.kv.lookup(hashes, seq.token_ids, len(hashes), head_until=len(seq.token_ids) - 1, root=root)
        return hit

    def loads_ready(self, hit: PrefixHit) -> bool:
        """Whether the hit's blocks on the SSD tier can be loaded without waiting for the disk; starts reading
        their files in the background (`DiskTier.prefetch`) when it has not yet."""
        blocks = [(h, tokens) for h, tokens, _, source in hit.disk if not source]
        return not blocks or self.kv.tier.prefetch(blocks)

    def _worth_loading(self, hit: PrefixHit) -> bool:
        """Whether loading the hit's blocks from the SSD tier is predicted to take no longer than computing them
        (the tier's measured load rate against the engine's fitted prefill cost; either unknown yet: load)."""
        load = self.kv.tier.load_seconds_estimate(len(hit.disk))
        end = hit.num_blocks * self.block_size
        start = end - len(hit.disk) * self.block_size
        compute = self.recompute_seconds(start, end) if self.recompute_seconds is not None else 0.0
        return load is None or not compute or load <= compute
    def commit(self, seq: Sequence, hit: PrefixHit, num_new_blocks: int) -> None:
        """Take `hit` for `seq` (`KVManager.commit`, with `num_new_blocks` more), set its counters and count the
        hit on first admission (not on a recompute after preemption)."""
        reused = self.kv.commit(seq.request_id, hit, num_new_blocks)  # fewer when a block on the SSD tier was bad
        seq.block_hashes = list(hit.hashes[:reused // self.block_size])
        seq.num_computed_tokens = reused
        if seq.num_output_tokens == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.queries += seq.num_prompt_tokens
            self.hits += seq.num_computed_tokens
