"""Continuous batching: which sequences compute how many tokens in the next engine step.

Each step is either a prefill step (prompt chunks of one or more sequences, at most
`prefill_chunk_size` tokens including padding) or a decode step (one token for every sequence that has
finished its prompt). When both kinds of work exist they alternate, so a long prompt advances one chunk
between two decode steps and never freezes the streams already running. New sequences are admitted
from the waiting queue (FCFS) between steps, reusing their longest cached prefix. When a running sequence
needs a block and none is free, the most recently admitted other sequence is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed later (vLLM's recompute preemption).

Speculative decoding is "schedule k+1" (nano-vllm's counters): `lookahead(seq)` says how many draft tokens
a decoding sequence wants this step; the decode item is then (seq, 1 + k), with blocks for all k+1
positions. Only the one token every decoding sequence needs may preempt others; draft room is taken from
free blocks only (k drops to 0 when there are none).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from cluster.config import EngineConfig
from cluster.hashing import block_hashes
from cluster.kv_manager import KVManager
from cluster.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """The work of one step: (sequence, number of tokens to compute from num_computed_tokens on). In a decode
    step the number is 1 + the draft tokens the sequence may verify (blocks are reserved for all of them)."""

    items: list[tuple[Sequence, int]]
    is_prefill: bool


class Scheduler:
    """Owns the waiting queue, the sequences awaiting their prompt KV from another worker and the running
    batch; allocates and frees their blocks through the `KVManager`.

    `extra_key(cache_salt)` gives the first block's hash key (model, revision, KV format, salt);
    `lookahead(seq)` the draft tokens a decoding sequence wants this step (None: never any).
    """

    def __init__(self, config: EngineConfig, kv: KVManager, extra_key: Callable[[Optional[str]], int],
                 lookahead: Optional[Callable[[Sequence], int]] = None):
        self.config, self.kv, self.pool, self.extra_key, self.lookahead = config, kv, kv.pool, extra_key, lookahead
        self.block_size = config.block_size
        self.waiting: deque[Sequence] = deque()
        self.awaiting_kv: dict[str, Sequence] = {}  # remote prefill: the prompt is computed elsewhere
        self.running: list[Sequence] = []
        self._preempted: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._last_was_prefill = False

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        self.waiting.append(seq)

    def add_awaiting_kv(self, seq: Sequence) -> None:
        """Queue a sequence whose prompt KV is being computed elsewhere (it holds no blocks yet)."""
        self.awaiting_kv[seq.request_id] = seq

    def admit_prefilled(self, seq: Sequence) -> None:
        """Move an awaiting sequence whose prompt KV is now in its blocks into the running batch when there
        is room, else to the back of the queue (still holding its blocks)."""
        del self.awaiting_kv[seq.request_id]
        if len(self.running) < self.config.max_num_seqs:
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        else:
            self.waiting.append(seq)

    def expired(self, arrived_before: float) -> list[Sequence]:
        """Waiting sequences never admitted yet that arrived before `arrived_before` (time.monotonic())."""
        return [s for s in self.waiting if s.arrival < arrived_before and s.num_output_tokens == 0]

    def has_work(self) -> bool:
        """True when a step has something to compute (sequences awaiting KV have not, yet)."""
        return bool(self.waiting or self.running)

    def queue_full(self) -> bool:
        """True when one more sequence would be queued beyond `max_waiting`: sequences waiting or awaiting
        their KV, less those the next step can still admit into free running slots, already fill the queue.
        So `max_num_seqs + max_waiting` sequences arriving at once at an idle engine are all taken."""
        free_slots = max(0, self.config.max_num_seqs - len(self.running))
        return len(self.waiting) + len(self.awaiting_kv) - free_slots >= self.config.max_waiting

    def schedule(self) -> Optional[ScheduledBatch]:
        """Pick the next step's work, or None when there is nothing to do."""
        decoding = [s for s in self.running if not s.is_prefilling]
        wants_prefill = any(s.is_prefilling for s in self.running) or (
            self.waiting and len(self.running) < self.config.max_num_seqs)
        batch = None
        if wants_prefill and (not decoding or not self._last_was_prefill):
            batch = self._schedule_prefill()
        self._last_was_prefill = batch is not None
        if batch is None:
            batch = self._schedule_decode()
        return batch

    def take_preempted(self) -> list[Sequence]:
        """The sequences preempted since the last call (blocks freed, counters at 0, back in the queue)."""
        preempted, self._preempted = self._preempted, []
        return preempted

    def finish(self, seq: Sequence, keep_blocks: bool = False) -> None:
        """Drop a sequence from the queues and free its blocks, or with `keep_blocks` move them into a
        holding under its request id (the role still needs them; `KVManager.release` frees them). Idempotent."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.awaiting_kv.pop(seq.request_id, None)
        if keep_blocks and seq.block_table:
            self.kv.hold(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED

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
            self.pool.cache_block(seq.block_table[i], h, seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
        seq.block_hashes.extend(new)

    # -- internals ---------------------------------------------------------------------------------

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        total = seq.num_computed_tokens + num_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def _schedule_prefill(self) -> Optional[ScheduledBatch]:
        """Chunks of prompts: the first sequence takes up to the whole budget; others join only while
        (number of sequences) x (longest chunk) stays within it, so padding never exceeds the budget."""
        budget = self.config.prefill_chunk_size
        items: list[tuple[Sequence, int]] = []

        def fits(n: int) -> bool:
            longest = max([m for _, m in items] + [n])
            return (len(items) + 1) * longest <= budget

        for seq in [s for s in self.running if s.is_prefilling]:
            n = min(seq.num_uncomputed, budget)
            if not fits(n) or not self._reserve(seq, n, allow_preempt=not items):
                break
            items.append((seq, n))
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            self._match_prefix(seq)
            n = min(seq.num_uncomputed, budget)
            if not fits(n) or self._blocks_needed(seq, n) > self.pool.num_free_blocks:
                self._unmatch_prefix(seq)
                break
            self.waiting.popleft()
            self._reserve(seq, n, allow_preempt=False)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            items.append((seq, n))
        return ScheduledBatch(items, is_prefill=True) if items else None

    def _schedule_decode(self) -> Optional[ScheduledBatch]:
        items = []
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.is_prefilling:
                continue
            if self._reserve(seq, 1, allow_preempt=True):
                k = self.lookahead(seq) if self.lookahead is not None else 0
                if k and not self._reserve(seq, 1 + k, allow_preempt=False):
                    k = 0
                items.append((seq, 1 + k))
        items = [(s, n) for s, n in items if s.status is SequenceStatus.RUNNING]  # minus preempted ones
        return ScheduledBatch(items, is_prefill=False) if items else None

    def _reserve(self, seq: Sequence, num_tokens: int, allow_preempt: bool) -> bool:
        """Make the blocks for `num_tokens` more tokens of `seq` exist, preempting others if allowed."""
        need = self._blocks_needed(seq, num_tokens)
        while need > self.pool.num_free_blocks:
            victims = [s for s in self.running if s is not seq]
            if not allow_preempt or not victims:
                return False
            self._preempt(victims[-1])
        if need:
            self.kv.allocate(seq, need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.block_hashes = []
        self._preempted.append(seq)
        seq.num_computed_tokens = seq.num_draft_computed = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _match_prefix(self, seq: Sequence) -> None:
        """Take the longest cached prefix (whole blocks, leaving at least one token to compute)."""
        if seq.block_table or seq.request.sampling.prompt_logprobs is not None:
            return  # prompt logprobs need every prompt position computed
        hashes = block_hashes(seq.token_ids, self.block_size, self.extra_key(seq.request.cache_salt))
        hashes = hashes[:(len(seq.token_ids) - 1) // self.block_size]
        hit = self.pool.find_cached_prefix(hashes, seq.token_ids, self.block_size)
        self.kv.take_prefix(seq, hit)
        seq.block_hashes = hashes[:len(hit)]
        seq.num_computed_tokens = len(hit) * self.block_size
        if seq.num_output_tokens == 0:  # first admission, not a recompute after preemption
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += seq.num_computed_tokens

    def _unmatch_prefix(self, seq: Sequence) -> None:
        if seq.num_output_tokens == 0:
            self.prefix_queries -= seq.num_prompt_tokens
            self.prefix_hits -= seq.num_computed_tokens
        self.kv.free(seq)
        seq.block_hashes, seq.num_computed_tokens = [], 0
