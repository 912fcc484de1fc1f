"""The harmony format of reasoning (gpt-oss's channels): `HarmonyState` reads the output's message headers token by
token and routes each message body to the reasoning (analysis), the answer (final, preambles) or the answer as a
tool call in the canonical form `<tool_call>{"name": NAME, "arguments": BODY}</tool_call>` (cluster/reasoning.py's
module docstring has the rules)."""

from __future__ import annotations

import enum
import json
import re
from typing import Callable

from cluster.reasoning_state import Channel, Piece, ReasoningState
from cluster.request import ReasoningParams

TOOL_CALL_START = "<tool_call>"  # harmony calls' canonical form (the Hermes form: the router's json_tools parser)
TOOL_CALL_END = "</tool_call>"
_RECIPIENT = re.compile(r"to=([^\s<]+)")


class _Phase(enum.Enum):
    HEADER = "header"  # after <|start|> (or the prompt's `<|start|>assistant`), before <|message|>
    BODY = "body"  # after <|message|>, before the message's end
    BETWEEN = "between"  # after a message ended, before the next <|start|>


class _Body(enum.Enum):
    REASONING = "reasoning"
    ANSWER = "answer"  # final, or commentary without a recipient
    FINAL = "final"  # the final channel: the answer a grammar constrains
    CALL = "call"  # a message to a recipient: the canonical call form


class HarmonyState(ReasoningState):
    """The "harmony" format (module docstring). `decode` turns header tokens into text."""

    def __init__(self, params: ReasoningParams, constrained: bool, decode: Callable[[list[int]], str]):
        super().__init__(params, constrained)
        (self.start, self.channel, self.message, self.end_id, self.return_id, self.call_id,
         self.constrain) = params.start_ids
        self._decode = decode
        self._phase = _Phase.BODY if params.starts_inside else _Phase.HEADER
        self._body = _Body.REASONING if params.starts_inside else None
        self._header: list[int] = []
        self._check_budget(params.end_ids)

    @property
    def inside(self) -> bool:
        return self._phase is _Phase.BODY and self._body is _Body.REASONING

    def feed(self, token: int) -> list[Piece]:
        self._take_forced(token)
        pieces: list[Piece] = []
        if token == self.start:
            pieces = self._close()  # a message without its end: ended by the next one's start
            self._phase, self._header = _Phase.HEADER, []
        elif token in (self.end_id, self.return_id, self.call_id):
            pieces = self._close()
        elif self._phase is _Phase.HEADER:
            if token == self.message:
                pieces = self._open()
            else:
                self._header.append(token)
        elif self._phase is _Phase.BODY:
            if self._body is _Body.REASONING:
                self.count += 1
                pieces = [Piece(Channel.REASONING, token)]
            else:
                pieces = [Piece(Channel.ANSWER, token)]
        else:  # a token outside any message (a malformed output): kept as answer text
            pieces = [Piece(Channel.ANSWER, token)]
        self._check_budget(self.params.end_ids)
        return pieces

    def end(self, token: int) -> list[Piece]:
        return self._close() if token in (self.end_id, self.return_id, self.call_id) else []

    def clone(self) -> "HarmonyState":
        new = super().clone()
        new._header = list(self._header)
        return new

    def grammar_applies(self) -> bool:
        return self._phase is _Phase.BODY and self._body is _Body.FINAL

    def grammar_consumes(self, token: int) -> bool:
        return (not self._forced and self.grammar_applies()
                and token not in (self.start, self.end_id, self.return_id, self.call_id))

    def _grammar_governs(self) -> bool:
        return self.grammar_applies() and not self._forced

    def _open(self) -> list[Piece]:
        """<|message|> ends the header: read its channel and recipient, start the body."""
        parts: list[list[int]] = [[]]
        for token in self._header:
            if token in (self.channel, self.constrain):
                parts.append([token])
            else:
                parts[-1].append(token)
        role = self._decode(parts[0])
        channel = next((self._decode(p[1:]) for p in parts[1:] if p[0] == self.channel), "")
        recipient = _RECIPIENT.search(role + " " + channel)
        name = channel.split()[0] if channel.split() else ""
        self._phase, self._header = _Phase.BODY, []
        if recipient is not None:
            self._body = _Body.CALL
            function = recipient.group(1).removeprefix("functions.")
            return [Piece(Channel.ANSWER, text=f'{TOOL_CALL_START}{{"name": {json.dumps(function)}, "arguments": ')]
        self._body = {"analysis": _Body.REASONING, "final": _Body.FINAL}.get(name, _Body.ANSWER)
        return []

    def _close(self) -> list[Piece]:
        """The current message ended: close a call; headers cut short are dropped."""
        pieces = [Piece(Channel.ANSWER, text="}" + TOOL_CALL_END)] if (
            self._phase is _Phase.BODY and self._body is _Body.CALL) else []
        self._phase, self._body, self._header = _Phase.BETWEEN, None, []
        return pieces
