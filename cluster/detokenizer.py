"""Per-token output text: incremental detokenization, stop strings, and the split of a thinking model's reasoning
from its answer.

The engine calls `OutputText.add(token_id)` once per generated token per sequence and sends the
returned delta in a `RequestOutput`; `OutputText.finish()` when the sequence ends for another reason.
Together they keep `RequestOutput.text`'s invariants: a delta never ends inside a multi-byte character
and never contains any part of a stop string; held text is released by a later delta. With reasoning
(cluster/reasoning.py) each token's text goes to `RequestOutput.text` or `.reasoning_text` as the sequence's
reasoning state says; stop strings apply to the answer's text only.

Cost per token is O(window + longest stop string), never O(output): the detokenizer decodes only a few
tokens (one or two `tokenizer.decode` calls) and the matcher looks only at the text it holds plus the delta.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from cluster.reasoning_state import Channel

REPLACEMENT = "\ufffd"  # what decode() shows for an incomplete (or invalid) UTF-8 byte sequence


class IncrementalDetokenizer:
    """Turn token ids into text one id at a time (vLLM/TGI's prefix_offset/read_offset technique).

    `tokenizer` is a Hugging Face fast tokenizer or mlx-lm's TokenizerWrapper (only `.decode` is used).
    Invariant, for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM): the deltas returned by
    `add`, then `flush()`, joined, equal `tokenizer.decode(output_ids, skip_special_tokens=...)`, and
    `text` after each `add` is that decode of the ids so far less one trailing U+FFFD (the character
    that may still be incomplete). So a delta holds U+FFFD only where the model produced bytes that can
    never become a character, and only once the bytes after them make that clear.

    The window `_ids` is the last tokens whose text is fully emitted (`_ids[:_read]`, starting with up to
    CONTEXT prompt tokens, so leading-space rules see their left context) plus the pending ones
    (`_ids[_read:]`). Example, SmolLM2, prompt "Say hi" = [36218, 15876], output "世界!" = tokens
    ['ä¸', 'ĸ', 'ç', 'ķ', 'Į', '!'] (their byte-level spellings):

        add('ä¸') -> ""    window [Say, hi, ä¸] decodes to "Say hi\ufffd": hold the partial char
        add('ĸ')  -> "世"   clean end: emit; window restarts at the old read offset: [ä¸, ĸ]
        add('ç')  -> ""    add('ķ') -> ""       window [ä¸, ĸ, ç, ķ] = "世\ufffd": hold 1 char
        add('Į')  -> "界"   window restarts: [ç, ķ, Į]
        add('!')  -> "!"    window [!]

    A run of tokens that each end inside a character (rare) grows the window until one ends cleanly;
    text is still emitted as each character completes.
    """

    CONTEXT = 5  # prompt tokens decoded before the first output token (vLLM's initial offset)

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_token_ids[max(0, len(prompt_token_ids) - self.CONTEXT):])
        if self._decode(context).endswith(REPLACEMENT):
            context = []  # the prompt ends inside a character: its bytes would merge with ours
        self._ids = context
        self._read = len(context)  # _ids[:_read]: tokens whose text was emitted in full
        self._emitted = len(self._decode(context))  # chars of decode(_ids) already emitted
        self._parts: list[str] = []

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it finalized (often "", never a partial char)."""
        self._ids.append(token_id)
        window = self._decode(self._ids)
        if window.endswith(REPLACEMENT):  # hold the last character: more bytes may complete it
            delta = window[self._emitted:-1]
            self._emitted += len(delta)
        else:  # clean boundary: emit all, the new window starts at the previous read offset
            delta = window[self._emitted:]
            self._advance()
        if delta:
            self._parts.append(delta)
        return delta

    def _advance(self) -> None:
        del self._ids[:self._read]
        self._read = len(self._ids)
        self._emitted = len(self._decode(self._ids))

    def flush(self) -> str:
        """Return the text still held (a trailing U+FFFD if the output ended inside a character)."""
        delta = self._decode(self._ids)[self._emitted:]
        self._advance()
        if delta:
            self._parts.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All text returned so far by `add` and `flush`."""
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""


class StopStringMatcher:
    """Cut streamed text before the first stop string, holding back only what could start one.

    `feed(text)` returns (text safe to emit now, stopped). It holds back the longest suffix of the
    pending text that is a prefix of some stop string, so a stop string split across feeds is still
    found and no part of it is ever emitted. Example, stop "DEFGHIJ", output "ABC" "DE" "FG" "HIJK":

        feed("ABC")  -> ("ABC", False)  no suffix of "ABC" starts "DEFGHIJ"
        feed("DE")   -> ("", False)     holds "DE"
        feed("FG")   -> ("", False)     holds "DEFG"
        feed("HIJK") -> ("", True)      "DEFGHIJK" contains the stop at 0: emit what precedes it

    With stop "DEX" instead, feed("DE") holds "DE" and feed("FG") -> ("DEFG", False). Once stopped,
    feed returns ("", True).

    With several stop strings, the output ends at the first one to complete (the earliest end; on a
    tie, the longer one), as if the text were checked character by character. So the result does not
    depend on how the text was split into feeds: stops ("abcdef", "cd") cut "abcdef" to "ab". `flush()` releases the held text when generation ends without a stop.
    """

    def __init__(self, stop: Sequence[str]):
        if isinstance(stop, str):
            raise ValueError(f"stop={stop!r} is invalid: pass a sequence of strings, not one string")
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop={stop!r} is invalid: stop strings must be non-empty strings")
        self._stop = tuple(stop)
        self._held = ""
        self.stopped = False
        self.matched: Optional[str] = None  # the stop string that ended the text, once stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """Add `text`; return (text safe to emit now, whether a stop string was found)."""
        if self.stopped:
            return "", True
        if not self._stop:
            return text, False
        pending = self._held + text
        # (end, start, stop) of each stop's first occurrence; none starts in emitted text (see _hold)
        found = [(i + len(s), i, s) for s, i in ((s, pending.find(s)) for s in self._stop) if i >= 0]
        if found:
            _, start, self.matched = min(found)
            self._held, self.stopped = "", True
            return pending[:start], True
        keep = self._hold(pending)
        self._held = pending[len(pending) - keep:]
        return pending[:len(pending) - keep], False

    def _hold(self, pending: str) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(pending)), best, -1):
                if pending.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """Release the held text (generation ended without a stop string); "" once stopped."""
        held, self._held = self._held, ""
        return held


class TextDelta(NamedTuple):
    """What one `OutputText.add` or `finish` returns: the answer's new text, whether a stop string ended the
    output, and the reasoning's new text ("" without reasoning)."""

    text: str
    stopped: bool
    reasoning: str = ""


class OutputText:
    """One sequence's output text: detokenizer + stop strings (+ the reasoning's split) behind one per-token call.

        out = OutputText(tokenizer, prompt_ids, stop=("\\n\\n",))
        text, stopped, reasoning = out.add(token_id)   # every token; on stopped, finish with "stop"
        text, _, reasoning = out.finish(last_token)     # EOS, stop token, length, abort: the held text

    With `reasoning` (cluster/reasoning.py's `ReasoningState` of the sequence, fed here), each token's text goes
    to the channel the state says: the answer's through the stop strings into `text`, the reasoning's into
    `reasoning` as it is; markers and harmony headers are never detokenized. One detokenizer serves both: at a
    switch of channel it is flushed into the channel it was in (a switch happens at marker tokens, where no
    character is split).
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, reasoning=None):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.matcher = StopStringMatcher(stop)
        self.reasoning = reasoning
        self._parts: list[str] = []
        self._answer = True  # the channel the detokenizer's held text belongs to

    def add(self, token_id: int) -> TextDelta:
        """Append one token; return its text (answer, stopped, reasoning)."""
        if self.reasoning is None:
            delta, stopped = self.matcher.feed(self.detokenizer.add(token_id))
            if delta:
                self._parts.append(delta)
            return TextDelta(delta, stopped)
        return self._route(self.reasoning.feed(token_id))

    def finish(self, last_token: Optional[int] = None) -> TextDelta:
        """Release everything still held, stop strings still applied (the output ended otherwise). `last_token`:
        the EOS or stop token that ended it, if one did (the reasoning state sees it: a harmony call's `<|call|>`
        closes the call)."""
        text, reasoning = "", ""
        if self.reasoning is not None:
            pieces = (self.reasoning.end(last_token) if last_token is not None else []) + self.reasoning.finish()
            text, _, reasoning = self._route(pieces)
        tail = self.detokenizer.flush()
        if self._answer:
            delta, stopped = self.matcher.feed(tail)
            if not stopped:
                delta += self.matcher.flush()
            if delta:
                self._parts.append(delta)
            return TextDelta(text + delta, self.stopped, reasoning)
        delta = self.matcher.flush() if not self.matcher.stopped else ""
        if delta:
            self._parts.append(delta)
        return TextDelta(text + delta, self.stopped, reasoning + tail)

    def _route(self, pieces) -> TextDelta:
        """The text of the reasoning state's `pieces` (cluster/reasoning.py's `Piece`), by channel."""
        answer, reasoning = [], []

        def emit(text: str) -> None:
            if not text:
                return
            if self._answer:
                delta, _ = self.matcher.feed(text)
                if delta:
                    self._parts.append(delta)
                    answer.append(delta)
            else:
                reasoning.append(text)

        for piece in pieces:
            to_answer = piece.channel is Channel.ANSWER
            if to_answer != self._answer:
                emit(self.detokenizer.flush())
                self._answer = to_answer
            if piece.token is not None:
                emit(self.detokenizer.add(piece.token))
            if piece.text:
                emit(self.detokenizer.flush())
                emit(piece.text)
        return TextDelta("".join(answer), self.matcher.stopped, "".join(reasoning))

    @property
    def stopped(self) -> bool:
        """True once a stop string was found."""
        return self.matcher.stopped

    @property
    def stop_string(self) -> Optional[str]:
        """The stop string that ended the output, None while none has."""
        return self.matcher.matched

    @property
    def text(self) -> str:
        """All answer text returned so far: what the client has received as `text`."""
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""
