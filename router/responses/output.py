"""Pydantic models of the answers of OpenAI's Responses API (POST /v1/responses), after
`openai.types.responses.Response`, whose required fields they all fill: the response object (also the
`response` of the lifecycle stream events), its output items (an assistant `message` with `output_text`
parts, `function_call` items) and its usage.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field


def _omit_none(value: Any) -> bool:
    return value is None


class OutputTopLogprob(BaseModel):
    """An alternative token at one position."""

    token: str
    logprob: float
    bytes: list[int]


class OutputLogprob(OutputTopLogprob):
    """The generated token at one position, with its alternatives (OpenAI's output_text logprobs)."""

    top_logprobs: list[OutputTopLogprob] = Field(default_factory=list)


class OutputText(BaseModel):
    """An `output_text` content part."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: Optional[list[OutputLogprob]] = Field(None, exclude_if=_omit_none)


class OutputMessage(BaseModel):
    """The assistant's `message` output item."""

    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class ReasoningText(BaseModel):
    """A reasoning item's content part: the model's own reasoning text."""

    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """A `reasoning` output item: a thinking model's reasoning as its `content` (no `summary` is generated);
    `encrypted_content` when the request's `include` asks for it (router/reasoning_token.py)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    encrypted_content: Optional[str] = Field(None, exclude_if=_omit_none)
    status: Literal["in_progress", "completed", "incomplete"]


class FunctionCallItem(BaseModel):
    """A `function_call` output item: `arguments` is the JSON text of an object; `call_id` pairs it with the
    function_call_output the client sends back; a function of a namespace tool is named by its own `name` and
    its `namespace` (left out for other functions)."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    namespace: Optional[str] = Field(None, exclude_if=_omit_none)
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    """`usage.input_tokens_details`: prompt tokens served from the prefix cache (no cache write is billed or
    reported apart: the prefix cache keeps blocks as a side effect)."""

    cached_tokens: int = 0
    cache_write_tokens: int = 0


class ResponseOutputTokensDetails(BaseModel):
    """`usage.output_tokens_details`: of the output tokens, those a thinking model spent reasoning."""

    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """Token counts of one response."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: ResponseOutputTokensDetails = Field(default_factory=ResponseOutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    """Why a response is `incomplete` (the output reached max_output_tokens or the context's end)."""

    reason: Literal["max_output_tokens"] = "max_output_tokens"


OutputItem = Union[ReasoningItem, OutputMessage, FunctionCallItem]


class ResponseObject(BaseModel):
    """The body of a non-streamed response, and the `response` of the lifecycle stream events (OpenAI's
    `Response`; the request's settings echoed as OpenAI echoes them)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: Optional[int] = None
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str] = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    tool_choice: Union[str, dict[str, Any]] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}, "verbosity": "medium"})
    max_output_tokens: Optional[int] = None
    max_tool_calls: Optional[int] = None
    metadata: dict[str, str] = Field(default_factory=dict)
    previous_response_id: None = None
    reasoning: Optional[dict[str, Any]] = None
    service_tier: str = "default"
    store: bool = False
    background: bool = False
    top_logprobs: int = 0
    truncation: str = "disabled"
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    usage: Optional[ResponseUsage] = None
