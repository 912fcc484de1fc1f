"""The tools of a Responses request and how the chat path sees them.

`tools` entries (OpenAI's `ToolParam`):

    function     {"type": "function", name, description?, parameters?, strict?}: the chat function `name`
    namespace    {"type": "namespace", name, description, tools: [function, ...]}: one chat function per inner
                 function, named `<namespace>__<name>` (`flat_name`; it must fit the chat path's name pattern,
                 1 to 64 of a-z, A-Z, 0-9, _ and -), its description led by the namespace's; a namespace without
                 tools, or one holding a tool that is not a function (custom), is refused naming it
    hosted       the built-in tools of HOSTED_TOOL_TYPES (web_search, file_search, mcp, ...): this server runs
                 none of them, so they are left out of the prompt; a `tool_choice` that forces one is refused
    other        (custom, ...) refused naming the entry

Two tools the model would see under one name are refused naming the later one. A call the model makes of a flat
name maps back to its pair: the `function_call` output item carries `name` (the function's own) and `namespace`,
as Codex looks tools up by (namespace, name); `function_call` input items and `tool_choice` entries with a
`namespace` map to the flat name again (`ToolSet.flat`; the `functions` namespace, Codex's name for the plain
tools, stands for none unless a namespace of that name is declared).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from router.errors import bad_request
from router.openai.tools import NAME_PATTERN, check_json_schema
from router.request_model import RequestModel
from router.responses.fields import CLIENT_RUN_TOOL_TYPES, HOSTED_TOOL_TYPES

FLAT_SEPARATOR = "__"
DEFAULT_NAMESPACE = "functions"  # Codex's namespace of the plain function tools


def is_hosted_type(value: Any) -> bool:
    """`value` is the type of a hosted tool this server does not run (HOSTED_TOOL_TYPES)."""
    return isinstance(value, str) and value in HOSTED_TOOL_TYPES


def flat_name(namespace: Optional[str], name: str) -> str:
    """The chat function name of function `name` in `namespace` (its own name outside any namespace)."""
    return name if namespace is None else f"{namespace}{FLAT_SEPARATOR}{name}"


class _Request(RequestModel):
    """Unknown keys ignored, near misses of known fields refused (router/request_model.py)."""


class FunctionTool(_Request):
    """A function tool: `{"type": "function", name, description?, parameters?, strict?}`."""

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
            raise ValueError(f"tools of type {self.type!r} are not supported here: this server runs no built-in, "
                             "MCP or custom tools; declare function tools ({\"type\": \"function\", \"name\": ...})")
        return self._check_function()

    def _check_function(self) -> "FunctionTool":
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

    def chat_function(self, namespace: Optional["Tool"] = None) -> dict[str, Any]:
        """The chat path's tool of this function (in `namespace`, if any)."""
        description = self.description
        if namespace is not None and namespace.description:
            description = namespace.description + ("\n" + description if description else "")
        function = {"name": flat_name(namespace.name if namespace else None, self.name or ""),
                    "description": description, "parameters": self.parameters, "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class Tool(FunctionTool):
    """One entry of `tools`: a function, a namespace of functions (`tools`), or a hosted tool this server does
    not run (kept as sent, to be echoed; left out of the prompt)."""

    tools: Optional[list[FunctionTool]] = Field(None, validate_default=True)
    hosted: SkipJsonSchema[Optional[dict[str, Any]]] = Field(None, exclude=True)  # a hosted tool as sent

    @model_validator(mode="before")
    @classmethod
    def _hosted_tool(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if is_hosted_type(data.get("type")):  # its own settings are not read, only echoed
            return {"type": data["type"], "hosted": dict(data)}
        return {k: v for k, v in data.items() if k != "hosted"}

    @field_validator("tools")
    @classmethod
    def _namespace_tools(cls, value: Optional[list[FunctionTool]], info: ValidationInfo) -> Any:
        if info.data.get("type") == "namespace" and not value:
            raise ValueError("a namespace needs its function tools in 'tools' (a non-empty list of "
                             "{\"type\": \"function\", \"name\": ...})")
        return value

    @model_validator(mode="after")
    def _check(self) -> "Tool":
        if self.is_hosted:
            return self
        if self.type == "namespace":
            if self.name is None or not NAME_PATTERN.match(self.name):
                raise ValueError(f"name {self.name!r} is not a valid namespace name: use 1 to 64 of a-z, A-Z, "
                                 "0-9, _ and -")
            return self
        if self.type in CLIENT_RUN_TOOL_TYPES:
            raise ValueError(f"tools of type {self.type!r} are not supported: the client runs them from calls of "
                             "their own item types, which this server's models do not write; declare what the "
                             "client runs as a function tool ({\"type\": \"function\", \"name\": ...})")
        if self.type != "function":
            raise ValueError(f"tools of type {self.type!r} are not supported: this server runs no custom tools; "
                             "declare function tools ({\"type\": \"function\", \"name\": ...}) or namespaces of "
                             "them")
        return self._check_function()

    @property
    def is_hosted(self) -> bool:
        """A built-in tool this server does not run (HOSTED_TOOL_TYPES)."""
        return is_hosted_type(self.type)

    def echo(self) -> dict[str, Any]:
        """The tool as the answer echoes it (OpenAI's FunctionTool, NamespaceTool, or the hosted tool as sent)."""
        if self.is_hosted:
            return dict(self.hosted or {"type": self.type})
        if self.type == "namespace":
            return {"type": "namespace", "name": self.name, "description": self.description or "",
                    "tools": [t.echo() for t in self.tools or ()]}
        return super().echo()


@dataclass
class ToolSet:
    """A request's tools as the chat path sees them: `functions` (chat tools, in order), `pairs` (flat name ->
    (namespace or None, own name)) and the `hosted` tool types left out."""

    functions: list[dict[str, Any]] = field(default_factory=list)
    pairs: dict[str, tuple[Optional[str], str]] = field(default_factory=dict)
    hosted: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, tools: Optional[list[Tool]]) -> "ToolSet":
        """The ToolSet of `tools`; 400 naming the later of two tools the model would see under one name."""
        out = cls()
        for i, tool in enumerate(tools or ()):
            if tool.is_hosted:
                out.hosted.append(tool.type)
                continue
            members = [(f"tools[{i}]", tool, None)] if tool.type == "function" else \
                [(f"tools[{i}].tools[{j}]", inner, tool) for j, inner in enumerate(tool.tools or ())]
            for where, function, namespace in members:
                chat = function.chat_function(namespace)
                flat = chat["function"]["name"]
                if not NAME_PATTERN.match(flat):
                    raise bad_request(f"{where}.name: {flat!r}, the namespace and the name joined by "
                                      f"{FLAT_SEPARATOR!r}, is the name the model sees, and it is longer than 64 "
                                      "characters: shorten the namespace or the function name", f"{where}.name")
                if flat in out.pairs:
                    raise bad_request(f"{where}: the model would see two functions named {flat!r} (a namespace's "
                                      f"functions are shown as <namespace>{FLAT_SEPARATOR}<name>): give each "
                                      "function its own name", where)
                out.functions.append(chat)
                out.pairs[flat] = (namespace.name if namespace else None, function.name or "")
        return out

    def flat(self, namespace: Optional[str], name: str) -> str:
        """The flat name of a call of `name` in `namespace` (an earlier call sent back, or a tool_choice)."""
        if namespace is None:
            return name
        flat = flat_name(namespace, name)
        if flat not in self.pairs and namespace == DEFAULT_NAMESPACE:
            return name
        return flat

    def pair(self, flat: str) -> tuple[Optional[str], str]:
        """(namespace or None, own name) of a flat name the model called."""
        return self.pairs.get(flat, (None, flat))

    def chosen(self, choice: dict[str, Any], where: str = "tool_choice") -> str:
        """The flat name a {"type": "function", "name", "namespace"?} choice names; 400 naming `where` when it
        names no declared function, or a name that several namespaces hold without saying which."""
        name, namespace = choice["name"], choice.get("namespace")
        if namespace is not None:
            flat = self.flat(namespace, name)
            found = [flat] if flat in self.pairs else []
        elif name in self.pairs:
            found = [name]
        else:
            found = [f for f, (_, own) in self.pairs.items() if own == name]
        if len(found) > 1:
            raise bad_request(f"{where}: {name!r} is a function of several namespaces "
                              f"({', '.join(repr(self.pairs[f][0]) for f in found)}): add \"namespace\"", where)
        if not found:
            declared = ", ".join(repr(n) if ns is None else f"{n!r} (namespace {ns!r})"
                                 for ns, n in self.pairs.values()) or "none"
            what = repr(name) if namespace is None else f"{name!r} in namespace {namespace!r}"
            raise bad_request(f"{where}: {what} is not one of the function tools "
                              f"({declared}): name one of them", where)
        return found[0]


def check_tool_choice(value: Any) -> Any:
    """`value` when it is a `tool_choice` of a shape this server serves: "none" | "auto" | "required" |
    {"type": "function", "name", "namespace"?} | {"type": "allowed_tools", "mode": "auto" | "required", "tools":
    [{"type": "function", "name", "namespace"?} | {"type": "namespace", "name"} | a hosted tool, ...]}; a
    ValueError naming what is wrong otherwise (a choice that forces a hosted or custom tool by its type)."""
    if value is None or value in ("none", "auto", "required"):
        return value
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "function" and isinstance(value.get("name"), str) and isinstance(value.get("namespace"),
                                                                                (str, type(None))):
        return value
    if kind == "allowed_tools":
        tools = value.get("tools")
        if value.get("mode") not in ("auto", "required"):
            raise ValueError("an allowed_tools choice needs 'mode' \"auto\" or \"required\"")
        if not isinstance(tools, list) or not tools or not all(isinstance(t, dict) for t in tools):
            raise ValueError("an allowed_tools choice needs 'tools', a non-empty list of {\"type\": \"function\", "
                             "\"name\": ...}")
        for j, tool in enumerate(tools):
            if is_hosted_type(tool.get("type")):
                continue
            if tool.get("type") not in ("function", "namespace") or not isinstance(tool.get("name"), str) or \
                    not isinstance(tool.get("namespace"), (str, type(None))):
                raise ValueError(f"allowed_tools entry {j} must be {{\"type\": \"function\", \"name\": ...}} "
                                 f"(with \"namespace\" for a namespace's function), {{\"type\": \"namespace\", "
                                 f"\"name\": ...}} or a built-in tool; got {json.dumps(tool)[:200]}")
        return value
    if is_hosted_type(kind):
        raise ValueError(f"{json.dumps({'type': kind})} forces the built-in tool {kind}, which this server cannot "
                         "run: send \"auto\" (the built-in tools are then left out of the prompt), \"none\", or a "
                         "function tool")
    if isinstance(kind, str) and kind != "function":
        raise ValueError(f"choices of type {kind!r} are not supported: this server runs no custom tools; send "
                         "\"none\", \"auto\", \"required\", {\"type\": \"function\", \"name\": ...} or "
                         "{\"type\": \"allowed_tools\", ...}")
    raise ValueError('must be "none", "auto", "required", {"type": "function", "name": ...} or '
                     '{"type": "allowed_tools", "mode": ..., "tools": [...]}')
