"""POST /v1/responses: OpenAI's Responses API, stateless, served through the chat completions path.

A request is validated (router/responses/request.py: every key of OpenAI's ResponseCreateParams honoured,
accepted or refused by name), translated into the OpenAI chat request it means, and then takes the chat
path unchanged (`prepare_chat`: template, tools, grammar, sampling; `serve_prepared`: engine, SSE, errors),
with its own formatter (router/responses/format.py). The translation:

    instructions                     a first system message
    input "text"                     one user message
    message items                    messages of the same role (developer as system), their parts' text joined
    function_call items              the assistant turn's tool_calls (consecutive calls, and a message of the
                                     assistant just before them, form one turn); a call with `namespace` is
                                     named by its flat name <namespace>__<name>
    function_call_output items       tool messages answering their call_id (which must name an earlier call)
    reasoning items                  the `reasoning_content` of the next assistant turn: content's reasoning_text
                                     parts, else the summary, else the text this server's encrypted_content
                                     carries (router/reasoning_token.py; another server's is left
                                     out, a changed one is a 400); with reasoning.context "current_turn" only
                                     the turns after the last user message keep theirs
    tools                            function tools as chat tools; a namespace's functions as chat tools named
                                     <namespace>__<name>; hosted tools left out (router/responses/tools.py)
    tool_choice {type: function}     {type: function, function: {name}} (the flat name for a namespace's
                                     function); allowed_tools: the listed functions only (a listed namespace:
                                     all of its functions), with its mode ("auto" or "required"); "auto" with no
                                     function left to call is dropped; a choice that can only be met by a hosted
                                     tool is a 400 naming tool_choice
    text.format                      response_format (text, json_object, json_schema {name, schema, strict})
    reasoning.effort                 reasoning_effort ("max" as "xhigh")
    thinking_token_budget            the same (vLLM's extension): the most reasoning tokens
    max_output_tokens                max_completion_tokens
    include output_text.logprobs     logprobs: true with top_logprobs (0 unless given)
    temperature, top_p, parallel_tool_calls, stream, user        the same fields

Stateless: `previous_response_id`, `conversation` and `background: true` are refused with a 400 that says to
send the whole conversation in `input`; nothing is kept after a response is sent. Nothing is compacted: POST
/v1/responses/compact, compaction items and `context_management` are a 400 that says how to compact on the
client. Errors of the chat path name the Responses field (`messages` -> `input`, `response_format` ->
`text.format`, `max_completion_tokens` -> `max_output_tokens`, `reasoning_effort` -> `reasoning.effort`).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response

from router.errors import APIError, bad_request
from router.openai.request import ChatCompletionRequest
from router.responses.fields import NO_COMPACTION
from router.responses.format import ResponsesFormatter
from router.reasoning_token import TokenChanged, read_token
from router.responses.request import InputItem, ResponsesRequest, TextConfig, parts_text
from router.responses.tools import ToolSet
from router.serving import FrontDoor, ServingContext, serve

_RENAMES = ((re.compile(r"^messages.*"), "input"),
            (re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
            (re.compile(r"^response_format.*"), "text.format"),
            (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
            (re.compile(r"^reasoning_effort"), "reasoning.effort"),
            (re.compile(r"^(tools\[\d+\])\.function"), r"\1"))


def responses_name(chat_field: str) -> str:
    """The Responses API's name of a chat request field (`messages[2].content` -> `input`)."""
    for pattern, name in _RENAMES:
        renamed, count = pattern.subn(name, chat_field, count=1)
        if count:
            return renamed
    return chat_field


def renamed(exc: APIError) -> APIError:
    """`exc` with its field (`param`, and the message's leading "field: ") named as the Responses API names it."""
    if not exc.param:
        return exc
    message = exc.message
    if message.startswith(exc.param + ":"):
        message = responses_name(exc.param) + message[len(exc.param):]
    return APIError(exc.status, message, param=responses_name(exc.param), code=exc.code, type=exc.type,
                    headers=exc.headers)


def _reasoning_text(item: InputItem, model: str, where: str) -> Optional[str]:
    """A reasoning item's text: what this server's encrypted_content carries, else its parts' text (None for
    neither); 400 naming the item's encrypted_content when a token of this server's form was changed, or its
    content when the text differs from what the token carries."""
    text = item.reasoning_text
    if item.encrypted_content:
        try:
            carried = read_token(item.encrypted_content, model)
        except TokenChanged as exc:
            raise bad_request(f"{where}.encrypted_content: {exc}", f"{where}.encrypted_content") from None
        if carried is not None and text is not None and text != carried:
            raise bad_request(f"{where}.content: the reasoning item's text is not the one its encrypted_content "
                              "carries (it was changed after this server sent it): send the item back unchanged",
                              f"{where}.content")
        text = carried if carried is not None else text
    return text or None


def chat_messages(req: ResponsesRequest, tools: Optional[ToolSet] = None, model: str = "") -> list[dict[str, Any]]:
    """The chat messages of `instructions` and `input` (see the module docstring); function calls named by the
    flat names of `tools`; reasoning read with served model `model`'s key. 400 naming the item for a
    function_call_output whose call_id answers no earlier function_call."""
    tools = tools or ToolSet()
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    calls: set[str] = set()
    reasoning: list[str] = []  # read from reasoning items, for the next assistant turn
    current_turn = req.reasoning is not None and req.reasoning.context == "current_turn"

    def assistant_turn(join: bool) -> dict[str, Any]:
        last = messages[-1] if messages else None
        if not (join and last is not None and last["role"] == "assistant"):
            last = {"role": "assistant", "content": None}
            messages.append(last)
        if reasoning:
            last["reasoning_content"] = "\n".join(filter(None, [last.get("reasoning_content"), *reasoning]))
            reasoning.clear()
        return last

    for i, item in enumerate(req.input):
        if item.type == "reasoning":
            text = _reasoning_text(item, model, f"input[{i}]")
            if text:
                reasoning.append(text)
        elif item.type == "message" and item.role == "assistant":
            assistant_turn(join=False)["content"] = parts_text(item.content or [])
        elif item.type == "message":
            reasoning.clear()  # reasoning not followed by an assistant turn belongs to none
            messages.append({"role": item.role, "content": parts_text(item.content or [])})
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": tools.flat(item.namespace, item.name or ""), "arguments": item.arguments}}
            assistant_turn(join=True).setdefault("tool_calls", []).append(call)
            calls.add(item.call_id or "")
        else:
            if item.call_id not in calls:
                raise bad_request(f"input[{i}].call_id: {item.call_id!r} answers no function_call item before it "
                                  "in input: send the function_call item (call_id, name, arguments) first",
                                  f"input[{i}].call_id")
            reasoning.clear()
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": parts_text(item.output or [])})
    if current_turn:
        last_user = max((j for j, m in enumerate(messages) if m["role"] == "user"), default=-1)
        for message in messages[:last_user]:
            message.pop("reasoning_content", None)
    return messages


def chat_tools(req: ResponsesRequest, tools: Optional[ToolSet] = None) -> tuple[Optional[list[dict[str, Any]]], Any]:
    """(chat `tools`, chat `tool_choice`) of the request: its functions, namespaces flattened and hosted tools
    left out (`tools`, router/responses/tools.py). 400 naming tool_choice for a choice that names no declared
    function, or one that requires a call when only hosted tools are left to call."""
    tools = tools or ToolSet.of(req.tools)
    functions, choice = tools.functions, req.tool_choice
    if isinstance(choice, dict) and choice["type"] == "function":
        choice = {"type": "function", "function": {"name": tools.chosen(choice)}}
    elif isinstance(choice, dict):  # allowed_tools: the model sees and may call the listed functions only
        allowed: set[str] = set()
        for j, entry in enumerate(choice["tools"]):
            if entry["type"] == "function":
                allowed.add(tools.chosen(entry))
            elif entry["type"] == "namespace":
                members = {f for f, (ns, _) in tools.pairs.items() if ns == entry["name"]}
                if not members:
                    raise bad_request(f"tool_choice: allowed_tools entry {j} names the namespace {entry['name']!r}, "
                                      "which is not among tools: list tools that are declared", "tool_choice")
                allowed |= members
        functions = [t for t in functions if t["function"]["name"] in allowed]
        choice = choice["mode"]
        if not functions and choice == "required":
            raise bad_request("tool_choice: allowed_tools with mode \"required\" lists only built-in tools, which "
                              "this server cannot run: list function tools, or send mode \"auto\"", "tool_choice")
    if not functions and tools.hosted and choice == "required":
        raise bad_request(f"tool_choice: \"required\" asks for a tool call, but the only tools are built-in tools "
                          f"this server cannot run ({', '.join(tools.hosted)}): send function tools, or send "
                          "\"auto\"", "tool_choice")
    if not functions and choice == "auto":
        choice = None  # nothing to call: the model answers in text, as "auto" lets it
    return functions or None, choice


def chat_response_format(text: Optional[TextConfig]) -> Optional[dict[str, Any]]:
    """The chat `response_format` of `text.format` (None for free text)."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def chat_body(req: ResponsesRequest, model: str, served_model: Optional[str] = None) -> dict[str, Any]:
    """The OpenAI chat request (a JSON-shaped dict) that means the same as `req`; 400 naming the field for
    what only shows across fields (top_logprobs without the logprobs include, a call_id that answers nothing,
    two tools under one name). `served_model`: the name reasoning tokens are keyed with (default `model`)."""
    if req.top_logprobs and not req.wants_logprobs:
        raise bad_request("top_logprobs: the alternatives come with the logprobs: add "
                          "\"message.output_text.logprobs\" to include, or leave top_logprobs out", "top_logprobs")
    toolset = ToolSet.of(req.tools)
    tools, tool_choice = chat_tools(req, toolset)
    body = {"model": model, "messages": chat_messages(req, toolset, served_model or model), "stream": bool(req.stream),
            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": chat_response_format(req.text), "user": req.user,
            "reasoning_effort": req.reasoning.chat_effort if req.reasoning else None,
            "thinking_token_budget": req.thinking_token_budget}
    if req.wants_logprobs:
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    return {k: v for k, v in body.items() if v is not None}


def _translate(req: ResponsesRequest, model: str, context: dict[str, Any]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(chat_body(req, model, context.get("served_model")), context=context)


RESPONSES = FrontDoor(ResponsesRequest, "resp_", _translate,
                      lambda req, prepared, ctx, created: ResponsesFormatter(prepared, ctx.tokenizer, req, created,
                                                                              ctx.served_model),
                      rename=renamed)


def install_responses_api(app: FastAPI, ctx: ServingContext) -> None:
    """Add POST /v1/responses (served with `ctx`) and POST /v1/responses/compact (refused) to the router's `app`."""

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, stateless: the whole conversation in `input`, nothing stored."""
        return await serve(request, RESPONSES, ctx)

    @app.post("/v1/responses/compact", include_in_schema=False)
    async def compact(request: Request) -> Response:
        """OpenAI's remote compaction: refused with a 400 that says what to do instead (NO_COMPACTION)."""
        raise bad_request(f"POST /v1/responses/compact: {NO_COMPACTION}")
