"""Turning engine deltas into OpenAI bodies: streamed chunks and whole answers, chat and completions.

The formatters read the choices' state from router/choices.py's `Accumulator` (counts and logprob clamping there).
Chat format: `logprobs.content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]`.
Legacy (completions) format: `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`,
where `top_logprobs` always includes the sampled token (so up to k+1 entries, as OpenAI documents) and
`text_offset` counts characters of the display strings from the start of the returned text.

Reasoning (a thinking model's, split by the engine): `message.reasoning_content` and `message.reasoning` (the same
text under vLLM's and mlx-lm's names), streamed as `delta.reasoning_content`/`delta.reasoning` in chunks of their
own (or beside the content of the same delta); `usage.completion_tokens_details.reasoning_tokens` counts it.

Tool calls (a request with a `tool_parser`, router/tool_calls.py): the whole answer's `message.tool_calls`
lists the calls and `content` is the remaining text or null; a stream sends, per call, a chunk with
`delta.tool_calls = [{index, id, type: "function", function: {name, arguments: ""}}]` then one with
`[{index, function: {arguments}}]`, content in chunks of its own; text the parser holds back (a possible
marker, a call not yet closed) waits, and so do its logprobs, which ride on the next chunk. A choice that
made a call and stopped by itself finishes with "tool_calls"; one cut by max_tokens keeps "length", with the
calls it completed and without the call it was cut inside, whose text reaches no chunk (the logprobs of its
tokens ride on the last chunk, as `logprobs.content` lists every token generated).
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Callable, Optional, Sequence, Union

from cluster.request import RequestOutput, TokenLogprob
from router.choices import Accumulator, ChoiceState, clamp_logprob
from router.errors import APIError
from router.openai.request import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                                  ChatLogprobs, ChatMessageOut, CompletionChoice, CompletionLogprobs,
                                  CompletionResponse, DeltaMessage, TokenLogprobOut,
                                  TopLogprob, Usage)
from router.params import PreparedRequest
from router.streams import SSE_DONE, sse_event
from router.tokenizer import RouterTokenizer
from router.tool_calls import ContentDelta, ToolCallArguments, ToolCallStarted, ToolCallStream, ToolEvent
from router.openai.tools import DeltaFunction, DeltaToolCall, FunctionCallOut, ToolCallOut



_TEXT_MARK = "\x00mlx-pd:text\x00"  # stands in for a delta's text when a stream's chunk template is rendered


class TextChunks:
    """The chunk JSON of a plain text delta (no logprobs, tool calls, reasoning or finish_reason) of one stream,
    without building its models per token: `render(index, text)` (the general path) renders the chunk once per
    choice index with a marker for the text, and every later chunk is that prefix, the text JSON-escaped as
    pydantic escapes it (`json.encoder.encode_basestring`, what `json.dumps(text, ensure_ascii=False)` uses: the
    same bytes for every string of Unicode scalar values, tests/test_sse_chunks.py) and that suffix. Where the
    marker does not come out exactly once (a model name holding it), every chunk takes the general path."""

    def __init__(self, render: Callable[[int, str], str]):
        self._render = render
        self._parts: dict[int, Optional[tuple[str, str]]] = {}

    def __call__(self, index: int, text: str) -> str:
        """The chunk of choice `index` whose text delta is `text`: the bytes `render(index, text)` makes."""
        try:
            parts = self._parts[index]
        except KeyError:
            pieces = self._render(index, _TEXT_MARK).split(encode_basestring(_TEXT_MARK))
            parts = self._parts[index] = (pieces[0], pieces[1]) if len(pieces) == 2 else None
        if parts is None:
            return self._render(index, text)
        return parts[0] + encode_basestring(text) + parts[1]


class _Formatter:
    def __init__(self, prepared: PreparedRequest, tok: RouterTokenizer, created: int):
        self.p = prepared
        self.tok = tok
        self.created = created

    def _top(self, entry: TokenLogprob) -> list[tuple[int, float]]:
        return list(entry.top[: self.p.logprobs or 0])

    def frame(self, chunk: str) -> str:
        """One chunk as SSE text: OpenAI's chunks are unnamed `data:` events."""
        return sse_event(chunk)

    def error_event(self, error: APIError) -> str:
        """The SSE event reporting `error` once the stream has started: OpenAI's error object."""
        return sse_event(json.dumps(error.body()))

    def end_of_stream(self) -> str:
        """The SSE text after the last event: OpenAI's `data: [DONE]`."""
        return SSE_DONE


def tool_finish_reason(finish_reason: Optional[str], num_calls: int) -> Optional[str]:
    """OpenAI's finish_reason of a choice: "tool_calls" when it made calls and stopped by itself."""
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason


def _reasoning_delta(reasoning: str, content: Optional[str] = None) -> DeltaMessage:
    """A chunk's delta carrying reasoning, under both names clients read (`reasoning_content`, `reasoning`)."""
    return DeltaMessage(reasoning_content=reasoning, reasoning=reasoning, content=content)


class ChatFormatter(_Formatter):
    """Chunks and answers of /v1/chat/completions."""

    def __init__(self, prepared: PreparedRequest, tok: RouterTokenizer, created: int):
        super().__init__(prepared, tok, created)
        self._streams: dict[int, ToolCallStream] = {}
        self._held_logprobs: dict[int, list[TokenLogprob]] = {}
        self._plain = prepared.tool_parser is None and prepared.logprobs is None  # its text deltas take TextChunks
        self.text_chunk = TextChunks(self._content_chunk)

    def _content_chunk(self, index: int, text: str) -> str:
        """The general path's chunk of a plain content delta (what `text_chunk` makes faster)."""
        return self._chunk([ChatChunkChoice(index=index, delta=DeltaMessage(content=text))])

    def _entries(self, logprobs: Sequence[TokenLogprob]) -> list[TokenLogprobOut]:
        tok = self.tok
        return [TokenLogprobOut(
            token=tok.token_text(e.token_id), logprob=clamp_logprob(e.logprob),
            bytes=list(tok.token_bytes(e.token_id)),
            top_logprobs=[TopLogprob(token=tok.token_text(t), logprob=clamp_logprob(lp),
                                     bytes=list(tok.token_bytes(t))) for t, lp in self._top(e)])
            for e in logprobs]

    def _chunk(self, choices: list[ChatChunkChoice], usage: Optional[Usage] = None) -> str:
        return ChatCompletionChunk(id=self.p.request_id, created=self.created, model=self.p.model,
                                   choices=choices, usage=usage).model_dump_json()

    def first_chunks(self) -> list[str]:
        """One chunk per choice with `delta.role = "assistant"`, sent before any content."""
        return [self._chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for i in range(self.p.n)]

    def delta_chunk(self, state: ChoiceState, out: RequestOutput) -> Union[None, str, list[str]]:
        """The chunk(s) for one delta (None when it carries nothing); logprobs ride with their tokens."""
        if self._plain and not out.reasoning_text and out.finish_reason is None and (out.text or out.token_ids):
            return self.text_chunk(state.index, out.text)  # the common case: a content delta, nothing else
        if self.p.tool_parser is not None:
            return self._tool_chunks(state, out)
        if not (out.token_ids or out.text or out.reasoning_text or out.finished):
            return None
        logprobs = None
        if self.p.logprobs is not None:
            logprobs = ChatLogprobs(content=self._entries(out.logprobs or ()))
        if out.reasoning_text:
            delta = _reasoning_delta(out.reasoning_text, out.text or None)
        else:
            delta = DeltaMessage(content=out.text) if (out.text or out.token_ids) else DeltaMessage()
        return self._chunk([ChatChunkChoice(index=state.index, delta=delta, logprobs=logprobs,
                                            finish_reason=state.finish_reason if out.finished else None)])

    def _tool_chunks(self, state: ChoiceState, out: RequestOutput) -> list[str]:
        """The chunks of one delta of a request that parses tool calls (see the module docstring)."""
        stream = self._streams.get(state.index)
        if stream is None:
            stream = self._streams[state.index] = self.p.tool_parser.stream(self.p.tools, self.p.max_tool_calls)
        events: list[ToolEvent] = stream.feed(out.text) if out.text else []
        if out.finished:
            events += stream.finish(state.finish_reason)
        held = self._held_logprobs.setdefault(state.index, [])
        held.extend(out.logprobs or ())
        deltas = [_reasoning_delta(out.reasoning_text)] if out.reasoning_text else []
        for e in events:
            if isinstance(e, ContentDelta):
                deltas.append(DeltaMessage(content=e.text))
            elif isinstance(e, ToolCallStarted):
                deltas.append(DeltaMessage(tool_calls=[DeltaToolCall(
                    index=e.index, id=e.id, type="function", function=DeltaFunction(name=e.name, arguments=""))]))
            elif isinstance(e, ToolCallArguments):
                deltas.append(DeltaMessage(tool_calls=[DeltaToolCall(index=e.index,
                                                                     function=DeltaFunction(arguments=e.text))]))
        if out.finished and not deltas:
            deltas.append(DeltaMessage())
        chunks = []
        for i, delta in enumerate(deltas):
            logprobs = None
            if self.p.logprobs is not None and i == 0:
                logprobs = ChatLogprobs(content=self._entries(held))
                held.clear()
            last = out.finished and i == len(deltas) - 1
            chunks.append(self._chunk([ChatChunkChoice(
                index=state.index, delta=delta, logprobs=logprobs,
                finish_reason=tool_finish_reason(state.finish_reason, stream.num_calls) if last else None)]))
        return chunks

    def usage_chunk(self, usage: Usage) -> str:
        """The final `choices: []` chunk of `stream_options.include_usage`."""
        return self._chunk([], usage)

    def _message(self, c: ChoiceState) -> tuple[ChatMessageOut, Optional[str]]:
        """A whole choice's message and finish_reason, its tool calls parsed out when the request has tools."""
        text = "".join(c.texts)
        reasoning = "".join(c.reasoning_texts) or None
        if self.p.tool_parser is None:
            return ChatMessageOut(content=text, reasoning_content=reasoning, reasoning=reasoning), c.finish_reason
        content, calls = self.p.tool_parser.parse(text, self.p.tools, c.finish_reason, self.p.max_tool_calls)
        out = [ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))
               for call in calls]
        message = ChatMessageOut(content=content, reasoning_content=reasoning, reasoning=reasoning,
                                 tool_calls=out or None)
        return message, tool_finish_reason(c.finish_reason, len(calls))

    def response(self, acc: Accumulator) -> ChatCompletionResponse:
        """The non-streamed answer."""
        choices = []
        for c in acc.choices:
            message, finish_reason = self._message(c)
            choices.append(ChatChoice(
                index=c.index, message=message, finish_reason=finish_reason,
                logprobs=ChatLogprobs(content=self._entries(c.logprobs)) if self.p.logprobs is not None else None))
        return ChatCompletionResponse(id=self.p.request_id, created=self.created, model=self.p.model,
                                      choices=choices, usage=acc.usage())


class CompletionFormatter(_Formatter):
    """Chunks and answers of /v1/completions (with `echo` and legacy logprobs)."""

    def __init__(self, prepared: PreparedRequest, tok: RouterTokenizer, created: int):
        super().__init__(prepared, tok, created)
        self.text_chunk = TextChunks(self._text_chunk)

    def _text_chunk(self, index: int, text: str) -> str:
        """The general path's chunk of a plain text delta (what `text_chunk` makes faster)."""
        return CompletionResponse(id=self.p.request_id, created=self.created, model=self.p.model,
                                  choices=[CompletionChoice(index=index, text=text)]).model_dump_json()

    def _legacy(self, logprobs: CompletionLogprobs, state: ChoiceState, token_id: int,
                logprob: Optional[float], top: Optional[dict[str, float]]) -> None:
        text = self.tok.token_text(token_id)
        logprobs.tokens.append(text)
        logprobs.token_logprobs.append(logprob)
        logprobs.top_logprobs.append(top)
        logprobs.text_offset.append(state.text_offset)
        state.text_offset += len(text)

    def _add_entries(self, logprobs: CompletionLogprobs, state: ChoiceState,
                     entries: Sequence[TokenLogprob]) -> None:
        for e in entries:
            top = {self.tok.token_text(t): clamp_logprob(lp) for t, lp in self._top(e)}
            top.setdefault(self.tok.token_text(e.token_id), clamp_logprob(e.logprob))
            self._legacy(logprobs, state, e.token_id, clamp_logprob(e.logprob), top)

    def _add_prompt(self, logprobs: CompletionLogprobs, state: ChoiceState) -> None:
        ids = self.p.prompt_token_ids
        self._legacy(logprobs, state, ids[0], None, None)
        given = list(state.prompt_logprobs or ())
        for pos, token_id in enumerate(ids[1:]):
            if pos < len(given):
                self._add_entries(logprobs, state, [given[pos]])
            else:  # the engine sent fewer prompt logprobs than prompt tokens
                self._legacy(logprobs, state, token_id, None, None)

    def _choice_parts(self, state: ChoiceState, text: str, entries: Sequence[TokenLogprob],
                      first: bool) -> tuple[str, Optional[CompletionLogprobs]]:
        logprobs = CompletionLogprobs() if self.p.logprobs is not None else None
        if first and self.p.echo:
            text = self.p.prompt_text + text
            if logprobs is not None:
                self._add_prompt(logprobs, state)
        if logprobs is not None:
            self._add_entries(logprobs, state, entries)
        return text, logprobs

    def first_chunks(self) -> list[str]:
        """Completions send nothing before the first delta (the echo rides on it)."""
        return []

    def delta_chunk(self, state: ChoiceState, out: RequestOutput) -> Optional[str]:
        """The chunk for one delta (None when it carries nothing)."""
        first = not state.started
        state.started = True
        if (self.p.logprobs is None and out.finish_reason is None and (out.token_ids or out.text)
                and not (first and self.p.echo)):
            return self.text_chunk(state.index, out.text)  # the common case: a text delta, nothing else
        if not (out.token_ids or out.text or out.finished or (first and self.p.echo)):
            return None
        text, logprobs = self._choice_parts(state, out.text, out.logprobs or (), first)
        choice = CompletionChoice(index=state.index, text=text, logprobs=logprobs,
                                  finish_reason=state.finish_reason if out.finished else None)
        return CompletionResponse(id=self.p.request_id, created=self.created, model=self.p.model,
                                  choices=[choice]).model_dump_json()

    def usage_chunk(self, usage: Usage) -> str:
        """The final `choices: []` chunk of `stream_options.include_usage`."""
        return CompletionResponse(id=self.p.request_id, created=self.created, model=self.p.model,
                                  choices=[], usage=usage).model_dump_json()

    def response(self, acc: Accumulator) -> CompletionResponse:
        """The non-streamed answer."""
        choices = []
        for c in acc.choices:
            c.text_offset = 0
            text, logprobs = self._choice_parts(c, "".join(c.texts), c.logprobs, True)
            choices.append(CompletionChoice(index=c.index, text=text, logprobs=logprobs,
                                            finish_reason=c.finish_reason))
        return CompletionResponse(id=self.p.request_id, created=self.created, model=self.p.model,
                                  choices=choices, usage=acc.usage())
