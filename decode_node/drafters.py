"""The drafters of speculative decoding (their interface, the rules and the speculator are in decode_node/speculative.py).

- `PromptLookupDrafter` (prompt lookup decoding, Saxena 2023; vLLM's "ngram" proposer): the last n tokens
  (n from `max_ngram` down to `min_ngram`) are looked up in the sequence's earlier tokens (prompt and output)
  and the tokens that followed their most recent occurrence are the draft. No second model; strong when the
  answer repeats its input (summaries, edits, code). Deterministic: its drafts are point masses.
- `DraftModelDrafter`: a small model sharing the target's tokenizer (checked at construction) runs k steps
  autoregressively, greedily for greedy requests, else sampling from its own distribution q with the
  request's sampling parameters (q goes to verification).

Draft-model KV: a `KVStore` of its own with the target pool's `num_blocks` and block size, indexed by the
same block tables (a sequence's draft KV sits in the same block ids as its target KV), in the target's KV
format. `seq.num_draft_computed` counts its valid positions; each `propose` first catches the draft up to
the sequence's tokens (its "draft prefill": at most `prefill_chunk_size` tokens per step, in separate
single-sequence forwards, before drafting), so sequences admitted with transferred KV (remote prefill) get
their prompt's draft KV computed here on the decode worker and transfers carry target KV only
(`KVFormat.speculative_kv` stays False). Prefix-cached blocks are reused for the draft too when their draft
KV is known to be valid: `valid` maps a block id to the block hash its draft KV was computed for, recorded
once the draft has computed a full hashed block and dropped before the draft writes that block again, so a
cached block reused by a request whose draft KV was never computed (or was computed for other tokens) is
recomputed. Stale draft KV could only lower the acceptance rate: verification never trusts the drafter.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Optional

import mlx.core as mx

from cluster.kv.plan import mirror_budget_bytes
from cluster.kv.store import KVStore, kv_bytes_per_block
from cluster.model import ModelSpec, load_draft_model
from cluster.model_structure import verify_model
from cluster.runner import BatchItem, Logits, ModelRunner
from cluster.sampling import adjusted, probabilities
from cluster.sequence import Sequence
from cluster.speculation import Draft
from decode_node.speculative import Drafter

logger = logging.getLogger(__name__)


class NgramIndex:
    """Where each n-gram of a token list (min_n <= n <= max_n) last occurred, built incrementally.

    `after[n][ngram]` is the position right after the most recent occurrence of `ngram` that ends before the
    list's last token. Example, tokens [5, 6, 7, 5, 6]: the suffix (5, 6) occurred at 0..1, so the draft is
    tokens[2:2 + k] = [7, 5, 6][:k]."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.after: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0  # n-grams ending before this position are in `after`

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix's most recent earlier occurrence ([] if none)."""
        end = len(tokens) - 1
        for p in range(self.indexed, end):  # the n-grams ending at position p
            for n in range(self.min_n, min(self.max_n, p + 1) + 1):
                self.after[n][tuple(tokens[p - n + 1:p + 1])] = p + 1
        self.indexed = max(self.indexed, end)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            pos = self.after[n].get(tuple(tokens[-n:]))
            if pos is not None:
                return list(tokens[pos:pos + k])
        return []


VERIFY_COST = 0.1  # verifying one more token, relative to a plain decode step: measured for SmolLM2 on the CPU
# backend ~0.02 at batch 1 and ~0.1 per sequence at batch 4 (feeding 5 tokens per sequence instead of 1)


class PromptLookupDrafter:
    """Drafts by n-gram lookup in the sequence's own tokens (see the module docstring).

    `cost_per_token` (relative to a plain decode step) is only the verification of one more token (drafting
    costs microseconds): `VERIFY_COST`."""

    method = "prompt_lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, cost_per_token: float = VERIFY_COST):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup n-gram sizes {min_ngram}..{max_ngram} are invalid: need 1 <= min <= max")
        self.max_ngram, self.min_ngram, self.cost_per_token = max_ngram, min_ngram, cost_per_token

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        out = []
        for seq, k in zip(seqs, num_tokens):
            if not isinstance(seq.draft_state, NgramIndex):
                seq.draft_state = NgramIndex(self.min_ngram, self.max_ngram)
            out.append(Draft(tuple(seq.draft_state.propose(seq.token_ids, k)) if k > 0 else ()))
        return out

    def release(self, seq: Sequence) -> None:
        pass

    def reset(self) -> None:
        pass


def check_same_tokenizer(target, draft) -> None:
    """Raise ValueError unless the two tokenizers (mlx-lm TokenizerWrappers or Hugging Face tokenizers) map
    the same strings to the same ids: speculative decoding compares token ids."""
    tv, dv = target.get_vocab(), draft.get_vocab()
    if tv == dv:
        return
    differ = sorted(set(tv.items()) ^ set(dv.items()), key=lambda kv: kv[1])[:3]
    raise ValueError(f"the draft model's tokenizer differs from the target's ({len(dv)} vs {len(tv)} tokens; "
                     f"first differences: {differ}): speculative decoding needs a draft model with the target's "
                     "tokenizer (e.g. a smaller model of the same family, or a quantized copy of the target)")


def forward_seconds(runner: ModelRunner, repeats: int = 5) -> float:
    """Median seconds of a one-token decode forward of `runner`'s model (batch 1, short context), written into
    the null block (block 0, where padding goes anyway)."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        mx.eval(runner.forward([BatchItem([0], min(i, runner.store.block_size - 1), [1], Logits.LAST)]))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first run compiles and warms up


def measured_cost(draft: ModelRunner, target: ModelRunner) -> float:
    """A draft token's cost relative to a plain decode step: one draft forward over one target forward, plus
    `VERIFY_COST`. Measured rather than derived from weight bytes: MLX's CPU backend runs a 4-bit draft slower
    than the float32 target (measured ~1.8x for SmolLM2), the opposite of a bandwidth-bound Mac."""
    return forward_seconds(draft) / forward_seconds(target) + VERIFY_COST


class DraftModelDrafter:
    """Drafts with a small model over its own KV pool (see the module docstring).

    `engine` is the target's `cluster.engine.EngineCore` (its pool geometry, config, tokenizer and runner are
    used). `cost_per_token` (relative to a plain decode step) is measured at construction when None
    (`measured_cost`); with a cost above ~1 the adaptive draft length stays at 0 (speculation cannot pay) except
    for probes. Raises ValueError for a draft model whose tokenizer differs from the target's.
    """

    method = "draft_model"
    catch_up_inline = 8  # a lag up to this many tokens is fed with the first draft step, longer ones before it

    def __init__(self, model, tokenizer, spec: ModelSpec, engine, cost_per_token: Optional[float] = None):
        check_same_tokenizer(engine.tokenizer, tokenizer)
        cfg = engine.config
        per_block = kv_bytes_per_block(spec, cfg.block_size, cfg.dtype, cfg.kv_bits, cfg.kv_group_size)
        mirror = mirror_budget_bytes(cfg, engine.pool.num_blocks * per_block)
        verified = verify_model(model)
        # the draft's KV belongs to the target engine's thread, like the target's (cluster/ownership.py)
        self.store = KVStore(spec, engine.pool.num_blocks, cfg.block_size, cfg.dtype, cfg.kv_bits,
                             cfg.kv_group_size, mirror_budget_bytes=mirror,
                             dequantize_for_attention=None if verified.reads_quantized_kv else True, owner=engine.owner)
        self.runner = ModelRunner(model, self.store, verified)
        self.kv = engine.kv  # the target's block tables, which the draft's KV follows
        self.block_size, self.chunk, self.vocab_size = cfg.block_size, cfg.prefill_chunk_size, engine.spec.vocab_size
        self.valid: dict[int, int] = {}  # block id -> the block hash its draft KV was computed for
        self.grammars = engine.grammars  # constrained sequences draft under their grammar's mask
        self.cost_per_token = measured_cost(self.runner, engine.runner) if cost_per_token is None else cost_per_token

    def reset(self) -> None:
        """After a failed step: forget the mirror and every validity record (the step may have written
        draft KV without counting it)."""
        if self.store.mirror is not None:
            self.store.mirror.reset()
        self.valid.clear()

    def release(self, seq: Sequence) -> None:
        """Record the finished sequence's complete draft blocks, so later requests reuse them from the cache."""
        self._record(seq, min(seq.num_draft_computed, seq.num_computed_tokens))

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        drafts = [Draft() for _ in seqs]
        budget, ready = self.chunk, []
        for b, seq in enumerate(seqs):
            self._reuse_cached(seq)
            budget = self._catch_up(seq, budget)
            if num_tokens[b] > 0 and len(seq.token_ids) - 1 - seq.num_draft_computed <= self.catch_up_inline:
                ready.append(b)
        tokens: dict[int, list[int]] = {b: [] for b in ready}
        probs: dict[int, list[mx.array]] = {b: [] for b in ready}
        rows = ready
        while rows:  # step i feeds the draft's lag and the last token (i = 0), or draft token i (i > 0)
            items = []
            for b in rows:
                seq = seqs[b]
                feed = tokens[b][-1:] or seq.token_ids[seq.num_draft_computed:]
                self._forget(seq, seq.num_draft_computed, len(feed))
                items.append(BatchItem(self.kv.block_table(seq.request_id), seq.num_draft_computed, feed, Logits.LAST,
                                       mirror_row=seq.request_id))
            logits = self.runner.forward(items)
            for b, item, (token, q) in zip(rows, items, self._choose([seqs[b] for b in rows],
                                                                     [tokens[b] for b in rows], logits)):
                seqs[b].num_draft_computed += len(item.token_ids)
                tokens[b].append(token)
                if q is not None:
                    probs[b].append(q)
            rows = [b for b in rows if len(tokens[b]) < num_tokens[b]]
        for b in ready:
            drafts[b] = Draft(tuple(tokens[b]), mx.stack(probs[b]) if probs[b] else None)
        return drafts

    def _choose(self, seqs: list[Sequence], drafted: list[list[int]], logits: list[mx.array]
                ) -> list[tuple[int, Optional[mx.array]]]:
        """The next draft token of each row: argmax for greedy requests, else a draw from q (returned too). A
        sequence with a grammar drafts under its mask after the tokens drafted so far (so q is the masked
        distribution, and no draft is wasted on a token the grammar refuses)."""
        tokens, qs = [], []
        for seq, done, row in zip(seqs, drafted, logits):
            row = self._fit(row)
            sp = seq.request.sampling
            history = seq.output_token_ids + done
            mask = self.grammars.mask_after(seq.grammar, done) if seq.grammar is not None else None
            if sp.greedy:
                tokens.append(mx.argmax(adjusted(row, sp, seq.request.prompt_token_ids, history, mask)))
                qs.append(None)
            else:
                q = probabilities(row, sp, seq.request.prompt_token_ids, history, mask)
                seq.rng_key, sub = mx.random.split(seq.rng_key)
                tokens.append(mx.random.categorical(mx.log(q), key=sub))
                qs.append(q)
        chosen = mx.stack(tokens)
        mx.eval(chosen, *[q for q in qs if q is not None])
        return list(zip(chosen.tolist(), qs))

    def _fit(self, row: mx.array) -> mx.array:
        """The draft's logits over the target's vocabulary (padded embedding rows differ between models)."""
        extra = self.vocab_size - row.shape[-1]
        if extra < 0:
            return row[:self.vocab_size]
        return mx.concatenate([row, mx.full((extra,), -float("inf"))]) if extra else row

    def _record(self, seq: Sequence, num_valid: int) -> None:
        """Remember the hashed blocks within the first `num_valid` positions as holding valid draft KV."""
        table = self.kv.block_table(seq.request_id)
        for i in range(min(num_valid // self.block_size, len(seq.block_hashes))):
            self.valid[table[i]] = seq.block_hashes[i]

    def _reuse_cached(self, seq: Sequence) -> None:
        """Record the blocks whose draft KV is complete; skip leading blocks whose draft KV is valid."""
        B, table, hashes = self.block_size, self.kv.block_table(seq.request_id), seq.block_hashes
        self._record(seq, seq.num_draft_computed)
        done = seq.num_draft_computed
        while done % B == 0 and done // B < len(hashes) and self.valid.get(table[done // B]) == hashes[done // B]:
            done += B
        seq.num_draft_computed = done

    def _catch_up(self, seq: Sequence, budget: int) -> int:
        """Draft prefill: feed tokens the draft has not seen (all but the last), in chunks within `budget`."""
        lag = len(seq.token_ids) - 1 - seq.num_draft_computed
        while lag > self.catch_up_inline and budget > 0:
            start, n = seq.num_draft_computed, min(lag, budget)
            self._forget(seq, start, n)
            self.runner.forward([BatchItem(self.kv.block_table(seq.request_id), start, seq.token_ids[start:start + n],
                                           Logits.NONE)])
            seq.num_draft_computed += n
            budget, lag = budget - n, lag - n
        return budget

    def _forget(self, seq: Sequence, start: int, n: int) -> None:
        """The draft is about to write positions [start, start + n): those blocks are no longer known valid."""
        table = self.kv.block_table(seq.request_id)
        for i in range(start // self.block_size, (start + n - 1) // self.block_size + 1):
            self.valid.pop(table[i], None)


def build_drafters(engine, target_source: Optional[str] = None) -> dict[str, Drafter]:
    """The drafters an engine offers: prompt lookup always (it costs nothing until a request asks for it),
    and a draft model when `engine.config.uses_draft_model` (loaded here: `draft_model`, or a copy of the
    target `target_source` quantized to `draft_quantize_bits`, 4 by default). Raises ValueError when the
    draft's tokenizer differs from the target's, FileNotFoundError when its source does not exist."""
    drafters: dict[str, Drafter] = {"prompt_lookup": PromptLookupDrafter()}
    cfg = engine.config
    if cfg.uses_draft_model:
        source = cfg.draft_model or target_source
        bits = cfg.draft_quantize_bits if cfg.draft_quantize_bits or cfg.draft_model else 4
        model, tokenizer, spec = load_draft_model(source, cfg.dtype, bits)
        drafters["draft_model"] = DraftModelDrafter(model, tokenizer, spec, engine, cfg.draft_cost_per_token)
        logger.info("draft model %s loaded (%s), relative cost per draft token %.2f", source or "(the target)",
                    f"{bits}-bit" if bits else cfg.dtype, drafters["draft_model"].cost_per_token)
    return drafters
