"""The engine core: one step at a time, on one thread.

    step = expire (waiting too long for KV blocks) -> admit (sequences whose prompt KV arrived from another
           worker) -> schedule (cluster/scheduler.py) -> execute (array work: cluster/runner.py, one typed
           RowResult per sequence) -> postprocess (count computed tokens, cache full blocks, append tokens,
           finish) -> tell the role what was computed (cluster/connector.py) -> emit the output deltas

Each worker role plugs into it through the connector (cluster/connector.py); the decode role also gives it
its speculator (cluster/speculation.py), whose accepted tokens are appended through the same `_append_token`
as plain decoding, so every stop rule ends a sequence where plain decoding would. `step()` never raises for a
request's sake: a failing step fails the sequences it ran with `FinishReason.ERROR` and the engine carries on.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Optional

import mlx.core as mx

from cluster.block_pool import BlockPool
from cluster.connector import Connector, NoConnector
from cluster.config import EngineConfig
from cluster.detokenizer import OutputText
from cluster.hashing import first_block_key
from cluster.kv_store import KVStore, kv_bytes_per_block
from cluster.kv_manager import KVManager
from cluster.model import ModelSpec
from cluster.ownership import ThreadOwner
from cluster.model_families import verify_model
from cluster.request import FinishReason, GenerateRequest, RequestOutput
from cluster.runner import ModelRunner, RowResult
from cluster.sampling import make_key, prompt_logprobs
from cluster.sequence import Sequence
from cluster.scheduler import ScheduledBatch, Scheduler
from cluster.speculation import Draft, NoSpeculator, Speculator, Verified

logger = logging.getLogger(__name__)


class EngineCore:
    """Continuous batching over a paged KV pool for one model.

    Raises `ValueError` at construction for a model outside the verified families
    (`cluster.model_families.verify_model`), and from `add_request` when a request can never run here
    (prompt at or over the context limit, or larger than the whole KV pool, or a speculative method this
    engine cannot run); the message says what to change.

    `speculator` runs speculative decoding (decode_node/speculative.py's `DecodeSpeculator`; cluster/ imports
    no sibling, so whoever builds the engine injects it, here or later through the `speculator` attribute
    before requests arrive); `connector` is the role seam. Without them the engine neither drafts nor
    plays a role.
    """

    def __init__(self, model, tokenizer, spec: ModelSpec, config: EngineConfig,
                 speculator: Optional[Speculator] = None, connector: Optional[Connector] = None):
        self.model, self.tokenizer, self.spec, self.config = model, tokenizer, spec, config
        verified = verify_model(model)  # before the pool is allocated: a refused model fails fast
        self.block_size = config.block_size
        self.max_model_len = min(config.max_model_len or spec.max_model_len, spec.max_model_len)
        per_block = kv_bytes_per_block(spec, config.block_size, config.dtype, config.kv_bits, config.kv_group_size)
        num_blocks = config.num_blocks or 1 + int(config.kv_cache_gb * 2**30 // per_block)
        if num_blocks < 2:
            raise ValueError(f"kv_cache_gb={config.kv_cache_gb} holds no block of {per_block} bytes")
        self.pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
        self.kv = KVManager(self.pool)  # the one owner that allocates and frees blocks
        # one owner thread for the model calls, the KV arrays and the pool (cluster/ownership.py)
        self.owner = ThreadOwner("this engine")
        self.store = KVStore(spec, num_blocks, config.block_size, config.dtype, config.kv_bits, config.kv_group_size,
                             mirror_budget_bytes=self._mirror_budget(config, num_blocks * per_block),
                             dequantize_for_attention=None if verified.reads_quantized_kv else True, owner=self.owner)
        self.runner = ModelRunner(model, self.store, verified)
        self.speculator: Speculator = speculator or NoSpeculator()
        self.scheduler = Scheduler(config, self.kv, self._extra_key, lookahead=lambda seq: self.speculator.lookahead(seq))
        self.connector: Connector = connector or NoConnector()  # the role seam (cluster/connector.py)
        self.eos_ids = set(spec.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.sequences: dict[str, Sequence] = {}

    @staticmethod
    def _mirror_budget(config: EngineConfig, pool_bytes: int) -> int:
        """Bytes for the decode mirror: `decode_mirror_gb`, or by default as much as the pool."""
        return pool_bytes if config.decode_mirror_gb is None else int(config.decode_mirror_gb * 2**30)

    def _extra_key(self, cache_salt: Optional[str]) -> int:
        c = self.config
        return first_block_key(self.spec.model_id, self.spec.revision, c.dtype, c.kv_bits, c.kv_group_size,
                               c.block_size, cache_salt)

    # -- requests ----------------------------------------------------------------------------------

    def check_request(self, request: GenerateRequest, remote_decode: bool = False) -> int:
        """Validate `request` for this engine; returns its clamped max_tokens. Raises ValueError.
        `remote_decode`: only its prompt runs here (a prefill worker's), so it needs no drafter here."""
        n = len(request.prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens but the context limit is {self.max_model_len}: "
                             f"shorten the prompt to at most {self.max_model_len - 1} tokens")
        capacity = self.pool.num_usable_blocks * self.block_size
        if n + 1 > capacity:
            raise ValueError(f"the prompt has {n} tokens but this engine's KV pool holds {capacity}: "
                             "shorten the prompt or start the server with a larger --kv-cache-gb")
        if any(t < 0 or t >= self.spec.vocab_size for t in request.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.spec.vocab_size})")
        method = request.sampling.speculative_method
        if (method is not None and request.sampling.num_draft_tokens != 0 and method not in self.speculator.methods
                and not remote_decode):
            have = ", ".join(self.speculator.methods) or "none"
            raise ValueError(f"speculative method {method!r} is not available on this server (available: {have}); "
                             + ("start it with --draft-model or --speculative-method draft_model"
                                if method == "draft_model" else "ask for another method"))
        return min(request.sampling.max_tokens, self.max_model_len - n, capacity - n)

    def add_request(self, request: GenerateRequest, *, remote_prefill: bool = False,
                    remote_decode: bool = False) -> Optional[RequestOutput]:
        """Queue a request (validated by `check_request`; raises ValueError). Returns a final output at once if
        it asks for no tokens, else None.

        `remote_prefill`: another worker computes the prompt and samples the first token; the sequence waits
        until the connector's `external_prefix` says its KV is here (held under its request id).
        `remote_decode`: the sequence leaves this engine after its first token, its blocks kept for the role
        (`Connector.request_finished`).
        """
        self.owner.check("EngineCore.add_request")
        if request.request_id in self.sequences:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        max_tokens = self.check_request(request, remote_decode)
        sp = request.sampling
        seq = Sequence(request, max_tokens=max_tokens, remote_decode=remote_decode)
        seq.output_text = OutputText(self.tokenizer, request.prompt_token_ids, sp.stop)
        seq.rng_key = None if sp.greedy else make_key(sp.seed)
        seq.speculation = None if remote_decode else self.speculator.state_for(request)
        if max_tokens == 0 and sp.prompt_logprobs is None:
            return self._final_output(seq, FinishReason.LENGTH)
        self.sequences[request.request_id] = seq
        if remote_prefill:
            self.scheduler.add_awaiting_kv(seq)
        else:
            self.scheduler.add(seq)
        return None

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Stop a request; returns its final `abort` output (None if unknown). Its blocks are freed, or kept
        for the role if the connector asks (`request_finished`)."""
        self.owner.check("EngineCore.abort")
        seq = self.sequences.get(request_id)
        if seq is None:
            return None
        return self._finish_with_output(seq, FinishReason.ABORT)

    def release(self, request_id: str) -> bool:
        """The role no longer needs the blocks held for `request_id` (a transfer ended): free them. False when
        none are held."""
        self.owner.check("EngineCore.release")
        return self.kv.release(request_id)

    def has_work(self) -> bool:
        """True when `step` has something to do: a sequence to compute, or one whose prompt KV arrived."""
        return self.scheduler.has_work() or any(self.connector.external_prefix(seq) is not None
                                                for seq in self.scheduler.awaiting_kv.values())

    # -- the loop ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns the output deltas it produced. Raises `WrongThreadError` off the
        owner thread (cluster/ownership.py); never for a request's sake."""
        self.owner.check("EngineCore.step")
        waited = f"it waited {self.config.queue_timeout_s:g} s for KV blocks (the server is at capacity); retry later"
        outputs = [self._finish_with_output(seq, FinishReason.ABORT, waited)
                   for seq in self.scheduler.expired(time.monotonic() - self.config.queue_timeout_s)]
        outputs += self._admit_prefilled()
        batch = self.scheduler.schedule()
        if batch is not None:
            outputs += self._execute(batch)
        computed = [] if batch is None else [seq for seq, _ in batch.items if not seq.finished]
        self.connector.on_computed(computed + self.scheduler.take_preempted())
        return outputs

    def _execute(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Run the batch (array work: cluster/runner.py) and postprocess each row; a failing step fails the
        sequences it ran, never the engine."""
        try:
            drafts = {} if batch.is_prefill else self.speculator.propose(batch.items)
            rows = self.runner.execute(batch, drafts, self.speculator.verify)
            return [out for out in map(self._postprocess, rows) if out is not None]
        except Exception as exc:
            logger.exception("engine step failed")
            if self.store.mirror is not None:
                self.store.mirror.reset()
            self.speculator.reset()
            message = f"engine step failed: {exc}"
            return [self._final_output(seq, FinishReason.ERROR, message) if seq.finished
                    else self._finish_with_output(seq, FinishReason.ERROR, message)
                    for seq, _ in batch.items]  # the finished ones' outputs of this step are lost too

    def _admit_prefilled(self) -> list[RequestOutput]:
        """Admit the sequences awaiting KV whose prompt the connector now holds: the held blocks become their
        block table, the first token (sampled, checked for stops and streamed where the prompt ran) their
        first output token; decoding continues from the second."""
        outputs = []
        for seq in list(self.scheduler.awaiting_kv.values()):
            prefix = self.connector.external_prefix(seq)
            if prefix is None:
                continue
            if self.kv.held(seq.request_id) is None:  # the role said ready but holds nothing: a bug
                outputs.append(self._finish_with_output(seq, FinishReason.ERROR,
                                                        "its prompt KV arrived without blocks (internal error)"))
                continue
            held = self.kv.adopt(seq.request_id, seq)
            seq.token_ids.append(prefix.first_token)
            seq.num_computed_tokens, seq.num_cached_tokens = seq.num_prompt_tokens, held.num_cached_tokens
            seq.output_text.add(prefix.first_token)  # its text went out with the first token
            if seq.rng_key is not None:
                seq.rng_key = mx.random.split(seq.rng_key)[0]  # as after one draw here
            self.scheduler.admit_prefilled(seq)
            if seq.num_output_tokens >= seq.max_tokens:
                outputs.append(self._finish_with_output(seq, FinishReason.LENGTH))
        return outputs

    def _postprocess(self, row: RowResult) -> Optional[RequestOutput]:
        """Bookkeeping after the step for one row: count what was computed, cache the blocks that filled up,
        append the sampled or accepted tokens (which may finish the sequence); returns its output delta."""
        seq = row.seq
        if row.verified is not None:
            return self._accept(seq, row.draft, row.verified)
        if row.prompt_logits is not None:
            self._collect_prompt_logprobs(seq, row)
        seq.num_computed_tokens += row.num_fed
        self.scheduler.cache_computed_blocks(seq)
        if not row.samples:
            return None
        if seq.max_tokens == 0:  # echo-only request: prompt logprobs, no token
            return self._finish_with_output(seq, FinishReason.LENGTH)
        return self._append_token(seq, row.token, row.logprob)

    def _accept(self, seq: Sequence, draft: Draft, result: Verified) -> RequestOutput:
        """Append the verified tokens one by one, as plain decoding would (stopping at the first stop), and
        roll the counters back to what was accepted; returns one delta with all of them."""
        self.speculator.record(seq, draft, result)
        outs = []
        for token, logprob in zip(result.tokens, result.logprobs):
            seq.num_computed_tokens = len(seq.token_ids)  # every token before this one is in the KV now
            self.scheduler.cache_computed_blocks(seq)
            outs.append(self._append_token(seq, token, logprob))
            if outs[-1].finished:
                break
        seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
        if len(outs) == 1:
            return outs[0]
        logprobs = None if outs[0].logprobs is None else tuple(lp for o in outs for lp in o.logprobs)
        return dataclasses.replace(outs[-1], token_ids=tuple(t for o in outs for t in o.token_ids),
                                   text="".join(o.text for o in outs), logprobs=logprobs,
                                   prompt_logprobs=outs[0].prompt_logprobs)

    def _collect_prompt_logprobs(self, seq: Sequence, row: RowResult) -> None:
        start, end = row.start, min(row.start + row.num_fed, seq.num_prompt_tokens - 1)
        if end > start and len(seq.prompt_logprobs) == start:  # not again after a preemption
            targets = seq.token_ids[start + 1:end + 1]
            seq.prompt_logprobs.extend(prompt_logprobs(row.prompt_logits[:end - start], targets,
                                                       seq.request.sampling.prompt_logprobs))

    def _append_token(self, seq: Sequence, token: int, logprob) -> RequestOutput:
        seq.token_ids.append(token)
        sp = seq.request.sampling
        reason, text = None, ""
        if (token in self.eos_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
            reason = FinishReason.STOP
        else:
            text, stopped = seq.output_text.add(token)
            if stopped:
                reason = FinishReason.STOP
        if reason is None and seq.num_output_tokens >= seq.max_tokens:
            reason = FinishReason.LENGTH
        plp = None
        if seq.num_output_tokens == 1 and sp.prompt_logprobs is not None:
            plp = tuple(seq.prompt_logprobs)
        if reason is not None:
            text += seq.output_text.finish()
        if reason is not None or seq.remote_decode:  # remote decode: another worker continues from here
            self._finish(seq, reason)
        return self._output(seq, (token,), text, (logprob,) if logprob else None, reason, plp)

    def _output(self, seq: Sequence, token_ids: tuple, text: str, logprobs, reason, plp=None,
                error: Optional[str] = None) -> RequestOutput:
        return RequestOutput(seq.request_id, token_ids, text, logprobs, plp, reason, seq.num_prompt_tokens,
                             seq.num_cached_tokens, seq.num_output_tokens, error)

    def _final_output(self, seq: Sequence, reason: FinishReason, error: Optional[str] = None) -> RequestOutput:
        """The last, token-less output delta of a sequence that finished with `reason`."""
        plp = tuple(seq.prompt_logprobs) if seq.request.sampling.prompt_logprobs is not None else None
        return self._output(seq, (), "", () if seq.request.sampling.logprobs is not None else None,
                            reason, plp, error)

    def _finish(self, seq: Sequence, reason: Optional[FinishReason]) -> None:
        """The one way a sequence leaves the engine (`reason` None: handed on after its first token, with
        remote decode); its blocks are freed, or kept as a holding when the connector still needs them.
        Called exactly once per sequence."""
        if seq.speculation is not None:
            self.speculator.release(seq)
        self.sequences.pop(seq.request_id, None)
        self.scheduler.finish(seq, keep_blocks=self.connector.request_finished(seq, reason))

    def _finish_with_output(self, seq: Sequence, reason: FinishReason, error: Optional[str] = None) -> RequestOutput:
        """`_finish` the sequence and return its final output."""
        self._finish(seq, reason)
        return self._final_output(seq, reason, error)
