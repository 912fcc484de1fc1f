"""Worker-local state of one request: token ids, counters, blocks and output text.

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
from typing import Any

from cluster.request import GenerateRequest, TokenLogprob


class SequenceStatus(enum.Enum):
    """WAITING: queued (new or preempted); RUNNING: holds blocks; FINISHED: blocks freed."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request on one worker.

    token_ids: prompt then output tokens. num_computed_tokens: tokens whose KV is in the blocks.
    block_table: block ids holding positions [i * block_size, (i + 1) * block_size).
    block_hashes: chained hashes of the full blocks of token_ids computed so far.
    max_tokens: output tokens allowed after clamping to the context.
    speculation: speculative decoding state (`Speculator.state_for`, decode_node/speculative.py's
        SpeculationState), None when it is off.
    num_draft_computed: tokens whose draft-model KV is in the draft pool (same block_table), at most
    num_computed_tokens after every step (the rejected drafts' KV is rolled back by lowering it).
    draft_state: the drafter's own per-sequence state (e.g. the prompt-lookup n-gram index).
    recurrent_state: its recurrent layers' state after its num_computed_tokens tokens
        (cluster/kv/recurrent_state.py; None before any, and always for models without recurrent layers).
    window_table: for a model with sliding-window layers beside full ones, the blocks of its window layers
        (`KVManager`'s window pool), index for index with block_table; 0 where a block fell out of every
        future query's window and was released. Empty otherwise.
    pending_snapshot: (block hash, state) at the latest block boundary reached while decoding, saved as a
        state snapshot when the sequence finishes (cluster/kv/snapshots.py); None otherwise.
    chunk_snapshots: (block hash, position) of the state snapshots it saved at prefill chunk ends (not its
        prompt's last whole block), thinned when it finishes (`StateSnapshots.finish`).
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
    """

    request: GenerateRequest
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    rng_key: Any = None
    output_text: Any = None  # cluster.detokenizer.OutputText
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    speculation: Any = None
    num_draft_computed: int = 0
    draft_state: Any = None
    recurrent_state: Any = None
    window_table: list[int] = field(default_factory=list)
    pending_snapshot: Any = None
    chunk_snapshots: list[tuple[int, int]] = field(default_factory=list)
    grammar: Any = None
    reasoning: Any = None
    remote_decode: bool = False
    num_inflight_tokens: int = 0
    arrival: float = field(default_factory=time.monotonic)

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
