"""Pydantic models of the bodies the router answers on Anthropic's Messages endpoints (the shapes of the
`anthropic` SDK's `Message`, `Usage`, `MessageTokensCount` and `ErrorResponse`); the streamed events are built
from them in router/anthropic/format.py. The requests are in router/anthropic/request.py."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]


class TextOut(BaseModel):
    """A text block of the answer."""

    type: Literal["text"] = "text"
    text: str


class ThinkingOut(BaseModel):
    """A thinking block of the answer: the model's reasoning (empty when the request's `thinking.display` is
    "omitted") and its signature, this server's token of the text, which carries it (router/reasoning_token.py)."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseOut(BaseModel):
    """A tool call of the answer: `input` is the arguments object."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class OutputTokensDetails(BaseModel):
    """`usage.output_tokens_details`: of the output tokens, those spent reasoning."""

    thinking_tokens: int = 0


class MessageUsage(BaseModel):
    """Token counts: `input_tokens` excludes the prompt tokens read from the prefix cache
    (`cache_read_input_tokens`), as Anthropic counts them; the prompt is their sum. `output_tokens` includes
    the reasoning's, which `output_tokens_details.thinking_tokens` counts."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    service_tier: Literal["standard"] = "standard"


class MessageResponse(BaseModel):
    """The body of a non-streamed answer (Anthropic's `Message`), and the `message` of `message_start`."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Union[ThinkingOut, TextOut, ToolUseOut]]
    stop_reason: Optional[StopReason] = None
    stop_sequence: Optional[str] = None
    usage: MessageUsage
    context_management: Optional[dict[str, Any]] = Field(None, exclude_if=lambda v: v is None)


class CountTokensResponse(BaseModel):
    """The body of POST /v1/messages/count_tokens."""

    input_tokens: int


class AnthropicErrorInfo(BaseModel):
    """Anthropic's error object."""

    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """`{"type": "error", "error": {...}}`, the body of every 4xx/5xx answer of the Messages endpoints and the
    data of a streamed `error` event."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
