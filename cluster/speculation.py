"""The engine's side of speculative decoding: the `Speculator` a role injects, and the values that cross it.

Speculation is "schedule k+1" (nano-vllm's counters): the scheduler reserves blocks for the draft length a
decoding sequence wants (`Speculator.lookahead`), the step asks for the drafts (`propose`), the runner feeds
them after the last token with logits at every position and has them verified (`verify`: array work, the
rules are the speculator's), and the scheduler appends the accepted tokens one by one through the same
`_append_token` as plain decoding (so EOS, stop strings, max_tokens and logprobs end a sequence exactly where
plain decoding would; the rest of the accepted block is dropped). Rejected positions are rolled back by the
counters alone: `num_computed_tokens` ends at the accepted length (their KV slots are overwritten by later
tokens, never hashed or cached before that) and so does `num_draft_computed` (a draft model's KV). Blocks
allocated for rejected positions stay with the sequence and are freed with it.

The decode role implements the speculator (decode_node/speculative.py: the rules, the per-sequence state and
the drafters); an engine without one (`NoSpeculator`: a prefill worker's) never drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import mlx.core as mx

from cluster.request import GenerateRequest, TokenLogprob
from cluster.sequence import Sequence



class SequenceSpeculation(Protocol):
    """One sequence's speculative-decoding state, as the speculator keeps it (decode_node/speculative.py's
    `SpeculationState`): its method and its adaptive draft length."""

    method: str

    def num_draft_tokens(self, cost_per_token: float) -> int: ...

    def update(self, proposed: int, accepted: int) -> None: ...


class DraftState(Protocol):
    """A drafter's own per-sequence state (e.g. decode_node/drafters.py's prompt-lookup n-gram index)."""

    def propose(self, tokens: list[int], k: int) -> list[int]: ...

@dataclass(frozen=True)
class Draft:
    """The draft tokens proposed for one sequence in one step.

    `probs`: float32 [len(tokens), vocab], row i the distribution q_i token i was drawn from; None for a
    deterministic drafter (a point mass at each token, e.g. prompt lookup, or greedy drafting)."""

    tokens: tuple[int, ...] = ()
    probs: Optional[mx.array] = None


@dataclass(frozen=True)
class Verified:
    """The outcome of verifying one sequence's draft: the tokens to emit (the accepted drafts, then the
    corrected or bonus token), their logprobs (None entries when logprobs are off), and how many drafts
    were accepted (len(tokens) - 1)."""

    tokens: tuple[int, ...]
    logprobs: tuple[Optional[TokenLogprob], ...]
    num_accepted: int



class Speculator(Protocol):
    """What the engine asks about speculative decoding; every call comes from the engine's thread.

    `methods`: the speculative methods it can run (`SamplingParams.speculative_method` values).
    `state_for(request)`: the per-sequence state of a new sequence (kept in `Sequence.speculation`, opaque to the
    engine), None when the request does not speculate. `lookahead(seq)`: draft tokens to reserve blocks for in
    this decode step (asked once per step). `propose(items)`: the drafts of a decode step's (sequence, tokens
    scheduled) items by request id; a sequence gets at most tokens - 1 draft tokens. `verify(seqs, drafts,
    logits, masks)`: one `Verified` per sequence from the target's logits (float32 [len(draft) + 1, vocab] each)
    and, for a sequence with a grammar, its masks at those positions (bool, same shape; None: free output);
    every emitted token follows the mask of its position.
    `record(seq, draft, verified)`: a verification's outcome, for the draft length and the counters.
    `release(seq)`: a sequence with state leaves the engine (before its blocks are freed). `reset()`: forget
    per-step state after a failed step. `num_draft_tokens` / `num_accepted_tokens`: draft tokens proposed and
    verified, and of those accepted, all sequences.
    """

    methods: tuple[str, ...]
    num_draft_tokens: int
    num_accepted_tokens: int

    def state_for(self, request: GenerateRequest) -> Optional[object]: ...

    def lookahead(self, seq: Sequence) -> int: ...

    def propose(self, items: list[tuple[Sequence, int]]) -> dict[str, Draft]: ...

    def verify(self, seqs: list[Sequence], drafts: list[Draft], logits: list[mx.array],
               masks: Optional[list[Optional[mx.array]]] = None) -> list[Verified]: ...

    def record(self, seq: Sequence, draft: Draft, verified: Verified) -> None: ...

    def release(self, seq: Sequence) -> None: ...

    def reset(self) -> None: ...


class NoSpeculator:
    """An engine that never drafts (no method, no state, nothing reserved)."""

    methods: tuple[str, ...] = ()
    num_draft_tokens = 0
    num_accepted_tokens = 0

    def state_for(self, request: GenerateRequest) -> None:
        return None

    def lookahead(self, seq: Sequence) -> int:
        return 0

    def propose(self, items: list[tuple[Sequence, int]]) -> dict[str, Draft]:
        return {}

    def verify(self, seqs: list[Sequence], drafts: list[Draft], logits: list[mx.array],
               masks: Optional[list[Optional[mx.array]]] = None) -> list[Verified]:
        raise AssertionError("an engine without a speculator has no drafts to verify")

    def record(self, seq: Sequence, draft: Draft, verified: Verified) -> None:
        return None

    def release(self, seq: Sequence) -> None:
        return None

    def reset(self) -> None:
        return None
