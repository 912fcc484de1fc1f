"""One engine step's work (`ScheduledBatch`) and its token budget: how many prompt tokens may run beside the
decode tokens (`StepBudget`).

Every step carries one token (plus its drafts) for every decoding sequence first; prompt chunks fill the rest
of `max_num_batched_tokens` (vLLM's token budget). While sequences are decoding, the prompt tokens of a step are
also bounded by time, so that the streams' inter-token latency (ITL) stays within a target:

    prefill tokens = (itl_target - t_decode) / t_token        (rounded down to whole blocks, at least one block)

where `t_decode` is the measured time of a step of decode tokens alone and `t_token` the measured time per
prompt token (step time less `t_decode`, over the step's prompt tokens), both exponential moving averages of the
engine's own steps. `itl_target` is `itl_target_ms`, or by default twice `t_decode` (a stream's ITL at most
doubles while a long prompt is prefilled). A prompt of at most `long_prefill_token_threshold` tokens still to
compute when it is admitted is never cut (vLLM's threshold of the same name): it goes whole in one step even past
the time bound, so short requests keep their TTFT, and short prompts waiting together share one step while their
tokens add up to at most the threshold (a step exceeds the time bound by at most `long_prefill_token_threshold`
prompt tokens); longer prompts advance in the time-bounded chunks to their end. With nothing decoding (and always on a prefill worker, which never decodes) prompts go in full
`prefill_chunk_size` chunks, as many as the budget holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from cluster.sequence import Sequence

_EMA = 0.3  # weight of the newest measurement in the moving averages


@dataclass
class ScheduledBatch:
    """The work of one step: (sequence, number of tokens to compute from num_computed_tokens on). `decode`: the
    decoding sequences, each with 1 + the draft tokens it may verify (blocks are reserved for all of them);
    `prefill`: prompt chunks."""

    decode: list[tuple[Sequence, int]]
    prefill: list[tuple[Sequence, int]]

    @property
    def items(self) -> list[tuple[Sequence, int]]:
        """Every (sequence, tokens) of the step, decode first."""
        return self.decode + self.prefill

    @property
    def num_decode_tokens(self) -> int:
        """Decode and draft tokens of the step."""
        return sum(n for _, n in self.decode)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens of the step."""
        return sum(n for _, n in self.prefill)


class StepBudget:
    """The per-step prompt-token allowance (see the module docstring). Times in seconds.

    `max_batched_tokens`: tokens per step at most (decode tokens, drafts and prompt tokens together);
    `chunk_size`: a prompt's tokens per step at most (`prefill_chunk_size`); `block_size`: chunk ends stay on
    block boundaries; `itl_target_s`: None = twice the measured decode step; `long_prefill_threshold`: a prompt
    with at most this many tokens left runs whole.
    """

    def __init__(self, max_batched_tokens: int, chunk_size: int, block_size: int,
                 itl_target_s: Optional[float] = None, long_prefill_threshold: int = 256):
        self.max_batched_tokens, self.chunk_size, self.block_size = max_batched_tokens, chunk_size, block_size
        self.itl_target_s, self.long_prefill_threshold = itl_target_s, long_prefill_threshold
        self.decode_step_s: Optional[float] = None  # t_decode
        self.prefill_token_s: Optional[float] = None  # t_token

    def prefill_allowance(self, num_decode_tokens: int) -> int:
        """Prompt tokens the next step may compute beside `num_decode_tokens` decode and draft tokens: the rest
        of the token budget, and while anything decodes at most what the ITL target leaves (whole blocks, at
        least one block; before any measurement, the rest of the budget)."""
        room = max(0, self.max_batched_tokens - num_decode_tokens)
        if num_decode_tokens == 0 or self.decode_step_s is None or self.prefill_token_s is None:
            return room
        target = self.itl_target_s if self.itl_target_s is not None else 2 * self.decode_step_s
        by_time = int(max(0.0, target - self.decode_step_s) / self.prefill_token_s)
        by_time = max(self.block_size, by_time // self.block_size * self.block_size)
        return min(room, by_time)

    def chunk(self, remaining: int, allowance: int, whole_room: int) -> int:
        """Tokens of a prompt with `remaining` tokens left to run in this step, given `allowance` prompt tokens
        left in the step and `whole_room` tokens that short prompts may still take whole past the allowance (the
        step's new prompts start with `whole_room(room)` and subtract what each takes; 0 for a prompt already
        partly computed). A prompt that fits the allowance runs whole; a short one (at most
        `long_prefill_threshold` tokens) runs whole when it fits `whole_room`, even past the time bound; a
        longer one gets the allowance in whole blocks (0: not this step; in whole chunks when `chunk_size` is
        under a block). At most `chunk_size`."""
        limit = max(0, min(allowance, self.chunk_size))
        if remaining <= limit:
            return remaining
        if remaining <= min(self.long_prefill_threshold, self.chunk_size, whole_room):
            return remaining
        unit = min(self.block_size, self.chunk_size)  # a chunk size below a block cuts in its own steps
        return limit // unit * unit

    def whole_room(self, room: int) -> int:
        """Prompt tokens that the step's new short prompts may take together past the time bound, with `room`
        tokens left in the step's token budget: `long_prefill_threshold`, within the budget."""
        return max(0, min(self.long_prefill_threshold, room))

    def observe(self, num_decode_tokens: int, num_prefill_tokens: int, seconds: float) -> None:
        """Record one step's wall time: a decode-only step updates t_decode; a step with prompt tokens updates
        t_token (its time less t_decode when it also decoded, over its prompt tokens)."""
        if num_prefill_tokens == 0:
            if num_decode_tokens:
                self.decode_step_s = _ema(self.decode_step_s, seconds)
            return
        decode = (self.decode_step_s or 0.0) if num_decode_tokens else 0.0
        per_token = max(seconds - decode, 0.0) / num_prefill_tokens
        self.prefill_token_s = _ema(self.prefill_token_s, max(per_token, 1e-7))


def _ema(old: Optional[float], new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new
