"""POST /v1/responses: OpenAI's Responses API, stateless, served through the chat completions path.

A request is validated (router/responses/request.py: every key of OpenAI's ResponseCreateParams honoured,
echoed or refused by name), translated into the OpenAI chat request it means, and then takes the chat
path unchanged (`prepare_chat`: template, tools, grammar, sampling; `serve_prepared`: engine, SSE, errors),
with its own formatter (router/responses/format.py). The translation:

    instructions                     a first system message
    input "text"                     one user message
    message items                    messages of the same role (developer as system), their parts' text joined
    function_call items              the assistant turn's tool_calls (consecutive calls, and a message of the
                                     assistant just before them, form one turn)
    function_call_output items       tool messages answering their call_id (which must name an earlier call)
    tools [{type: function, ...}]    tools [{type: function, function: {name, description, parameters, strict}}]
    tool_choice {type: function}     {type: function, function: {name}}; allowed_tools: the listed tools only,
                                     with its mode ("auto" or "required")
    text.format                      response_format (text, json_object, json_schema {name, schema, strict})
    max_output_tokens                max_completion_tokens
    include output_text.logprobs     logprobs: true with top_logprobs (0 unless given)
    temperature, top_p, parallel_tool_calls, stream, user        the same fields

Stateless: `previous_response_id`, `conversation`, `store: true` and `background: true` are refused with a
400 that says to send the whole conversation in `input`; nothing is kept after a response is sent. Errors
of the chat path name the Responses field (`messages` -> `input`, `response_format` -> `text.format`,
`max_completion_tokens` -> `max_output_tokens`).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response

from router.errors import APIError, bad_request
from router.openai.request import ChatCompletionRequest
from router.responses.request import ResponsesRequest, TextConfig, parts_text
from router.responses.format import ResponsesFormatter
from router.serving import FrontDoor, ServingContext, serve

_RENAMES = ((re.compile(r"^messages.*"), "input"),
            (re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
            (re.compile(r"^response_format.*"), "text.format"),
            (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
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


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of `instructions` and `input` (see the module docstring); 400 naming the item for a
    function_call_output whose call_id answers no earlier function_call."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    calls: set[str] = set()
    for i, item in enumerate(req.input):
        if item.type == "message":
            messages.append({"role": item.role, "content": parts_text(item.content or [])})
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            calls.add(item.call_id or "")
        else:
            if item.call_id not in calls:
                raise bad_request(f"input[{i}].call_id: {item.call_id!r} answers no function_call item before it "
                                  "in input: send the function_call item (call_id, name, arguments) first",
                                  f"input[{i}].call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": parts_text(item.output or [])})
    return messages


def chat_tools(req: ResponsesRequest) -> tuple[Optional[list[dict[str, Any]]], Any]:
    """(chat `tools`, chat `tool_choice`) of the request; 400 naming tool_choice for an allowed_tools choice
    that lists a function not in tools."""
    tools = [{"type": "function", "function": {k: v for k, v in (("name", t.name), ("description", t.description),
                                                                  ("parameters", t.parameters), ("strict", t.strict))
                                               if v is not None}} for t in req.tools or ()]
    choice = req.tool_choice
    if isinstance(choice, dict) and choice["type"] == "function":
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif isinstance(choice, dict):  # allowed_tools: the model sees and may call the listed tools only
        allowed = [t["name"] for t in choice["tools"]]
        names = [t["function"]["name"] for t in tools]
        missing = [n for n in allowed if n not in names]
        if missing:
            raise bad_request(f"tool_choice: allowed_tools lists {', '.join(map(repr, missing))}, not among tools "
                              f"({', '.join(map(repr, names)) or 'none'}): list tools that are declared",
                              "tool_choice")
        tools, choice = [t for t in tools if t["function"]["name"] in allowed], choice["mode"]
    return tools or None, choice


def chat_response_format(text: Optional[TextConfig]) -> Optional[dict[str, Any]]:
    """The chat `response_format` of `text.format` (None for free text)."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def chat_body(req: ResponsesRequest, model: str) -> dict[str, Any]:
    """The OpenAI chat request (a JSON-shaped dict) that means the same as `req`; 400 naming the field for
    what only shows across fields (top_logprobs without the logprobs include, a call_id that answers nothing)."""
    if req.top_logprobs and not req.wants_logprobs:
        raise bad_request("top_logprobs: the alternatives come with the logprobs: add "
                          "\"message.output_text.logprobs\" to include, or leave top_logprobs out", "top_logprobs")
    tools, tool_choice = chat_tools(req)
    body = {"model": model, "messages": chat_messages(req), "stream": bool(req.stream),
            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": chat_response_format(req.text), "user": req.user}
    if req.wants_logprobs:
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    return {k: v for k, v in body.items() if v is not None}


def _translate(req: ResponsesRequest, model: str, context: dict[str, Any]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(chat_body(req, model), context=context)


RESPONSES = FrontDoor(ResponsesRequest, "resp_", _translate,
                      lambda req, prepared, ctx, created: ResponsesFormatter(prepared, ctx.tokenizer, req, created),
                      rename=renamed)


def install_responses_api(app: FastAPI, ctx: ServingContext) -> None:
    """Add POST /v1/responses to the router's `app`, served with `ctx`."""

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, stateless: the whole conversation in `input`, nothing stored."""
        return await serve(request, RESPONSES, ctx)
