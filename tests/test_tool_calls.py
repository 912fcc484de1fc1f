"""Tool-call parsing (router/tool_calls.py) on text written the way each model family writes its calls:
whole and streamed (markers split across deltas), invalid calls kept as content, calls cut by max_tokens
dropped (the complete calls and the text before them kept), and the choice of parser from a chat template."""

from __future__ import annotations

import importlib
import json
import random
import re

import pytest

from router.tool_calls import (ContentDelta, ToolCallArguments, ToolCallCut, ToolCallStarted, ToolParser,
                               build_tool_parser, infer_parser_name)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                       "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]


def parser(name: str) -> ToolParser:
    return ToolParser(name, importlib.import_module(f"mlx_lm.tool_parsers.{name}"), native=True,
                      markers_are_special=False)


def calls_of(result):
    return [(c.name, json.loads(c.arguments)) for c in result[1]]


# What each family's model writes (its chat template's format), and the calls in it.
FAMILY_OUTPUTS = {
    "json_tools": ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
                   '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
                   "I will check.",
                   [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "CET"})]),
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n"
                    "3\n</parameter>\n</function>\n</tool_call>",
                    None, [("get_weather", {"city": "Paris", "days": 3})]),
    "mistral": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}',
                None, [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]),
    "pythonic": ('Sure. <|tool_call_start|>[get_weather(city="Rome", days=1)]<|tool_call_end|>',
                 "Sure.", [("get_weather", {"city": "Rome", "days": 1})]),
    "glm47": ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key>"
              "<arg_value>4</arg_value></tool_call>",
              None, [("get_weather", {"city": "Oslo", "days": 4})]),
}


@pytest.mark.parametrize("family", sorted(FAMILY_OUTPUTS))
def test_each_family_output_parses_into_its_calls(family):
    text, content, calls = FAMILY_OUTPUTS[family]
    result = parser(family).parse(text, TOOLS, "stop")
    assert result[0] == content
    assert calls_of(result) == calls
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in result[1])
    assert len({c.id for c in result[1]}) == len(result[1])


@pytest.mark.parametrize("family", sorted(FAMILY_OUTPUTS))
def test_streamed_output_split_anywhere_gives_the_same_calls(family):
    text, content, calls = FAMILY_OUTPUTS[family]
    rng = random.Random(family)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), 12))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        stream = parser(family).stream(TOOLS)
        events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish("stop")
        assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == (content or "")
        started = [e for e in events if isinstance(e, ToolCallStarted)]
        args = {}
        for e in events:
            if isinstance(e, ToolCallArguments):
                args[e.index] = args.get(e.index, "") + e.text
        assert [(s.name, json.loads(args[s.index])) for s in started] == calls
        assert [s.index for s in started] == list(range(len(calls)))


def test_a_partial_start_marker_is_held_until_it_is_decided():
    stream = parser("json_tools").stream(TOOLS)
    assert stream.feed("Hello <tool") == [ContentDelta("Hello")]  # the space waits: a call may follow
    assert stream.feed("_ca") == []
    assert stream.feed("ll>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}\n</tool_") == []
    events = stream.feed("call> bye")
    assert [type(e) for e in events] == [ToolCallStarted, ToolCallArguments, ContentDelta]
    assert events[0].name == "get_time" and json.loads(events[1].text) == {"tz": "UTC"}
    assert events[2].text == " bye"
    # text that only looked like a marker's start is released as content
    stream = parser("json_tools").stream(TOOLS)
    assert stream.feed("a <tool") == [ContentDelta("a")]
    assert stream.feed("box") == [ContentDelta(" <toolbox")]


@pytest.mark.parametrize("body", [
    '{"name": "get_wether", "arguments": {"city": "Paris"}}',  # unknown name
    '{"name": "get_weather", "arguments": {"days": 2}}',  # misses a required argument
    '{"name": "get_weather", "arguments": {"city": 7}}',  # wrong type
    '{"name": "get_time", "arguments": {"tz": "UTC", "extra": 1}}',  # additionalProperties false
    '{"name": "get_weather", "arguments": {"city": "Paris"',  # not JSON
])
def test_a_call_that_does_not_validate_stays_content(body):
    text = f"<tool_call>\n{body}\n</tool_call>"
    assert parser("json_tools").parse(text, TOOLS, "stop") == (text, [])


def test_a_call_cut_by_max_tokens_is_dropped_even_when_its_json_is_whole_and_an_unclosed_call_at_stop_is_parsed():
    mid_arguments = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    assert parser("json_tools").parse(mid_arguments, TOOLS, "length") == (None, [])
    # without its end marker a call is not known to be complete, however whole its JSON looks
    unclosed = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n'
    assert parser("json_tools").parse(unclosed, TOOLS, "length") == (None, [])
    assert parser("json_tools").parse(unclosed, TOOLS) == (unclosed, [])  # no finish reason: no end marker, no call
    # the model ending by itself closes the call: parsed when valid, its text kept as content when not
    content, calls = parser("json_tools").parse(unclosed, TOOLS, "stop")
    assert content is None and [c.name for c in calls] == ["get_time"]
    unknown = '<tool_call>\n{"name": "get_date", "arguments": {}}\n'
    assert parser("json_tools").parse(unknown, TOOLS, "stop") == (unknown, [])


def test_text_before_a_cut_call_stays_and_complete_calls_before_it_are_kept():
    text, _, _ = FAMILY_OUTPUTS["json_tools"]
    cut = text[:text.rindex('"CET"')]  # inside the second call's arguments
    content, calls = parser("json_tools").parse(cut, TOOLS, "length")
    assert content == "I will check." and [c.name for c in calls] == ["get_weather"]
    content, calls = parser("json_tools").parse('Let me look.\n<tool_call>\n{"name": "get_ti', TOOLS, "length")
    assert (content, calls) == ("Let me look.", [])
    # a complete call that does not validate is not cut off: it stays content, the cut one after it goes
    bad = '<tool_call>\n{"name": "get_date", "arguments": {}}\n</tool_call>'
    assert parser("json_tools").parse(bad + '\n<tool_call>\n{"na', TOOLS, "length") == (bad, [])
    # a call beyond max_calls is content as ever; a cut one is dropped all the same
    content, calls = parser("json_tools").parse(cut, TOOLS, "length", max_calls=1)
    assert content == "I will check." and len(calls) == 1


def test_a_partial_start_marker_at_the_cut_is_dropped_but_plain_text_cut_by_max_tokens_is_kept_whole():
    assert parser("json_tools").parse("Let me look. <tool_ca", TOOLS, "length") == ("Let me look.", [])
    assert parser("json_tools").parse("Let me look. <tool_ca", TOOLS, "stop") == ("Let me look. <tool_ca", [])
    assert parser("json_tools").parse("Plain text, cut \n", TOOLS, "length") == ("Plain text, cut \n", [])


@pytest.mark.parametrize("family", sorted(FAMILY_OUTPUTS))
def test_every_cut_inside_a_family_last_call_keeps_the_calls_before_it_whole_and_streamed(family):
    """Cut (finish "length") anywhere inside the last call of each family's output, the answer is the content
    and calls before that call, however the text arrived; nothing of the cut call is ever sent."""
    text, content, calls = FAMILY_OUTPUTS[family]
    p = parser(family)
    last = text.rindex(p.start)
    first_cut = last + (1 if p.end else len(p.start))  # without end marker only a whole marker ends a call
    rng = random.Random(family)
    for at in range(first_cut, len(text)):
        cut = text[:at]
        result = p.parse(cut, TOOLS, "length")
        assert (result[0], calls_of(result)) == (content, calls[:-1]), cut
        cuts = sorted(rng.sample(range(1, at), min(6, at - 1)))
        pieces = [cut[a:b] for a, b in zip([0] + cuts, cuts + [at])]
        stream = p.stream(TOOLS)
        fed = [e for piece in pieces for e in stream.feed(piece)]
        finished = stream.finish("length")
        events = fed + finished
        assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == (content or "")
        assert [e.name for e in events if isinstance(e, ToolCallStarted)] == [c[0] for c in calls[:-1]]
        assert [type(e) for e in finished if isinstance(e, ToolCallCut)] == [ToolCallCut]


def test_a_cut_call_in_formats_whose_markers_are_special_tokens():
    """Markers that are special tokens arrive whole, one token per delta: the cut call after them is dropped,
    the call and text before it kept, in a format with an end marker and in Mistral's, which has none."""
    lfm = build_tool_parser(_HFLike("<|tool_call_start|>[{{ c }}]<|tool_call_end|>",
                                    vocab=["<|tool_call_start|>", "<|tool_call_end|>"]), renders_tools=True)
    assert (lfm.name, lfm.markers_are_special) == ("pythonic", True)
    stream = lfm.stream(TOOLS)
    tokens = ["Sure", ".", " ", "<|tool_call_start|>", "[get_weather(", 'city="Rome")]', "<|tool_call_end|>", " ",
              "<|tool_call_start|>", "[get_time(", "tz="]
    events = [e for t in tokens for e in stream.feed(t)] + stream.finish("length")
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Sure."
    assert [(type(e).__name__, getattr(e, "name", getattr(e, "text", None))) for e in events
            if not isinstance(e, ContentDelta)] == [
        ("ToolCallStarted", "get_weather"), ("ToolCallArguments", '{"city": "Rome"}'),
        ("ToolCallCut", "<|tool_call_start|>[get_time(tz=")]
    mistral = build_tool_parser(_HFLike("[TOOL_CALLS]{{ x }}", vocab=["[TOOL_CALLS]"]), renders_tools=True)
    assert mistral.markers_are_special
    stream = mistral.stream(TOOLS)
    tokens = ["[TOOL_CALLS]", "get_time", "[ARGS]", '{"tz": "UTC"}', "[TOOL_CALLS]", "get_weather", "[ARGS]", '{"ci']
    events = [e for t in tokens for e in stream.feed(t)]
    assert events == []  # Mistral's calls end only with the output
    events = stream.finish("length")
    assert [type(e) for e in events] == [ToolCallStarted, ToolCallArguments, ToolCallCut]
    assert events[0].name == "get_time" and events[2].text == '[TOOL_CALLS]get_weather[ARGS]{"ci'


def test_max_calls_keeps_later_calls_as_content_and_whitespace_between_calls_is_dropped():
    text, _, _ = FAMILY_OUTPUTS["json_tools"]
    content, calls = parser("json_tools").parse(text, TOOLS, "stop", max_calls=1)
    assert [c.name for c in calls] == ["get_weather"]
    assert content == 'I will check.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    only_calls = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>\n\n'
    assert parser("json_tools").parse(only_calls, TOOLS, "stop")[0] is None
    assert parser("json_tools").parse("  \n", TOOLS, "stop") == ("  \n", [])


class _HFLike:
    """What mlx-lm's inference reads of a Hugging Face tokenizer: the template and the vocabulary."""

    def __init__(self, template, vocab=(), config=None):
        self.chat_template = template
        self._vocab = {t: i for i, t in enumerate(vocab)}
        self.init_kwargs = config or {}
        self.all_special_tokens = list(vocab)

    def get_vocab(self):
        return self._vocab


@pytest.mark.parametrize("template, name", [
    ("{% for tool_call in m.tool_calls %}<tool_call>{{ tool_call.name }}</tool_call>{% endfor %}", "json_tools"),
    ("<tool_call>\n<function={{ name }}>", "qwen3_coder"),
    ("[TOOL_CALLS]{{ calls }}", "mistral"),
    ("<|tool_call_start|>[{{ c }}]<|tool_call_end|>", "pythonic"),
    ("<tool_call>{{ n }}<arg_key>{{ k }}</arg_key>", "glm47"),
    ("{{ messages }}", None),
])
def test_the_parser_is_inferred_from_the_chat_template_as_mlx_lm_does(template, name):
    assert infer_parser_name(_HFLike(template)) == name
    assert infer_parser_name(_HFLike("{{ x }}", config={"tool_parser_type": "mistral"})) == "mistral"


def test_markers_that_are_special_tokens_are_flagged_and_an_unknown_format_falls_back_to_json_tools():
    special = build_tool_parser(_HFLike("[TOOL_CALLS]{{ x }}", vocab=["[TOOL_CALLS]"]), renders_tools=True)
    assert (special.name, special.native, special.markers_are_special) == ("mistral", True, True)
    plain = build_tool_parser(_HFLike("<tool_call>{{ tool_call.name }}"), renders_tools=True)
    assert (plain.name, plain.native, plain.markers_are_special) == ("json_tools", True, False)
    fallback = build_tool_parser(_HFLike("{{ messages }}"), renders_tools=True)
    assert (fallback.name, fallback.native) == ("json_tools", False)
    ignored = build_tool_parser(_HFLike("[TOOL_CALLS]{{ x }}"), renders_tools=False)
    assert (ignored.name, ignored.native) == ("json_tools", False)
