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
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from cluster.request import MAX_DRAFT_TOKENS
from router.openai.fields import CHAT_REFUSED, COMPLETION_REFUSED, MESSAGE_REFUSED
from router.request_model import check_field
from router.openai.output import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                                  ChatLogprobs, ChatMessageOut, CompletionChoice, CompletionLogprobs,
                                  CompletionResponse, DeltaMessage, ErrorInfo, ErrorResponse, ModelCard, ModelList,
                                  PromptTokensDetails, TokenLogprobOut, TopLogprob, Usage)
from router.request_model import RequestModel
from router.openai.tools import MessageToolCall, ResponseFormat, ToolChoice, ToolDefinition, check_tool_choice

__all__ = [  # the response models live in router/openai/output.py; importing them from here keeps working
    "ChatChoice", "ChatChunkChoice", "ChatCompletionChunk", "ChatCompletionResponse", "ChatLogprobs",
    "ChatMessageOut", "CompletionChoice", "CompletionLogprobs", "CompletionResponse", "DeltaMessage", "ErrorInfo",
    "ErrorResponse", "ModelCard", "ModelList", "PromptTokensDetails", "TokenLogprobOut", "TopLogprob", "Usage",
    "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "ContentPart", "SpeculativeOptions",
    "StreamOptions", "context_length_message", "CONTEXT_LENGTH_EXCEEDED", "INT64_MAX", "INT64_MIN", "MAX_N"]

MAX_N = 128  # most choices per request (OpenAI's own limit)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
ROLES = ("system", "developer", "user", "assistant", "tool")
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the error code (and pydantic error type) of a prompt too long


def context_length_message(num_tokens: str, max_model_len: int) -> str:
    """What a prompt of `num_tokens` ("123", "at least 9000") tokens that leaves no room is told."""
    return (f"the prompt has {num_tokens} tokens but this model's context is {max_model_len} tokens, which "
            f"leaves no room for the completion: shorten the prompt to at most {max_model_len - 1} tokens")


def check_turn_count(value: Any, info: ValidationInfo) -> Any:
    """A before-validator of a conversation (`messages`): validated with `context={"max_model_len": N}`, more
    than N turns are refused by their number (error type CONTEXT_LENGTH_EXCEEDED) before any is validated or
    rendered: a chat template renders every turn to at least one token (its role marker; at most a first system
    turn may be merged into the next), so they cannot fit."""
    limit = (info.context or {}).get("max_model_len")
    if limit is not None and isinstance(value, list) and len(value) > limit:
        raise PydanticCustomError(CONTEXT_LENGTH_EXCEEDED, context_length_message(
            f"{len(value)} messages, so at least {len(value) - 1}", limit))
    return value


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


class _Request(RequestModel):
    """Unknown keys ignored, near misses of known fields refused (router/request_model.py)."""


Refused = SkipJsonSchema[Any]  # a field of router/openai/fields.py's refusal tables (left out of the OpenAPI schema)


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
    best_of: Refused = None
    suffix: Refused = None

    @field_validator(*COMPLETION_REFUSED, mode="before")
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        return check_field(COMPLETION_REFUSED, info.field_name, value)

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
    """One chat message; `content` is normalised to a string (None for an assistant turn without text).
    An assistant turn may carry `tool_calls`; a `tool` turn answers one of them by `tool_call_id`."""

    role: str
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[MessageToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None  # an earlier assistant turn's reasoning (vLLM's name)
    reasoning: Optional[str] = None  # the same, by mlx-lm's and newer vLLM's name
    audio: Refused = None
    function_call: Refused = None
    refusal: Refused = None

    @property
    def reasoning_text(self) -> Optional[str]:
        """The turn's reasoning, by either name (handed to the chat template as `reasoning_content`)."""
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning

    @field_validator(*MESSAGE_REFUSED, mode="before")
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        return check_field(MESSAGE_REFUSED, info.field_name, value)

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
    Tools, tool_choice and response_format are router/openai/tools.py's models; the fields of
    router/openai/fields.py's CHAT_REFUSED are read only to refuse them by name.

    Validated with `context={"max_model_len": N}`, more than N messages are refused by their number before
    any is validated or rendered: a chat template renders every message to at least one token (its role
    marker; at most a first system message may be merged into the next), so they cannot fit."""

    MOVED = {"max_output_tokens": "use max_completion_tokens (or max_tokens)",
             "input": "send the conversation as messages", "instructions": "send them as a system message",
             "stop_sequences": "use stop", "system": "send it as a system message in messages"}

    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[ToolDefinition]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None
    thinking_token_budget: Optional[int] = Field(None, ge=0)  # vLLM's extension: the most reasoning tokens
    chat_template_kwargs: Optional[dict[str, Any]] = None  # vLLM's extension: more variables for the template
    audio: Refused = None
    modalities: Refused = None
    web_search_options: Refused = None
    functions: Refused = None
    function_call: Refused = None

    @field_validator(*CHAT_REFUSED, mode="before")
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        return check_field(CHAT_REFUSED, info.field_name, value)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        return check_tool_choice(value)

    @field_validator("messages", mode="before")
    @classmethod
    def _message_count(cls, value: Any, info: ValidationInfo) -> Any:
        return check_turn_count(value, info)

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
