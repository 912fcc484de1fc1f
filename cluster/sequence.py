"""Worker-local state of one request: token ids, counters, sampling state and output text.

Counters, not phases (nano-vllm): the engine computes KV for `token_ids[num_computed_tokens:]`, chunk by
chunk; the step that feeds the last token yields the logits of the next one, which is sampled and
appended. A sequence is "prefilling" while more than one token remains uncomputed. After a preemption
`num_computed_tokens` returns to 0 and the same counters recompute prompt and output.

In the engine's overlapped loop a token sampled on the device and not read back yet is counted, not stored
(vLLM v1's output placeholders): `num_inflight_tokens` says how many follow `token_ids`, and every counter
(`num_tokens`, `num_output_tokens`, `num_uncomputed`) includes them, so scheduling sees the sequence as if
the token were there; `token_ids` holds real token ids only.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from cluster.request import GenerateRequest, TokenLogprob

if TYPE_CHECKING:  # the types of the sequence's state; their modules import this one
    import mlx.core as mx

    from cluster.detokenizer import OutputText
    from cluster.grammar import GrammarMatcher
    from cluster.reasoning_state import ReasoningState
    from cluster.speculation import DraftState, SequenceSpeculation


class SequenceStatus(enum.Enum):
    """WAITING: queued (new or preempted); RUNNING: holds blocks; FINISHED: blocks freed."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request on one worker.

    token_ids: prompt then output tokens. num_computed_tokens: tokens whose KV is in the blocks.
    block_hashes: chained hashes of the full blocks of token_ids computed so far (and registered in the prefix
        cache).
    token_block_hashes: chained hashes of the leading full blocks of token_ids, each computed once for the
        sequence (`PrefixMatcher.hashes`): the prompt's, carried by the request or hashed at its first lookup,
        then each output block's as it fills; `block_hashes` is a prefix of them. Kept across preemption.
    Its KV (block tables, recurrent state) is the `KVManager`'s, by request id (cluster/kv/manager.py).
    max_tokens: output tokens allowed after clamping to the context.
    speculation: speculative decoding state (`Speculator.state_for`, decode_node/speculative.py's
        SpeculationState), None when it is off.
    num_draft_computed: tokens whose draft-model KV is in the draft pool (same block table), at most
    num_computed_tokens after every step (the rejected drafts' KV is rolled back by lowering it).
    draft_state: the drafter's own per-sequence state (e.g. the prompt-lookup n-gram index).
    grammar: for a request with `SamplingParams.grammar`, its matcher (cluster/grammar.py's GrammarMatcher),
        which has consumed every output token; kept across preemption (the output tokens are kept too). None
        for free output.
    reasoning: for a request with `SamplingParams.reasoning`, its reasoning state (cluster/reasoning.py's
        ReasoningState: inside or outside, the reasoning count, forced end-marker tokens), fed every output token
        by its `output_text`; kept across preemption like the grammar. None otherwise.
    remote_decode: the sequence leaves this engine after its first token (a prefill worker's: another worker
    decodes the rest; `cluster.connector`).
    num_inflight_tokens: tokens sampled on the device for it and not read back yet, which follow `token_ids`
        (0 or 1; the engine's overlapped loop, `EngineCore._inflight`).
    prefill_plan: when (the engine's clock, seconds) and at which position its prompt's chunks beside decoding
        streams began (`StepBudget.plan`, `StepBudget.stretch`); None until its first such chunk, and again
        after preemption.
    """

    request: GenerateRequest
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list)
    token_block_hashes: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    rng_key: Optional[mx.array] = None
    output_text: Optional[OutputText] = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    speculation: Optional[SequenceSpeculation] = None
    num_draft_computed: int = 0
    draft_state: Optional[DraftState] = None
    grammar: Optional[GrammarMatcher] = None
    reasoning: Optional[ReasoningState] = None
    remote_decode: bool = False
    num_inflight_tokens: int = 0
    arrival: float = field(default_factory=time.monotonic)
    prefill_plan: Optional[tuple[float, int]] = None  # StepBudget.plan: (time, position) its chunks began

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, those in flight included (`len(token_ids) + num_inflight_tokens`)."""
        return len(self.token_ids) + self.num_inflight_tokens

    @property
    def num_output_tokens(self) -> int:
        """Output tokens, those in flight included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens read back so far (those in flight are not known yet)."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to feed before the next token can be sampled (>= 1 while running), a token in flight
        included."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while more than the last token remains to be computed."""
        return self.num_uncomputed > 1

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
