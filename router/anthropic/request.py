"""Pydantic models of the Anthropic Messages requests the router serves (the shapes of the `anthropic` SDK's
`MessageCreateParams` and `MessageCountTokensParams`; the answers are in router/anthropic/output.py).

Requests ignore unknown keys (as the OpenAI models do) and refuse, with a 400 naming the field, every key of
the SDK's request types that the router cannot honour (`MESSAGES_REFUSED`), so nothing a client asks for is dropped
silently. What is honoured, and how:

    system, messages          text blocks (string shorthand too); `tool_use` blocks in assistant turns, `tool_result`
                              blocks (string or text content, `is_error`) in user turns; "system" turns inside
                              `messages` (the SDK allows them); consecutive turns of one role are one turn, as
                              Anthropic merges them. Other block types, and empty content lists, are refused.
    tools, tool_choice        custom tools (`input_schema` a JSON schema of an object); auto | any | tool | none,
                              `disable_parallel_tool_use`. Server tools (bash, web search, ...) are refused.
    stop_sequences            at most 16 non-empty strings
    temperature, top_p, top_k Anthropic's ranges (temperature in [0, 1]); the SDK sends them as extra body keys
    output_config.format      {"type": "json_schema", "schema"}: the answer's text follows the schema
    cache_control             accepted anywhere Anthropic takes it: the prefix cache keeps every prompt's blocks
                              anyway (LRU, whatever the `ttl`), and `usage.cache_read_input_tokens` reports hits
    metadata.user_id, service_tier ("auto" | "standard_only": one standard tier here), speed "standard",
    thinking {"type": "disabled"} and `null` for any field are accepted as meaning what the server does anyway.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, ValidationInfo, field_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from router.anthropic.fields import MESSAGES_REFUSED
from router.anthropic.thinking import ContextManagementParam, ThinkingParam
from router.request_model import check_field
from router.openai.request import _count, check_turn_count
from router.request_model import RequestModel
from router.openai.tools import NAME_PATTERN, check_json_schema

MAX_STOP_SEQUENCES = 16  # cluster.request.SamplingParams' limit on stop strings
Refused = SkipJsonSchema[Any]  # a field of MESSAGES_REFUSED (left out of the OpenAPI schema)
Accepted = Any  # a field of MESSAGES_ACCEPTED: any value, with the effect stated there


class _Request(RequestModel):
    """Unknown keys ignored, near misses of known fields refused (router/request_model.py)."""


class CacheControlEphemeralParam(BaseModel):
    """`cache_control`: {"type": "ephemeral", "ttl"?}; the prefix cache serves it (module docstring)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["ephemeral"]
    ttl: Optional[Literal["5m", "1h"]] = None


class TextBlockParam(_Request):
    """A text block of a turn or of the system prompt."""

    type: Literal["text"]
    text: str
    cache_control: Optional[CacheControlEphemeralParam] = None
    citations: Optional[list[Any]] = None

    @field_validator("citations")
    @classmethod
    def _citations(cls, value: Optional[list[Any]]) -> Optional[list[Any]]:
        if value:
            raise ValueError("citations are not supported by this server: leave citations out of the text block")
        return value


def _refuse_toolset(value: Optional[str]) -> Optional[str]:
    if value is not None:
        raise ValueError("toolsets are not supported by this server: leave toolset_name out")
    return value


class ToolUseBlockParam(_Request):
    """An assistant turn's call of a tool: `input` is the arguments object."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: Optional[CacheControlEphemeralParam] = None
    caller: Optional[dict[str, Any]] = None
    toolset_name: Optional[str] = None

    @field_validator("caller")
    @classmethod
    def _caller(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if value is not None and value.get("type") != "direct":
            raise ValueError("only {\"type\": \"direct\"} callers are supported: this server runs no "
                             "server-side code execution")
        return value

    _toolset = field_validator("toolset_name")(_refuse_toolset)


def _block_parser(kinds: dict[str, type[BaseModel]]) -> Callable[[Any], BaseModel]:
    """A validator of one content block that dispatches on its `type` to the model in `kinds`, refusing other
    types by name (errors inside the block keep their path, e.g. `messages[0].content[1].tool_use_id`)."""
    allowed = ", ".join(kinds)

    def parse(value: Any) -> BaseModel:
        if isinstance(value, BaseModel):
            return value
        kind = value.get("type") if isinstance(value, dict) else None
        if not isinstance(kind, str):
            raise PydanticCustomError("block_type", "must be a content block: an object with a \"type\" ({allowed})",
                                      {"allowed": allowed})
        if kind not in kinds:
            raise PydanticCustomError("unsupported_block", "content blocks of type '{kind}' are not supported by this "
                                      "server: send only {allowed} blocks here", {"kind": kind, "allowed": allowed})
        return kinds[kind].model_validate(value)
    return parse


def _text_shorthand(value: Any) -> Any:
    """A string stands for one text block."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


def _blocks(*models: type[BaseModel]) -> Any:
    """The type of a content list holding blocks of `models` (keyed by their `type` literal), or a string."""
    kinds = {m.model_fields["type"].annotation.__args__[0]: m for m in models}
    one = Union[models] if len(models) > 1 else models[0]  # type: ignore[valid-type]
    block = Annotated[one, PlainValidator(_block_parser(kinds), json_schema_input_type=one)]
    return Annotated[list[block], BeforeValidator(_text_shorthand, json_schema_input_type=Union[str, list[one]])]


TextContent = _blocks(TextBlockParam)


class ToolReferenceBlockParam(_Request):
    """A tool search's result: the named tool (one sent with `defer_loading`) is shown to the model from then on."""

    type: Literal["tool_reference"]
    tool_name: str = Field(min_length=1)


class ToolResultBlockParam(_Request):
    """A user turn's result of an earlier `tool_use` (by its id); `is_error` marks a failed call; its content is
    text, and tool references when it answers a tool search."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: _blocks(TextBlockParam, ToolReferenceBlockParam) = []  # type: ignore[valid-type]
    is_error: bool = False
    cache_control: Optional[CacheControlEphemeralParam] = None
    toolset_name: Optional[str] = None

    _toolset = field_validator("toolset_name")(_refuse_toolset)

    @property
    def text(self) -> str:
        """The result as one text (text parts joined by newlines; a tool reference as "Tool loaded: NAME")."""
        return "\n".join(p.text if isinstance(p, TextBlockParam) else f"Tool loaded: {p.tool_name}"
                         for p in self.content)

    @property
    def referenced_tools(self) -> list[str]:
        """The names of the tools this result's tool references load."""
        return [p.tool_name for p in self.content if isinstance(p, ToolReferenceBlockParam)]


class ThinkingBlockParam(_Request):
    """An earlier assistant turn's reasoning, sent back: `signature` is the one this server gave it
    (router/reasoning_token.py reads and checks it)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""
    cache_control: Optional[CacheControlEphemeralParam] = None


class RedactedThinkingBlockParam(_Request):
    """Reasoning another server encrypted (`data` is opaque here): accepted and left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str


class MessageParam(_Request):
    """One entry of `messages`; string content is one text block."""

    role: Literal["user", "assistant", "system"]
    content: _blocks(TextBlockParam, ToolUseBlockParam, ToolResultBlockParam, ThinkingBlockParam,  # type: ignore[valid-type]
                     RedactedThinkingBlockParam)

    @field_validator("content")
    @classmethod
    def _content(cls, value: list[Any]) -> list[Any]:
        if not value:
            raise ValueError("is empty: send a string or at least one content block (text, tool_use, tool_result)")
        return value


_TOOL_OPTIONS = {
    "input_examples": "input examples are not supported by this server: leave input_examples out and describe "
                      "the input in the description",
}


class ToolParam(_Request):
    """A client tool: `input_schema` is the JSON schema of the `input` the model produces. `strict` is kept
    whatever its value: a call is reported as tool_use only when its input validates against the schema
    (router/tool_calls.py); other text stays text."""

    name: str
    input_schema: dict[str, Any]
    description: Optional[str] = None
    type: Optional[Literal["custom"]] = None
    cache_control: Optional[CacheControlEphemeralParam] = None
    strict: Optional[bool] = None
    allowed_callers: Optional[list[str]] = None
    defer_loading: Optional[bool] = None  # left out of the prompt until a tool_reference names it
    eager_input_streaming: Optional[bool] = None  # satisfied: a call's input is streamed whole once it is written
    input_examples: Optional[list[Any]] = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_PATTERN.match(value):
            raise ValueError(f"{value!r} is not a valid tool name: use 1 to 64 of a-z, A-Z, 0-9, _ and -")
        return value

    @field_validator("input_schema")
    @classmethod
    def _schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_json_schema(value)
        if value.get("type") != "object":
            raise ValueError("must be a JSON schema with \"type\": \"object\" (a tool's input is an object)")
        return value

    @field_validator("allowed_callers")
    @classmethod
    def _callers(cls, value: Optional[list[str]]) -> Optional[list[str]]:
        if value is not None and value != ["direct"]:
            raise ValueError("only [\"direct\"] is supported: this server runs no server-side code execution")
        return value

    @field_validator("input_examples")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, False, []):
            raise ValueError(_TOOL_OPTIONS[info.field_name])
        return value


# Anthropic's server tools: its servers run them, and a model answers with their results; this server runs none,
# so they are left out of the prompt (a tool_choice that forces one is refused). Anthropic-defined tools the client
# runs (bash, text_editor, computer, memory) are refused by name: left out, the model could not use them.
SERVER_TOOL_PREFIXES = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_")


class ServerToolParam(BaseModel):
    """A server tool (`type` e.g. "web_search_20250305", and its `name`): kept to be left out of the prompt."""

    model_config = ConfigDict(extra="ignore")

    type: str
    name: str = ""


def _tool(value: Any) -> Any:
    """One entry of `tools`: a custom tool, or a server tool this server leaves out; other types refused."""
    if isinstance(value, BaseModel):
        return value
    kind = value.get("type") if isinstance(value, dict) else None
    if isinstance(kind, str) and kind.startswith(SERVER_TOOL_PREFIXES):
        return ServerToolParam.model_validate(value)
    if kind not in (None, "custom"):
        raise PydanticCustomError("unsupported_tool", "tools of type '{kind}' run on the client from a schema of "
                                  "Anthropic's that this server's models do not know: send it as a custom tool "
                                  "(name, description, input_schema)", {"kind": str(kind)})
    return ToolParam.model_validate(value)


class ToolChoiceParam(BaseModel):
    """`tool_choice`: auto | any | tool (with `name`) | none."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: bool = False


class JSONOutputFormatParam(BaseModel):
    """`output_config.format`: the answer is JSON following `schema`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    @field_validator("schema_")
    @classmethod
    def _schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_json_schema(value)


class OutputConfigParam(BaseModel):
    """`output_config`: `format` (the answer follows a JSON schema) and `effort` (how hard the model works: the
    chat template's reasoning-effort switch where it has one, router/reasoning.py)."""

    model_config = ConfigDict(extra="ignore")

    format: Optional[JSONOutputFormatParam] = None
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None


class MetadataParam(BaseModel):
    """`metadata`: only `user_id`, an opaque id of the end user."""

    model_config = ConfigDict(extra="forbid")

    user_id: Optional[str] = None


class CountTokensRequest(_Request):
    """POST /v1/messages/count_tokens (the prompt-shaping fields of a Messages request).

    Validated with `context={"max_model_len": N}`, more than N turns are refused by their number first (each
    renders to at least one token), as for Chat Completions."""

    model: Optional[str] = None
    messages: list[MessageParam]
    system: Optional[TextContent] = None
    tools: Optional[list[Annotated[Union[ToolParam, ServerToolParam], PlainValidator(
        _tool, json_schema_input_type=ToolParam)]]] = None
    tool_choice: Optional[ToolChoiceParam] = None
    output_config: Optional[OutputConfigParam] = None
    cache_control: Optional[CacheControlEphemeralParam] = None
    thinking: Optional[ThinkingParam] = None
    service_tier: Accepted = None
    speed: Accepted = None
    container: Refused = None
    diagnostics: Accepted = None
    inference_geo: Accepted = None
    user_profile_id: Accepted = None
    workspace_id: Accepted = None
    mcp_servers: Refused = None
    context_management: Optional[ContextManagementParam] = None
    betas: Accepted = None
    compaction: Refused = None
    fallbacks: Accepted = None
    fallback_credit_token: Accepted = None
    billing_policy: Accepted = None
    thread: Refused = None

    @field_validator(*MESSAGES_REFUSED, mode="before")
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        return check_field(MESSAGES_REFUSED, info.field_name, value)

    @field_validator("messages", mode="before")
    @classmethod
    def _turn_count(cls, value: Any, info: ValidationInfo) -> Any:
        return check_turn_count(value, info)

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[MessageParam]) -> list[MessageParam]:
        if not value:
            raise ValueError("must contain at least one message")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Optional[ToolChoiceParam]) -> Optional[ToolChoiceParam]:
        if value is not None and value.type == "tool" and not value.name:
            raise ValueError("a tool_choice of type \"tool\" needs the name of the tool to call")
        return value


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages. `max_tokens` is required, an integer >= 0 as on the OpenAI endpoints (0 answers with no
    output; past the context, it is clamped to the context left)."""

    MOVED = {"stop": "use stop_sequences", "max_completion_tokens": "use max_tokens",
             "response_format": "use output_config.format"}

    max_tokens: int = Field(ge=0)
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    stream: bool = False
    metadata: Optional[MetadataParam] = None

    _max_tokens = field_validator("max_tokens", mode="before")(_count)  # null: pydantic's "a valid integer"

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value: Optional[list[str]]) -> Optional[list[str]]:
        if value is not None:
            if len(value) > MAX_STOP_SEQUENCES:
                raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(value)}")
            if any(not s for s in value):
                raise ValueError("stop sequences must be non-empty strings")
        return value
