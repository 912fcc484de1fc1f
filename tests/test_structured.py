"""Grammars for response_format and forced tool calls (router/structured.py), checked directly with llguidance
over SmolLM2's tokenizer: what they accept, what they refuse, that whitespace between JSON values cannot loop,
and that a schema llguidance cannot build is a 400 naming its field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from router.errors import APIError
from router.openai.request import ChatCompletionRequest
from router.params import plan_tools
from router.structured import _marker, build_grammar, closed_schema, json_grammar, llg_tokenizer, tool_calls_lark
from tests.router_fakes import load_tokenizer
from tests.tool_helpers import WEATHER

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}}}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "role": {"type": "string", "enum": ["admin", "user"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                "additionalProperties": False}},
    "required": ["name", "role", "tags", "address"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def matcher(tok, grammar):
    from llguidance import LLMatcher

    m = LLMatcher(llg_tokenizer(tok), grammar)
    assert not m.is_error(), m.get_error()
    return m


def accepts(tok, grammar, text) -> bool:
    """True when the grammar takes all of `text` (as the model's tokenizer splits it) and is then complete."""
    m = matcher(tok, grammar)
    ids = tok.wrapped.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def grammar_of(tok, **body):
    """The grammar the chat path builds for a request with `body` (its tool plan, then `build_grammar`)."""
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], **body})
    plan = plan_tools(req, tok)
    return build_grammar(req, plan.shown, plan.forced, tok, plan.parallel)


def test_json_object_grammar_takes_compact_objects_only(tok):
    g = grammar_of(tok, response_format={"type": "json_object"})
    assert accepts(tok, g, '{"a": 1, "b": [true, null], "c": {"d": "x y"}}')
    assert not accepts(tok, g, '[1, 2]')
    assert not accepts(tok, g, '{ "a": 1}') and not accepts(tok, g, '{"a":  1}')
    assert not accepts(tok, g, ' {"a": 1}')


def test_whitespace_between_json_values_cannot_loop(tok):
    """Between the values of a JSON answer, at most one whitespace-only token can follow, never two in a row."""
    import llguidance.numpy

    lt = llg_tokenizer(tok)
    vocab = tok.vocab_size
    space = np.array([bool(t.strip() == "" and t) for t in (tok.decode([i]) for i in range(vocab))])
    g = json_grammar(PERSON)
    text = '{"name": "Ann", "role": "user", "tags": ["a", "b"], "address": {"city": "Oslo"}}'
    ids = tok.wrapped.encode(text, add_special_tokens=False)
    m = matcher(tok, g)
    mask = llguidance.numpy.allocate_token_bitmask(1, lt.vocab_size)

    def allowed_spaces(mm):
        llguidance.numpy.fill_next_token_bitmask(mm, mask, 0)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab].astype(bool)
        return np.flatnonzero(bits & space)

    checked = 0
    for n, t in enumerate(ids):
        prefix = tok.decode(ids[:n])
        if prefix.count('"') % 2 == 0:  # between values (spaces inside a string are its content)
            for w in allowed_spaces(m)[:4]:
                after = m.deep_copy()
                assert after.consume_token(int(w))
                assert len(allowed_spaces(after)) == 0, prefix
                checked += 1
        assert m.consume_token(t)
    assert checked >= 4  # the spaces after ':' and ',' were there and each was alone


def test_json_schema_grammar_enforces_nested_object_enum_and_array(tok):
    g = grammar_of(tok, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    good = {"name": "Ann", "role": "admin", "tags": ["x"], "address": {"city": "Oslo"}}
    assert accepts(tok, g, json.dumps(good))
    assert not accepts(tok, g, json.dumps({**good, "role": "boss"}))
    assert not accepts(tok, g, json.dumps({**good, "tags": ["a", "b", "c", "d"]}))
    assert not accepts(tok, g, json.dumps({**good, "address": {"city": "Oslo", "zip": "1"}}))


def test_objects_that_list_properties_are_closed_unless_the_schema_says_otherwise(tok):
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    assert accepts(tok, json_grammar(point), '{"x": 1}') and not accepts(tok, json_grammar(point), '{"x": 1, "y": 2}')
    open_point = {**point, "additionalProperties": True}
    assert accepts(tok, json_grammar(open_point), '{"x": 1, "y": 2}')
    nested = {"type": "array", "items": point, "$defs": {"p": point},
              "allOf": [point, {"properties": {"y": {"type": "integer"}}}]}
    closed = closed_schema(nested)
    assert closed["items"]["additionalProperties"] is False and closed["$defs"]["p"]["additionalProperties"] is False
    assert all("additionalProperties" not in branch for branch in closed["allOf"])  # allOf combines properties
    assert nested["items"] == point and "additionalProperties" not in point  # the request's schema is untouched


def test_forced_call_grammar_takes_the_hermes_form_with_valid_arguments(tok):
    one = grammar_of(tok, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    assert accepts(tok, one, weather) and accepts(tok, one, time_call)
    assert not accepts(tok, one, weather + "\n" + time_call)
    assert not accepts(tok, one, '<tool_call>\n{"name": "get_time", "arguments": {"tz": "PST"}}\n</tool_call>')
    assert not accepts(tok, one, "Sure! " + weather)
    many = grammar_of(tok, tools=[WEATHER, TIME], tool_choice="required")
    assert accepts(tok, many, weather + "\n" + time_call)
    named = grammar_of(tok, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert accepts(tok, named, time_call) and not accepts(tok, named, weather)
    # naming a function asks for one call of it, even with parallel calls allowed: never the same tool twice
    assert not accepts(tok, named, time_call + "\n" + time_call)


def test_tools_with_a_json_format_allow_either_the_answer_or_calls(tok):
    g = grammar_of(tok, tools=[WEATHER], response_format={"type": "json_object"})
    assert accepts(tok, g, '{"answer": 42}')
    assert accepts(tok, g, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    assert not accepts(tok, g, "plain text")
    assert grammar_of(tok, tools=[WEATHER]) is None and grammar_of(tok, tools=[WEATHER], tool_choice="none") is None


def test_special_token_markers_are_written_as_tokens(tok):
    lt = llg_tokenizer(tok)
    assert _marker("<|im_end|>", lt) == "<|im_end|>"
    assert _marker("<tool_call>", lt) == '"<tool_call>"'
    assert "<|im_end|>" not in tool_calls_lark([WEATHER], False, lt)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(?<=a)b"}}}}, "response_format.json_schema.schema"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"d": {"type": "string", "format": "no-such-format"}}}}}],
      "tool_choice": "required"}, "tools[1].function.parameters"),
])
def test_a_schema_llguidance_cannot_build_is_a_400_naming_its_field(tok, body, param):
    with pytest.raises(APIError) as exc:
        grammar_of(tok, **body)
    assert exc.value.status == 400 and exc.value.param == param and param in exc.value.message
