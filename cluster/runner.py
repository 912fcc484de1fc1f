"""One forward pass over a batch of sequences, shared by every worker role.

A batch item is (block_table, start, token_ids): compute `token_ids` at positions [start, start + T_b)
of a sequence whose KV lives in the blocks of `block_table`. A forward pads its items into one
[B, T] token array (T = max T_b), runs the unmodified mlx-lm model over the paged KV cache, and
returns logits only where the caller needs them: the vocabulary projection (lm_head, ~10% of a small
model's prefill FLOPs) runs on the selected rows only, and a chunk that needs no logits evaluates just
the KV writes (the trick mlx-lm's own prefill uses: evaluate the cache, never the logits). A step
(`execute`) reads as forward -> grammar masks -> sample, then the engine's `verify` (vLLM v1's execute_model then
sample_tokens, nano-vllm's prepare -> run_model -> sampler): `forward_step` runs its decode rows in one forward
and its prompt chunks in forwards of chunks of similar length (`pack_prefill`), so padding stays bounded;
`grammar_masks` computes the constrained rows' masks on the host while the device computes; `sample` samples
every row that needs a token at once (the overlapped loop's rows on the device, the `InFlight` tokens; the rest
on the host) and takes the prompt logprobs; `verify` checks the drafts with the speculator's rules.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import AbstractSet, Callable, Optional, Protocol, Sequence as Seq, Union

import mlx.core as mx

from cluster.grammar import Grammars, token_rule
from cluster.kv.attention_groups import FullAttentionGroup
from cluster.kv.groups import KVCacheGroup
from cluster.kv.manager import KVManager
from cluster.kv.store import KVStore
from cluster.model_structure import VerifiedModel, verify_model
from cluster.request import TokenLogprob
from cluster.sampling import prompt_logprobs, sample, sample_tokens
from cluster.sequence import Sequence
from cluster.speculation import Draft, Verified

# `Speculator.verify`: (sequences, drafts, logits, grammar masks or None) -> results
Verify = Callable[[list[Sequence], list[Draft], list[mx.array], Optional[list[Optional[mx.array]]]], list[Verified]]


class Logits(enum.Enum):
    """Which logits a batch item needs: the last new position's (to sample), every new position's (prompt
    logprobs, or verifying speculative drafts), or none (a prefill chunk that samples nothing)."""

    LAST = "last"
    ALL = "all"
    NONE = "none"


@dataclass(frozen=True)
class BatchItem:
    """One sequence's share of a step: compute `token_ids` at positions [start, start + len) into the blocks of
    `block_table`. `mirror_row` names the sequence across decode steps (its row of the decode mirror).
    `entries`: the sequence's entry in every KV cache group (`KVManager.entries`, cluster/kv/groups.py), of
    which `block_table` is the first group's; empty for a runner over one store. `inflight_request`: set when
    the item's one input is a token in flight, to the request whose token the previous step sampled on the
    device and did not read back (`InFlight`); `token_ids` is then empty and the forward takes that token from
    the device array."""

    block_table: Seq[int]
    start: int
    token_ids: Seq[int]
    logits: Logits = Logits.LAST
    mirror_row: Optional[str] = None
    entries: tuple = ()
    inflight_request: Optional[str] = None


@dataclass
class InFlight:
    """Tokens one step sampled on the device and did not read back yet (the engine's overlapped loop): `tokens`
    int32 [R] (evaluating asynchronously), and each row's (sequence, index in `tokens`). The next step feeds
    each sequence its token from there (`ModelRunner.execute`); the engine reads them back after building it."""

    tokens: mx.array
    rows: list[tuple[Sequence, int]]


class Replicas(Protocol):
    """The other ranks of a worker group (cluster/parallel/leader.py's `GroupLeader`): told each forward's items
    (the decode mirror they start from, and what each KV cache group of `groups` changed since the last forward,
    `KVCacheGroup.replica_ops`) before this rank runs it, so every rank runs the same forward over
    its shard and their collectives meet, and each block copy of a prefix hit (`KVManager.copy_block`). A forward
    that fails here after the followers took it leaves the ranks' collectives out of step: `abandon` ends the
    group."""

    def forward(self, items: Seq[BatchItem], mirror, groups: Seq[KVCacheGroup]) -> None: ...

    def copy_block(self, src: int, dst: int) -> None: ...

    def abandon(self, exc: BaseException) -> None: ...


class ModelRunner:
    """Runs `model` over the KV cache groups of `kv` (a `KVManager`), or over one `KVStore` of full attention.
    Not thread-safe: one engine thread owns it (MLX runs on that thread).

    `verified` is `verify_model(model)`'s result (computed here when None). `replicas`: the followers of a
    worker group this runner leads (None: a runner alone); every forward is handed to them first, and no
    forward may then take its input tokens from the device (`fed`). Raises ValueError for a model
    that `verify_model` refuses, or whose attention cannot read the store's quantized KV as stored.
    """

    def __init__(self, model, kv: Union[KVManager, KVStore], verified: Optional[VerifiedModel] = None,
                 replicas: Optional[Replicas] = None):
        self.model = model
        self.replicas = replicas
        self.verified = verified or verify_model(model)
        if isinstance(kv, KVStore):
            self.kv: Optional[KVManager] = None
            self.groups: tuple[KVCacheGroup, ...] = (FullAttentionGroup.over(kv),)
        else:
            self.kv, self.groups = kv, kv.groups
        if replicas is not None:
            for group in self.groups:
                group.replicate()
        self.store = self.groups[0].store  # the first group's: its decode mirror, its block size
        store = self.store
        if store.kv_bits is not None and not store.dequantize_for_attention and not self.verified.reads_quantized_kv:
            raise ValueError(f"{self.verified.model_type} attention reads float KV only: a KV store with "
                             f"kv_bits={store.kv_bits} must dequantize for attention")
        self._body, self._head, self._mask_rank = self.verified.body, self.verified.head, self.verified.mask_rank
        self._num_slots = {space: sum(len(g.layers) for g in self.groups if g.layer_space == space)
                           for space in ("kv", "state")}
        # a pipeline-parallel rank's body (mlx-lm's `pipeline`) receives from one rank, sends to another and
        # all-gathers; each rank's graph differs, so two forwards evaluated together could run their transfers in
        # different orders on different ranks: every forward is evaluated at once, whole, on every rank
        self._pipelined = getattr(self._body, "pipeline_size", 1) > 1
        self.num_prefill_tokens = 0  # prompt tokens computed
        self.num_padding_tokens = 0  # padding computed beside them (bounded by `pack_prefill`)

    def forward(self, items: Seq[BatchItem], fed: Optional[tuple[mx.array, list[int], list[int]]] = None
                ) -> list[Optional[mx.array]]:
        """Run one step; returns per item float32 logits: [vocab] for Logits.LAST, [T_b, vocab] for Logits.ALL,
        None for Logits.NONE. The returned arrays are lazy; if none is returned the KV writes are evaluated here.
        What a group keeps per row besides blocks (a recurrent state) is written back into the items' entries,
        evaluated. `fed`: (tokens on the device, rows, indices): row rows[i]'s one input token is
        tokens[indices[i]] (an item with `inflight_request`, whose `token_ids` are empty)."""
        if self.replicas is not None:
            assert fed is None, "a worker group's followers cannot read tokens left on the leader's device"
            self.replicas.forward(items, self.store.mirror, self.groups)
            try:
                return self._forward(items, fed)
            except BaseException as exc:
                self.replicas.abandon(exc)
                raise
        return self._forward(items, fed)

    def _forward(self, items: Seq[BatchItem], fed: Optional[tuple[mx.array, list[int], list[int]]]
                 ) -> list[Optional[mx.array]]:
        num_new = [len(it.token_ids) + (it.inflight_request is not None) for it in items]
        T = max(num_new)
        tokens = mx.array([list(it.token_ids) + [0] * (T - len(it.token_ids)) for it in items], dtype=mx.int32)
        if fed is not None:
            source, rows, index = fed
            tokens[mx.array(rows), 0] = mx.take(source, mx.array(index))
        starts = [it.start for it in items]
        mirror_rows = [it.mirror_row for it in items] if all(it.mirror_row is not None for it in items) else None
        slots = {space: [None] * n for space, n in self._num_slots.items()}
        group_entries, group_views = [], []
        for g, group in enumerate(self.groups):  # each group's layers over its own entries (cluster/kv/groups.py)
            entries = [it.entries[g] if it.entries else it.block_table for it in items]
            views = group.views(entries, starts, num_new, self._mask_rank, mirror_rows)
            for i, view in zip(group.layers, views):
                slots[group.layer_space][i] = view
            group_entries.append(entries)
            group_views.append(views)
        kv_views = slots["kv"]
        caches = self.verified.caches(kv_views, slots["state"]) if self.verified.layer_kinds else kv_views
        hidden = self._body(tokens, cache=caches)
        if self._pipelined:  # its receive, send and all-gather, before any other forward's (see __init__)
            mx.eval(hidden)
        out: list[Optional[mx.array]] = [None] * len(items)
        # one [rows, hidden] x [hidden, vocab] product: the head's weights are read once per step
        batch_rows, positions, spans = [], [], []
        for b, it in enumerate(items):
            if it.logits is Logits.NONE:
                continue
            first = num_new[b] - 1 if it.logits is Logits.LAST else 0
            spans.append((b, len(positions), num_new[b] - first))
            batch_rows += [b] * (num_new[b] - first)
            positions += range(first, num_new[b])
        if positions:
            logits = self._head(hidden[mx.array(batch_rows), mx.array(positions)]).astype(mx.float32)
            for b, at, n in spans:
                out[b] = logits[at] if items[b].logits is Logits.LAST else logits[at:at + n]
        else:
            mx.eval(*[a for group in self.groups for a in group.arrays()])
        for group, entries, views in zip(self.groups, group_entries, group_views):
            group.collect(entries, views)
        return out

    def execute(self, batch, drafts: dict[str, Draft], grammars: Optional[Grammars] = None,
                inflight: Optional[InFlight] = None, defer: AbstractSet[str] = frozenset()
                ) -> tuple[list["RowResult"], Optional[InFlight]]:
        """One step's array work over `batch` (cluster.scheduler.ScheduledBatch), in three steps: `forward_step`
        (the model over every row, drafts (`drafts` by request id) fed after their last token), `grammar_masks`
        (with `grammars`, the engine's constrained decoding: the masks of the rows with a grammar or a reasoning
        budget, on the host while the device computes) and `sample`. The drafts are verified after it by the
        caller (`verify`, with the speculator's rules). Sequences are not changed, except their PRNG keys
        (advanced by sampling).

        The overlapped loop: `inflight` holds the previous step's tokens still on the device, which its
        sequences' decode rows take as input there; the rows of sequences whose request id is in `defer` sample
        on the device without being read back. Returns one `RowResult` per scheduled sequence (decode rows
        first) and the `InFlight` of the rows sampled on the device (None when there are none)."""
        rows = self.forward_step(batch, drafts, inflight, defer)
        masks = self.grammar_masks(rows, grammars)
        return rows, self.sample(rows, masks)

    def forward_step(self, batch, drafts: dict[str, Draft], inflight: Optional[InFlight] = None,
                     defer: AbstractSet[str] = frozenset()) -> list["RowResult"]:
        """Forward: plan each scheduled sequence's row (`plan_row`; a row that samples is marked `on_device`
        when its request id is in `defer`), then run the decode rows in one forward (a row whose input is a
        token in flight takes it from `inflight`'s device array) and the prompt chunks in forwards of chunks of
        similar length (`pack_prefill`), each forward's evaluation started before the next is built (`_settle`).
        Sets each row's `logits` (lazy, float32; what a group keeps per row goes to its entries); counts prompt
        and padding tokens. A step with drafts gathers its contexts, so it resets the decode mirror (the next
        plain decode step rebuilds it). Returns the rows, decode first."""
        kv = self.kv
        decode = [plan_row(seq, n, False, drafts.get(seq.request_id), kv.entries(seq.request_id))
                  for seq, n in batch.decode]
        prefill = [plan_row(seq, n, True, None, kv.entries(seq.request_id)) for seq, n in batch.prefill]
        rows = [row for row, _ in decode + prefill]
        for row in rows:
            row.on_device = row.samples and row.seq.request_id in defer
        # the decode rows in one forward, then the prompt chunks in forwards of rows of similar length
        groups = ([decode] if decode else []) + pack_prefill(prefill, bool(self.verified.num_state_layers))
        for i, group in enumerate(groups):
            fed = self._feed_inflight([item for _, item in group], inflight) if group is decode else None
            for (row, _), logits in zip(group, self.forward([item for _, item in group], fed)):
                row.logits = logits
            if i + 1 < len(groups):
                self._settle([row.logits for row, _ in group if row.logits is not None])
            if group is not decode:
                real = sum(len(item.token_ids) for _, item in group)
                self.num_prefill_tokens += real
                self.num_padding_tokens += len(group) * max(len(item.token_ids) for _, item in group) - real
        if drafts and self.store.mirror is not None:
            self.store.mirror.reset()  # a verify step gathers; the next plain decode step rebuilds the mirror
        return rows

    def grammar_masks(self, rows: list["RowResult"], grammars: Optional[Grammars]) -> Optional[mx.array]:
        """Grammar masks: for the rows sampled on the host (`samples`, not `on_device`), bool [S, vocab] in their
        order (all True for a free row; None when every row is free or there is no `grammars`), and for each
        verifying row of a sequence with a grammar or a reasoning budget its masks at its k+1 positions
        (`RowResult.draft_mask`). When there are masks to compute, the device computes the step's logits
        (`mx.async_eval`) while the host computes them (they depend only on the tokens so far), so a mask is
        ready when the logits it applies to are."""
        sampling = _host_sampled(rows)
        verifying = [row for row in rows if row.draft is not None]
        rules = [token_rule(r.seq.grammar, r.seq.reasoning) for r in sampling]
        checked = any(r.seq.grammar is not None or (r.seq.reasoning is not None and r.seq.reasoning.may_constrain)
                      for r in verifying)
        if grammars is None or not (checked or any(rule is not None for rule in rules)):
            return None
        # the device computes the step while the host computes the masks below
        mx.async_eval(*[r.logits for r in sampling + verifying])
        masks = grammars.rule_masks(rules) if sampling else None
        if checked:
            for row in verifying:
                row.draft_mask = grammars.verify_masks(row.seq.grammar, row.seq.reasoning, row.draft.tokens)
        return masks

    def sample(self, rows: list["RowResult"], masks: Optional[mx.array] = None) -> Optional[InFlight]:
        """Sample: the rows marked `on_device` in one batch on the device, evaluated asynchronously and not read
        back (returned as the step's `InFlight`; None when there are none), then the other rows that reached
        the end of their tokens on the host under `masks` (bool [S, vocab] for them, in order, or None), which
        sets their `token` and `logprob`; and each chunk's prompt logprobs for a request that wants them. Every
        sampled sequence's PRNG key advances."""
        inflight = self._sample_on_device([row for row in rows if row.on_device])
        self._sample(_host_sampled(rows), masks)
        for row in rows:
            if row.prompt_logits is not None:
                row.prompt_logprobs = _prompt_logprobs(row)
        return inflight

    @staticmethod
    def verify(rows: list["RowResult"], rules: Verify) -> None:
        """Verify: the drafts of the rows that fed some, with the speculator's rules (`rules`, e.g.
        `Speculator.verify`) over their logits (float32 [k+1, vocab]) and draft masks (`grammar_masks`); sets
        each such row's `verified`. Advances those sequences' PRNG keys."""
        verifying = [row for row in rows if row.draft is not None]
        if not verifying:
            return
        masks = [row.draft_mask for row in verifying]
        results = rules([r.seq for r in verifying], [r.draft for r in verifying], [r.logits for r in verifying],
                         None if all(m is None for m in masks) else masks)
        for row, result in zip(verifying, results):
            row.verified = result

    def _settle(self, logits: list[mx.array]) -> None:
        """Start evaluating a forward (its `logits` and the pool arrays it wrote, `mx.async_eval`) before the
        next forward of the same step is built. In one lazy graph, a pool array that one forward reads (its
        contexts) and the next one writes has two consumers, so the write cannot reuse the buffer and copies
        the whole pool (measured with a 1 GiB pool: 340 ms a step of decode rows and a prompt, 30 ms so)."""
        mx.async_eval(*logits, *[a for group in self.groups for a in group.arrays()])

    @staticmethod
    def _feed_inflight(items: Seq[BatchItem], inflight: Optional[InFlight]
                       ) -> Optional[tuple[mx.array, list[int], list[int]]]:
        """(the previous step's tokens, rows of `items` whose input is a token in flight, their indices in it),
        or None when no row takes one."""
        rows = [b for b, it in enumerate(items) if it.inflight_request is not None]
        if not rows:
            return None
        assert inflight is not None, "a row takes a token in flight, but no step left one"
        index = {seq.request_id: i for seq, i in inflight.rows}
        return inflight.tokens, rows, [index[items[b].inflight_request] for b in rows]

    @staticmethod
    def _sample_on_device(rows: list["RowResult"]) -> Optional[InFlight]:
        """Sample `rows` on the device in one batch and start evaluating it (`mx.async_eval`); None for no
        rows."""
        if not rows:
            return None
        seqs = [row.seq for row in rows]
        last = mx.stack([row.logits for row in rows])
        tokens, keys = sample_tokens(last, [s.request.sampling for s in seqs], [()] * len(rows), [()] * len(rows),
                                     [s.rng_key for s in seqs])
        mx.async_eval(tokens, *[k for k in keys if k is not None])
        for row, key in zip(rows, keys):
            row.seq.rng_key = key
        return InFlight(tokens, [(seq, i) for i, seq in enumerate(seqs)])

    @staticmethod
    def _sample(rows: list["RowResult"], masks: Optional[mx.array]) -> None:
        if not rows:
            return
        seqs = [row.seq for row in rows]
        keys = [s.rng_key for s in seqs]
        last = mx.stack([row.logits[-1] if row.wanted is Logits.ALL else row.logits for row in rows])
        tokens, lps = sample(last, [s.request.sampling for s in seqs], [s.request.prompt_token_ids for s in seqs],
                             [s.output_token_ids for s in seqs], keys, masks)
        for row, key, token, lp in zip(rows, keys, tokens, lps):
            row.seq.rng_key, row.token, row.logprob = key, token, lp


@dataclass
class RowResult:
    """One scheduled sequence's share of a step and what it got.

    The step computed the KV of `seq.token_ids[start:start + num_fed]` (a verified draft's accepted tokens are
    counted by the engine). `wanted`/`logits`: the logits it asked for and got (float32 [vocab] for LAST,
    [T, vocab] for ALL). `samples`: the step reached the end of its tokens, so `token`/`logprob` hold the next
    token sampled. `draft`/`verified`: the draft fed after the last token and what verification accepted.
    `prompt_logprobs`: for a request that wants them, the entries of the prompt positions this chunk predicted
    (positions start + 1 .. start + num_fed, within the prompt), unless the sequence already has them (a
    recompute after preemption). `on_device`: it samples on the device and is not read back in this step (the
    overlapped loop; its token is in the step's `InFlight`, `token` stays None). `draft_mask`: bool [k+1, vocab],
    the masks its draft is verified under (a sequence with a grammar or a reasoning budget), else None."""

    seq: Sequence
    start: int
    num_fed: int
    wanted: Logits
    samples: bool = False
    logits: Optional[mx.array] = None
    token: Optional[int] = None
    logprob: Optional[TokenLogprob] = None
    draft: Optional[Draft] = None
    verified: Optional[Verified] = None
    prompt_logprobs: Optional[list[TokenLogprob]] = None
    on_device: bool = False
    draft_mask: Optional[mx.array] = None

    @property
    def prompt_logits(self) -> Optional[mx.array]:
        """[num_fed, vocab] over a chunk of a request that wants prompt logprobs, else None."""
        return self.logits if self.draft is None and self.wanted is Logits.ALL else None


def _host_sampled(rows: list[RowResult]) -> list[RowResult]:
    """The rows that sample on the host this step: they reached the end of their tokens, not `on_device`."""
    return [row for row in rows if row.samples and not row.on_device]


def _prompt_logprobs(row: RowResult) -> Optional[list[TokenLogprob]]:
    seq = row.seq
    start, end = row.start, min(row.start + row.num_fed, seq.num_prompt_tokens - 1)
    if end <= start or len(seq.prompt_logprobs) != start:
        return None
    return prompt_logprobs(row.prompt_logits[:end - start], seq.token_ids[start + 1:end + 1],
                           seq.request.sampling.prompt_logprobs)


MAX_PADDING = 1 / 8  # padding a prefill forward may compute, as a fraction of its real tokens


def pack_prefill(planned: list, exact: bool = False) -> list[list]:
    """The prompt chunks of a step, (RowResult, BatchItem) pairs, grouped into forwards: longest first, each
    forward taking the next chunks while its padding to its longest chunk stays within `MAX_PADDING` of its real
    tokens (`exact`: no padding at all, for recurrent layers, whose state would run over the padding). Chunks of
    very different lengths thus run as separate forwards (one row each, without padding) instead of one padded
    [B, T] batch; chunks of similar lengths share a forward (the weights read once)."""
    groups: list[list] = []
    for pair in sorted(planned, key=lambda p: -len(p[1].token_ids)):
        n = len(pair[1].token_ids)
        if groups:
            group = groups[-1]
            longest = len(group[0][1].token_ids)
            real = sum(len(item.token_ids) for _, item in group) + n
            if (n == longest) if exact else (len(group) + 1) * longest <= real * (1 + MAX_PADDING):
                group.append(pair)
                continue
        groups.append([pair])
    return groups


def plan_row(seq: Sequence, num_tokens: int, is_prefill: bool, draft: Optional[Draft],
             entries: tuple) -> tuple[RowResult, BatchItem]:
    """The batch item for `seq` in this step (`num_tokens` scheduled for it: a prefill chunk, or in a decode
    step the last token plus room for drafts; `entries`: its KV in every group) and its result slot."""
    start = seq.num_computed_tokens
    table = entries[0]
    mirror_row = None if is_prefill else seq.request_id
    if not is_prefill and seq.num_inflight_tokens:  # its input is its token in flight (overlapped loop)
        return (RowResult(seq, start, 1, Logits.LAST, True),
                BatchItem(table, start, (), Logits.LAST, mirror_row, entries, seq.request_id))
    if draft is not None:  # verify: the last token and the drafts, logits at every position
        return (RowResult(seq, start, len(seq.token_ids) - start, Logits.ALL, draft=draft),
                BatchItem(table, start, seq.token_ids[start:] + list(draft.tokens), Logits.ALL, mirror_row,
                          entries))
    n = num_tokens if is_prefill else len(seq.token_ids) - start  # decode: the reserved rest is for drafts
    samples = start + n == len(seq.token_ids)
    if seq.request.sampling.prompt_logprobs is not None and start < seq.num_prompt_tokens:
        wanted = Logits.ALL
    else:
        wanted = Logits.LAST if samples else Logits.NONE
    return (RowResult(seq, start, n, wanted, samples),
            BatchItem(table, start, seq.token_ids[start:start + n], wanted, mirror_row, entries))
