"""Tools and structured outputs with the official `openai` client against a live server over the real SmolLM2
(whose plain ChatML template gets the Hermes fallback): a call streamed, tool_choice "required" (whole) and
named (streamed), a call cut by max_tokens, response_format json_object and json_schema, and the bad inputs
that are 400s. A second app over the same engine serves a tokenizer whose chat template renders tools itself
(a Hermes-style template, the json_tools format of Qwen2.5), for a whole answer with a call through the native
path. Greedy decoding throughout; a few-shot conversation makes the model call on its own ("auto")."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.live_server import live_server, serve_app
from tests.tool_helpers import WEATHER, call, hermes_tokenizer, weather_few_shot

TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone",
                                         "parameters": {"type": "object", "properties": {
                                             "tz": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
                                             "required": ["tz"]}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
USER = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "role": {"type": "string", "enum": ["admin", "user"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 1},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
                "additionalProperties": False}},
    "required": ["name", "role", "tags", "address"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    with live_server() as (base, engine):
        yield base, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def native_client(server):
    """A client of a second app over the same engine, whose tokenizer's template renders tools."""
    from cluster.model import DEFAULT_MODEL
    from router.app import create_app

    with serve_app(create_app(server[1], hermes_tokenizer(), served_model_names=[DEFAULT_MODEL])) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)


def create(client, **kw):
    kw.setdefault("model", "SmolLM2-135M-Instruct")
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(**kw)


def check_call(call_out, names=("get_weather", "get_time")) -> dict:
    """The arguments of a returned call, after checking its id, type and name, and its arguments' schema."""
    assert re.fullmatch(r"call_[0-9a-f]{24}", call_out.id) and call_out.type == "function"
    assert call_out.function.name in names
    arguments = json.loads(call_out.function.arguments)
    jsonschema.validate(arguments, PARAMS[call_out.function.name])
    return arguments


def test_auto_call_streamed_in_openai_chunks(client):
    chunks = list(create(client, messages=weather_few_shot("London"), tools=[WEATHER], max_tokens=40, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    first, rest = deltas[0][0], [d[0] for d in deltas[1:]]
    assert first.index == 0 and re.fullmatch(r"call_[0-9a-f]{24}", first.id) and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert rest and all(d.index == 0 and d.id is None and d.type is None and d.function.name is None for d in rest)
    assert json.loads("".join(d.function.arguments for d in rest)) == {"city": "London"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_a_call_cut_by_max_tokens_is_dropped_and_finishes_with_length(client):
    """The real model starts its call, greedy, and max_tokens cuts it: no call, no markup as content, finish
    "length" and all 6 tokens counted, whole and streamed."""
    r = create(client, messages=weather_few_shot("London"), tools=[WEATHER], max_tokens=6)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content is None and r.usage.completion_tokens == 6
    chunks = list(create(client, messages=weather_few_shot("London"), tools=[WEATHER], max_tokens=6, stream=True,
                         stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "" and not any(d.tool_calls for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 6


def test_tool_choice_required_gives_one_valid_call(client):
    r = create(client, messages=[{"role": "user", "content": "What time is it in Berlin?"}], tools=[WEATHER, TIME],
               tool_choice="required", parallel_tool_calls=False, max_tokens=50)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])


def test_named_tool_choice_streamed_calls_that_function(client):
    chunks = list(create(client, messages=[{"role": "user", "content": "Is it sunny?"}], tools=[WEATHER, TIME],
                         tool_choice={"type": "function", "function": {"name": "get_time"}},
                         parallel_tool_calls=False, max_tokens=50, stream=True))
    calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert calls[0].function.name == "get_time" and {d.index for d in calls} == {0}
    arguments = json.loads("".join(d.function.arguments or "" for d in calls))
    jsonschema.validate(arguments, TIME["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_response_format_json_object(client):
    r = create(client, messages=[{"role": "user", "content": 'Reply with a JSON object with the key "answer" only. '
                                                             "What is the capital of France?"}],
               response_format={"type": "json_object"}, max_tokens=40)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_response_format_json_schema_with_nested_object_enum_and_array(client):
    r = create(client, messages=[{"role": "user", "content": "Describe a user as JSON."}], max_tokens=60,
               response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": USER,
                                                                        "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), USER)
    # the engine's constrained-decoding counters reach the router's /metrics
    metrics = httpx.get(str(client.base_url.join("/metrics")), timeout=30).text
    counts = {m[0]: float(m[1]) for m in re.findall(r"^(mlx_pd_(?:constrained_requests|grammar_mask_seconds)_total) "
                                                    r"(\S+)$", metrics, re.M)}
    assert counts["mlx_pd_constrained_requests_total"] >= 1
    assert counts["mlx_pd_grammar_mask_seconds_total"] > 0


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools[0].function.parameters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                          "required": "a"}}}},
     "response_format.json_schema.schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None,
                                                       "tool_calls": [call("call_1", "get_weather", {"city": "A"})]},
                   {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]}, "messages[2].tool_call_id"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(?<=a)b"}}}}, "response_format.json_schema.schema"),
])
def test_bad_tool_and_format_inputs_are_400s_naming_the_field(client, body, param):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **body}
    with pytest.raises(openai.BadRequestError) as exc:
        create(client, **body)
    assert exc.value.body["param"] == param and param in exc.value.message
    assert create(client, messages=[{"role": "user", "content": "Hi"}], max_tokens=1).choices[0].message.content


def test_auto_call_through_a_template_that_renders_tools(native_client):
    r = create(native_client, messages=weather_few_shot("Madrid"), tools=[WEATHER], max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert check_call(choice.message.tool_calls[0]) == {"city": "Madrid"}

