"""Pydantic models of the requests of OpenAI's Responses API (POST /v1/responses), the stateless subset
mlx-pd serves (the answers are in router/responses/output.py).

The request mirrors `openai.types.responses.response_create_params.ResponseCreateParamsBase`; which of its
keys are honoured, echoed or refused is router/responses/fields.py's table, applied here. Shapes are
normalised so the translation (router/responses/endpoints.py) sees one form:

    input                   "text" | [item, ...]                    ->  [item, ...] ("text" = one user message)
    item.content, .output   "text" | [{"type": "input_text", ...}]  ->  [part, ...]
    item.type               absent (OpenAI's EasyInputMessage)      ->  "message"

Items: `message` (roles user, assistant, system, developer; parts input_text, output_text, refusal),
`function_call` (call_id, name, arguments: the JSON text of an object) and `function_call_output` (call_id,
output). Every other item type (reasoning, web_search_call, item_reference, ...) and every image, file or
audio part is refused by name: the server keeps no state, runs no built-in tool and serves text-only models.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from router.request_model import check_field
from router.openai.request import CONTEXT_LENGTH_EXCEEDED, Refused, _count, context_length_message
from router.request_model import RequestModel
from router.responses.fields import INCLUDE_LOGPROBS, INCLUDE_SERVED, RESPONSES_REFUSED
from router.openai.tools import NAME_PATTERN, check_json_schema

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")
ITEM_TYPES = ("message", "function_call", "function_call_output")
TEXT_FORMATS = ("text", "json_object", "json_schema")
TOOL_CHOICE_MODES = ("none", "auto", "required")
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
    refusal (`refusal`, an assistant's refusal, read as its text)."""

    type: str
    text: Optional[str] = None
    refusal: Optional[str] = None

    @model_validator(mode="after")
    def _check(self) -> "InputContentPart":
        if self.type in MEDIA_PARTS:
            raise ValueError(f"content parts of type {self.type!r} are not supported: this server's model reads "
                             "text only; send input_text parts")
        if self.type in TEXT_PARTS and self.text is None:
            raise ValueError(f"a {self.type} part needs its text in 'text'")
        if self.type == "refusal" and self.refusal is None:
            raise ValueError("a refusal part needs its text in 'refusal'")
        if self.type not in TEXT_PARTS + ("refusal",):
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
    """One input item: a message, a function_call of an earlier turn, or a function_call_output."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=lambda s: _text_or_list(s, "content", "output"))

    type: str = "message"
    role: Optional[str] = None
    content: Optional[list[InputContentPart]] = None
    call_id: Optional[str] = None
    name: Optional[str] = None
    arguments: Optional[str] = None
    output: Optional[list[InputContentPart]] = None
    namespace: Optional[str] = None

    @field_validator("content", "output", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> Any:
        return _as_parts(value)

    @model_validator(mode="after")
    def _check(self) -> "InputItem":
        if self.type not in ITEM_TYPES:
            raise ValueError(f"input items of type {self.type!r} are not supported: this server keeps no state "
                             "and runs no built-in tools; send message, function_call and function_call_output "
                             "items (the whole conversation in every request)")
        if self.type == "message":
            if self.role not in ROLES:
                raise ValueError(f"a message's role must be one of {', '.join(ROLES)}, got {self.role!r}")
            if self.content is None:
                raise ValueError("a message needs its 'content' (a string or a list of input_text parts)")
            return self
        if not self.call_id:
            raise ValueError(f"a {self.type} item needs its 'call_id'")
        if self.namespace is not None:
            raise ValueError("namespaced function calls are not supported: this server offers no namespace tools")
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


class FunctionTool(_Request):
    """One entry of `tools`: only `{"type": "function", name, description?, parameters?, strict?}`."""

    MOVED = {"function": "a Responses API tool is flat: send {\"type\": \"function\", \"name\": ..., "
                         "\"parameters\": ...} without the \"function\" wrapper of Chat Completions"}

    type: str
    name: Optional[str] = None
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None
    defer_loading: Optional[bool] = None
    allowed_callers: Optional[list[str]] = None
    async_: Optional[bool] = Field(None, alias="async")
    output_schema: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _check(self) -> "FunctionTool":
        if self.type != "function":
            raise ValueError(f"tools of type {self.type!r} are not supported: this server runs no built-in, MCP "
                             "or custom tools; declare function tools ({\"type\": \"function\", \"name\": ...})")
        if self.name is None or not NAME_PATTERN.match(self.name):
            raise ValueError(f"name {self.name!r} is not a valid function name: use 1 to 64 of a-z, A-Z, 0-9, "
                             "_ and -")
        if self.parameters is not None:
            try:
                check_json_schema(self.parameters)
            except ValueError as exc:
                raise ValueError(f"parameters {exc}") from None
        refused = [("defer_loading", self.defer_loading not in (None, False), "tool search"),
                   ("allowed_callers", self.allowed_callers not in (None, ["direct"]), "programmatic calls"),
                   ("async", self.async_ not in (None, False), "asynchronous calls"),
                   ("output_schema", self.output_schema is not None, "programmatic tool calling")]
        for key, given, what in refused:
            if given:
                raise ValueError(f"{key} is not supported: this server runs no {what}; leave it out")
        return self

    def echo(self) -> dict[str, Any]:
        """The tool as the answer echoes it (OpenAI's FunctionTool)."""
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict}


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
    """`text`: the answer's format; `verbosity` only at OpenAI's default, "medium" (a small model has no knob
    for it)."""

    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None

    @field_validator("verbosity")
    @classmethod
    def _verbosity(cls, value: Optional[str]) -> Optional[str]:
        if value not in (None, "medium"):
            raise ValueError(f"{value!r} is not supported: this server cannot steer verbosity; leave it out or "
                             "send \"medium\"")
        return value

    def echo(self) -> dict[str, Any]:
        """The config as the answer echoes it."""
        fmt = self.format.model_dump(by_alias=True, exclude_none=True) if self.format else {"type": "text"}
        return {"format": fmt, "verbosity": self.verbosity or "medium"}


class ResponsesStreamOptions(_Request):
    """`stream_options`: `include_obfuscation` adds a random `obfuscation` string to every delta event."""

    include_obfuscation: bool = False


def check_tool_choice(value: Any) -> Any:
    """`value` when it is a `tool_choice` this server serves: "none" | "auto" | "required" |
    {"type": "function", "name"} | {"type": "allowed_tools", "mode": "auto" | "required", "tools": [{"type":
    "function", "name"}, ...]}; a ValueError naming what is wrong otherwise (built-in tool types by name)."""
    if value is None or value in TOOL_CHOICE_MODES:
        return value
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "function" and isinstance(value.get("name"), str):
        return value
    if kind == "allowed_tools":
        tools = value.get("tools")
        if value.get("mode") not in ("auto", "required"):
            raise ValueError("an allowed_tools choice needs 'mode' \"auto\" or \"required\"")
        if not isinstance(tools, list) or not tools or not all(
                isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str) for t in tools):
            raise ValueError("an allowed_tools choice needs 'tools', a non-empty list of {\"type\": \"function\", "
                             "\"name\": ...}")
        return value
    if isinstance(kind, str) and kind != "function":
        raise ValueError(f"choices of type {kind!r} are not supported: this server runs no built-in, MCP or custom "
                         "tools; send \"none\", \"auto\", \"required\", {\"type\": \"function\", \"name\": ...} "
                         "or {\"type\": \"allowed_tools\", ...}")
    raise ValueError('must be "none", "auto", "required", {"type": "function", "name": ...} or '
                     '{"type": "allowed_tools", "mode": ..., "tools": [...]}')


class ResponsesRequest(_Request):
    """POST /v1/responses. Every key of OpenAI's ResponseCreateParams is in RESPONSES_HONOURED, RESPONSES_ACCEPTED
    or RESPONSES_REFUSED (router/responses/fields.py); a refused one gets a 400 naming it unless its value asks
    for what the server does anyway, e.g. `store: false`."""

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
    tools: Optional[list[FunctionTool]] = None
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
    previous_response_id: Refused = None
    conversation: Refused = None
    store: Refused = None
    background: Refused = None
    background_options: Refused = None
    prompt: Refused = None
    reasoning: Refused = None
    moderation: Refused = None
    image: Refused = None
    access_programs: Refused = None
    context_management: Refused = None
    prompt_cache_options: Refused = None
    prompt_cache_retention: Refused = None
    service_tier: Refused = None
    truncation: Refused = None

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
            raise PydanticCustomError(CONTEXT_LENGTH_EXCEEDED, context_length_message(
                f"{len(value)} input items, so at least {len(value) - 1}", limit))
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
