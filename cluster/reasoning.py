"""Reasoning of thinking models, separated token by token: one sequence's state machine (`SamplingParams.reasoning`).
This file holds the rules, the "think" format's `ThinkState` and `start_reasoning`; the state both formats share is
cluster/reasoning_state.py, the harmony format's `HarmonyState` cluster/reasoning_harmony.py.

A sequence with reasoning gets a `ReasoningState` (`Sequence.reasoning`, made by `start_reasoning`) that is fed
every output token once, in order (`feed`; the EOS or stop token that ends the output through `end`), and says:
- where each token's text goes (`Piece`s: the reasoning, the answer, or nowhere for markers and headers; a token
  that may begin a multi-token marker is held until the marker completes or cannot), which
  `cluster.detokenizer.OutputText` turns into `RequestOutput.reasoning_text` and `.text`;
- how many reasoning tokens the sequence has produced (`count`: tokens of the reasoning's content, markers and
  harmony headers excluded; `RequestOutput.num_reasoning_tokens`);
- what the next token may be (`forced_token`, `grammar_applies`, `also_allowed`, which
  `cluster.grammar.token_rule` turns into the step's mask): at the budget, the end marker is forced one token per
  step; a grammar constrains the answer only (`grammar_consumes` says which tokens its matcher is fed);
- for speculative decoding, how many draft tokens a verify step may carry (`draft_limit`) and which of its
  positions are forced (`forced_along`).

Two formats (`ReasoningParams.format`):

"think": reasoning is the text between a start and an end marker (token id sequences, e.g. Qwen3's `<think>` and
`</think>`, gemma4's multi-token `<|channel>thought` and `<channel|>`). The prompt may end inside it
(`starts_inside`, a template that opens `<think>\\n`). Without a grammar a start marker opens reasoning again
anywhere in the answer (as mlx-lm's server reads it); with a grammar only the first output token may open it
(the mask allows the grammar's tokens and the start marker's first token there; the rest of a multi-token start
marker is forced), and once the answer has begun every token is the grammar's.

"harmony" (gpt-oss): the output is messages `<|start|>ROLE<|channel|>CHANNEL[ to=RECIPIENT][<|constrain|>TYPE]
<|message|>BODY<|end|>` (the last one ends with `<|return|>`, a call with `<|call|>`); the generation prompt ends
with `<|start|>assistant`, so the first output tokens are a header. A body goes to:
- the reasoning, for the analysis channel;
- the answer, for the final channel and for commentary without a recipient (preambles);
- the answer as a tool call in one canonical form, for a message with a recipient (`to=functions.NAME`, in the
  header's role or channel part; any channel):

      <tool_call>{"name": "NAME", "arguments": BODY}</tool_call>

  `NAME` is the recipient without its `functions.` prefix (JSON-encoded), BODY the message's text as written (the
  arguments' JSON for `<|constrain|>json` calls); `<tool_call>{"name": ..., "arguments": ` is emitted when the
  body starts, `}</tool_call>` when it ends (`<|call|>`, `<|end|>` or `<|return|>`). This is the Hermes form, so
  the router's `json_tools` parser reads it (`TOOL_CALL_START`, `TOOL_CALL_END`); a call cut by max_tokens stays
  unclosed. A body that is not JSON (a built-in tool's code) makes text that parses as no call.
Headers and the specials are never text. The budget's forced sequence (`end_ids`) is e.g.
`<|end|><|start|>assistant<|channel|>final<|message|>`: it closes the analysis and opens the final answer.

Budget (`ReasoningParams.budget`): once `count` plus the tokens held as a possible end marker reaches the budget
inside reasoning, the rest of the end marker is forced (`end_ids` whole when nothing is held), one token per
step through the sampling mask, so logprobs, penalties and speculation see the forced token as sampled. So a
sequence produces at most `budget` reasoning tokens; exactly `budget` when its model writes no part of the end
marker itself. A section opened again after the budget is spent is closed at once.

Speculative decoding: a verify step checks every draft position under the rule plain decoding would apply there.
Without a grammar that rule is free or forced: `forced_along` feeds the drafts to a copy of the state, and a
position where the end marker is forced gets a mask of that one token (a greedy row takes it, a sampled row's p
is a point mass there, so the rejection rule emits it). With a grammar, drafts wait until the grammar governs
every later token (`draft_limit` is 0 before the answer has begun: the grammar's draft masks cannot follow a
reasoning section's end); from then on the grammar's own draft masks apply. No drafts while a token is forced
(the draft would only be rejected). So greedy output with speculation is plain decoding's, token for token.
"""

from __future__ import annotations

from typing import Callable, Sequence as Seq

from cluster.reasoning_harmony import TOOL_CALL_END, TOOL_CALL_START, HarmonyState
from cluster.reasoning_state import Channel, Piece, ReasoningState
from cluster.request import HARMONY_SPECIALS, ReasoningParams

__all__ = ["Channel", "HarmonyState", "Piece", "ReasoningState", "TOOL_CALL_END", "TOOL_CALL_START", "ThinkState",
           "ends_inside", "harmony_ids", "start_reasoning"]


def ends_inside(prompt: Seq[int], start_ids: Seq[int], end_ids: Seq[int]) -> bool:
    """True when `prompt` (token ids) ends inside a "think" section: its last start marker comes after its last
    end marker (how the router finds `ReasoningParams.starts_inside`; mlx-lm's server decides so)."""
    def last(marker: Seq[int]) -> int:
        n = len(marker)
        for i in range(len(prompt) - n, -1, -1):
            if tuple(prompt[i:i + n]) == tuple(marker):
                return i
        return -1

    return last(start_ids) > last(end_ids)


def harmony_ids(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(start_ids, end_ids) of a harmony `ReasoningParams` for `tokenizer` (a tokenizer with the gpt-oss specials):
    the ids of `HARMONY_SPECIALS` in their order, and `<|end|><|start|>assistant<|channel|>final<|message|>`
    tokenized. Raises ValueError when a special is not one token."""
    ids = []
    for special in HARMONY_SPECIALS:
        encoded = tokenizer.encode(special, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"{special!r} is not one token of this tokenizer: not a harmony model")
        ids.append(encoded[0])
    closing = tokenizer.encode("<|end|><|start|>assistant<|channel|>final<|message|>", add_special_tokens=False)
    return tuple(ids), tuple(closing)


def start_reasoning(params: ReasoningParams, constrained: bool, decode: Callable[[list[int]], str]
                    ) -> "ReasoningState":
    """A fresh state for a sequence with `params`; `constrained`: it has a grammar (which then constrains the
    answer only); `decode`: token ids -> text (harmony headers)."""
    if params.format == "harmony":
        return HarmonyState(params, constrained, decode)
    return ThinkState(params, constrained)


class ThinkState(ReasoningState):
    """The "think" format (module docstring)."""

    def __init__(self, params: ReasoningParams, constrained: bool):
        super().__init__(params, constrained)
        self.start, self.end_marker = tuple(params.start_ids), tuple(params.end_ids)
        self._inside = params.starts_inside
        self._pending: list[int] = []  # a proper prefix of the marker that would switch the state
        self._fed = False  # any output token fed
        self._check_budget(self.end_marker)

    @property
    def inside(self) -> bool:
        return self._inside

    @property
    def _held(self) -> int:
        return len(self._pending) if self._inside else 0

    def feed(self, token: int) -> list[Piece]:
        self._take_forced(token)
        first, self._fed = not self._fed, True
        if self.constrained and not self._inside and not self._pending and not (first and token == self.start[0]):
            return self._release([token])  # the grammar's answer: no reasoning opens again
        self._pending.append(token)
        marker = self.end_marker if self._inside else self.start
        if tuple(self._pending[-len(marker):]) == marker:
            pieces = self._release(self._pending[:-len(marker)])
            self._pending = []
            self._inside = not self._inside
        else:
            keep = _overlap(self._pending, marker)
            pieces = self._release(self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            if self.constrained and not self._inside and self._pending and not self._forced:
                self._forced.extend(self.start[len(self._pending):])  # the grammar allowed only the marker
        self._check_budget(self.end_marker[len(self._pending):] if self._inside else ())
        return pieces

    def finish(self) -> list[Piece]:
        pieces, self._pending = self._release(self._pending), []
        return pieces

    def clone(self) -> "ThinkState":
        new = super().clone()
        new._pending = list(self._pending)
        return new

    def grammar_applies(self) -> bool:
        return not self._inside and not self._pending

    def also_allowed(self) -> tuple[int, ...]:
        return (self.start[0],) if not self._fed and not self._inside else ()

    def grammar_consumes(self, token: int) -> bool:
        return (not self._forced and not self._inside and not self._pending
                and not (not self._fed and token == self.start[0]))

    def _grammar_governs(self) -> bool:
        return self._fed and not self._inside and not self._pending and not self._forced

    def _release(self, tokens: Seq[int]) -> list[Piece]:
        channel = Channel.REASONING if self._inside else Channel.ANSWER
        if self._inside:
            self.count += len(tokens)
        return [Piece(channel, token) for token in tokens]


def _overlap(tokens: Seq[int], marker: Seq[int]) -> int:
    """Length of the longest proper suffix of `tokens` that is a prefix of `marker` (a marker still possible)."""
    for k in range(min(len(tokens), len(marker) - 1), 0, -1):
        if tuple(tokens[len(tokens) - k:]) == tuple(marker[:k]):
            return k
    return 0
