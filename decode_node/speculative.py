"""The decode role's speculative decoding: the rules, the per-sequence state and the speculator the engine is given.

Counters, not phases (nano-vllm): a decoding sequence with a draft d1..dk schedules k+1 tokens. Its last
token and the drafts are fed at positions [n, n+k] (n = num_computed_tokens) in the ordinary batched
forward pass, with logits at every one of those positions: row i is the target's next-token distribution
after d1..di. Each sequence of the batch then accepts its own number of drafts:

    greedy    accept d_{i+1} while it equals argmax(row i); the first mismatch emits argmax(row i) instead (the
              corrected token); when all k are accepted, argmax(row k) is a bonus token. The output is token
              for token what plain greedy decoding gives.
    sampled   accept d_{i+1} with probability min(1, p_i(d)/q_i(d)), p_i the target's and q_i the drafter's
              distribution (a point mass for deterministic drafters); on the first rejection emit a token drawn
              from norm(max(p_i - q_i, 0)); when all k are accepted draw the bonus from p_k. The emitted tokens
              are distributed exactly as the target's own samples (Leviathan et al. 2023, "Fast Inference from
              Transformers via Speculative Decoding", Algorithm 1 and Theorem 1; Chen et al. 2023,
              "Accelerating Large Language Model Decoding with Speculative Sampling", Algorithm 2).

So a step emits 1..k+1 tokens per sequence. p_i is what `cluster.sampling.sample` would draw from at that
position: logit_bias, penalties (over the output plus the drafts before it), the grammar's mask after the
drafts before it (constrained decoding, cluster/grammar.py), temperature, top-k/p, min-p.

The number of drafts adapts per sequence (`SpeculationState`): with per-token acceptance rate a, a step with k drafts
emits E(k) = (1 - a^(k+1)) / (1 - a) tokens on average (Leviathan et al. 2023, eq. 1) and costs about
1 + c*k plain steps (c = the drafter's `cost_per_token`: drafting plus verifying one more token), so each
sequence uses the k in [0, its maximum] that maximizes E(k) / (1 + c*k) for its recent acceptance rate
(an exponentially decayed estimate). k = 0 turns speculation off for that sequence; it is probed again with
one draft token every `PROBE_EVERY` steps, so a sequence whose text turns repetitive picks it up again
(unless c >= 1: then no acceptance rate makes drafting pay, e.g. a draft model as slow as the target).

`DecodeSpeculator` implements `cluster.speculation.Speculator` over a set of drafters (decode_node/drafters.py)
and is what a decode worker (and so single-node mode) injects into its engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence as Seq

import mlx.core as mx

from cluster.config import EngineConfig
from cluster.request import GenerateRequest, TokenLogprob
from cluster.sampling import adjusted, apply_mask, probabilities, token_logprobs
from cluster.sequence import Sequence
from cluster.speculation import Draft, Verified

PROBE_EVERY = 16  # steps a sequence spends at k = 0 before one probe with k = 1
DECAY = 0.8  # per-step decay of the acceptance counts (an effective memory of ~5 steps)


class Drafter(Protocol):
    """Proposes draft tokens for a batch of decoding sequences (decode_node/drafters.py implements it).

    Invariants: `propose(seqs, num_tokens)` returns one `Draft` per sequence with at most `num_tokens[i]`
    tokens (fewer, or none, is always allowed) and never changes a sequence's tokens or target KV; a drafter
    that keeps KV of its own writes it only at positions >= `seq.num_draft_computed`, into the blocks of
    `seq.block_table`, and raises `num_draft_computed` accordingly (the engine lowers it back to the accepted
    length after verification). `cost_per_token` is the cost of one more draft token (drafting and verifying
    it) relative to a plain decode step. `release(seq)` is called when a speculating sequence finishes, before
    its blocks are freed (its valid KV is `min(num_draft_computed, num_computed_tokens)` positions then);
    `reset()` forgets cached per-step state after a failed step.
    """

    method: str
    cost_per_token: float

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]: ...

    def release(self, seq: Sequence) -> None: ...

    def reset(self) -> None: ...


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one step emits on average with k drafts, each accepted with probability `acceptance`:
    1 + a + ... + a^k (Leviathan et al. 2023, eq. 1, with the bonus token)."""
    return sum(acceptance ** i for i in range(k + 1))


def best_draft_length(acceptance: float, max_tokens: int, cost_per_token: float) -> int:
    """The k in [0, max_tokens] that maximizes tokens per unit of cost, E(k) / (1 + cost_per_token * k)
    (the smallest on ties, so a useless drafter ends at 0)."""
    best, best_value = 0, 1.0
    for k in range(1, max_tokens + 1):
        value = expected_tokens(acceptance, k) / (1.0 + cost_per_token * k)
        if value > best_value + 1e-9:
            best, best_value = k, value
    return best


@dataclass
class SpeculationState:
    """Speculative decoding state of one sequence: its method, its maximum draft length and its recent
    acceptance. `accepted` / `trials` are decayed counts of accepted drafts and of drafts whose fate was
    decided (accepted ones plus the first rejected one); their ratio estimates the per-token acceptance
    rate (prior 2/3). `proposed_total` / `accepted_total` count this sequence's drafts."""

    method: str
    max_draft_tokens: int
    accepted: float = 2.0
    trials: float = 3.0
    idle_steps: int = 0
    proposed_total: int = 0
    accepted_total: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.trials

    def num_draft_tokens(self, cost_per_token: float) -> int:
        """Draft tokens for the next step (call once per step): the best length for the recent acceptance,
        or a one-token probe every `PROBE_EVERY` steps spent at 0 (never when even drafts that are always
        accepted would not pay: cost_per_token >= 1)."""
        k = best_draft_length(self.acceptance, self.max_draft_tokens, cost_per_token)
        if k == 0 and best_draft_length(1.0, self.max_draft_tokens, cost_per_token) > 0:
            self.idle_steps += 1
            if self.idle_steps >= PROBE_EVERY:
                self.idle_steps = 0
                return 1
        return k

    def update(self, proposed: int, accepted: int) -> None:
        """Record one verification: `accepted` of `proposed` drafts."""
        if proposed == 0:
            return
        self.proposed_total += proposed
        self.accepted_total += accepted
        self.accepted = DECAY * self.accepted + accepted
        self.trials = DECAY * self.trials + accepted + (1 if accepted < proposed else 0)


def accept_greedy(draft: Seq[int], target: Seq[int]) -> int:
    """How many leading drafts equal the target's tokens (target[i] = the target's choice after draft[:i])."""
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return n


def accept_sampled(p: mx.array, q: Optional[mx.array], draft: Seq[int], key: mx.array
                   ) -> tuple[int, int, mx.array]:
    """The rejection-sampling rule (see the module docstring) for one sequence.

    p: float32 [k+1, vocab], the target's distributions; q: float32 [k, vocab], the drafter's (None = point
    masses at `draft`); draft: the k draft tokens; key: the sequence's PRNG key.
    Returns (number of drafts accepted, the token that follows them, the successor key)."""
    k = len(draft)
    key, accept_key, draw_key = mx.random.split(key, 3)
    accepted = k
    if k:
        rows, tokens = mx.arange(k), mx.array(list(draft), dtype=mx.int32)
        p_d = p[rows, tokens]
        q_d = q[rows, tokens] if q is not None else mx.ones((k,), dtype=mx.float32)
        u = mx.random.uniform(shape=(k,), key=accept_key)
        ok = (u * q_d < p_d).tolist()  # u < p/q, without dividing by q
        accepted = ok.index(False) if False in ok else k
    if accepted < k:
        if q is not None:
            residual = mx.maximum(p[accepted] - q[accepted], 0.0)
        else:  # max(p - onehot(d), 0) is p without d
            residual = p[accepted] * (mx.arange(p.shape[-1]) != draft[accepted])
        total = residual.sum()
        dist = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p[accepted])
    else:
        dist = p[k]
    token = mx.random.categorical(mx.log(dist), key=draw_key)
    return accepted, int(token.item()), key


def _row(masks: Optional[mx.array], i: int) -> Optional[mx.array]:
    return None if masks is None else masks[i]


def _adjusts(seq: Sequence) -> bool:
    sp = seq.request.sampling
    return bool(sp.logit_bias) or sp.needs_penalties


def verify(seqs: list[Sequence], drafts: list[Draft], logits: list[mx.array],
           masks: Optional[list[Optional[mx.array]]] = None) -> list[Verified]:
    """Verify each sequence's draft against the target's logits (float32 [len(draft) + 1, vocab] each).

    `masks`: per sequence, its grammar's masks at those positions (bool [len(draft) + 1, vocab],
    `cluster.grammar.Grammars.draft_masks`) or None (free). A constrained row's target is its masked
    distribution (greedy: the masked argmax), so a draft its grammar refuses is never accepted and the token
    emitted there follows the grammar. Greedy rows without logit adjustments are decided with one argmax over
    all of them; sampled rows use `accept_sampled` and advance the sequence's `rng_key`."""
    masks = masks if masks is not None else [None] * len(seqs)
    targets: dict[int, list[int]] = {}
    plain = [b for b, s in enumerate(seqs) if s.request.sampling.greedy and not _adjusts(s)]
    if plain:
        flat = mx.argmax(mx.concatenate([apply_mask(logits[b], masks[b]) for b in plain]), axis=-1).tolist()
        for b in plain:
            n = len(drafts[b].tokens) + 1
            targets[b], flat = flat[:n], flat[n:]
    out = []
    for b, (seq, draft) in enumerate(zip(seqs, drafts)):
        sp, prompt, history = seq.request.sampling, seq.request.prompt_token_ids, seq.output_token_ids
        d = list(draft.tokens)
        if sp.greedy:
            target = targets.get(b)
            if target is None:
                rows = [adjusted(logits[b][i], sp, prompt, history + d[:i], _row(masks[b], i))
                        for i in range(len(d) + 1)]
                target = mx.argmax(mx.stack(rows), axis=-1).tolist()
            n = accept_greedy(d, target)
            tokens = tuple(target[:n + 1])
        else:
            p = mx.stack([probabilities(logits[b][i], sp, prompt, history + d[:i], _row(masks[b], i))
                          for i in range(len(d) + 1)])
            n, token, seq.rng_key = accept_sampled(p, draft.probs, d, seq.rng_key)
            tokens = (*d[:n], token)
        logprobs: tuple[Optional[TokenLogprob], ...] = (None,) * len(tokens)
        if sp.logprobs is not None:
            logprobs = tuple(token_logprobs(logits[b][:len(tokens)], tokens, [sp.logprobs] * len(tokens)))
        out.append(Verified(tokens, logprobs, n))
    return out


class DecodeSpeculator:
    """`cluster.speculation.Speculator` over `drafters` (method -> drafter) for an engine with `config` (its
    default method and draft length). See the module docstring for the rules."""

    def __init__(self, drafters: dict[str, Drafter], config: EngineConfig):
        self.drafters, self.config = dict(drafters), config
        self.methods = tuple(sorted(self.drafters))
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def state_for(self, request: GenerateRequest) -> Optional[SpeculationState]:
        """The request's speculation (its own choice, else the engine's default); None when it is off."""
        sp = request.sampling
        method = sp.speculative_method or self.config.speculative_method
        k = self.config.num_draft_tokens if sp.num_draft_tokens is None else sp.num_draft_tokens
        if method is None or k == 0 or method not in self.drafters:
            return None
        return SpeculationState(method, k)

    def lookahead(self, seq: Sequence) -> int:
        drafter = self.drafters.get(seq.speculation.method) if seq.speculation is not None else None
        if drafter is None:
            return 0
        left = seq.max_tokens - seq.num_output_tokens - 1  # the corrected or bonus token comes on top
        return max(0, min(seq.speculation.num_draft_tokens(drafter.cost_per_token), left))

    def propose(self, items: list[tuple[Sequence, int]]) -> dict[str, Draft]:
        """Each drafter is called once, for its sequences. A deterministic draft (no `probs`) of a sequence
        with a grammar is cut before its first token the grammar refuses (verification would reject it);
        a sampled one is kept whole, since cutting it where its sampled tokens fail would bias the rejection
        rule (the draft model draws from its grammar-masked q instead, so its drafts never fail)."""
        by_method: dict[str, list[tuple[Sequence, int]]] = {}
        for seq, n in items:
            if n > 1 and seq.speculation is not None:
                by_method.setdefault(seq.speculation.method, []).append((seq, n))
        drafts = {}
        for method, group in by_method.items():
            proposed = self.drafters[method].propose([seq for seq, _ in group], [n - 1 for _, n in group])
            for (seq, n), draft in zip(group, proposed):
                assert len(draft.tokens) < n, "a drafter proposed more tokens than asked"
                if seq.grammar is not None and draft.probs is None:
                    draft = Draft(draft.tokens[:seq.grammar.valid_prefix(draft.tokens)])
                if draft.tokens:
                    drafts[seq.request_id] = draft
        return drafts

    def verify(self, seqs: list[Sequence], drafts: list[Draft], logits: list[mx.array],
               masks: Optional[list[Optional[mx.array]]] = None) -> list[Verified]:
        return verify(seqs, drafts, logits, masks)

    def record(self, seq: Sequence, draft: Draft, verified: Verified) -> None:
        self.num_draft_tokens += len(draft.tokens)
        self.num_accepted_tokens += verified.num_accepted
        seq.speculation.update(len(draft.tokens), verified.num_accepted)

    def release(self, seq: Sequence) -> None:
        if seq.speculation is not None and seq.speculation.method in self.drafters:
            self.drafters[seq.speculation.method].release(seq)

    def reset(self) -> None:
        for drafter in self.drafters.values():
            drafter.reset()
