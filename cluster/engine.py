"""The engine core: one step at a time, on one thread.

    step = expire (waiting too long for KV blocks) -> admit (sequences whose prompt KV arrived from another
           worker) -> schedule -> execute (array work: cluster/runner.py, one typed RowResult per sequence) ->
           update from the output (count computed tokens, cache full blocks, append tokens, finish) -> tell
           the role what was computed (cluster/connector.py) -> emit the output deltas

The engine validates requests and runs the loop; the scheduler (cluster/scheduler.py) owns the sequences and
their bookkeeping, the runner the array work, the `KVManager` the blocks. Each worker role plugs in through
the connector; the decode role also gives the engine its speculator (cluster/speculation.py). `step()` never
raises for a request's sake: a failing step fails the sequences it ran with `FinishReason.ERROR` and the
engine carries on.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from cluster.connector import Connector
from cluster.config import EngineConfig
from cluster.detokenizer import OutputText
from cluster.reasoning import start_reasoning
from cluster.grammar import GrammarError, Grammars
from cluster.kv.tier_setup import tier_for
from cluster.kv.hashing import first_block_key
from cluster.kv.plan import KVPlan, plan_kv
from cluster.model import ModelSpec
from cluster.ownership import ThreadOwner
from cluster.model_structure import VerifiedModel, kv_spec, verify_model
from cluster.request import FinishReason, GenerateRequest, RequestOutput
from cluster.runner import InFlight, ModelRunner, Replicas
from cluster.sampling import make_key
from cluster.sequence import Sequence
from cluster.scheduler import ScheduledBatch, Scheduler
from cluster.speculation import Speculator

logger = logging.getLogger(__name__)


class EngineCore:
    """Continuous batching over a paged KV pool for one model.

    Raises `ValueError` at construction for a model whose structure the engine does not serve
    (`cluster.model_structure.verify_model`), and from `add_request` when a request can never run here
    (prompt at or over the context limit, or larger than the whole KV pool, or a speculative method this
    engine cannot run); the message says what to change.

    The speculator runs speculative decoding (decode_node/speculative.py's `DecodeSpeculator`; cluster/ imports
    no sibling, so the decode role installs it through the `speculator` setter before requests arrive);
    `connector` is the role seam; `kv_plan` the KV's plan (cluster/kv/plan.py; by default `plan_kv`'s for
    this model and config). Without a speculator and a connector the engine neither drafts nor plays a role.
    """

    def __init__(self, model, tokenizer, spec: ModelSpec, config: EngineConfig,
                 connector: Optional[Connector] = None, kv_plan: Optional[KVPlan] = None,
                 verified: Optional[VerifiedModel] = None, replicas: Optional[Replicas] = None,
                 open_tier: bool = True):
        # before the pool is allocated: a refused model fails fast (`verified`: the load check's, with the mask
        # rank it found, cluster/load_check.py)
        verified = verified or verify_model(model)
        spec = kv_spec(spec, verified)
        self.model, self.tokenizer, self.spec = model, tokenizer, spec
        if kv_plan is None:  # the KV wing plans the budget (cluster/kv/plan.py)
            kv_plan = plan_kv(spec, config, verified)
        self.kv_plan, self.config = kv_plan, kv_plan.config
        self.block_size = config.block_size
        self.max_model_len = min(config.max_model_len or spec.max_model_len, spec.max_model_len)
        # one owner thread for the model calls, the KV arrays and the pool (cluster/ownership.py)
        self.owner = ThreadOwner("this engine")
        self.kv = kv_plan.build(self.owner)  # the one owner of every request's KV, by KV cache group
        self.pool, self.store = self.kv.pool, self.kv.block_groups[0].store
        # the SSD tier under the pool (`ssd_cache_gb`; cluster/kv/disk_tier.py), None without; a worker group's
        # ranks (`open_tier` False) open theirs once the group is formed (cluster/parallel/group_tier.py)
        self.tier = tier_for(self.kv, spec, self.config) if open_tier else None
        self.runner = ModelRunner(model, self.kv, verified, replicas)
        # a pipeline group's leader: the whole model's cache slot kinds (its own model runs only its layers'; the
        # KV transfer's format states the whole, kv_transfer/handshake.py)
        self.group_layer_kinds: Optional[tuple[str, ...]] = None
        if replicas is not None and self.kv.copy_block is not None:  # a head hit's copy runs on every rank
            self.kv.copy_block = _copied_on_replicas(self.kv.copy_block, replicas)
        eos_ids = set(spec.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.scheduler = Scheduler(self.config, self.kv, self._extra_key, eos_ids, connector)
        # constrained decoding (cluster/grammar.py): its llguidance tokenizer is built on the first grammar
        self.grammars = Grammars(tokenizer, spec.vocab_size, eos_ids)
        # the overlapped loop: plain rows' tokens stay on the device for a step (`_defers`, `InFlight`); their
        # sequences count them in `num_inflight_tokens` until `_resolve` reads them back
        # (not in a worker group: its followers are handed each forward's input tokens)
        self._overlap = self.config.async_scheduling and not verified.num_state_layers and replicas is None
        self._inflight: Optional[InFlight] = None
        self.clock = time.perf_counter  # times the steps for the step budget (a test may set a fake clock)

    def close(self) -> None:
        """Release what outlives a step: the SSD tier writes what it has queued and lets its folder go."""
        if self.tier is not None:
            self.tier.close()
            self.tier = None

    def disk_block_worth(self) -> Optional[float]:
        """What a prefix block only the SSD tier holds is worth, as a share of one in RAM (placement weighs it so,
        router/placement.py): 1 - the seconds to load a prefill chunk's blocks / the seconds to compute them from
        position 0, in [0, 1]; from the tier's measured load rate and the fitted prefill cost, None until both are
        measured (or without a tier)."""
        if self.tier is None:
            return None
        tokens = max(self.block_size, self.config.prefill_chunk_size // self.block_size * self.block_size)
        load = self.tier.load_seconds_estimate(tokens // self.block_size)
        compute = self.scheduler.budget.solo_seconds(0, tokens)
        if load is None or not compute:
            return None
        return max(0.0, min(1.0, 1.0 - load / compute))

    @property
    def speculator(self) -> Speculator:
        """The speculator (`NoSpeculator` until the decode role installs its own, decode_node/speculative.py's,
        through the setter: the one route, since a speculator's drafters are built over this engine)."""
        return self.scheduler.speculator

    @speculator.setter
    def speculator(self, speculator: Speculator) -> None:
        """Raises ValueError for a speculator that drafts over a model with recurrent layers: rejected drafts
        are rolled back by lowering counters, which cannot undo a recurrent state's update."""
        if self.runner.verified.num_state_layers and getattr(speculator, "methods", ()):
            raise ValueError(self._no_speculation("start the server without speculation (the --speculative-method "
                                                  "/ --draft-model flags, or speculative_method / draft_model in "
                                                  "the topology's [engine] table)"))
        self.scheduler.speculator = speculator

    def _no_speculation(self, what_to_do: str) -> str:
        """Why a model with recurrent layers runs no speculative decoding, and `what_to_do` about it."""
        return (f"speculative decoding is not available for {self.runner.verified.model_type}: its recurrent "
                f"layers' state cannot be rolled back past rejected drafts; {what_to_do}")

    @property
    def connector(self) -> Connector:
        """The role seam (cluster/connector.py; `NoConnector` by default)."""
        return self.scheduler.connector

    @connector.setter
    def connector(self, connector: Connector) -> None:
        self.scheduler.connector = connector

    @property
    def sequences(self) -> dict[str, Sequence]:
        """The live sequences by request id (the scheduler's; read them, never change them)."""
        return self.scheduler.sequences

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
        reasoning = request.sampling.reasoning
        if reasoning is not None and any(t >= self.spec.vocab_size for t in reasoning.start_ids + reasoning.end_ids):
            raise ValueError(f"reasoning marker token ids must be in [0, {self.spec.vocab_size}): this model's "
                             "vocabulary does not have them")
        method = request.sampling.speculative_method
        if (method is not None and request.sampling.num_draft_tokens != 0 and method not in self.speculator.methods
                and not remote_decode):
            if self.runner.verified.num_state_layers:
                raise ValueError(self._no_speculation("send the request without `speculative`"))
            have = ", ".join(self.speculator.methods) or "none"
            raise ValueError(f"speculative method {method!r} is not available on this server (available: {have}); "
                             + ("start it with --draft-model or --speculative-method draft_model"
                                if method == "draft_model" else "ask for another method" if self.speculator.methods
                                else "send the request without `speculative`"))
        return min(request.sampling.max_tokens, self.max_model_len - n, capacity - n)

    def add_request(self, request: GenerateRequest, *, remote_prefill: bool = False,
                    remote_decode: bool = False) -> Optional[RequestOutput]:
        """Queue a request (validated by `check_request`; raises ValueError). Returns a final output at once if
        it asks for no tokens (`length`) or its grammar does not compile (`error`, saying why), else None.

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
        grammar_prefix = sp.grammar_prefix
        if sp.reasoning is not None:  # replayed through the output generated before (a continuation), if any
            seq.reasoning = start_reasoning(sp.reasoning, sp.grammar is not None, self.tokenizer.decode)
            generated = request.prompt_token_ids[len(request.prompt_token_ids) - sp.reasoning.num_generated:]
            grammar_prefix = tuple(seq.reasoning.replay(generated))  # of those, the answer's
        seq.output_text = OutputText(self.tokenizer, request.prompt_token_ids, sp.stop, sp.skip_special_tokens,
                                     seq.reasoning)
        seq.rng_key = None if sp.greedy else make_key(sp.seed)
        seq.speculation = None if remote_decode else self.speculator.state_for(request)
        if sp.grammar is not None:
            try:
                seq.grammar = self.grammars.start(sp.grammar, grammar_prefix)
            except GrammarError as exc:  # the request fails, the engine does not
                return self.scheduler.final_output(seq, FinishReason.ERROR, str(exc))
        if max_tokens == 0 and sp.prompt_logprobs is None:
            return self.scheduler.final_output(seq, FinishReason.LENGTH)
        self.scheduler.add(seq, remote_prefill)
        return None

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Stop a request; returns its final `abort` output (None if unknown). Its blocks are freed, or kept
        for the role if the connector asks (`request_finished`)."""
        self.owner.check("EngineCore.abort")
        seq = self.sequences.get(request_id)
        if seq is None:
            return None
        return self.scheduler.finish_with_output(seq, FinishReason.ABORT)

    def release(self, request_id: str) -> bool:
        """The role no longer needs the blocks held for `request_id` (a transfer ended): free them. False when
        none are held."""
        self.owner.check("EngineCore.release")
        return self.kv.release(request_id)

    def has_work(self) -> bool:
        """True when `step` has something to do: a sequence to compute, one whose prompt KV arrived, or tokens
        of the last step still to read back."""
        inflight = self._inflight is not None and any(not seq.finished for seq, _ in self._inflight.rows)
        return inflight or self.scheduler.has_work()

    # -- the loop ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns the output deltas it produced. Raises `WrongThreadError` off the
        owner thread (cluster/ownership.py); never for a request's sake."""
        self.owner.check("EngineCore.step")
        outputs = self.scheduler.expire(time.monotonic())
        outputs += self.scheduler.admit_prefilled()
        batch = self.scheduler.schedule(self.clock())
        inflight, self._inflight = self._inflight, None
        if batch is not None:
            started = self.clock()
            outputs += self._execute(batch, inflight)
            self.scheduler.budget.observe(batch.num_decode_tokens, batch.prefill_spans, self.clock() - started)
        else:
            outputs += self._resolve(inflight)
        self.scheduler.report_computed(batch)
        return outputs

    def _execute(self, batch: ScheduledBatch, inflight: Optional[InFlight]) -> list[RequestOutput]:
        """Run the batch (array work: cluster/runner.py, forward -> grammar masks -> sample, then verify the
        drafts with the speculator's rules), then read back the tokens of the step before it (`inflight`,
        sampled on the device while this one was being built), then update the batch's sequences from the
        results (the scheduler); rows sampled on the device this step become the next `InFlight`. A failing
        step fails the sequences it ran, never the engine; except on a worker group's leader (`replicas`), whose
        followers ran the forward, or wait inside its collectives, or are gone: its ranks are out of step for
        good, so the failure propagates and ends the group (cluster/worker.py)."""
        try:
            drafts = self.speculator.propose(batch.decode) if batch.decode else {}
            defer = {seq.request_id for seq, _ in batch.items if self._defers(seq)}
            rows, sampled = self.runner.execute(batch, drafts, self.grammars, inflight, defer)
            self.runner.verify(rows, self.speculator.verify)
        except Exception as exc:
            if self.runner.replicas is not None:
                raise
            return self._resolve(inflight) + self._fail(batch, exc)
        outputs = self._resolve(inflight)
        try:
            outputs += self.scheduler.update_from_output([row for row in rows if not row.on_device])
            self.scheduler.defer([row for row in rows if row.on_device])
            live = [] if sampled is None else [(seq, i) for seq, i in sampled.rows if not seq.finished]
            if live:
                self._inflight = InFlight(sampled.tokens, live)
        except Exception as exc:
            outputs += self._fail(batch, exc)
        return outputs

    def _resolve(self, inflight: Optional[InFlight]) -> list[RequestOutput]:
        """Read back the tokens sampled on the device by the step before and apply them (`Scheduler.resolve`);
        if that step failed on the device, its sequences finish with `error`."""
        if inflight is None:
            return []
        try:
            tokens = inflight.tokens.tolist()
        except Exception as exc:
            logger.exception("engine step failed")
            return [self.scheduler.finish_with_output(seq, FinishReason.ERROR, f"engine step failed: {exc}")
                    for seq, _ in inflight.rows if not seq.finished]
        return [self.scheduler.resolve(seq, tokens[i]) for seq, i in inflight.rows if not seq.finished]

    def _fail(self, batch: ScheduledBatch, exc: Exception) -> list[RequestOutput]:
        logger.exception("engine step failed")
        if self.store.mirror is not None:
            self.store.mirror.reset()
        self.speculator.reset()
        return self.scheduler.fail(batch, f"engine step failed: {exc}")

    def _defers(self, seq: Sequence) -> bool:
        """True when `seq`'s sampled tokens may stay on the device for a step (the overlapped loop): nothing on
        the host needs them before its next step (no grammar mask, no drafts, no penalties over its output, no
        logprobs, not handed to another worker, no reasoning budget whose forced tokens depend on it), and the
        model has no recurrent state (evaluated every step)."""
        sp = seq.request.sampling
        return (self._overlap and sp.grammar is None and seq.speculation is None and not sp.needs_penalties
                and sp.logprobs is None and sp.prompt_logprobs is None and not seq.remote_decode
                and (seq.reasoning is None or not seq.reasoning.may_constrain))


def _copied_on_replicas(copy_block: Callable[[int, int], None], replicas: Replicas) -> Callable[[int, int], None]:
    """`copy_block` that has the group's followers copy the same block first."""

    def copy(src: int, dst: int) -> None:
        replicas.copy_block(src, dst)
        copy_block(src, dst)

    return copy
