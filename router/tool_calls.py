"""Tool calls in model output: finding, parsing and checking them, whole or while streaming.

The parser is mlx-lm's, chosen from the chat template as mlx-lm chooses it: the tokenizer config's
`tool_parser_type`, else `mlx_lm.tokenizer_utils._infer_tool_parser` (template markers, then the vocab).
Each is a module `mlx_lm.tool_parsers.<name>` with `tool_call_start`, `tool_call_end` (the markers around a
call in the text) and `parse_tool_call(text, tools)` (the text between the markers -> {"name", "arguments"}
or a list of them). A template that cannot render tools, or one mlx-lm knows no parser for, gets the
fallback (router/tool_prompt.py renders the tools Hermes-style) and is parsed with `json_tools`:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A harmony model (gpt-oss), for which mlx-lm has no parser, renders its tools with its own template and is read
with `json_tools`: the engine writes each of its calls (`commentary to=functions.NAME`) in the Hermes form.

A parsed call is a tool call only when its name is one of the request's tools and its arguments validate
against that tool's `parameters` JSON schema (jsonschema); otherwise its text, markers included, stays
content, so nothing the model wrote is lost. That holds for a complete call (its end marker came) that is
invalid, and for a call beyond the request's `max_calls`.

Text a format's calls may hold that mlx-lm's parser does not read is removed before it parses
(`IGNORED_IN_CALLS`): Mistral's templates write a previous call as `NAME[CALL_ID]ID[ARGS]{...}` (Mistral
Small 3.2), where mlx-lm's mistral parser reads `NAME[ARGS]{...}`, so a model that writes its call as its
history shows it is read too (the id it writes is not used: every call gets a fresh id).

A call the output ends inside (its end marker not yet seen) is decided by why the output ended:

    "length"     the output was cut by max_tokens (or the context's end): the call is cut off, and its
                 text is dropped, markers included, with the whitespace before it (so is a partial start
                 marker ending the output: it may begin a call, and the text is cut anyway). The complete
                 calls before it are kept, the text before its start marker stays content, and the finish
                 reason stays "length". In a format without an end marker (Mistral's), a call ends where
                 the next start marker begins: the calls before the last start marker are complete, the
                 last one is the cut one.
    "stop"       the model ended by itself (EOS or a stop sequence): the call is parsed as if its end
                 marker had come, as mlx-lm's server and vLLM's parsers do; valid, it is a call, otherwise
                 its text stays content (the model chose to end there, so nothing was cut off).
    other/None   its text stays content (a format without end marker parses it, as for "stop").

Streamed, nothing of an open call is sent before its end marker (a call starts only once it is complete
and valid), so a cut call has sent nothing, neither as content nor as a call; its dropping is reported as
one `ToolCallCut` event for the formatters that must forget what it was (the Responses API's logprobs).
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import uuid
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional, Sequence, Union

from jsonschema.validators import validator_for

from router.reasoning import reasoning_support

logger = logging.getLogger(__name__)

FALLBACK_PARSER = "json_tools"  # the Hermes format the fallback rendering asks for
# parser name -> the text its calls may hold that mlx-lm's parser does not read (module docstring)
IGNORED_IN_CALLS = {"mistral": re.compile(r"\[CALL_ID\]\s*[A-Za-z0-9_-]*\s*(?=\[ARGS\])")}


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `id` "call_<24 hex>", the function `name`, `arguments` the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ContentDelta:
    """Plain assistant text (outside any tool call)."""

    text: str


@dataclass(frozen=True)
class ToolCallStarted:
    """A complete, valid call begins: its position among the choice's calls, id and function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """A fragment of call `index`'s arguments JSON (the fragments of one call join to its `arguments`)."""

    index: int
    text: str


@dataclass(frozen=True)
class ToolCallCut:
    """The output was cut (finish reason "length") inside a call, or inside what may be its start marker:
    `text`, that call's markup, is dropped (never content, never a call); only for logging and bookkeeping."""

    text: str


ToolEvent = Union[ContentDelta, ToolCallStarted, ToolCallArguments, ToolCallCut]


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id, "call_" and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def _tool_functions(tools: Sequence[dict]) -> dict[str, dict]:
    """name -> the `function` object of each OpenAI function tool."""
    out = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            out[function["name"]] = function
    return out


def _valid_arguments(function: dict, arguments: Any) -> bool:
    """True when `arguments` is an object that validates against the function's parameters schema."""
    if not isinstance(arguments, dict):
        return False
    schema = function.get("parameters")
    if not isinstance(schema, dict) or not schema:
        return True
    try:
        return validator_for(schema)(schema).is_valid(arguments)
    except Exception:  # a schema the request check let through but jsonschema cannot apply
        return False


class ToolParser:
    """The tool-call format of one model: mlx-lm parser module `name` (markers `start`/`end`).

    `markers_are_special`: the markers are special tokens, so a request that parses calls must keep special
    tokens in its output text (`SamplingParams.skip_special_tokens=False`). `native`: the chat template
    renders tools itself; False means the Hermes fallback (router/tool_prompt.py) and `json_tools`.
    """

    def __init__(self, name: str, module: ModuleType, *, native: bool, markers_are_special: bool):
        self.name = name
        self.module = module
        self.start: str = module.tool_call_start
        self.end: str = module.tool_call_end or ""
        self.native = native
        self.markers_are_special = markers_are_special
        self._ignored = IGNORED_IN_CALLS.get(name)

    def __repr__(self) -> str:
        return f"ToolParser({self.name!r}, native={self.native})"

    def stream(self, tools: Sequence[dict], max_calls: Optional[int] = None) -> "ToolCallStream":
        """A parser for one choice's streamed text; `max_calls` (e.g. 1 without parallel tool calls) caps the
        calls reported, later ones staying content."""
        return ToolCallStream(self, tools, max_calls)

    def parse(self, text: str, tools: Sequence[dict], finish_reason: Optional[str] = None,
              max_calls: Optional[int] = None) -> tuple[Optional[str], list[ToolCall]]:
        """(content or None when there is none, calls) of a whole output; `finish_reason` as in
        `ToolCallStream.finish`."""
        stream = self.stream(tools, max_calls)
        events = stream.feed(text) + stream.finish(finish_reason)
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        names: dict[int, tuple[str, str]] = {}
        arguments: dict[int, list[str]] = {}
        for e in events:
            if isinstance(e, ToolCallStarted):
                names[e.index] = (e.id, e.name)
            elif isinstance(e, ToolCallArguments):
                arguments.setdefault(e.index, []).append(e.text)
        calls = [ToolCall(id=names[i][0], name=names[i][1], arguments="".join(arguments.get(i, ())))
                 for i in sorted(names)]
        return (content or None), calls

    def calls_from(self, body: str, tools: Sequence[dict]) -> Optional[list[tuple[str, str]]]:
        """[(name, arguments JSON)] of the text between one pair of markers, or None unless every call in it
        parses, names one of `tools` and has arguments valid for that tool."""
        if self._ignored is not None:
            body = self._ignored.sub("", body)
        try:
            parsed = self.module.parse_tool_call(body, list(tools))
        except Exception as exc:  # the parsers raise ValueError, JSONDecodeError, SyntaxError, KeyError...
            logger.debug("tool call text does not parse (%s: %s); it stays content", type(exc).__name__, exc)
            return None
        items = parsed if isinstance(parsed, list) else [parsed]
        functions = _tool_functions(tools)
        out = []
        for item in items:
            if not isinstance(item, dict):
                return None
            name = item.get("name")
            args = item.get("arguments", item.get("parameters", {}))
            if isinstance(args, str):  # some formats carry the arguments as JSON text
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            if not isinstance(name, str) or name not in functions or not _valid_arguments(functions[name], args):
                return None
            out.append((name, json.dumps(args, ensure_ascii=False)))
        return out or None


class ToolCallStream:
    """Splits one choice's streamed text into content and tool calls (`ToolParser.stream`).

    `feed` holds back text that may be the start of a start marker and the text of a call until its end
    marker, then reports the call (`ToolCallStarted`, then its arguments in one `ToolCallArguments`) or, when
    it is not a valid call, its text as content. Trailing whitespace of content is held until more content
    comes; whitespace right before a reported call, and at the end of an output with calls, is dropped (so
    the content is the same however the text was split into deltas).
    """

    def __init__(self, parser: ToolParser, tools: Sequence[dict], max_calls: Optional[int] = None):
        self.parser = parser
        self.tools = list(tools)
        self.max_calls = max_calls
        self.num_calls = 0
        self._held = ""  # normal text that may begin a start marker
        self._call: Optional[str] = None  # text after a start marker, while its end marker has not come
        self._space = ""  # trailing whitespace of the content, not yet sent

    def _content(self, text: str, out: list[ToolEvent]) -> None:
        """Send content, holding its trailing whitespace until more content comes (dropped before a call)."""
        if not text:
            return
        text = self._space + text
        kept = text.rstrip()
        self._space = text[len(kept):]
        if not kept:
            return
        if out and isinstance(out[-1], ContentDelta):
            out[-1] = ContentDelta(out[-1].text + kept)
        else:
            out.append(ContentDelta(kept))

    def _close(self, body: str, closed: bool, out: list[ToolEvent]) -> None:
        """Report the call whose text is `body` (end marker seen when `closed`), or its text as content."""
        parser = self.parser
        calls = parser.calls_from(body, self.tools)
        if calls is not None and (self.max_calls is None or self.num_calls + len(calls) <= self.max_calls):
            self._space = ""
            for name, arguments in calls:
                out.append(ToolCallStarted(self.num_calls, new_call_id(), name))
                out.append(ToolCallArguments(self.num_calls, arguments))
                self.num_calls += 1
            return
        self._content(parser.start + body + (parser.end if closed else ""), out)

    def feed(self, text: str) -> list[ToolEvent]:
        """The events that `text`, appended to the choice's output, completes."""
        out: list[ToolEvent] = []
        start, end = self.parser.start, self.parser.end
        data = self._held + text
        self._held = ""
        while data:
            if self._call is None:
                at = data.find(start)
                if at < 0:
                    keep = next((k for k in range(min(len(start) - 1, len(data)), 0, -1)
                                 if start.startswith(data[-k:])), 0)
                    self._content(data[:len(data) - keep], out)
                    self._held = data[len(data) - keep:]
                    break
                self._content(data[:at], out)
                self._call, data = "", data[at + len(start):]
                continue
            if not end:  # the call runs to the end of the output (Mistral's format)
                self._call += data
                break
            search_from = max(0, len(self._call) - len(end) + 1)
            whole = self._call + data
            at = whole.find(end, search_from)
            if at < 0:
                self._call = whole
                break
            self._call = None
            self._close(whole[:at], True, out)
            data = whole[at + len(end):]
        return out

    def _cut(self, body: str, out: list[ToolEvent]) -> None:
        """Drop the call cut off by max_tokens whose text after its start marker is `body`; in a format
        without end marker, the calls before the last start marker in `body` are complete and closed first."""
        start = self.parser.start
        at = -1 if self.parser.end else body.rfind(start)
        if at >= 0:
            self._close(body[:at], False, out)
            body = body[at + len(start):]
        self._space = ""
        out.append(ToolCallCut(start + body))
        logger.debug("a tool call was cut off by max_tokens; its text is dropped: %r", start + body)

    def finish(self, finish_reason: Optional[str] = None) -> list[ToolEvent]:
        """The events left at the end of the output, by `finish_reason` (rules in the module docstring): a
        call still open is dropped ("length"), parsed ("stop", or any reason in a format without end marker)
        or content; held text is content, or dropped with a cut call when it may begin a start marker."""
        out: list[ToolEvent] = []
        cut = finish_reason == "length"
        if self._call is not None:
            body, self._call = self._call, None
            if cut:
                self._cut(body, out)
            elif not self.parser.end or finish_reason == "stop":
                self._close(body, False, out)
            else:
                self._content(self.parser.start + body, out)
        if self._held:  # only ever a proper prefix of the start marker, the output's last characters
            if cut:
                self._space = ""
                out.append(ToolCallCut(self._held))
            else:
                self._content(self._held, out)
            self._held = ""
        if self._space and not self.num_calls:
            out.append(ContentDelta(self._space))
        self._space = ""
        return out


# ------------------------------------------------------------------------------------------ choosing


def _load_module(name: str) -> Optional[ModuleType]:
    try:
        return importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    except ImportError:
        logger.warning("mlx-lm has no tool parser %r; tools use the Hermes fallback", name)
        return None


def infer_parser_name(wrapper: Any) -> Optional[str]:
    """The mlx-lm tool parser name of a tokenizer (config's `tool_parser_type`, else mlx-lm's inference
    from the chat template and vocab), or None."""
    hf = getattr(wrapper, "_tokenizer", wrapper)
    configured = (getattr(hf, "init_kwargs", None) or {}).get("tool_parser_type")
    if isinstance(configured, str):
        return configured
    if not isinstance(getattr(hf, "chat_template", None), str) or not hasattr(hf, "get_vocab"):
        return None
    try:
        from mlx_lm.tokenizer_utils import _infer_tool_parser
    except ImportError:  # pragma: no cover - mlx-lm renamed it
        return None
    try:
        return _infer_tool_parser(hf)
    except Exception:
        return None


def special_token_texts(wrapper: Any) -> frozenset[str]:
    """The texts of the tokenizer's special tokens (those `skip_special_tokens` leaves out of decoded text)."""
    added = getattr(wrapper, "added_tokens_decoder", None) or {}
    texts = {str(getattr(t, "content", t)) for t in added.values() if getattr(t, "special", False)}
    hf = getattr(wrapper, "_tokenizer", wrapper)
    texts.update(str(t) for t in (getattr(hf, "all_special_tokens", None) or ()))
    return frozenset(texts)


def build_tool_parser(wrapper: Any, renders_tools: bool) -> ToolParser:
    """The ToolParser of a tokenizer wrapper whose chat template renders tools (`renders_tools`) or not."""
    name = infer_parser_name(wrapper) if renders_tools else None
    module = _load_module(name) if name else None
    native = module is not None
    if module is None:
        name, module = FALLBACK_PARSER, importlib.import_module(f"mlx_lm.tool_parsers.{FALLBACK_PARSER}")
        # a harmony model (gpt-oss): its template renders tools and calls, and the engine writes each call it
        # makes in the Hermes form (cluster/reasoning_harmony.py), which the fallback parser reads
        native = renders_tools and reasoning_support(wrapper).format == "harmony"
    special = special_token_texts(wrapper)
    markers = [m for m in (module.tool_call_start, module.tool_call_end) if m]
    return ToolParser(name, module, native=native, markers_are_special=any(m in special for m in markers))


_PARSERS: "weakref.WeakKeyDictionary[Any, tuple[ToolParser, ToolParser]]" = weakref.WeakKeyDictionary()


def _parsers(tok: Any) -> tuple[ToolParser, ToolParser]:
    parsers = _PARSERS.get(tok)
    if parsers is None:
        from router.tool_prompt import template_renders_tools

        native = build_tool_parser(tok.wrapped, template_renders_tools(tok.wrapped))
        forced = native if native.name == FALLBACK_PARSER else build_tool_parser(tok.wrapped, False)
        parsers = _PARSERS[tok] = (native, forced)
    return parsers


def tool_parser_for(tok: Any) -> ToolParser:
    """The ToolParser of a RouterTokenizer (the model's own format, or the fallback), built on first use and
    kept for the tokenizer's life."""
    return _parsers(tok)[0]


def forced_tool_parser_for(tok: Any) -> ToolParser:
    """The json_tools ToolParser of a RouterTokenizer, for output a grammar forced into the Hermes form
    (router/structured.py): the model's own parser when it is json_tools, else the fallback one."""
    return _parsers(tok)[1]
