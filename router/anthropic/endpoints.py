"""Anthropic's Messages API on the router: POST /v1/messages and POST /v1/messages/count_tokens.

A Messages request is translated into the OpenAI chat request that asks for the same thing (`chat_body`), which
then takes the Chat Completions path (router/params.py: chat template, tools, grammar, GenerateRequests;
router/serving.py: engine, failure rules), with Anthropic's formatter (router/anthropic/format.py):

    system (string or text blocks)     a system message first
    user turn: text blocks             a user message (blocks joined by newlines)
               tool_result blocks      a "tool" message each, `tool_call_id` = tool_use_id, the content's text
                                       (prefixed "Error: " when `is_error`)
    assistant turn: text, tool_use     an assistant message: content and `tool_calls` (id, name, input as JSON)
                    thinking           its `reasoning_content` (the chat template decides whether to render it),
                                       when its signature is this server's token of its text
                                       (router/reasoning_token.py; a changed one is a 400); another server's
                                       signature and redacted_thinking blocks are left out
    system turn (the SDK allows them)  a system message
    tools                              function tools (input_schema -> parameters); server tools (web_search_...,
                                       code_execution_...) left out (a tool_choice naming one is a 400); a
                                       tool with defer_loading
                                       only once a tool_result's tool_reference block names it (as Anthropic's
                                       tool search loads it), the reference itself as "Tool loaded: NAME"
    tool_choice auto | any | tool | none   "auto" | "required" | {"type": "function", ...} | "none";
                                       disable_parallel_tool_use -> parallel_tool_calls false
    stop_sequences, temperature, top_p, top_k, max_tokens, stream   the same sampling fields
    metadata.user_id                   user
    output_config.format               response_format {"type": "json_schema", ...}
    thinking disabled | enabled        reasoning_effort "none" | thinking_token_budget = budget_tokens (a budget
                                       at or over max_tokens never binds: thinking counts toward max_tokens);
             adaptive | between_tools  the template's default (the model decides)
    output_config.effort               reasoning_effort (max as xhigh); the template's effort switch, if any
    context_management.edits           clear_thinking_20251015: the reasoning of all but the last `keep`
                                       assistant turns that have some is dropped (the answer's
                                       `context_management.applied_edits` says how many turns)

Consecutive turns of one role are merged first (as Anthropic does). A conversation that ends with an assistant
turn (a prefill to continue) is refused with a 400, as Anthropic does for models without prefill. Errors on these
paths take Anthropic's shape (router/errors.py); a 400 from the chat path names the Anthropic field
(`_anthropic_names`). count_tokens renders the same prompt (tools included) and counts its tokens; a prompt
that leaves no room in the context is refused as a Messages request is (400 context_length_exceeded, after
bounded work for one far over it), so a body far over the context is never tokenized whole.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from router.anthropic.output import CountTokensResponse
from router.anthropic.format import AnthropicFormatter
from router.anthropic.request import (CountTokensRequest, MessageParam, MessagesRequest, RedactedThinkingBlockParam,
                                      ServerToolParam, TextBlockParam, ThinkingBlockParam, ToolParam,
                                      ToolResultBlockParam, ToolUseBlockParam)
from router.errors import APIError, bad_request, from_validation_error
from router.openai.request import ChatCompletionRequest
from router.params import clamp_max_tokens, tokenize_chat
from router.reasoning_token import TokenChanged, is_ours, read_token
from router.serving import FrontDoor, ServingContext, serve

_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_RENAMES = [(re.compile(r"^response_format\.json_schema\.schema"), "output_config.format.schema"),
            (re.compile(r"^response_format"), "output_config.format"),
            (re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
            (re.compile(r"^tools\[(\d+)\]\.function\.(\w+)"), r"tools[\1].\2"),
            (re.compile(r"^stop\b"), "stop_sequences"),
            (re.compile(r"^max_completion_tokens\b"), "max_tokens")]


def _anthropic_names(error: APIError) -> APIError:
    """`error` with an OpenAI field name at the start of its param and message replaced by the Anthropic one."""
    for pattern, name in _RENAMES:
        if error.param and pattern.match(error.param):
            old, error.param = error.param, pattern.sub(name, error.param)
            if error.message.startswith(old):
                error.message = error.param + error.message[len(old):]
            break
    return error


def _merged(turns: list[MessageParam]) -> list[tuple[str, list[Any]]]:
    """(role, blocks) of the turns, consecutive turns of one role merged into one."""
    out: list[tuple[str, list[Any]]] = []
    for turn in turns:
        if out and out[-1][0] == turn.role:
            out[-1][1].extend(turn.content)
        else:
            out.append((turn.role, list(turn.content)))
    return out


def _check_blocks(turns: list[MessageParam], model: str) -> None:
    """400 naming the block for a tool_use or thinking block outside an assistant turn, a tool_result outside a
    user turn, a tool_result whose tool_use_id names no earlier tool_use, or a thinking block whose signature is
    this server's but does not verify; and for a last turn from the assistant."""
    called: set[str] = set()
    for i, turn in enumerate(turns):
        for j, block in enumerate(turn.content):
            where = f"messages[{i}].content[{j}]"
            if isinstance(block, (ThinkingBlockParam, RedactedThinkingBlockParam)):
                if turn.role != "assistant":
                    raise bad_request(f"{where}: {block.type} blocks belong to assistant turns: send them back in "
                                      "the assistant turn that produced them", where)
                if isinstance(block, ThinkingBlockParam):
                    _vouched(block, model, f"{where}.signature")
            elif isinstance(block, ToolUseBlockParam):
                if turn.role != "assistant":
                    raise bad_request(f"{where}: tool_use blocks belong to assistant turns: move it to the "
                                      "assistant turn that made the call", where)
                called.add(block.id)
            elif isinstance(block, ToolResultBlockParam):
                if turn.role != "user":
                    raise bad_request(f"{where}: tool_result blocks belong to user turns: send the result in the "
                                      "user turn after the call", where)
                if block.tool_use_id not in called:
                    raise bad_request(f"{where}.tool_use_id: {block.tool_use_id!r} matches no tool_use block of an "
                                      "earlier assistant turn: send the id of the call this result answers",
                                      f"{where}.tool_use_id")
    if turns and turns[-1].role == "assistant":
        last = f"messages[{len(turns) - 1}]"
        raise bad_request(f"{last}: the conversation ends with an assistant turn (a prefill to continue), which "
                          "this server does not support: end with a user turn", last)


def _text(blocks: list[TextBlockParam]) -> str:
    return "\n".join(b.text for b in blocks)


def _vouched(block: ThinkingBlockParam, model: str, where: str) -> Optional[str]:
    """The reasoning a thinking block's signature carries when it is this server's token (None for another
    server's); 400 naming `where` when the token was changed or the block's text is not the one it carries."""
    if not is_ours(block.signature):
        return None
    try:
        text = read_token(block.signature, model)
    except TokenChanged as exc:
        raise bad_request(f"{where}: the thinking block's signature does not verify: {exc}", where) from None
    if block.thinking and block.thinking != text:
        raise bad_request(f"{where}: the thinking block was changed after this server sent it: send it back "
                          "unchanged, or leave it out", where)
    return text


def _reasoning(blocks: list[Any], model: str) -> Optional[str]:
    """The reasoning of an assistant turn's thinking blocks this server vouches for (None when there is none)."""
    texts = [_vouched(b, model, "") for b in blocks if isinstance(b, ThinkingBlockParam)]
    texts = [t for t in texts if t]
    return "\n\n".join(texts) if texts else None


def _clear_thinking(messages: list[dict[str, Any]], keep: Optional[int]) -> list[str]:
    """Drop `reasoning_content` from all but the last `keep` assistant messages that have it (None keeps all);
    returns the texts dropped."""
    having = [m for m in messages if m.get("reasoning_content")]
    cleared = having[:max(0, len(having) - keep)] if keep is not None else []
    return [m.pop("reasoning_content") for m in cleared]


def thinking_cleared(req: CountTokensRequest, model: str) -> list[list[str]]:
    """For each context edit of `req`, in order, the reasoning texts it drops."""
    messages = _messages(req, model, apply_edits=False)
    return [_clear_thinking(messages, edit.keep_turns)
            for edit in (req.context_management.edits if req.context_management else ())]


def _messages(req: CountTokensRequest, model: str, apply_edits: bool = True) -> list[dict[str, Any]]:
    """The OpenAI chat messages of the system prompt and the turns (see the module docstring), after the
    request's context edits unless `apply_edits` is false."""
    _check_blocks(req.messages, model)
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    for role, blocks in _merged(req.messages):
        if role == "assistant":
            texts = [b for b in blocks if isinstance(b, TextBlockParam)]
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if isinstance(b, ToolUseBlockParam)]
            message: dict[str, Any] = {"role": "assistant", "content": _text(texts) if texts or not calls else None}
            if calls:
                message["tool_calls"] = calls
            reasoning = _reasoning(blocks, model)
            if reasoning:
                message["reasoning_content"] = reasoning
            out.append(message)
            continue
        pending: list[TextBlockParam] = []
        for block in blocks:
            if isinstance(block, ToolResultBlockParam):
                if pending:
                    out.append({"role": role, "content": _text(pending)})
                    pending = []
                text = "Error: " + block.text if block.is_error else block.text
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
            else:
                pending.append(block)
        if pending:
            out.append({"role": role, "content": _text(pending)})
    if apply_edits and req.context_management is not None:
        for edit in req.context_management.edits:
            _clear_thinking(out, edit.keep_turns)
    return out


_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}


def chat_body(req: Union[CountTokensRequest, MessagesRequest], model: str) -> dict[str, Any]:
    """The OpenAI chat request body (for ChatCompletionRequest) asking for what `req` asks of served model
    `model`; 400 naming the field for turns that do not fit together (`_check_blocks`)."""
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req, model)}
    effort = req.output_config.effort if req.output_config is not None else None
    if effort is not None:
        body["reasoning_effort"] = _EFFORTS[effort]
    if req.thinking is not None and req.thinking.type == "disabled":
        body["reasoning_effort"] = "none"
    elif req.thinking is not None and req.thinking.type == "enabled":
        body["thinking_token_budget"] = req.thinking.budget_tokens
    loaded = {name for turn in req.messages for block in turn.content if isinstance(block, ToolResultBlockParam)
              for name in block.referenced_tools}
    tools = [t for t in req.tools or () if isinstance(t, ToolParam) and (not t.defer_loading or t.name in loaded)]
    hosted = {t.name for t in req.tools or () if isinstance(t, ServerToolParam)}
    if tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description is not None else {})}} for t in tools]
    choice = req.tool_choice
    if choice is not None and choice.type == "tool" and choice.name in hosted:
        raise bad_request(f"tool_choice: {choice.name!r} is a server tool, which this server does not run: "
                          "choose a custom tool, \"auto\" or \"none\"", "tool_choice")
    if choice is not None:
        body["tool_choice"] = (_CHOICES[choice.type] if choice.type in _CHOICES
                               else {"type": "function", "function": {"name": choice.name}})
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.output_config is not None and req.output_config.format is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": req.output_config.format.schema_}}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stream=req.stream, temperature=req.temperature, top_p=req.top_p,
                    top_k=req.top_k, stop=req.stop_sequences,
                    user=req.metadata.user_id if req.metadata is not None else None)
    return body


def to_chat_request(req: Union[CountTokensRequest, MessagesRequest], context: dict[str, Any]) -> ChatCompletionRequest:
    """The validated ChatCompletionRequest of `req` (a 400 naming the Anthropic field when it does not validate);
    `context["served_model"]` keys the thinking signatures."""
    try:
        return ChatCompletionRequest.model_validate(chat_body(req, context.get("served_model", "")), context=context)
    except ValidationError as exc:
        raise _anthropic_names(from_validation_error(exc)) from None


def _translate(req: MessagesRequest, _model: str, context: dict[str, Any]) -> ChatCompletionRequest:
    return to_chat_request(req, context)


def _formatter(req: MessagesRequest, prepared: Any, ctx: ServingContext, _created: int) -> AnthropicFormatter:
    """Anthropic's formatter for `req`: thinking signed for the served model, shown or omitted as asked, and the
    context edits that dropped reasoning reported (each with the tokens its dropped text makes)."""
    edits = None
    if req.context_management is not None:
        edits = [{"type": edit.type, "cleared_thinking_turns": len(texts),
                  "cleared_input_tokens": sum(len(ctx.tokenizer.encode(t)) for t in texts)}
                 for edit, texts in zip(req.context_management.edits, thinking_cleared(req, ctx.served_model))
                 if texts]
    omit = req.thinking is not None and req.thinking.display == "omitted"
    return AnthropicFormatter(prepared, req.max_tokens, ctx.served_model, omit, edits)


MESSAGES = FrontDoor(MessagesRequest, "msg_", _translate, _formatter, rename=_anthropic_names)


def install_anthropic_api(app: FastAPI, ctx: ServingContext) -> None:
    """Add the Messages endpoints to the router's `app`, served with `ctx`."""

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        """Anthropic's Messages: one answer (JSON, or Anthropic's SSE events with "stream": true)."""
        return await serve(request, MESSAGES, ctx)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> JSONResponse:
        """The number of tokens of the prompt a Messages request renders to (system, turns and tools); a prompt
        that leaves no room in the context is the 400 a Messages request gets, found after bounded work."""
        req = await ctx.read(request, CountTokensRequest)
        ctx.resolve_model(req.model)
        chat = to_chat_request(req, ctx.context)
        max_model_len = ctx.engine.max_model_len
        try:
            _, ids = await tokenize_chat(chat, ctx.tokenizer, max_model_len)
            clamp_max_tokens(None, len(ids), max_model_len, "messages")
        except APIError as exc:
            raise _anthropic_names(exc) from None
        return JSONResponse(CountTokensResponse(input_tokens=len(ids)).model_dump())
