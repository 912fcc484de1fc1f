"""POST /v1/responses with the official `openai` client against a real single-node server (real SmolLM2,
float32, greedy): text answers and their usage, the streaming events, max_output_tokens, structured output,
a function-call round trip, the stateless refusals and an audit of every request key the SDK knows."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response
from openai.types.responses.response_create_params import ResponseCreateParamsBase

from router.responses.fields import RESPONSES_HONOURED, RESPONSES_ACCEPTED, RESPONSES_REFUSED
from tests.live_server import live_server

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
INSTRUCTIONS = "Answer in one short sentence."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": WEATHER, "strict": True}]


@pytest.fixture(scope="module")
def server():
    with live_server(max_model_len=1024, max_num_seqs=4) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(base: str, body: dict) -> httpx.Response:
    return httpx.post(base + "/v1/responses", json={"model": MODEL, **body}, timeout=120)


def test_text_answer_matches_the_chat_endpoint_and_validates_as_an_sdk_response(server, client):
    """instructions + a string input mean a system and a user message: the same prompt tokens and the same
    greedy text as /v1/chat/completions, with usage counted and the body a valid SDK Response."""
    raw = post(server, {"input": QUESTION, "instructions": INSTRUCTIONS, "max_output_tokens": 12,
                        "temperature": 0})
    assert raw.status_code == 200, raw.text
    r = Response.model_validate(raw.json())
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content and "Paris" in r.output_text
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.instructions == INSTRUCTIONS
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert r.status == message.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")


def test_stream_deltas_join_to_the_whole_answer(client):
    """The SDK's stream helper parses every event; the deltas join to the non-streamed greedy text, the
    sequence numbers count from 0 and the last event is response.completed with the whole response."""
    kwargs = dict(model=MODEL, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=16, temperature=0)
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed", "the answer should end before max_output_tokens"
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert events[-1].response.id == events[0].response.id == final.id


def test_max_output_tokens_makes_the_response_incomplete(client):
    """Output cut by max_output_tokens: status incomplete with the reason, whole and streamed."""
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2 and r.output[0].status == "incomplete"
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, temperature=0,
                                          stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == r.output_text


def test_json_schema_format_gives_valid_json(client):
    """text.format json_schema constrains the output: it parses and validates against the schema."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Is Paris in France? Answer in JSON.", temperature=0,
                                max_output_tokens=20, text={"format": {"type": "json_schema", "name": "verdict",
                                                                       "schema": schema, "strict": True}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_forced_function_call_then_its_output_gives_text(client):
    """tool_choice naming a function yields a function_call item (streamed as arguments deltas) whose
    arguments validate; sending it back with a function_call_output gets a text answer."""
    question = {"role": "user", "content": "What is the weather in Paris?"}
    with client.responses.stream(model=MODEL, input=[question], tools=TOOLS, temperature=0, max_output_tokens=40,
                                 parallel_tool_calls=False,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = list(stream)
        first = stream.get_final_response()
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done[0].arguments == calls[0].arguments and first.status == "completed"
    call = calls[0]
    second = client.responses.create(model=MODEL, tools=TOOLS, temperature=0, max_output_tokens=8, input=[
        question, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees"}])
    assert second.output_text.strip() and not [i for i in second.output if i.type == "function_call"]
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its output are in the prompt


@pytest.mark.parametrize("field,value", [("previous_response_id", "resp_123"), ("conversation", "conv_123"),
                                         ("background", True)])
def test_stateful_fields_are_refused_by_name(client, field, value):
    """The server keeps no state: the stateful fields get a 400 naming them that says to send the whole input."""
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=MODEL, input=QUESTION, extra_body={field: value})
    assert exc.value.body["param"] == field and "input" in exc.value.message


# A value of each refused key that asks for what the server does not do.
REFUSED_SAMPLES = {
    "previous_response_id": "resp_1", "conversation": {"id": "conv_1"}, "background": True,
    "prompt": {"id": "pmpt_1"}, "context_management": [{"type": "compaction"}]}
# A value of each honoured or echoed key, and what the Response shows of it.
ACCEPTED_SAMPLES = {
    "model": (MODEL, lambda r: r["model"] == MODEL), "input": ("Hi", lambda r: r["output"]),
    "instructions": ("Be brief.", lambda r: r["instructions"] == "Be brief."),
    "max_output_tokens": (1, lambda r: r["usage"]["output_tokens"] == 1 and r["max_output_tokens"] == 1),
    "temperature": (0.0, lambda r: r["temperature"] == 0.0), "top_p": (0.9, lambda r: r["top_p"] == 0.9),
    "stream": (False, lambda r: r["object"] == "response"),
    "stream_options": ({"include_obfuscation": False}, lambda r: r["status"]),
    "tools": (TOOLS, lambda r: r["tools"][0]["name"] == "get_weather"),
    "tool_choice": ("none", lambda r: r["tool_choice"] == "none"),
    "parallel_tool_calls": (False, lambda r: r["parallel_tool_calls"] is False),
    "text": ({"format": {"type": "text"}, "verbosity": "low"},
             lambda r: r["text"]["format"]["type"] == "text" and r["text"]["verbosity"] == "low"),
    "include": (["message.output_text.logprobs"], lambda r: len(r["output"][0]["content"][0]["logprobs"]) == 1),
    "top_logprobs": (2, lambda r: r["top_logprobs"] == 2),
    "max_tool_calls": (3, lambda r: r["max_tool_calls"] == 3),
    "metadata": ({"k": "v"}, lambda r: r["metadata"] == {"k": "v"}), "user": ("u1", lambda r: r["user"] == "u1"),
    "safety_identifier": ("s1", lambda r: r["safety_identifier"] == "s1"),
    "prompt_cache_key": ("p1", lambda r: r["prompt_cache_key"] == "p1"),
    "reasoning": ({"effort": "low", "summary": "auto", "context": "all_turns"},
                  lambda r: r["reasoning"]["effort"] == "low" and r["reasoning"]["summary"] == "auto"),
    "store": (True, lambda r: r["store"] is False), "service_tier": ("flex", lambda r: r["service_tier"] == "default"),
    "truncation": ("auto", lambda r: r["truncation"] == "disabled"),
    "prompt_cache_options": ({"ttl": "12h"}, lambda r: r["status"]),
    "prompt_cache_retention": ("24h", lambda r: r["status"]),
    "moderation": ({"model": "omni-moderation-latest"}, lambda r: r["status"]),
    "image": ({"context_compression": "enabled"}, lambda r: r["status"]),
    "background_options": ({"completion_window": "2h"}, lambda r: r["status"]),
    "access_programs": ({"cyber": "standard"}, lambda r: r["status"])}


def test_every_sdk_request_key_is_honoured_or_refused_by_name(server):
    """Walks every key of the SDK's ResponseCreateParams: each is in exactly one of the audit's sets, and an
    accepted one has its effect stated; a refused key's value gets a 400 naming it; the honoured and accepted
    keys' values, all in one request, are answered and each shows in the Response (what it echoes, or what the
    server reports it did)."""
    keys = set(ResponseCreateParamsBase.__annotations__) | {"stream"}
    sets = (RESPONSES_HONOURED, set(RESPONSES_ACCEPTED), set(RESPONSES_REFUSED))
    assert all(sum(k in s for s in sets) == 1 for k in keys), [k for k in keys if sum(k in s for s in sets) != 1]
    assert all(isinstance(effect, str) and effect for effect in RESPONSES_ACCEPTED.values())
    assert set(REFUSED_SAMPLES) == set(RESPONSES_REFUSED) and set(ACCEPTED_SAMPLES) == keys - set(REFUSED_SAMPLES)
    for key, value in REFUSED_SAMPLES.items():
        r = post(server, {"input": "Hi", key: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == key, (key, r.text)
        assert r.json()["error"]["message"].startswith(key + ": ")
    body = {key: value for key, (value, _) in ACCEPTED_SAMPLES.items()}  # all at once: one generation
    r = post(server, body)
    assert r.status_code == 200, r.text
    answer = Response.model_validate(r.json()).model_dump()
    assert [key for key, (_, shows) in ACCEPTED_SAMPLES.items() if not shows(answer)] == []


@pytest.mark.parametrize("body,param,words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]", "input_image"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "item_reference"),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "exec", "input": "x"}]}, "input[0]",
     "custom_tool_call"),
    ({"input": "Hi", "tools": [{"type": "custom", "name": "exec"}]}, "tools[0]", "custom"),
    ({"input": "Hi", "tool_choice": {"type": "file_search"}}, "tool_choice", "file_search"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "input[0].call_id", "c9"),
    ({"input": "Hi", "include": ["file_search_call.results"]}, "include", "file_search_call.results"),
    ({"input": "Hi", "top_logprobs": 3}, "top_logprobs", "include"),
    ({"input": "Hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
])
def test_unsupported_inputs_are_refused_naming_the_field(server, body, param, words):
    """Images, items the server cannot take (references to stored items, custom tool calls), custom tools, a
    choice forcing a built-in tool, an output answering no call: 400 naming the field."""
    r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.usefixtures("server")  # its model load gives the tokenizer below for free
def test_stream_and_whole_answer_agree_on_text_calls_and_text_again():
    """Text, a tool call, then more text (as the tool parser reads it): the stream's events each validate as the
    SDK's event types and build the same items, in the same order, as the whole answer."""
    from pydantic import TypeAdapter
    from openai.types.responses import ResponseStreamEvent

    from cluster.request import RequestOutput
    from router.params import PreparedRequest
    from router.choices import Accumulator
    from router.responses.request import ResponsesRequest
    from router.responses.format import ResponsesFormatter
    from router.tokenizer import RouterTokenizer
    from router.tool_calls import build_tool_parser
    from tests.engine_helpers import real_model

    tok = RouterTokenizer(real_model()[1])  # the served model's tokenizer, loaded once per session
    tools = ({"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},)
    prepared = PreparedRequest(request_id="resp_1", model=MODEL, prompt_token_ids=(1, 2), prompt_text="",
                               requests=(None,), max_tokens=64, stream=True, include_usage=False, logprobs=None,
                               tools=tools, tool_parser=build_tool_parser(tok.wrapped, False))
    req = ResponsesRequest.model_validate({"input": "x", "tools": TOOLS})
    paris = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = 'Let me look.' + paris + "\n" + paris.replace("Paris", "London") + "\nDone."
    streamed, acc = ResponsesFormatter(prepared, tok, req, 0), Accumulator(prepared)
    chunks = streamed.first_chunks()
    for at in range(0, len(text), 5):
        out = RequestOutput(request_id="resp_1-0", text=text[at:at + 5], token_ids=(7,),
                            finish_reason="stop" if at + 5 >= len(text) else None)
        chunks += streamed.delta_chunk(acc.add(0, out), out)
    events = [json.loads(c.split("\ndata: ", 1)[1]) for c in chunks]
    assert [c.split("\n", 1)[0] for c in chunks] == ["event: " + e["type"] for e in events]
    adapter = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python(e) for e in events]
    final = Response.model_validate(events[-1]["response"])
    whole = Response.model_validate(ResponsesFormatter(prepared, tok, req, 0).response(acc).model_dump(mode="json"))

    def shape(r: Response) -> list:
        return [(i.type, i.content[0].text) if i.type == "message" else (i.type, i.name, i.arguments)
                for i in r.output]
    assert shape(final) == shape(whole) == [("message", "Let me look."), ("function_call", "get_weather",
                                             '{"city": "Paris"}'), ("function_call", "get_weather",
                                             '{"city": "London"}'), ("message", "\nDone.")]
    assert parsed[-1].type == "response.completed" and final.usage.output_tokens == len(range(0, len(text), 5))
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [i.id for i in final.output]
    # each item is done before the next one is added (two calls in a row included), as OpenAI streams them
    opened = [e["type"] for e in events if e["type"] in ("response.output_item.added", "response.output_item.done")]
    assert opened == ["response.output_item.added", "response.output_item.done"] * len(final.output)


CONTEXT = 64  # the scripted engine's context in the invalid-value tests


@pytest.fixture
def scripted():
    """A TestClient of an app over the scripted engine (a 64-token context) and the engine."""
    from starlette.testclient import TestClient

    from router.app import create_app
    from tests.router_fakes import FakeEngine, load_tokenizer

    tok = load_tokenizer()
    engine = FakeEngine(tok, max_model_len=CONTEXT)
    with TestClient(create_app(engine, tok, served_model_names=[MODEL])) as http:
        yield http, engine


def serves_on(http) -> None:
    """The server is healthy and answers a plain request."""
    assert http.get("/health").status_code == 200
    r = http.post("/v1/responses", json={"model": MODEL, "input": QUESTION, "max_output_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2, r.text


@pytest.mark.parametrize("value", [100000000, 2147483647, 1e18])
def test_a_huge_max_output_tokens_is_clamped_to_the_context_left(scripted, value):
    """max_output_tokens far past the context generates until the context is full, whole and streamed: the
    response is incomplete (max_output_tokens) with output_tokens the context left."""
    http, _ = scripted
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": value}
    r = http.post("/v1/responses", content=json.dumps(body))
    assert r.status_code == 200, r.text
    answer = Response.model_validate(r.json())
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert answer.usage.output_tokens == CONTEXT - answer.usage.input_tokens > 0
    r = http.post("/v1/responses", content=json.dumps({**body, "stream": True}))
    last = json.loads(r.text.strip().split("\n")[-1][6:])
    assert last["type"] == "response.incomplete" and last["response"]["usage"]["output_tokens"] == \
        answer.usage.output_tokens
    serves_on(http)


def test_max_output_tokens_0_and_1_answer_no_token_and_one_token(scripted):
    """max_output_tokens 0 answers an empty, incomplete message with 0 output tokens; 1 answers one token."""
    http, _ = scripted
    for n in (0, 1):
        r = http.post("/v1/responses", json={"model": MODEL, "input": QUESTION, "max_output_tokens": n})
        assert r.status_code == 200, r.text
        answer = Response.model_validate(r.json())
        assert answer.usage.output_tokens == n and answer.status == "incomplete"
        assert (answer.output_text == "") == (n == 0)


@pytest.mark.parametrize("raw,status,param", [
    ({"temperature": -1}, 400, "temperature"),
    ({"top_p": 2}, 400, "top_p"),
    ({"max_output_tokens": -1}, 400, "max_output_tokens"),
    ({"max_output_tokens": True}, 400, "max_output_tokens"),
    ({"input": None}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({"model": "no-such-model"}, 404, "model"),
    ('{"model": "x", "input": ', 400, None),
    ("", 400, None),
    ('"just text"', 400, None),
])
def test_invalid_values_are_4xx_in_openai_shape_and_the_server_serves_on(scripted, raw, status, param):
    """Out-of-range sampling values, a bad max_output_tokens, a missing or empty input, an unknown model and
    bodies that are not a JSON object: a 4xx with OpenAI's error object naming the field, nothing reaches the
    engine, and a plain request is answered after it."""
    http, engine = scripted
    if isinstance(raw, dict):
        body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 4, **raw}
        raw = json.dumps({k: v for k, v in body.items() if v is not None})
    r = http.post("/v1/responses", content=raw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert param is None or error["message"].startswith(param) or f"{param} " in error["message"]
    assert engine.submitted == []
    serves_on(http)
