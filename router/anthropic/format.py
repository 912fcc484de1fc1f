"""Turning engine deltas into Anthropic Messages bodies: the whole `Message` and its streamed events.

A choice's reasoning and text (the text split into text and tool calls by the request's tool parser,
router/tool_calls.py, when it has tools) become content blocks in order, the same way for both forms
(`BlockBuilder`):

    reasoning                 {"type": "thinking", "thinking", "signature"}: the signature is this server's token
                              of the text (router/reasoning_token.py), which carries it; with
                              `thinking.display: "omitted"` the block's own text is ""
    text                      {"type": "text", "text"}
    a tool call               {"type": "tool_use", "id": "toolu_...", "name", "input": {...}}

Streamed, as Anthropic's Messages streaming events (SSE with `event: <type>` lines):

    message_start             the message with `content: []`, stop_reason null and the input usage (sent
                              with the first delta, when the prefix cache's hit is known)
    content_block_start       a block opens: thinking with "" and signature "", text with "", tool_use with
                              `input: {}`
    content_block_delta       {"type": "thinking_delta", "thinking"} (none when the display is omitted), then
                              {"type": "signature_delta", "signature"} just before the block closes |
                              {"type": "text_delta", "text"} | {"type": "input_json_delta", "partial_json"}
                              (a call's input arrives whole, in one delta, once the model has written it)
    content_block_stop        a block closes (the next block opens, or the answer ends)
    message_delta             stop_reason, stop_sequence and the final usage (output_tokens)
    message_stop
    error                     {"type": "error", "error": {...}} when the stream fails after it started

stop_reason: "tool_use" when the model made calls and stopped by itself; "stop_sequence" (with
`stop_sequence`) when one of the request's stop sequences ended it (`RequestOutput.stop_string`); "end_turn"
for the model's own end; "max_tokens" when it reached the request's max_tokens, and
"model_context_window_exceeded" when it reached the end of the context first. Cut inside a tool call, the
answer keeps the calls completed before it (tool_use blocks) and drops the cut one's text
(router/tool_calls.py), so no block, streamed or not, holds any of it.

usage: `input_tokens` + `cache_read_input_tokens` is the prompt (the second the part the prefix cache served),
`output_tokens` the tokens generated, as Anthropic counts them, of which `output_tokens_details.thinking_tokens`
reasoned. A request with `context_management` gets the answer's `context_management.applied_edits`: one entry
per clear_thinking edit that dropped reasoning (`cleared_thinking_turns`, `cleared_input_tokens`).
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from cluster.request import RequestOutput
from router.anthropic.output import (MessageResponse, MessageUsage, OutputTokensDetails, StopReason, TextOut,
                                     ThinkingOut, ToolUseOut)
from router.errors import APIError
from router.openai.request import Usage
from router.params import PreparedRequest
from router.reasoning_token import make_token
from router.choices import Accumulator, ChoiceState
from router.tool_calls import ContentDelta, ToolCallArguments, ToolCallStarted, ToolCallStream, ToolEvent


def named_event(payload: dict[str, Any]) -> str:
    """One Anthropic SSE event: `event: <payload type>` and the payload as its data."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def tool_use_id(call_id: str) -> str:
    """Anthropic's "toolu_..." id for a parsed call's "call_..." id."""
    return "toolu_" + call_id.removeprefix("call_")


Block = Union[ThinkingOut, TextOut, ToolUseOut]


class BlockBuilder:
    """Content blocks from a choice's reasoning and tool events, in order; `events` are the streaming events each
    step made. `model` keys the thinking blocks' signatures; `omit_thinking` sends them with empty text."""

    def __init__(self, model: str = "", omit_thinking: bool = False) -> None:
        self.blocks: list[Block] = []
        self._arguments: list[str] = []  # the open tool_use block's input JSON so far
        self._thinking: list[str] = []  # the open thinking block's text so far
        self._open = False
        self._model, self._omit = model, omit_thinking

    def _start(self, block: Block, out: list[dict[str, Any]]) -> None:
        self.close(out)
        self.blocks.append(block)
        self._open = True
        shown = block.model_dump()
        if isinstance(block, ToolUseOut):
            shown["input"] = {}
        out.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": shown})

    def think(self, text: str, out: list[dict[str, Any]]) -> None:
        """Add reasoning text, appending the streaming events it makes to `out`."""
        if not text:
            return
        if not (self._open and isinstance(self.blocks[-1], ThinkingOut)):
            self._start(ThinkingOut(thinking=""), out)
            self._thinking = []
        self._thinking.append(text)
        if not self._omit:
            out.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                        "delta": {"type": "thinking_delta", "thinking": text}})

    def add(self, event: ToolEvent, out: list[dict[str, Any]]) -> None:
        """Apply one parser event, appending the streaming events it makes to `out`."""
        index = len(self.blocks) - 1
        if isinstance(event, ContentDelta):
            if not event.text:
                return
            if not (self._open and isinstance(self.blocks[-1], TextOut)):
                self._start(TextOut(text=""), out)
                index = len(self.blocks) - 1
            self.blocks[-1].text += event.text
            out.append({"type": "content_block_delta", "index": index,
                        "delta": {"type": "text_delta", "text": event.text}})
        elif isinstance(event, ToolCallStarted):
            self._start(ToolUseOut(id=tool_use_id(event.id), name=event.name, input={}), out)
            self._arguments = []
        elif isinstance(event, ToolCallArguments) and self._open and isinstance(self.blocks[-1], ToolUseOut):
            self._arguments.append(event.text)
            out.append({"type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": event.text}})

    def close(self, out: list[dict[str, Any]]) -> None:
        """Close the open block (a tool_use block gets its input parsed from the arguments JSON)."""
        if not self._open:
            return
        block = self.blocks[-1]
        if isinstance(block, ToolUseOut):
            block.input = json.loads("".join(self._arguments) or "{}")  # the parser checked it is an object
        elif isinstance(block, ThinkingOut):
            text = "".join(self._thinking)
            block.thinking = "" if self._omit else text
            block.signature = make_token(text, self._model)
            out.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                        "delta": {"type": "signature_delta", "signature": block.signature}})
        out.append({"type": "content_block_stop", "index": len(self.blocks) - 1})
        self._open = False

    @property
    def num_calls(self) -> int:
        """How many tool_use blocks there are."""
        return sum(isinstance(b, ToolUseOut) for b in self.blocks)


def stop_reason(state: ChoiceState, num_calls: int, max_tokens: int) -> tuple[Optional[StopReason], Optional[str]]:
    """(stop_reason, stop_sequence) of a finished choice (rules in the module docstring); `max_tokens` is what the
    request asked for, before the context clamped it."""
    if state.finish_reason == "stop":
        if num_calls:
            return "tool_use", None
        if state.stop_string is not None:
            return "stop_sequence", state.stop_string
        return "end_turn", None
    if state.finish_reason == "length":
        return ("max_tokens" if state.num_tokens >= max_tokens else "model_context_window_exceeded"), None
    return None, None


class AnthropicFormatter:
    """The body and the events of one POST /v1/messages (one choice); `max_tokens` is the request's own, `model`
    the served model's name (it keys thinking signatures), `omit_thinking` the request's `thinking.display` is
    "omitted", `applied_edits` the answer's `context_management.applied_edits` (None: the request sent none)."""

    def __init__(self, prepared: PreparedRequest, max_tokens: int, model: str = "", omit_thinking: bool = False,
                 applied_edits: Optional[list[dict[str, Any]]] = None):
        self.p = prepared
        self.max_tokens = max_tokens
        self._builder = BlockBuilder(model, omit_thinking)
        self._edits = applied_edits
        self._stream: Optional[ToolCallStream] = None
        self._started = False

    def _parse(self, state: ChoiceState, text: str, finished: bool) -> list[ToolEvent]:
        if self.p.tool_parser is None:
            return [ContentDelta(text)]
        if self._stream is None:
            self._stream = self.p.tool_parser.stream(self.p.tools, self.p.max_tool_calls)
        events = self._stream.feed(text) if text else []
        return events + (self._stream.finish(state.finish_reason) if finished else [])

    def _usage(self, state: ChoiceState, output_tokens: int, thinking_tokens: int) -> MessageUsage:
        prompt = len(self.p.prompt_token_ids)
        cached = min(state.num_cached_tokens, prompt)
        return MessageUsage(input_tokens=prompt - cached, output_tokens=output_tokens,
                            cache_read_input_tokens=cached,
                            output_tokens_details=OutputTokensDetails(thinking_tokens=thinking_tokens))

    def _message(self, state: ChoiceState, content: list[Block], finished: bool) -> MessageResponse:
        reason, sequence = stop_reason(state, self._builder.num_calls, self.max_tokens) if finished else (None, None)
        usage = self._usage(state, state.num_tokens, state.num_reasoning_tokens) if finished else self._usage(
            state, 0, 0)
        edits = {"applied_edits": self._edits} if self._edits is not None else None
        return MessageResponse(id=self.p.request_id, model=self.p.model, content=content, stop_reason=reason,
                               stop_sequence=sequence, usage=usage, context_management=edits)

    def first_chunks(self) -> list[str]:
        """Nothing: `message_start` goes out with the first delta, which tells the prefix cache's hit."""
        return []

    def delta_chunk(self, state: ChoiceState, out: RequestOutput) -> list[str]:
        """The events of one delta: `message_start` first, block events, and on the last delta the closing
        `content_block_stop`, `message_delta` and `message_stop`."""
        payloads: list[dict[str, Any]] = []
        if not self._started:
            self._started = True
            payloads.append({"type": "message_start",
                             "message": self._message(state, [], finished=False).model_dump()})
        self._builder.think(out.reasoning_text, payloads)
        for event in self._parse(state, out.text, out.finished):
            self._builder.add(event, payloads)
        if out.finished:
            self._builder.close(payloads)
            final = self._message(state, [], finished=True)
            delta: dict[str, Any] = {"type": "message_delta",
                                     "delta": {"stop_reason": final.stop_reason, "stop_sequence": final.stop_sequence},
                                     "usage": final.usage.model_dump(exclude={"service_tier"})}
            if final.context_management is not None:
                delta["context_management"] = final.context_management
            payloads.append(delta)
            payloads.append({"type": "message_stop"})
        return [named_event(p) for p in payloads]

    def usage_chunk(self, usage: Usage) -> str:
        """Never asked for (a Messages request has no stream_options): the usage rides on `message_delta`."""
        return ""

    def response(self, acc: Accumulator) -> MessageResponse:
        """The non-streamed answer."""
        state = acc.choices[0]
        for delta in state.deltas:  # as the stream sent them: reasoning and text in the order written
            self._builder.think(delta.reasoning, [])
            for event in self._parse(state, delta.text, False) if delta.text else ():
                self._builder.add(event, [])
        for event in self._parse(state, "", True):
            self._builder.add(event, [])
        self._builder.close([])
        return self._message(state, self._builder.blocks, finished=True)

    def frame(self, chunk: str) -> str:
        """The chunks are whole named events already (one delta can make several)."""
        return chunk

    def error_event(self, error: APIError) -> str:
        """The `error` event: Anthropic's error object."""
        return named_event(error.anthropic_body())

    def end_of_stream(self) -> str:
        """Nothing follows `message_stop`."""
        return ""
