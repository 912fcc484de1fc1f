"""The sequences' lifecycle: continuous batching (which sequences compute how many tokens in the next engine
step) and the bookkeeping after each step (appending tokens, finishing, caching computed blocks).

Each step is decode-first under a token budget (cluster/step_budget.py): one token (plus its drafts) for every
sequence that has finished its prompt, then prompt chunks in the rest of the budget, bounded while anything
decodes so the streams' inter-token latency stays within its target. A decoding sequence is never skipped for a
step, and a long prompt advances a bounded chunk beside each decode step. New sequences are admitted from the
waiting queue (FCFS) whenever the budget, a running slot and the blocks allow, reusing their longest cached
prefix. While other sequences run, a prefix whose blocks are on the SSD tier is read from disk in the background
(cluster/kv/tier_prefetch.py): its sequence stays at the head of the queue, while the running batch goes on,
until the reads are done (with nothing running there is nothing to overlap: the commit reads them). When a
running sequence needs a block and none is free, the most recently admitted other sequence is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed later (vLLM's recompute preemption).

Speculative decoding is "schedule k+1" (nano-vllm's counters): `lookahead(seq)` says how many draft tokens
a decoding sequence wants this step; the decode item is then (seq, 1 + k), with blocks for all k+1
positions. Only the one token every decoding sequence needs may preempt others; draft room is taken from
free blocks only (k drops to 0 when there are none).

After the step, `update_from_output` takes the runner's typed `RowResult`s (the shape of vLLM v1's
`Scheduler.update_from_output` and nano-vllm's `Scheduler.postprocess`): it counts what was computed, caches the
blocks that filled up, appends the sampled or accepted tokens (advancing a grammar and a reasoning state), applies
the stop rules (EOS, stop ids, stop strings, a complete grammar, max_tokens) and finishes sequences. Accepted drafts
go one at a time through the same `_append_token` as plain decoding, so every stop rule ends a sequence where it
would. `finish` is the one way a sequence leaves: the speculator forgets it, the connector says whether its blocks
are kept for the role (`Connector.request_finished`, called exactly once), and the `KVManager` frees or holds them.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Callable, Iterable, Optional

from cluster.config import EngineConfig
from cluster.grammar import consume_answer
from cluster.connector import Connector, NoConnector
from cluster.kv.manager import KVManager
from cluster.prefix_match import PrefixMatcher
from cluster.request import MAX_DRAFT_TOKENS, FinishReason, RequestOutput
from cluster.runner import RowResult
from cluster.sampling import advance_key
from cluster.sequence import Sequence, SequenceStatus
from cluster.speculation import Draft, NoSpeculator, Speculator, Verified
from cluster.step_budget import ScheduledBatch, StepBudget


class Scheduler:
    """Owns the live sequences by request id (`sequences`), the waiting queue, the sequences awaiting their
    prompt KV from another worker and the running batch; allocates and frees their blocks through the
    `KVManager`, and updates them from each step's results.

    `extra_key(cache_salt)` gives the first block's hash key (model, revision, KV format, salt); `eos_ids` the
    model's end-of-sequence token ids. `speculator` (how many drafts a decoding sequence wants, what
    verification accepted) and `connector` (the role seam) are the engine's, set through it. The `KVManager`
    keeps every sequence's KV by request id, in each KV cache group (cluster/kv/groups.py).
    """

    def __init__(self, config: EngineConfig, kv: KVManager, extra_key: Callable[[Optional[str]], int],
                 eos_ids: Iterable[int] = (), connector: Optional[Connector] = None):
        self.config, self.kv, self.pool, self.extra_key = config, kv, kv.pool, extra_key
        self.eos_ids = frozenset(eos_ids)
        self.speculator: Speculator = NoSpeculator()  # the engine's `speculator` setter installs another
        self.connector: Connector = connector or NoConnector()
        self.block_size = config.block_size
        self.sequences: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self.awaiting_kv: dict[str, Sequence] = {}  # remote prefill: the prompt is computed elsewhere
        self.running: list[Sequence] = []
        self._preempted: list[Sequence] = []
        self.num_preemptions = 0
        self.budget = StepBudget(config.max_num_batched_tokens or config.prefill_chunk_size,
                                 config.prefill_chunk_size, config.block_size,
                                 None if config.itl_target_ms is None else config.itl_target_ms / 1000,
                                 config.long_prefill_token_threshold, config.prefill_slowdown)
        self.prefix = PrefixMatcher(kv, config.block_size, extra_key, self.budget.solo_seconds)

    @property
    def prefix_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache at first admission."""
        return self.prefix.queries

    @property
    def prefix_hits(self) -> int:
        """Of those, the tokens served from it."""
        return self.prefix.hits

    def add(self, seq: Sequence, remote_prefill: bool = False) -> None:
        """Register and queue a new sequence. `remote_prefill`: its prompt KV is being computed elsewhere (it
        holds no blocks yet) and it waits until the connector's `external_prefix` says the KV is here."""
        self.sequences[seq.request_id] = seq
        if remote_prefill:
            self.awaiting_kv[seq.request_id] = seq
        else:
            self.waiting.append(seq)

    def expire(self, now: float) -> list[RequestOutput]:
        """Abort the waiting sequences never admitted that arrived more than `queue_timeout_s` before `now`
        (time.monotonic()); returns their final outputs."""
        timeout = self.config.queue_timeout_s
        waited = f"it waited {timeout:g} s for KV blocks (the server is at capacity); retry later"
        expired = [s for s in self.waiting if s.arrival < now - timeout and s.num_output_tokens == 0]
        return [self.finish_with_output(s, FinishReason.ABORT, waited) for s in expired]

    def admit_prefilled(self) -> list[RequestOutput]:
        """Admit the sequences awaiting KV whose prompt the connector now holds: the held blocks become their
        block table, the first token (sampled, checked for stops and streamed where the prompt ran) their first
        output token; decoding continues from the second. They join the running batch when there is room, else
        the back of the queue (holding their blocks). The prompt's block hashes come with the KV, its blocks
        registered in the prefix cache already. Returns the outputs of those that finish at once."""
        outputs = []
        for seq in list(self.awaiting_kv.values()):
            prefix = self.connector.external_prefix(seq)
            if prefix is None:
                continue
            if self.kv.held(seq.request_id) is None:  # the role said ready but holds nothing: a bug
                outputs.append(self.finish_with_output(seq, FinishReason.ERROR,
                                                       "its prompt KV arrived without blocks (internal error)"))
                continue
            held = self.kv.adopt(seq.request_id)
            seq.token_ids.append(prefix.first_token)
            seq.num_computed_tokens, seq.num_cached_tokens = seq.num_prompt_tokens, held.num_cached_tokens
            # the prompt's blocks came registered under the hashes the transfer carried: none is hashed again
            seq.token_block_hashes = list(prefix.block_hashes)
            seq.block_hashes = list(prefix.block_hashes)
            # its text went out with the first token, under its grammar and reasoning: resume them
            error = consume_answer(seq.grammar, seq.reasoning, prefix.first_token)[1]
            seq.output_text.add(prefix.first_token)
            if seq.rng_key is not None:
                seq.rng_key = advance_key(seq.rng_key)  # as after one draw here
            del self.awaiting_kv[seq.request_id]
            if len(self.running) < self.config.max_num_seqs:
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            else:
                self.waiting.append(seq)
            if error is not None or seq.num_output_tokens >= seq.max_tokens:
                reason = FinishReason.ERROR if error is not None else FinishReason.LENGTH
                outputs.append(self.finish_with_output(seq, reason, error))
        return outputs

    def has_work(self) -> bool:
        """True when a step has something to do: a sequence to compute, or one whose prompt KV arrived."""
        return bool(self.waiting or self.running) or any(self.connector.external_prefix(seq) is not None
                                                         for seq in self.awaiting_kv.values())

    def queue_full(self) -> bool:
        """True when one more sequence would be queued beyond `max_waiting`: sequences waiting or awaiting
        their KV, less those the next step can still admit into free running slots, already fill the queue.
        So `max_num_seqs + max_waiting` sequences arriving at once at an idle engine are all taken."""
        free_slots = max(0, self.config.max_num_seqs - len(self.running))
        return len(self.waiting) + len(self.awaiting_kv) - free_slots >= self.config.max_waiting

    def schedule(self, now: float = 0.0) -> Optional[ScheduledBatch]:
        """Pick the next step's work (decode first, then prompt chunks within the budget), or None when there is
        nothing to do. `now`: the engine's step clock (seconds), which long prompts' deadlines are kept in."""
        decode = self._schedule_decode()
        num_decode = sum(n for _, n in decode)
        # a stream whose token is still on the device (the overlapped loop) waits on this step as well
        streaming = bool(decode) or any(s.num_inflight_tokens for s in self.running)
        prefill = self._schedule_prefill(self.budget.prefill_allowance(num_decode), self.budget.time_left(streaming),
                                         may_preempt=not decode, now=now)
        return ScheduledBatch(decode, prefill) if decode or prefill else None

    def report_computed(self, batch: Optional[ScheduledBatch]) -> None:
        """Tell the connector which sequences' computed KV changed in the step that ran `batch`: those still
        live that it computed, and those preempted since the last report (blocks freed, counters at 0)."""
        computed = [] if batch is None else [seq for seq, _ in batch.items if not seq.finished]
        preempted, self._preempted = self._preempted, []
        self.connector.on_computed(computed + preempted)

    # -- after the step --------------------------------------------------------------------------------

    def update_from_output(self, rows: list[RowResult]) -> list[RequestOutput]:
        """Bookkeeping after a step, row by row: count what was computed, keep the prompt logprobs, cache the
        blocks that filled up, append the sampled or accepted tokens (which may finish the sequence). Returns
        the output deltas, one per row that produced tokens or finished."""
        return [out for out in map(self._update_row, rows) if out is not None]

    def fail(self, batch: ScheduledBatch, error: str) -> list[RequestOutput]:
        """A step over `batch` failed: finish every sequence it ran with `FinishReason.ERROR` (those that had
        already finished in it get a second, error-only final output: their outputs of this step are lost)."""
        return [self.final_output(seq, FinishReason.ERROR, error) if seq.finished
                else self.finish_with_output(seq, FinishReason.ERROR, error) for seq, _ in batch.items]

    def finish(self, seq: Sequence, reason: Optional[FinishReason]) -> None:
        """The one way a sequence leaves (`reason` None: handed on after its first token, with remote decode).
        The speculator forgets it; its blocks are freed, or held under its request id when the connector
        still needs them (`KVManager.release` frees them then). Called exactly once per sequence."""
        seq.num_inflight_tokens = 0  # aborted while its token was on the device: that token is dropped
        if seq.speculation is not None:
            self.speculator.release(seq)
        self.sequences.pop(seq.request_id, None)
        keep_blocks = self.connector.request_finished(seq, reason)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.awaiting_kv.pop(seq.request_id, None)  # its holding, if any, stays the role's to release
        self.kv.finish(seq.request_id, reason is FinishReason.ERROR, keep_blocks, seq.num_cached_tokens)
        seq.status = SequenceStatus.FINISHED

    def finish_with_output(self, seq: Sequence, reason: FinishReason, error: Optional[str] = None) -> RequestOutput:
        """`finish` the sequence and return its final output."""
        self.finish(seq, reason)
        return self.final_output(seq, reason, error)

    def final_output(self, seq: Sequence, reason: FinishReason, error: Optional[str] = None) -> RequestOutput:
        """The last, token-less output delta of a sequence that finished with `reason`."""
        sp = seq.request.sampling
        plp = tuple(seq.prompt_logprobs) if sp.prompt_logprobs is not None else None
        return _output(seq, (), "", () if sp.logprobs is not None else None, reason, plp, error)

    def defer(self, rows: list[RowResult]) -> None:
        """The overlapped loop's bookkeeping for rows whose sampled token is still on the device: count what
        was computed and cache the blocks that filled up, as `update_from_output` does, and count the token in
        flight (`Sequence.num_inflight_tokens`) until `resolve` (finished sequences are skipped)."""
        for row in rows:
            if not row.seq.finished:
                self._advance(row)
                row.seq.num_inflight_tokens += 1

    def resolve(self, seq: Sequence, token: int) -> RequestOutput:
        """`seq`'s token in flight is read back as `token`: append it in its place and apply the stop rules as
        `update_from_output` would have; returns its output delta."""
        assert seq.num_inflight_tokens > 0, "resolved a sequence without a token in flight"
        seq.num_inflight_tokens -= 1
        return self._append_token(seq, token, None)

    def _update_row(self, row: RowResult) -> Optional[RequestOutput]:
        seq = row.seq
        if row.verified is not None:
            return self._accept(seq, row.draft, row.verified)
        self._advance(row)
        if not row.samples:
            return None
        if seq.max_tokens == 0:  # echo-only request: prompt logprobs, no token
            return self.finish_with_output(seq, FinishReason.LENGTH)
        return self._append_token(seq, row.token, row.logprob)

    def _advance(self, row: RowResult) -> None:
        """Count the row's computed tokens (and prompt logprobs, recurrent state), cache the blocks that filled
        up, release window blocks out of every later window, take a state snapshot where one is due."""
        seq = row.seq
        if row.prompt_logprobs is not None:
            seq.prompt_logprobs.extend(row.prompt_logprobs)
        seq.num_computed_tokens += row.num_fed
        self.prefix.cache_computed_blocks(seq)
        self.kv.computed(seq.request_id, seq.num_computed_tokens, seq.block_hashes, seq.num_prompt_tokens)

    def _accept(self, seq: Sequence, draft: Draft, result: Verified) -> RequestOutput:
        """Append the verified tokens one by one, as plain decoding would (stopping at the first stop), and
        roll the counters back to what was accepted; returns one delta with all of them."""
        self.speculator.record(seq, draft, result)
        outs = []
        for token, logprob in zip(result.tokens, result.logprobs):
            seq.num_computed_tokens = len(seq.token_ids)  # every token before this one is in the KV now
            self.prefix.cache_computed_blocks(seq)
            outs.append(self._append_token(seq, token, logprob))
            if outs[-1].finished:
                break
        seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
        self.kv.computed(seq.request_id, seq.num_computed_tokens, seq.block_hashes, seq.num_prompt_tokens)
        if len(outs) == 1:
            return outs[0]
        logprobs = None if outs[0].logprobs is None else tuple(lp for o in outs for lp in o.logprobs)
        return dataclasses.replace(outs[-1], token_ids=tuple(t for o in outs for t in o.token_ids),
                                   text="".join(o.text for o in outs), logprobs=logprobs,
                                   prompt_logprobs=outs[0].prompt_logprobs,
                                   reasoning_text="".join(o.reasoning_text for o in outs))

    def _append_token(self, seq: Sequence, token: int, logprob) -> RequestOutput:
        """Append one output token, advance its grammar, apply the stop rules and finish the sequence if one
        holds (or if it leaves after its first token, with remote decode); returns its output delta. A
        grammar ends it with stop once complete, with error (the token left out) when the token breaks it."""
        complete, error = consume_answer(seq.grammar, seq.reasoning, token)
        if error is not None:
            return self.finish_with_output(seq, FinishReason.ERROR, error)
        seq.token_ids.append(token)
        sp = seq.request.sampling
        reason, text, reasoning, last = None, "", "", None
        if (token in self.eos_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
            reason, last = FinishReason.STOP, token  # no text of its own (a harmony `<|call|>` closes its call)
        else:
            text, stopped, reasoning = seq.output_text.add(token)
            if stopped or complete:
                reason = FinishReason.STOP
        if reason is None and seq.num_output_tokens >= seq.max_tokens:
            reason = FinishReason.LENGTH
        plp = tuple(seq.prompt_logprobs) if seq.num_output_tokens == 1 and sp.prompt_logprobs is not None else None
        if reason is not None:
            tail = seq.output_text.finish(last)
            text, reasoning = text + tail.text, reasoning + tail.reasoning
        if reason is not None or seq.remote_decode:  # remote decode: another worker continues from here
            self.finish(seq, reason)
        return _output(seq, (token,), text, (logprob,) if logprob else None, reason, plp,
                       stop_string=seq.output_text.stop_string if reason == FinishReason.STOP else None,
                       reasoning=reasoning)

    def _chunk(self, seq: Sequence, allowance: int, whole_room: int, time_left: Optional[float], floor: bool,
               now: float, start: Optional[int] = None) -> int:
        """Tokens of `seq` to compute in this step from `start` (default: its computed tokens) given `allowance`
        prompt tokens and `time_left` seconds left (`StepBudget.chunk`; a long prompt computed beside streams
        may take more time to keep its plan: `StepBudget.stretch`), ending where a KV cache group
        wants it to (`KVManager.chunk_end`)."""
        start = seq.num_computed_tokens if start is None else start
        end = len(seq.token_ids)
        if time_left is not None and end - start > self.budget.long_prefill_threshold:
            plan = seq.prefill_plan
            if plan is None:  # kept once the chunk runs (`_schedule_prefill`)
                plan = self.budget.plan(start, now)
            time_left = self.budget.stretch(time_left, start, end, plan, now)
        end = start + self.budget.chunk(end - start, allowance, whole_room, start, time_left, floor)
        return self.kv.chunk_end(len(seq.token_ids), start, end) - start

    # -- internals ---------------------------------------------------------------------------------

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return self.kv.blocks_needed(seq.request_id, seq.num_computed_tokens + num_tokens)

    def _schedule_prefill(self, allowance: int, time_left: Optional[float], may_preempt: bool,
                          now: float = 0.0) -> list[tuple[Sequence, int]]:
        """Prompt chunks within `allowance` tokens of the step's token budget and, while streams decode,
        `time_left` seconds (None: no time bound; the chunks' predicted cost is subtracted as they are taken,
        the first time-bounded one gets at least a block; the step's new short prompts may take
        `StepBudget.whole_room` together past the time bound): the running prompts first, then new sequences
        admitted from the queue while a running slot and the blocks allow. One prompt at a time is cut into
        chunks (vLLM's one partial prefill): a new prompt that would not finish in this step waits while
        another is partial, so prompts finish in arrival order instead of all advancing slowly; short ones
        still join whole. Only the first chunk of a step with no decode work (`may_preempt`) may preempt
        others for its blocks: decode work is never preempted by a prompt."""
        items: list[tuple[Sequence, int]] = []
        partial, floor = False, True

        def took(seq: Sequence, start: int, n: int) -> None:
            nonlocal allowance, time_left, floor
            allowance -= n
            if time_left is not None and seq.prefill_plan is None and n < len(seq.token_ids) - start:
                seq.prefill_plan = self.budget.plan(start, now)  # cut beside streams
            if time_left is not None:
                time_left = max(0.0, time_left - self.budget.chunk_seconds(start, n))
                floor = False

        for seq in [s for s in self.running if s.is_prefilling]:  # a long prompt's rest: never past the bound
            start = seq.num_computed_tokens
            n = self._chunk(seq, allowance, 0, time_left, floor, now)
            if not n or not self._reserve(seq, n, allow_preempt=may_preempt and not items):
                break
            items.append((seq, n))
            took(seq, start, n)
            partial = partial or n < seq.num_uncomputed
        whole_room = self.budget.whole_room(allowance)
        overlap = bool(self.running)  # else nothing runs while the disk reads: the commit reads, batched as they came
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_inflight_tokens:  # preempted with its token on the device: after `resolve`
                break
            hit = self.prefix.lookup(seq)  # no side effects: nothing to undo when it does not fit
            if hit is not None and hit.disk and overlap and not self.prefix.loads_ready(hit):
                break  # its blocks are being read from the SSD tier while the running batch goes on
            start = seq.num_computed_tokens if hit is None else hit.num_tokens
            n = self._chunk(seq, allowance, whole_room, time_left, floor, now, start)
            if n < len(seq.token_ids) - start and partial:
                n = 0
            if hit is None:  # it holds its KV already
                need, free = self._blocks_needed(seq, n), self.kv.num_free_blocks
            else:
                need, free = max(0, -(-(start + n) // self.block_size) - hit.num_blocks), self.kv.free_besides(hit)
            if not n or need > free:
                break
            self.waiting.popleft()
            if hit is None:
                self.kv.allocate(seq.request_id, need)
            else:
                self.prefix.commit(seq, hit, need)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            items.append((seq, n))
            took(seq, start, n)
            whole_room, partial = whole_room - n, partial or n < seq.num_uncomputed
        return [(s, n) for s, n in items if s.status is SequenceStatus.RUNNING]

    def _schedule_decode(self) -> list[tuple[Sequence, int]]:
        """One token for every decoding sequence (preempting others for its block if it must), plus the drafts
        its speculator wants, from free blocks only and within the token budget (keeping a block's worth for a
        prompt when one waits)."""
        decoding = [s for s in self.running if s.status is SequenceStatus.RUNNING and not s.is_prefilling]
        prompts_wait = len(decoding) < len(self.running) or bool(self.waiting)
        draft_room = self.budget.max_batched_tokens - len(decoding) - (self.block_size if prompts_wait else 0)
        items = []
        for seq in decoding:
            if seq.status is not SequenceStatus.RUNNING or seq.num_output_tokens >= seq.max_tokens:
                continue  # preempted for an earlier one's block, or its token in flight is its last
            if self._reserve(seq, 1, allow_preempt=True):
                limit = seq.reasoning.draft_limit() if seq.reasoning is not None else None  # reasoning's rule
                k = min(self.speculator.lookahead(seq), max(0, draft_room), MAX_DRAFT_TOKENS if limit is None
                        else limit)
                if k and not self._reserve(seq, 1 + k, allow_preempt=False):
                    k = 0
                draft_room -= k
                items.append((seq, 1 + k))
        return [(s, n) for s, n in items if s.status is SequenceStatus.RUNNING]  # minus preempted ones

    def _reserve(self, seq: Sequence, num_tokens: int, allow_preempt: bool) -> bool:
        """Make the blocks for `num_tokens` more tokens of `seq` exist, preempting others if allowed."""
        need = self._blocks_needed(seq, num_tokens)
        while need > self.kv.num_free_blocks:
            victims = [s for s in self.running if s is not seq]
            if not allow_preempt or not victims:
                return False
            self._preempt(victims[-1])
        if need:
            self.kv.allocate(seq.request_id, need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.request_id)
        seq.block_hashes = []
        self._preempted.append(seq)
        seq.num_computed_tokens = seq.num_draft_computed = 0
        seq.prefill_plan = None
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1


def _output(seq: Sequence, token_ids: tuple, text: str, logprobs, reason: Optional[FinishReason], plp=None,
            error: Optional[str] = None, stop_string: Optional[str] = None, reasoning: str = "") -> RequestOutput:
    return RequestOutput(seq.request_id, token_ids, text, logprobs, plp, reason, seq.num_prompt_tokens,
                         seq.num_cached_tokens, seq.num_output_tokens, error, stop_string, reasoning,
                         seq.reasoning.count if seq.reasoning is not None else 0)
