"""Reading OpenAI-style server-sent event streams, as both mlx-pd and mlx_lm.server send them.

The differences this copes with:

- mlx_lm.server sends SSE comment lines (``: keepalive 12/45``) while it prefills; they are skipped.
- mlx_lm.server repeats ``"role": "assistant"`` in every delta and sends its final usage chunk with
  ``"object": "chat.completion"``; mlx-pd sends a role-only first chunk with ``"content": ""``.
- mlx-pd sends one chunk per token, with ``"content": ""`` for tokens that decode to no text
  (special tokens after EOS with ``ignore_eos``); mlx_lm.server sends only chunks with text.
  So a token count taken from chunks is a lower bound: prefer ``usage.completion_tokens``
  (asked for with ``stream_options: {"include_usage": true}``).
- An error inside a stream is an event whose JSON has an ``error`` key.

Chat chunks carry text in ``choices[0].delta.content``, completion chunks in ``choices[0].text``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

DONE = "[DONE]"


class SSEParser:
    """Incremental SSE decoder: feed it lines (without newlines), get back complete event data.

    >>> p = SSEParser()
    >>> [d for line in [": ping", "data: {}", "", "data: [DONE]", ""] for d in p.feed(line)]
    ['{}', '[DONE]']
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> Iterator[str]:
        """Take one line; yield the event's data when `line` is the blank line that ends it."""
        line = line.rstrip("\r\n")
        if not line:
            if self._data:
                data, self._data = "\n".join(self._data), []
                yield data
            return
        if line.startswith(":"):
            return  # comment (keepalive)
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)

    def close(self) -> Iterator[str]:
        """Yield the data of an event left unterminated at the end of the stream."""
        if self._data:
            data, self._data = "\n".join(self._data), []
            yield data


def iter_events(lines: Iterable[str]) -> Iterator[str]:
    """All event data strings of a finished stream given as lines."""
    parser = SSEParser()
    for line in lines:
        yield from parser.feed(line)
    yield from parser.close()


@dataclass(frozen=True)
class Chunk:
    """The parts of one streamed chunk a benchmark needs."""

    content: str = ""
    finish_reason: Optional[str] = None
    usage_tokens: Optional[int] = None
    prompt_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    error: Optional[str] = None
    done: bool = False


def parse_chunk(data: str) -> Chunk:
    """Decode one event's data (a JSON chunk, an error object, or ``[DONE]``)."""
    if data.strip() == DONE:
        return Chunk(done=True)
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as exc:
        return Chunk(error=f"bad JSON in stream: {exc}: {data[:200]!r}")
    if not isinstance(obj, dict):
        return Chunk(error=f"unexpected event: {data[:200]!r}")
    if obj.get("error"):
        err = obj["error"]
        message = err.get("message", err) if isinstance(err, dict) else err
        return Chunk(error=f"server error in stream: {message}")
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
    usage_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") if isinstance(usage.get("prompt_tokens_details"), dict) else {}
    choices = obj.get("choices") or []
    if not choices:
        return Chunk(usage_tokens=usage_tokens, prompt_tokens=usage.get("prompt_tokens"),
                     cached_tokens=details.get("cached_tokens"))
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        content = delta.get("content") or ""
    else:
        content = choice.get("text") or ""
    return Chunk(content=content, finish_reason=choice.get("finish_reason"), usage_tokens=usage_tokens)
