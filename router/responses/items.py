"""The output items of one Responses choice (reasoning, messages, function calls), built step by step from the
choice's reasoning and the tool parser's events, with the stream events each step causes; router/responses/
format.py's formatter drives it for the whole answer and the stream alike (its docstring gives the item and
event order)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from cluster.request import TokenLogprob
from router.choices import clamp_logprob
from router.responses.output import (FunctionCallItem, OutputLogprob, OutputMessage, OutputText, OutputTopLogprob,
                                     ReasoningItem, ReasoningText)
from router.responses.tools import ToolSet
from router.tokenizer import RouterTokenizer
from router.tool_calls import ContentDelta, ToolCallArguments, ToolCallCut, ToolCallStarted


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Message:
    output_index: int
    id: str = field(default_factory=lambda: _item_id("msg"))
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    status: str = "in_progress"


@dataclass
class _Reasoning:
    output_index: int
    id: str = field(default_factory=lambda: _item_id("rs"))
    texts: list[str] = field(default_factory=list)
    status: str = "in_progress"


@dataclass
class _Call:
    output_index: int
    call_id: str
    name: str
    id: str = field(default_factory=lambda: _item_id("fc"))
    arguments: list[str] = field(default_factory=list)


class OutputBuilder:
    """The output items of one choice, built from its text events (`ContentDelta`, `ToolCallStarted`,
    `ToolCallArguments`, `ToolCallCut`); every step appends the stream events it causes to `events` (dicts
    without `sequence_number`), which a non-streamed answer simply drops."""

    def __init__(self, tok: RouterTokenizer, top_logprobs: Optional[int], tools: Optional[ToolSet] = None,
                 sign: Optional[Callable[[str], str]] = None):
        self.tok = tok
        self.top_logprobs = top_logprobs  # None = no logprobs
        self.tools = tools or ToolSet()  # flat names of calls -> (namespace, name)
        self.sign = sign  # reasoning text -> its encrypted_content, when the request includes it
        self.items: list[Union[_Reasoning, _Message, _Call]] = []
        self._reasoning: Optional[_Reasoning] = None  # the open reasoning item
        self.events: list[dict[str, Any]] = []
        self._message: Optional[_Message] = None  # the open message
        self._calls: dict[int, _Call] = {}  # parser index -> call
        self._open_calls: list[_Call] = []
        self._pending: list[TokenLogprob] = []  # logprobs not yet attached to a text delta

    # ---- logprobs, in OpenAI's two shapes
    def _full(self, entries: Sequence[TokenLogprob]) -> list[OutputLogprob]:
        tok, k = self.tok, self.top_logprobs or 0
        return [OutputLogprob(token=tok.token_text(e.token_id), logprob=clamp_logprob(e.logprob),
                              bytes=list(tok.token_bytes(e.token_id)),
                              top_logprobs=[OutputTopLogprob(token=tok.token_text(t), logprob=clamp_logprob(lp),
                                                             bytes=list(tok.token_bytes(t))) for t, lp in e.top[:k]])
                for e in entries]

    def _delta_logprobs(self, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        return [{"token": p.token, "logprob": p.logprob,
                 "top_logprobs": [{"token": t.token, "logprob": t.logprob} for t in p.top_logprobs]}
                for p in self._full(entries)]

    # ---- steps
    def add_logprobs(self, entries: Sequence[TokenLogprob]) -> None:
        """Tokens that arrived; their logprobs ride with the next text delta."""
        if self.top_logprobs is not None:
            self._pending.extend(entries)

    def feed(self, events: Sequence[Any]) -> None:
        """Apply the parser's events in order."""
        for event in events:
            if isinstance(event, ContentDelta):
                self._content(event.text)
            elif isinstance(event, ToolCallStarted):
                self._start_call(event)
            elif isinstance(event, ToolCallArguments):
                self._arguments(event)
            elif isinstance(event, ToolCallCut):
                self._pending = []  # the dropped call's tokens: no text of theirs is in the output

    def think(self, text: str) -> None:
        """Reasoning text: it goes to the open reasoning item, or opens one after closing what is open."""
        if not text:
            return
        reasoning = self._reasoning
        if reasoning is None:
            self._close_message("completed")
            self._close_calls()
            reasoning = self._reasoning = _Reasoning(len(self.items))
            self.items.append(reasoning)
            self.events.append({"type": "response.output_item.added", "output_index": reasoning.output_index,
                                "item": self.reasoning_item(reasoning, with_text=False)})
            self.events.append({"type": "response.content_part.added", **self._part_ref(reasoning),
                                "part": {"type": "reasoning_text", "text": ""}})
        reasoning.texts.append(text)
        self.events.append({"type": "response.reasoning_text.delta", **self._part_ref(reasoning), "delta": text})

    def _close_reasoning(self, status: str = "completed") -> None:
        reasoning, self._reasoning = self._reasoning, None
        if reasoning is None:
            return
        reasoning.status = status
        text = "".join(reasoning.texts)
        self.events.append({"type": "response.reasoning_text.done", **self._part_ref(reasoning), "text": text})
        self.events.append({"type": "response.content_part.done", **self._part_ref(reasoning),
                            "part": {"type": "reasoning_text", "text": text}})
        self.events.append({"type": "response.output_item.done", "output_index": reasoning.output_index,
                            "item": self.reasoning_item(reasoning)})

    def _open_message(self) -> _Message:
        message = self._message = _Message(len(self.items))
        self.items.append(message)
        self.events.append({"type": "response.output_item.added", "output_index": message.output_index,
                            "item": self.message_item(message, "in_progress", with_text=False)})
        self.events.append({"type": "response.content_part.added", **self._part_ref(message),
                            "part": {"type": "output_text", "text": "", "annotations": []}})
        return message

    def _content(self, text: str) -> None:
        if not text:
            return
        self._close_reasoning()
        self._close_calls()
        message = self._message or self._open_message()
        logprobs, self._pending = self._pending, []
        message.texts.append(text)
        message.logprobs.extend(logprobs)
        self.events.append({"type": "response.output_text.delta", **self._part_ref(message), "delta": text,
                            "logprobs": self._delta_logprobs(logprobs)})

    def _start_call(self, event: ToolCallStarted) -> None:
        self._close_reasoning()
        self._close_message("completed")
        self._close_calls()  # each item is done before the next is added, as OpenAI streams them
        self._pending = []  # the call's tokens: function_call items carry no logprobs
        call = _Call(len(self.items), call_id=event.id, name=event.name)
        self.items.append(call)
        self._calls[event.index] = call
        self._open_calls.append(call)
        self.events.append({"type": "response.output_item.added", "output_index": call.output_index,
                            "item": self.call_item(call, "in_progress", with_arguments=False)})

    def _arguments(self, event: ToolCallArguments) -> None:
        call = self._calls[event.index]
        call.arguments.append(event.text)
        self.events.append({"type": "response.function_call_arguments.delta", "item_id": call.id,
                            "output_index": call.output_index, "delta": event.text})

    def finish(self, status: str) -> None:
        """Close every open item with `status` ("completed" or "incomplete"); an output with no item gets one
        empty message."""
        if not self.items:
            self._open_message()
        if self._message is not None and self._pending:
            self._message.logprobs.extend(self._pending)
            self._pending = []
        self._close_reasoning(status)
        self._close_message(status)
        self._close_calls()

    def _close_message(self, status: str) -> None:
        message, self._message = self._message, None
        if message is None:
            return
        part = self.output_text(message)
        message.status = status
        self.events.append({"type": "response.output_text.done", **self._part_ref(message), "text": part.text,
                            "logprobs": self._delta_logprobs(message.logprobs)})
        self.events.append({"type": "response.content_part.done", **self._part_ref(message),
                            "part": part.model_dump(mode="json")})
        self.events.append({"type": "response.output_item.done", "output_index": message.output_index,
                            "item": self.message_item(message, status)})

    def _close_calls(self) -> None:
        for call in self._open_calls:
            self.events.append({"type": "response.function_call_arguments.done", "item_id": call.id,
                                "output_index": call.output_index, "name": self.tools.pair(call.name)[1],
                                "arguments": "".join(call.arguments)})
            self.events.append({"type": "response.output_item.done", "output_index": call.output_index,
                                "item": self.call_item(call, "completed")})
        self._open_calls = []

    # ---- items
    @staticmethod
    def _part_ref(item: Union[_Message, _Reasoning]) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": item.output_index, "content_index": 0}

    def _reasoning_model(self, reasoning: _Reasoning, with_text: bool = True) -> ReasoningItem:
        text = "".join(reasoning.texts)
        done = with_text and reasoning.status != "in_progress"
        return ReasoningItem(id=reasoning.id, status=reasoning.status,
                             content=[ReasoningText(text=text)] if with_text else [],
                             encrypted_content=self.sign(text) if self.sign is not None and done else None)

    def reasoning_item(self, reasoning: _Reasoning, with_text: bool = True) -> dict[str, Any]:
        """The reasoning item as JSON (no content part while it is being added)."""
        return self._reasoning_model(reasoning, with_text).model_dump(mode="json")

    def output_text(self, message: _Message) -> OutputText:
        """The message's output_text part so far."""
        logprobs = self._full(message.logprobs) if self.top_logprobs is not None else None
        return OutputText(text="".join(message.texts), logprobs=logprobs)

    def message_item(self, message: _Message, status: str, with_text: bool = True) -> dict[str, Any]:
        """The message item as JSON (no content part while it is being added)."""
        content = [self.output_text(message)] if with_text else []
        return OutputMessage(id=message.id, status=status, content=content).model_dump(mode="json")

    def _call(self, call: _Call, status: str, with_arguments: bool = True) -> FunctionCallItem:
        namespace, name = self.tools.pair(call.name)
        return FunctionCallItem(id=call.id, call_id=call.call_id, name=name, namespace=namespace, status=status,
                                arguments="".join(call.arguments) if with_arguments else "")

    def call_item(self, call: _Call, status: str, with_arguments: bool = True) -> dict[str, Any]:
        """The function_call item as JSON (arguments "" while it is being added)."""
        return self._call(call, status, with_arguments).model_dump(mode="json")

    def output(self) -> list[Union[ReasoningItem, OutputMessage, FunctionCallItem]]:
        """The finished output items (after `finish`)."""
        out: list[Union[ReasoningItem, OutputMessage, FunctionCallItem]] = []
        for item in self.items:
            if isinstance(item, _Reasoning):
                out.append(self._reasoning_model(item))
            elif isinstance(item, _Message):
                out.append(OutputMessage(id=item.id, status=item.status, content=[self.output_text(item)]))
            else:
                out.append(self._call(item, "completed"))
        return out
