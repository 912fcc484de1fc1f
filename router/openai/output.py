"""Pydantic v2 models of the bodies the router answers with (OpenAI's chat.completion, chat.completion.chunk,
text_completion, error and model list objects). Fields that are None where OpenAI leaves them out are left out
(`exclude_if`); router/openai/request.py re-exports every name here."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field

from router.openai.tools import DeltaToolCall, ToolCallOut


def _omit_none(value: Any) -> bool:
    return value is None


class PromptTokensDetails(BaseModel):
    """`usage.prompt_tokens_details`: prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    """`usage.completion_tokens_details`: of the completion tokens, those the model spent reasoning."""

    reasoning_tokens: int = 0


class Usage(BaseModel):
    """Token counts of one request (completion_tokens summed over its choices, reasoning tokens included)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)


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
    """The assistant message of a non-streamed chat choice; `content` None when the model wrote no text,
    `tool_calls` left out when it made no call."""

    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = Field(None, exclude_if=_omit_none)  # a thinking model's reasoning
    reasoning: Optional[str] = Field(None, exclude_if=_omit_none)  # the same, by mlx-lm's and newer vLLM's name
    tool_calls: Optional[list[ToolCallOut]] = Field(None, exclude_if=_omit_none)


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
    reasoning_content: Optional[str] = Field(None, exclude_if=_omit_none)
    reasoning: Optional[str] = Field(None, exclude_if=_omit_none)
    tool_calls: Optional[list[DeltaToolCall]] = Field(None, exclude_if=_omit_none)


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


class ModelLoadCheck(BaseModel):
    """One worker's load check (cluster/load_check.py) in a `ModelCard`: the worker (`engine` in single-node
    mode), the `model_type` it checked, each check it `passed` (in words), what the check cost in `seconds`,
    and whether it was `skipped` (`--skip-load-check` for a family the tests cover: then `passed` is empty)."""

    worker: str
    model_type: str
    passed: list[str]
    seconds: float
    skipped: bool


class ModelCard(BaseModel):
    """One entry of GET /v1/models. `load_checks`: the load check of each worker that reports one, in the
    topology's order (one, `engine`, in single-node mode; a worker the router counts as dead is left out until
    it answers again, with the check its restart ran); null when none does (engines built without a check)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mlx-pd"
    max_model_len: Optional[int] = None
    load_checks: Optional[list[ModelLoadCheck]] = None


class ServeLayout(BaseModel):
    """How `mlx-pd serve` laid out its processes (cluster/launch/platform.py `choose_layout`): `name`
    "one-process" (router and engine share one interpreter: both pids are the same) or "split" (the engine in
    a child process), and why."""

    name: Literal["one-process", "split"]
    reason: str
    router_pid: int
    engine_pid: int


class ModelList(BaseModel):
    """GET /v1/models. `layout`: the serve's process layout (null at a cluster's router)."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    layout: Optional[ServeLayout] = None
