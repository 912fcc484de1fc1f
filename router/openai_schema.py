"""Pydantic v2 models of the OpenAI API subset the router serves.

Requests ignore unknown fields (as OpenAI clients expect of compatible servers) and normalise the
shapes they accept, so the handlers see one form only:

    CompletionRequest.prompt    "text" | [1, 2, 3] | ["text"] | [[1, 2, 3]]  ->  "text" or [1, 2, 3]
    ChatMessage.content         "text" | [{"type": "text", "text": "..."}]   ->  "text" (parts joined by "\\n")
    max_tokens                  any integer >= 0, also a JSON number such as 1e18 when it is integral;
                                huge values stay Python ints and are clamped later to the context left.

Value ranges that `cluster.request.SamplingParams` checks (temperature, top_p, penalties, ...) are
checked there, once; the models here only check types and what SamplingParams cannot see (n, seed,
message roles, prompt shapes).
"""

from __future__ import annotations

import math
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from cluster.request import MAX_DRAFT_TOKENS

MAX_N = 128  # most choices per request (OpenAI's own limit)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
ROLES = ("system", "developer", "user", "assistant", "tool")
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the error code (and pydantic error type) of a prompt too long


def context_length_message(num_tokens: str, max_model_len: int) -> str:
    """What a prompt of `num_tokens` ("123", "at least 9000") tokens that leaves no room is told."""
    return (f"the prompt has {num_tokens} tokens but this model's context is {max_model_len} tokens, which "
            f"leaves no room for the completion: shorten the prompt to at most {max_model_len - 1} tokens")


def _count(value: Any) -> Optional[int]:
    """An integer >= 0 from an int or an integral finite float; None stays None.
    (Pydantic prefixes the field name to the message.)"""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError("must be an integer >= 0, not a boolean")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"must be an integer >= 0, got {value!r}")
        value = int(value)
    if not isinstance(value, int):
        raise ValueError(f"must be an integer >= 0, got a {type(value).__name__}")
    if value < 0:
        raise ValueError(f"must be an integer >= 0, got {value}")
    return value


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    """`stream_options`: `include_usage` adds a final chunk with `choices: []` and `usage`."""

    include_usage: bool = False


class SpeculativeOptions(BaseModel):
    """`speculative`: speculative decoding for this request (mlx-pd's extension; off unless the server's
    default or this field turns it on). `num_draft_tokens` is the most draft tokens per step (None = the
    server's default; 0 turns speculation off). Unknown keys are errors, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["prompt_lookup", "draft_model"]
    num_draft_tokens: Optional[int] = Field(None, ge=0, le=MAX_DRAFT_TOKENS)


class _SamplingFields(_Request):
    """Fields shared by both endpoints. None means "the default"."""

    model: Optional[str] = None
    n: Optional[int] = Field(None, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = Field(None, ge=INT64_MIN, le=INT64_MAX)
    logit_bias: Optional[dict[str, float]] = None
    ignore_eos: bool = False
    user: Optional[str] = None
    cache_salt: Optional[str] = None
    max_tokens: Optional[int] = None
    speculative: Optional[SpeculativeOptions] = None

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _max_tokens(cls, value: Any) -> Optional[int]:
        return _count(value)

    @property
    def include_usage(self) -> bool:
        """True when a streamed answer must end with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` is normalised to a string or a list of token ids.

    Validated with `context={"max_model_len": N}`, a token-id prompt of N or more ids is refused by its
    length before its ids are looked at (error type CONTEXT_LENGTH_EXCEEDED)."""

    prompt: Union[str, list[int]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any, info: ValidationInfo) -> Union[str, list[int]]:
        if isinstance(value, list) and len(value) >= 1 and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request "
                                 "(use n for several completions of it)")
            value = value[0]
        if isinstance(value, list):
            limit = (info.context or {}).get("max_model_len")
            if limit is not None and len(value) >= limit:
                raise PydanticCustomError(CONTEXT_LENGTH_EXCEEDED, context_length_message(str(len(value)), limit))
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
                raise ValueError("must be a string or a list of token ids (integers >= 0)")
        elif not isinstance(value, str):
            raise ValueError("must be a string or a list of token ids (integers >= 0)")
        if len(value) == 0:
            raise ValueError("is empty: send at least one character or token")
        return value


class ContentPart(_Request):
    """One part of a message's content; only text parts are supported."""

    type: str
    text: Optional[str] = None


class ChatMessage(_Request):
    """One chat message; `content` is normalised to a string (None for an assistant turn without text)."""

    role: str
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        if value not in ROLES:
            raise ValueError(f"role {value!r} is not one of {', '.join(ROLES)}")
        return value

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> Optional[str]:
        if value is None or isinstance(value, str):
            return value
        texts = []
        for part in value:
            if part.type not in ("text", "input_text") or part.text is None:
                raise ValueError(f"content part of type {part.type!r} is not supported: "
                                 "only {\"type\": \"text\", \"text\": ...} parts are")
            texts.append(part.text)
        return "\n".join(texts)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. Without max_tokens/max_completion_tokens the context left is the limit.

    Validated with `context={"max_model_len": N}`, more than N messages are refused by their number before
    any is validated or rendered: a chat template renders every message to at least one token (its role
    marker; at most a first system message may be merged into the next), so they cannot fit."""

    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)

    @field_validator("messages", mode="before")
    @classmethod
    def _message_count(cls, value: Any, info: ValidationInfo) -> Any:
        limit = (info.context or {}).get("max_model_len")
        if limit is not None and isinstance(value, list) and len(value) > limit:
            raise PydanticCustomError(CONTEXT_LENGTH_EXCEEDED, context_length_message(
                f"{len(value)} messages, so at least {len(value) - 1}", limit))
        return value

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("must contain at least one message")
        return value

    @field_validator("max_completion_tokens", mode="before")
    @classmethod
    def _max_completion_tokens(cls, value: Any) -> Optional[int]:
        return _count(value)

    @property
    def requested_max_tokens(self) -> Optional[int]:
        """max_completion_tokens (OpenAI's current name) when given, else max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---------------------------------------------------------------------------------------- responses


def _omit_none(value: Any) -> bool:
    return value is None


class PromptTokensDetails(BaseModel):
    """`usage.prompt_tokens_details`: prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts of one request (completion_tokens summed over its choices)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(BaseModel):
    """A candidate token at one position (chat format)."""

    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprobOut(TopLogprob):
    """The sampled token at one position with its alternatives (chat format)."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """`choices[i].logprobs` of the chat API."""

    content: Optional[list[TokenLogprobOut]] = None


class ChatMessageOut(BaseModel):
    """The assistant message of a non-streamed chat choice."""

    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None


class ChatChoice(BaseModel):
    """One choice of a non-streamed chat completion."""

    index: int
    message: ChatMessageOut
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    """The body of a non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    """`choices[i].delta` of a chat chunk; fields that are None are left out."""

    role: Optional[str] = Field(None, exclude_if=_omit_none)
    content: Optional[str] = Field(None, exclude_if=_omit_none)


class ChatChunkChoice(BaseModel):
    """One choice's part of a chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    """One SSE event of a streamed chat completion (`choices: []` and `usage` on the usage chunk)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = Field(None, exclude_if=_omit_none)


class CompletionLogprobs(BaseModel):
    """The legacy logprobs format of /v1/completions, one list entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice of a completion (also the streamed form, with a text delta)."""

    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    """The body of a non-streamed completion, and (object "text_completion" too) of each chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = Field(None, exclude_if=_omit_none)


class ErrorInfo(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    """`{"error": {...}}`, the body of every 4xx/5xx answer and of an SSE error event."""

    error: ErrorInfo


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mlx-pd"
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
