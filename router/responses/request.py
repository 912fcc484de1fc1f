"""Pydantic models of the requests of OpenAI's Responses API (POST /v1/responses), the stateless subset
mlx-pd serves (the answers are in router/responses/output.py; the tools in router/responses/tools.py).

The request mirrors `openai.types.responses.response_create_params.ResponseCreateParamsBase`; which of its
keys are honoured, accepted or refused is router/responses/fields.py's table, applied here. Shapes are
normalised so the translation (router/responses/endpoints.py) sees one form:

    input                   "text" | [item, ...]                    ->  [item, ...] ("text" = one user message)
    item.content, .output   "text" | [{"type": "input_text", ...}]  ->  [part, ...]
    item.type               absent (OpenAI's EasyInputMessage)      ->  "message"

Items: `message` (roles user, assistant, system, developer; parts input_text, output_text, refusal),
`function_call` (call_id, name, namespace?, arguments: the JSON text of an object), `function_call_output`
(call_id, output; name and namespace read as hints) and `reasoning` (content's reasoning_text parts, summary's
summary_text parts, encrypted_content). Items' `id`, `status` and `phase` are accepted and ignored. Every other
item type (item_reference, web_search_call, custom_tool_call, compaction, ...) and every image, file or audio
part is refused by name: the server keeps no state, runs no built-in tool, compacts nothing and serves text-only
models.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from router.request_model import check_field
from router.openai.request import CONTEXT_LENGTH_EXCEEDED, Refused, _count, context_length_message
from router.request_model import RequestModel
from router.responses.fields import INCLUDE_LOGPROBS, INCLUDE_SERVED, NO_COMPACTION, RESPONSES_REFUSED
from router.responses.tools import Tool, check_tool_choice
from router.openai.tools import NAME_PATTERN, check_json_schema

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")
REASONING_PARTS = ("reasoning_text", "summary_text")  # a reasoning item's content and summary parts
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
COMPACTION_ITEMS = ("compaction", "compaction_trigger")
TEXT_FORMATS = ("text", "json_object", "json_schema")
METADATA_MAX_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits


def _text_or_list(schema: dict[str, Any], *names: str) -> None:
    """Publish `names` as "a string, or the list" (the validators take both, see the module docstring)."""
    for name in names:
        listed = schema.get("properties", {}).get(name)
        if listed is not None:
            schema["properties"][name] = {"anyOf": [{"type": "string"}, listed]}


def _as_parts(value: Any) -> Any:
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


class _Request(RequestModel):
    """Unknown keys ignored, near misses of known fields refused (router/request_model.py)."""


class InputContentPart(_Request):
    """One content part of an input message or function output: input_text / output_text (`text`) or
    refusal (`refusal`, an assistant's refusal, read as its text); of a reasoning item: reasoning_text (its
    content) or summary_text (its summary)."""

    type: str
    text: Optional[str] = None
    refusal: Optional[str] = None

    @model_validator(mode="after")
    def _check(self) -> "InputContentPart":
        if self.type in MEDIA_PARTS:
            raise ValueError(f"content parts of type {self.type!r} are not supported: this server's model reads "
                             "text only; send input_text parts")
        if self.type in TEXT_PARTS + REASONING_PARTS and self.text is None:
            raise ValueError(f"a {self.type} part needs its text in 'text'")
        if self.type == "refusal" and self.refusal is None:
            raise ValueError("a refusal part needs its text in 'refusal'")
        if self.type not in TEXT_PARTS + REASONING_PARTS + ("refusal",):
            raise ValueError(f"content part type {self.type!r} is not one of input_text, output_text, refusal")
        return self

    @property
    def as_text(self) -> str:
        """The part's text."""
        return self.text if self.text is not None else (self.refusal or "")


def parts_text(parts: list[InputContentPart]) -> str:
    """The text of a content list, parts joined by "\\n" (as the chat endpoint joins text parts)."""
    return "\n".join(p.as_text for p in parts)


class InputItem(_Request):
    """One input item: a message, a function_call of an earlier turn, a function_call_output, or the reasoning
    of an earlier turn."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=lambda s: _text_or_list(s, "content", "output"))

    type: str = "message"
    role: Optional[str] = None
    content: Optional[list[InputContentPart]] = None
    call_id: Optional[str] = None
    name: Optional[str] = None
    arguments: Optional[str] = None
    output: Optional[list[InputContentPart]] = None
    namespace: Optional[str] = None
    summary: Optional[list[InputContentPart]] = None
    encrypted_content: Optional[str] = None

    @field_validator("content", "output", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> Any:
        return _as_parts(value)

    @model_validator(mode="after")
    def _check(self) -> "InputItem":
        if self.type in COMPACTION_ITEMS:
            raise ValueError(f"{self.type} items are not supported: {NO_COMPACTION}")
        if self.type == "additional_tools":
            raise ValueError("additional_tools items are not supported: declare the tools in the request's tools "
                             "(function tools, and namespaces of them)")
        if self.type not in ITEM_TYPES:
            raise ValueError(f"input items of type {self.type!r} are not supported: this server keeps no state "
                             "and runs no built-in or custom tools; send message, reasoning, function_call and "
                             "function_call_output items (the whole conversation in every request)")
        if self.type == "message":
            if self.role not in ROLES:
                raise ValueError(f"a message's role must be one of {', '.join(ROLES)}, got {self.role!r}")
            if self.content is None:
                raise ValueError("a message needs its 'content' (a string or a list of input_text parts)")
            misplaced = next((p.type for p in self.content if p.type in REASONING_PARTS), None)
            if misplaced is not None:
                raise ValueError(f"a message's content has no {misplaced} parts: send input_text or output_text "
                                 "parts (reasoning goes in a reasoning item)")
            return self
        if self.type == "reasoning":
            for key, parts, kind in (("content", self.content, "reasoning_text"),
                                     ("summary", self.summary, "summary_text")):
                wrong = next((p.type for p in parts or () if p.type != kind), None)
                if wrong is not None:
                    raise ValueError(f"a reasoning item's {key} holds {kind} parts, got a {wrong} part")
            return self
        if not self.call_id:
            raise ValueError(f"a {self.type} item needs its 'call_id'")
        if self.type == "function_call":
            if self.name is None or self.arguments is None:
                raise ValueError("a function_call item needs 'name' and 'arguments' (the JSON text of an object)")
            try:
                arguments = json.loads(self.arguments)
            except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
                raise ValueError(f"arguments must be the JSON text of an object: {exc}") from None
            if not isinstance(arguments, dict):
                raise ValueError("arguments must be the JSON text of an object")
        if self.type == "function_call_output" and self.output is None:
            raise ValueError("a function_call_output item needs its 'output' (a string or input_text parts)")
        return self

    @property
    def reasoning_text(self) -> Optional[str]:
        """A reasoning item's readable text: its content's reasoning_text parts, else its summary texts (None
        when it has neither; its encrypted_content is read by the translation, which knows the model)."""
        for parts in (self.content, self.summary):
            if parts:
                return parts_text(parts)
        return None


class TextFormat(_Request):
    """`text.format`: {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", name, schema,
    description?, strict?}."""

    type: str
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _check(self) -> "TextFormat":
        if self.type not in TEXT_FORMATS:
            raise ValueError(f"format type {self.type!r} is not one of {', '.join(TEXT_FORMATS)}")
        if self.type == "json_schema":
            if self.name is None or not NAME_PATTERN.match(self.name):
                raise ValueError(f"a json_schema format needs a 'name' of 1 to 64 of a-z, A-Z, 0-9, _ and -, "
                                 f"got {self.name!r}")
            if self.schema_ is None:
                raise ValueError("a json_schema format needs its 'schema'")
            try:
                check_json_schema(self.schema_)
            except ValueError as exc:
                raise ValueError(f"schema {exc}") from None
        return self


class TextConfig(_Request):
    """`text`: the answer's format, and `verbosity` (low, medium, high): a hint no chat template reads,
    accepted and echoed (router/responses/fields.py)."""

    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None

    def echo(self) -> dict[str, Any]:
        """The config as the answer echoes it."""
        fmt = self.format.model_dump(by_alias=True, exclude_none=True) if self.format else {"type": "text"}
        return {"format": fmt, "verbosity": self.verbosity or "medium"}


class ReasoningConfig(_Request):
    """`reasoning`: `effort` is the chat path's reasoning_effort ("max" as "xhigh"); `context` "current_turn"
    leaves out the reasoning of earlier turns; `summary`, `generate_summary` and `mode` are accepted with the
    effects router/responses/fields.py states."""

    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None
    context: Optional[Literal["auto", "current_turn", "all_turns"]] = None
    mode: Optional[str] = None

    @property
    def chat_effort(self) -> Optional[str]:
        """The chat request's reasoning_effort."""
        return "xhigh" if self.effort == "max" else self.effort

    def echo(self) -> dict[str, Any]:
        """The configuration as the answer echoes it (OpenAI's Reasoning)."""
        return self.model_dump(exclude_none=True)


class ResponsesStreamOptions(_Request):
    """`stream_options`: `include_obfuscation` adds a random `obfuscation` string to every delta event."""

    include_obfuscation: bool = False


class ResponsesRequest(_Request):
    """POST /v1/responses. Every key of OpenAI's ResponseCreateParams is in RESPONSES_HONOURED, RESPONSES_ACCEPTED
    or RESPONSES_REFUSED (router/responses/fields.py); a refused one gets a 400 naming it unless its value asks
    for what the server does anyway, e.g. `background: false`."""

    MOVED = {"messages": "send the conversation as input (a string or items)",
             "max_tokens": "use max_output_tokens", "max_completion_tokens": "use max_output_tokens",
             "response_format": "use text.format", "stop": "the Responses API has no stop sequences: leave it "
             "out, or use /v1/chat/completions"}

    model_config = ConfigDict(extra="ignore", populate_by_name=True,
                              json_schema_extra=lambda s: _text_or_list(s, "input"))

    model: Optional[str] = None
    input: list[InputItem]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = False
    stream_options: Optional[ResponsesStreamOptions] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    max_tool_calls: Optional[int] = Field(None, ge=0)
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    reasoning: Optional[ReasoningConfig] = None
    thinking_token_budget: Optional[int] = Field(None, ge=0)  # vLLM's extension: the most reasoning tokens
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    prompt_cache_retention: Optional[str] = None
    moderation: Optional[dict[str, Any]] = None
    image: Optional[dict[str, Any]] = None
    background_options: Optional[dict[str, Any]] = None
    access_programs: Optional[dict[str, Any]] = None
    previous_response_id: Refused = None
    conversation: Refused = None
    background: Refused = None
    prompt: Refused = None
    context_management: Refused = None

    @field_validator(*RESPONSES_REFUSED, mode="before")
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        return check_field(RESPONSES_REFUSED, info.field_name, value)

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str):
            return [{"type": "message", "role": "user", "content": value}]
        if isinstance(value, list) and not value:
            raise ValueError("is empty: send at least one message")
        limit = (info.context or {}).get("max_model_len")
        if limit is not None and isinstance(value, list) and len(value) > limit:  # as the chat endpoint counts
            rendered = sum(not (isinstance(v, dict) and v.get("type") == "reasoning") for v in value)
            if rendered > limit:  # reasoning items join an assistant turn, which a template may render without
                raise PydanticCustomError(CONTEXT_LENGTH_EXCEEDED, context_length_message(
                    f"{rendered} input items, so at least {rendered - 1}", limit))
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        return check_tool_choice(value)

    @field_validator("max_output_tokens", mode="before")
    @classmethod
    def _max_output_tokens(cls, value: Any) -> Optional[int]:
        return _count(value)

    @field_validator("include")
    @classmethod
    def _include(cls, value: Optional[list[str]]) -> Optional[list[str]]:
        for item in value or ():
            if item not in INCLUDE_SERVED:
                raise ValueError(f"{item!r} cannot be included: it belongs to a built-in tool or an input kind this "
                                 f"server does not serve; it can include {', '.join(map(repr, INCLUDE_SERVED))}")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
        if value is None:
            return value
        if len(value) > METADATA_MAX_PAIRS:
            raise ValueError(f"has {len(value)} pairs: at most {METADATA_MAX_PAIRS} are allowed")
        for key, item in value.items():
            if len(key) > METADATA_KEY_CHARS or len(item) > METADATA_VALUE_CHARS:
                raise ValueError(f"key {key[:80]!r}: keys have at most {METADATA_KEY_CHARS} characters and "
                                 f"values at most {METADATA_VALUE_CHARS}")
        return value

    @property
    def wants_logprobs(self) -> bool:
        """True when the answer's output_text parts carry logprobs (`include` names them)."""
        return INCLUDE_LOGPROBS in (self.include or ())
