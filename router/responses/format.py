"""From engine deltas to OpenAI's Responses API answers: the Response object and its streaming events.

One `OutputBuilder` turns the choice's text into output items, for the streamed and the non-streamed answer
alike (so both give the same items, in the same order): plain text opens an assistant `message` item with one
`output_text` part; a tool call (found by the request's tool parser, router/tool_calls.py) closes it and adds
a `function_call` item; text after a call opens a new message. With no call and no text there is one empty
message. A thinking model's reasoning (split by the engine) is a `reasoning` item before the text or call it
precedes: its `content` is one `reasoning_text` part (no summary is generated), and with
`include: ["reasoning.encrypted_content"]` its `encrypted_content` is this server's token of the text
(router/reasoning_token.py), which a client may send back as the item's only text. Streamed, each
step is an event of OpenAI's Responses streaming format, in this order:

    response.created, response.in_progress                       (status in_progress, no output)
    per reasoning: response.output_item.added, response.content_part.added (reasoning_text),
                  response.reasoning_text.delta ..., response.reasoning_text.done,
                  response.content_part.done, response.output_item.done
    per message:  response.output_item.added, response.content_part.added,
                  response.output_text.delta ..., response.output_text.done,
                  response.content_part.done, response.output_item.done
    per call:     response.output_item.added (arguments ""), response.function_call_arguments.delta ...,
                  response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete                    (the whole Response, usage included)

Every event is `event: <type>` and `data: <json>` with `type` and a `sequence_number` counting from 0; an
error mid-stream is an `error` event (`code`, `message`, `param`). The stream has no `[DONE]` line, as
OpenAI's has none. A response is `incomplete` (`incomplete_details.reason` "max_output_tokens") when the
output stopped at max_output_tokens or at the end of the context.

A call of a namespace's function (the chat path knows it by its flat name `<namespace>__<name>`,
router/responses/tools.py) is a function_call item with the function's own `name` and its `namespace`, in the
stream's events as in the whole answer.

Logprobs (with `include: ["message.output_text.logprobs"]`): each token's logprob rides with the first text
delta after it arrives and ends in that message's output_text part (OpenAI's format, -inf as -9999.0); the
tokens of a tool call have none (function_call items carry no logprobs), nor have those of a call cut off by
max_output_tokens, whose text is dropped (router/tool_calls.py): the response is then `incomplete` with the
calls completed before it and the text before its start marker. Reasoning tokens, and the end marker after them,
have none either (output_text parts hold the answer's tokens). The non-streamed answer replays the choice's
deltas as the stream sent them, so both give the same logprobs.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Optional, Sequence

from cluster.request import RequestOutput, TokenLogprob
from router.errors import APIError
from router.params import PreparedRequest
from router.openai.request import Usage
from router.choices import Accumulator, ChoiceState
from router.reasoning_token import make_token
from router.responses.fields import REASONING_CONTENT
from router.responses.items import OutputBuilder
from router.responses.output import (IncompleteDetails, InputTokensDetails, ResponseObject,
                                     ResponseOutputTokensDetails, ResponseUsage)
from router.responses.request import ResponsesRequest
from router.responses.tools import ToolSet
from router.tokenizer import RouterTokenizer
from router.tool_calls import ContentDelta

OBFUSCATION_MIN_CHARS = 16  # an obfuscated delta's text plus padding is at least this long, plus 0..15 more


class ResponsesFormatter:
    """The `router.serving.Formatter` of POST /v1/responses (one choice): the Response object whole, or the
    events above. Its chunks are whole SSE events already (each names its event type), so `frame` keeps them."""

    def __init__(self, prepared: PreparedRequest, tok: RouterTokenizer, req: ResponsesRequest, created: int,
                 model: str = ""):
        self.p = prepared
        self.req = req
        self.created = created
        self._sequence = 0
        self._thinking = False  # the last delta with anything in it was reasoning
        self._num_reasoning = 0  # reasoning tokens seen so far (the engine's cumulative count)
        self._obfuscate = bool(req.stream_options and req.stream_options.include_obfuscation)
        sign = (lambda text: make_token(text, model)) if REASONING_CONTENT in (req.include or ()) else None
        self.builder = OutputBuilder(tok, (req.top_logprobs or 0) if req.wants_logprobs else None,
                                     ToolSet.of(req.tools), sign)
        parser = prepared.tool_parser
        self._parser = parser.stream(prepared.tools, prepared.max_tool_calls) if parser is not None else None

    # ---- the Response object
    def _response(self, status: str, output: list, usage: Optional[ResponseUsage] = None) -> ResponseObject:
        req = self.req
        return ResponseObject(
            id=self.p.request_id, created_at=self.created, status=status, model=self.p.model, output=output,
            completed_at=int(time.time()) if status != "in_progress" else None,
            incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            instructions=req.instructions, usage=usage, parallel_tool_calls=req.parallel_tool_calls is not False,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            tool_choice=req.tool_choice or "auto", tools=[t.echo() for t in req.tools or ()],
            text=req.text.echo() if req.text else {"format": {"type": "text"}, "verbosity": "medium"},
            max_output_tokens=req.max_output_tokens, max_tool_calls=req.max_tool_calls,
            metadata=req.metadata or {}, top_logprobs=req.top_logprobs or 0, user=req.user,
            reasoning=req.reasoning.echo() if req.reasoning else None,
            safety_identifier=req.safety_identifier, prompt_cache_key=req.prompt_cache_key)

    def _usage(self, state: ChoiceState) -> ResponseUsage:
        prompt = len(self.p.prompt_token_ids)
        return ResponseUsage(input_tokens=prompt, output_tokens=state.num_tokens,
                             total_tokens=prompt + state.num_tokens,
                             input_tokens_details=InputTokensDetails(cached_tokens=state.num_cached_tokens),
                             output_tokens_details=ResponseOutputTokensDetails(
                                 reasoning_tokens=state.num_reasoning_tokens))

    def _feed(self, text: str, logprobs: Sequence[TokenLogprob], reasoning: str = "", num_reasoning: int = 0
              ) -> None:
        """One delta: its reasoning, then its tokens' logprobs (those of its `num_reasoning` leading reasoning
        tokens, and of the end marker between reasoning and the text, belong to no output_text), then its text."""
        if reasoning:
            self.builder.think(reasoning)
            self._thinking = True
        if self._thinking and not text:
            return  # reasoning tokens, or the end marker after them: not the text's
        self._thinking = self._thinking and not text
        self.builder.add_logprobs(logprobs[num_reasoning:])
        if text:
            self.builder.feed(self._parser.feed(text) if self._parser is not None else [ContentDelta(text)])

    def _finish(self, state: ChoiceState) -> ResponseObject:
        if self._parser is not None:
            self.builder.feed(self._parser.finish(state.finish_reason))
        status = "incomplete" if state.finish_reason == "length" else "completed"
        self.builder.finish(status)
        return self._response(status, self.builder.output(), self._usage(state))

    def response(self, acc: Accumulator) -> ResponseObject:
        """The non-streamed answer: the choice's whole text through the same builder as the stream."""
        state = acc.choices[0]
        for delta in state.deltas:  # as the stream sent them
            self._feed(delta.text, delta.logprobs, delta.reasoning, delta.num_reasoning_tokens)
        return self._finish(state)

    # ---- the stream
    def _event(self, event: dict[str, Any]) -> str:
        event["sequence_number"] = self._sequence
        self._sequence += 1
        if self._obfuscate and "delta" in event:
            pad = max(OBFUSCATION_MIN_CHARS - len(event["delta"]), 0) + secrets.randbelow(16)
            event["obfuscation"] = secrets.token_urlsafe(pad)[:pad]
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def _drain(self) -> list[str]:
        events, self.builder.events = self.builder.events, []
        return [self._event(e) for e in events]

    def first_chunks(self) -> list[str]:
        """response.created and response.in_progress (status in_progress, no output yet)."""
        response = self._response("in_progress", []).model_dump(mode="json")
        return [self._event({"type": kind, "response": response})
                for kind in ("response.created", "response.in_progress")]

    def delta_chunk(self, state: ChoiceState, out: RequestOutput) -> list[str]:
        """The events of one delta; the finishing delta closes every item and ends with response.completed
        (or response.incomplete) carrying the whole Response."""
        num_reasoning = max(0, out.num_reasoning_tokens - self._num_reasoning)
        self._num_reasoning = max(self._num_reasoning, out.num_reasoning_tokens)
        self._feed(out.text, out.logprobs or (), out.reasoning_text, num_reasoning)
        if not out.finished:
            return self._drain()
        response = self._finish(state)
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        return self._drain() + [self._event({"type": kind, "response": response.model_dump(mode="json")})]

    def usage_chunk(self, usage: Usage) -> str:
        """Nothing (the translated request never asks for a usage chunk): usage rides on response.completed."""
        return ""

    def frame(self, chunk: str) -> str:
        """The chunk itself: it is a whole SSE event (`event: <type>`, `data: <json>`)."""
        return chunk

    def error_event(self, error: APIError) -> str:
        """The `error` event of a failure mid-stream (OpenAI's ResponseErrorEvent: code, message, param)."""
        code = error.code if isinstance(error.code, str) else error.type
        return self._event({"type": "error", "code": code, "message": error.message, "param": error.param})

    def end_of_stream(self) -> str:
        """Nothing: OpenAI's Responses stream ends with its last event, no [DONE]."""
        return ""
