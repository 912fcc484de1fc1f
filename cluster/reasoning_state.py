"""The state every format of reasoning shares (cluster/reasoning.py has the rules): where text goes (`Channel`,
`Piece`), the reasoning count, the forced end-marker tokens at the budget, the draft rules of speculative decoding.
`ReasoningState` is the base of the formats' state machines (cluster/reasoning.py's `ThinkState`,
cluster/reasoning_harmony.py's `HarmonyState`)."""

from __future__ import annotations

import copy
import enum
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence as Seq

from cluster.request import ReasoningParams


class Channel(enum.Enum):
    """Where a piece of output text goes: `RequestOutput.reasoning_text` or `RequestOutput.text`."""

    REASONING = "reasoning"
    ANSWER = "answer"


@dataclass(frozen=True)
class Piece:
    """Output text for one channel: the text of `token` (detokenized in order with the others), or `text` as it
    is (harmony's canonical call markers)."""

    channel: Channel
    token: Optional[int] = None
    text: str = ""


class ReasoningState:
    """The state shared by both formats: the reasoning count, the forced tokens, the budget rule. Subclasses
    implement `feed`, `end`, `finish`, `inside`, `_held`, `grammar_applies`, `grammar_consumes`,
    `_grammar_governs`."""

    def __init__(self, params: ReasoningParams, constrained: bool):
        self.params, self.constrained = params, constrained
        self.count = 0  # reasoning content tokens (module docstring)
        self._forced: deque[int] = deque()

    @property
    def inside(self) -> bool:
        """True while the next token is part of the reasoning."""
        raise NotImplementedError

    @property
    def _held(self) -> int:
        """Tokens held as a possible end marker (counted towards the budget, not yet in `count`)."""
        return 0

    def feed(self, token: int) -> list[Piece]:
        """Advance by one output token (not the EOS or stop token that ends the output: `end`); returns the text
        pieces it releases, in order (none for a marker, a header, or a token held as a possible marker)."""
        raise NotImplementedError

    def end(self, token: int) -> list[Piece]:
        """The output ended with the EOS or stop token `token` (not content): the pieces that closes."""
        return []

    def finish(self) -> list[Piece]:
        """The output ended: release the tokens still held (as the content they turned out to be)."""
        return []

    def replay(self, tokens: Seq[int]) -> list[int]:
        """Advance through output tokens generated before (a continuation: `ReasoningParams.num_generated`);
        returns those the grammar consumes (the answer's), in order."""
        answer = []
        for token in tokens:
            if self.grammar_consumes(token):
                answer.append(token)
            self.feed(token)
        return answer

    def forced_token(self) -> Optional[int]:
        """The only token the next step may produce (the end marker at the budget), or None."""
        return self._forced[0] if self._forced else None

    def grammar_applies(self) -> bool:
        """True when a grammar's mask (if the sequence has one) constrains the next token."""
        raise NotImplementedError

    def also_allowed(self) -> tuple[int, ...]:
        """Tokens allowed beside the grammar's mask at the next token (the start marker's first token where the
        answer may still begin with reasoning)."""
        return ()

    def grammar_consumes(self, token: int) -> bool:
        """True when `token`, as the next output token, is an answer token the grammar's matcher consumes (asked
        before `feed`)."""
        raise NotImplementedError

    def draft_limit(self) -> Optional[int]:
        """The most draft tokens a verify step may carry now (None: no limit); see the module docstring."""
        if self._forced:
            return 0
        if self.constrained:
            return None if self._grammar_governs() else 0
        return None

    def forced_along(self, draft: Seq[int]) -> Optional[list[Optional[int]]]:
        """The forced token (or None) at each of a verify step's len(draft) + 1 positions (position i: after the
        first i drafts), from a copy of this state fed the drafts; None when no position can be forced (no
        budget). The state itself does not move."""
        if self.params.budget is None:
            return None
        state, forced = self.clone(), []
        for i in range(len(draft) + 1):
            forced.append(state.forced_token())
            if i < len(draft):
                state.feed(draft[i])
        return forced

    def clone(self) -> "ReasoningState":
        """An independent copy (drafts are fed to it, never to the sequence's own state)."""
        new = copy.copy(self)
        new._forced = deque(self._forced)
        return new

    @property
    def may_constrain(self) -> bool:
        """True when the state can ever change a sampled token's rule (a budget, or a grammar whose mask it
        defers): the engine then reads each token back before the next step."""
        return self.constrained or self.params.budget is not None

    def _grammar_governs(self) -> bool:
        """True once the grammar constrains every later token (the answer began and cannot return to reasoning)."""
        raise NotImplementedError

    def _check_budget(self, end_ids: Seq[int]) -> None:
        """Inside reasoning at the budget: force `end_ids` (the rest of the end marker)."""
        budget = self.params.budget
        if self.inside and not self._forced and budget is not None and self.count + self._held >= budget:
            self._forced.extend(end_ids)

    def _take_forced(self, token: int) -> None:
        if self._forced:
            if token == self._forced[0]:
                self._forced.popleft()
            else:  # only when a mask was bypassed: the forcing restarts from the state the token leads to
                self._forced.clear()
