"""Pydantic models of OpenAI's function tools, tool calls and response formats (Chat Completions).

Requests (the shapes of OpenAI's `ChatCompletionFunctionToolParam`, `ChatCompletionToolChoiceOptionParam`,
`ChatCompletionMessageFunctionToolCallParam` and `ResponseFormat*` params):

    tools               [{"type": "function", "function": {name, description?, parameters?, strict?}}]
                        names match ^[a-zA-Z0-9_-]{1,64}$ (OpenAI's rule); `parameters` must be a valid JSON
                        schema (checked with jsonschema's meta-schema of its dialect)
    tool_choice         "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    response_format     {"type": "text"} | {"type": "json_object"}
                        | {"type": "json_schema", "json_schema": {name, description?, schema?, strict?}}
    message.tool_calls  [{"id", "type": "function", "function": {"name", "arguments"}}]; `arguments` is JSON text
                        of an object (as OpenAI sends it) or the object itself, normalised to the object

Responses: `message.tool_calls` and the streamed `delta.tool_calls` (OpenAI's `ChatCompletionMessageToolCall`
and `ChoiceDeltaToolCall`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field, field_validator, model_validator

from router.request_model import RequestModel

NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def check_json_schema(value: Any) -> dict[str, Any]:
    """`value` when it is a valid JSON schema object; ValueError saying what is wrong otherwise."""
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON schema object, got {type(value).__name__}")
    try:
        validator_for(value).check_schema(value)
    except RecursionError:
        raise ValueError("is nested too deeply to check: flatten the schema (use $defs and $ref)") from None
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise ValueError(f"is not a valid JSON schema: {exc.message}" + (f" (at {where})" if where else "")) \
            from None
    return value


def _name(value: str) -> str:
    if not NAME_PATTERN.match(value):
        raise ValueError(f"{value!r} is not a valid function name: use 1 to 64 of a-z, A-Z, 0-9, _ and -")
    return value


class _Model(RequestModel):
    """Unknown keys ignored, near misses of known fields refused (router/request_model.py)."""


class FunctionDefinition(_Model):
    """A function the model may call; `parameters` is the JSON schema of its arguments object."""

    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        return _name(value)

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        return None if value is None else check_json_schema(value)


class ToolDefinition(_Model):
    """One entry of `tools`: only function tools are served."""

    type: Literal["function"]
    function: FunctionDefinition

    def openai(self) -> dict[str, Any]:
        """The tool as a plain OpenAI-shaped dict (what chat templates and mlx-lm's parsers read)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class FunctionName(_Model):
    """`{"name": ...}` of a named tool choice."""

    name: str


class NamedToolChoice(_Model):
    """`tool_choice` forcing one function."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class JsonSchemaFormat(_Model):
    """`response_format.json_schema`: the answer must be JSON valid against `schema` (always enforced)."""

    name: str
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        return _name(value)

    @field_validator("schema_")
    @classmethod
    def _schema(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        return None if value is None else check_json_schema(value)


class ResponseFormat(_Model):
    """`response_format`: "text" (free text, the default), "json_object" (one JSON object) or "json_schema"
    (JSON valid against `json_schema.schema`, which must then be given)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _needs_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs "json_schema": {"name": ..., "schema": {...}}')
        return self


def check_tool_choice(value: Any) -> Any:
    """A clear ValueError for a `tool_choice` of none of its shapes (before pydantic's union errors)."""
    if value is None or value in ("none", "auto", "required"):
        return value
    function = value.get("function") if isinstance(value, dict) else None
    if not (isinstance(value, dict) and value.get("type") == "function" and isinstance(function, dict)
            and isinstance(function.get("name"), str)):
        raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    return value


class CalledFunction(_Model):
    """The function of a tool call in an assistant message: `arguments` normalised to an object."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)

    @field_validator("arguments", mode="before")
    @classmethod
    def _arguments(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"must be the JSON text of an object: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("must be a JSON object (or its JSON text)")
        return value


class MessageToolCall(_Model):
    """One tool call of an earlier assistant turn."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


# ------------------------------------------------------------------------------------------ responses


def _omit_none(value: Any) -> bool:
    return value is None


class FunctionCallOut(BaseModel):
    """`function` of a returned tool call: `arguments` is JSON text."""

    name: str
    arguments: str


class ToolCallOut(BaseModel):
    """One entry of `message.tool_calls` (OpenAI's ChatCompletionMessageToolCall)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class DeltaFunction(BaseModel):
    """`function` of a streamed tool call delta; fields that are None are left out."""

    name: Optional[str] = Field(None, exclude_if=_omit_none)
    arguments: Optional[str] = Field(None, exclude_if=_omit_none)


class DeltaToolCall(BaseModel):
    """One entry of `delta.tool_calls` (OpenAI's ChoiceDeltaToolCall): the first chunk of a call has index, id,
    type, function.name and arguments ""; later ones the index and an arguments fragment."""

    index: int
    id: Optional[str] = Field(None, exclude_if=_omit_none)
    type: Optional[Literal["function"]] = Field(None, exclude_if=_omit_none)
    function: DeltaFunction
