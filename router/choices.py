"""What the choices of one request have delivered so far, whatever the API: `Accumulator` keeps each choice's
text, token count and logprobs, so a streamed answer and the non-streamed one are built from the same state. The
counts obey one rule:

    usage.completion_tokens = sum over choices of tokens delivered = sum of logprob entries (when asked)

(the engine's cumulative `num_output_tokens` must agree; a mismatch is logged as an engine bug.) Logprobs: -inf
(and NaN) become -9999.0 (`clamp_logprob`), as OpenAI reports them, since JSON has no infinities.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Optional

from cluster.request import FinishReason, RequestOutput, TokenLogprob
from router.errors import APIError, engine_unavailable
from router.openai.output import CompletionTokensDetails, PromptTokensDetails, Usage
from router.params import PreparedRequest

logger = logging.getLogger(__name__)


def clamp_logprob(value: float) -> float:
    """A JSON-safe logprob: finite values >= -9999.0; -inf and NaN become -9999.0."""
    return max(value, -9999.0) if math.isfinite(value) else -9999.0


ABORT_RETRY_AFTER_S = 5.0  # seconds a client should wait after an overload abort


def finish_error(out: RequestOutput) -> Optional[APIError]:
    """The error to report for a choice the engine ended with `error` or `abort`, else None."""
    if out.finish_reason == FinishReason.ERROR:
        return APIError(500, f"the engine failed this request: {out.error or 'unknown error'}",
                        code="engine_error")
    if out.finish_reason == FinishReason.ABORT:  # overload, or the cluster's fault (a worker or transfer lost)
        message = f"the engine aborted this request: {out.error}" if out.error else "the engine aborted this request"
        return engine_unavailable(message, ABORT_RETRY_AFTER_S)
    return None


@dataclass(frozen=True)
class Delta:
    """What one engine delta of a choice carried: its reasoning and answer text, its tokens' logprobs and how many
    of its tokens were reasoning (they lead the delta). A whole answer replays these as its stream sent them."""

    reasoning: str
    text: str
    logprobs: tuple[TokenLogprob, ...]
    num_reasoning_tokens: int


@dataclass
class ChoiceState:
    """What one choice has delivered so far."""

    index: int
    texts: list[str] = field(default_factory=list)
    reasoning_texts: list[str] = field(default_factory=list)  # a thinking model's reasoning, apart from the answer
    deltas: list[Delta] = field(default_factory=list)  # what each delta carried, in order (replayed for whole answers)
    num_reasoning_tokens: int = 0  # of num_tokens, those inside the reasoning (the engine's count)
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: Optional[tuple[TokenLogprob, ...]] = None
    finish_reason: Optional[str] = None
    stop_string: Optional[str] = None  # the stop string that ended it (finish_reason "stop")
    num_cached_tokens: int = 0
    started: bool = False  # streaming: the first chunk (role / echo) was sent
    text_offset: int = 0  # legacy logprobs: characters emitted so far


class Accumulator:
    """Per-choice state of one request, fed with every delta in order."""

    def __init__(self, prepared: PreparedRequest):
        self.prepared = prepared
        self.choices = [ChoiceState(i) for i in range(prepared.n)]

    def add(self, index: int, out: RequestOutput) -> ChoiceState:
        """Record one delta of choice `index`."""
        state = self.choices[index]
        if out.reasoning_text:
            state.reasoning_texts.append(out.reasoning_text)
        if out.text:
            state.texts.append(out.text)
        new_reasoning = max(0, out.num_reasoning_tokens - state.num_reasoning_tokens)
        if out.text or out.reasoning_text or out.logprobs:
            state.deltas.append(Delta(out.reasoning_text, out.text, tuple(out.logprobs or ()), new_reasoning))
        state.num_reasoning_tokens = max(state.num_reasoning_tokens, out.num_reasoning_tokens)
        state.num_tokens += len(out.token_ids)
        if out.logprobs:
            state.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None and state.prompt_logprobs is None:
            state.prompt_logprobs = out.prompt_logprobs
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        if out.finish_reason is not None:
            state.finish_reason = FinishReason(out.finish_reason).value
            state.stop_string = out.stop_string
            if out.num_output_tokens and out.num_output_tokens != state.num_tokens:
                logger.warning("request %s: the engine counts %d output tokens but delivered %d; usage "
                               "reports the delivered count", out.request_id, out.num_output_tokens,
                               state.num_tokens)
        return state

    def usage(self) -> Usage:
        """Usage of the whole request (prompt counted once; cached tokens of choice 0; reasoning tokens summed)."""
        prompt = len(self.prepared.prompt_token_ids)
        completion = sum(c.num_tokens for c in self.choices)
        cached = self.choices[0].num_cached_tokens if self.choices else 0
        reasoning = sum(c.num_reasoning_tokens for c in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                     completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning))
