"""Anthropic's Messages API with the real `anthropic` SDK against a real single-node server (real SmolLM2,
float32, an API key): answers whole and streamed, stop reasons, a tool_use round trip, count_tokens, and
errors in Anthropic's shape; plus an audit that every key of the SDK's request type is honoured or refused."""

from __future__ import annotations

import json
import typing

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import message_create_params
from anthropic.types.beta import message_create_params as beta_message_create_params
from starlette.testclient import TestClient

from cluster.engine_client import EngineError
from router.anthropic.fields import MESSAGES_HONOURED, MESSAGES_ACCEPTED, MESSAGES_REFUSED
from router.app import create_app
from tests.engine_helpers import chat_prompt
from tests.live_server import live_server
from tests.router_fakes import FakeEngine, load_tokenizer

MODEL = "SmolLM2-135M-Instruct"
KEY = "anthropic-test-key"
GREEDY = {"temperature": 0}  # not a keyword of this SDK's messages.create: sent as an extra body key
QUESTION = [{"role": "user", "content": "Tell me a story about a dragon."}]
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# a value each refused field cannot take (the others refuse any value that is not null)
REFUSED_VALUES: dict = {}


@pytest.fixture(scope="module")
def server():
    with live_server(api_key=KEY, max_num_seqs=4) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def story(client):
    """The greedy non-streamed answer to QUESTION, cut at 12 tokens."""
    return client.messages.create(model=MODEL, max_tokens=12, messages=QUESTION, extra_body=GREEDY)


def test_create_answers_text_with_max_tokens_reason_and_usage_of_the_prompt(client, story):
    """A non-streamed answer: one text block, cut at max_tokens, and usage that adds up to the prompt the chat
    template renders (count_tokens says the same)."""
    assert story.type == "message" and story.role == "assistant" and story.id.startswith("msg_")
    assert [b.type for b in story.content] == ["text"] and story.content[0].text.strip()
    assert story.stop_reason == "max_tokens" and story.stop_sequence is None
    assert story.usage.output_tokens == 12
    prompt = len(chat_prompt(QUESTION[0]["content"]))  # the model's own chat template, rendered independently
    assert story.usage.input_tokens + story.usage.cache_read_input_tokens == prompt
    counted = client.messages.count_tokens(model=MODEL, messages=QUESTION)
    assert counted.input_tokens == prompt


def test_stream_gives_the_same_greedy_text_and_final_message(client, story):
    """messages.stream: Anthropic's event order, and the SDK's final message equals the non-streamed one."""
    with client.messages.stream(model=MODEL, max_tokens=12, messages=QUESTION, extra_body=GREEDY) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events.index("content_block_start") < events.index("content_block_stop") < events.index("message_delta")
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == story.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        story.usage.input_tokens + story.usage.cache_read_input_tokens


def test_a_stop_sequence_ends_the_answer_and_is_reported(client, story):
    """A stop sequence the greedy answer reaches ends it just before it, with stop_reason "stop_sequence" and the
    sequence named, streamed and not."""
    text = story.content[0].text
    word = text.split()[3]  # a word the greedy answer reaches; the answer must end just before it
    with client.messages.stream(model=MODEL, max_tokens=12, messages=QUESTION, extra_body=GREEDY,
                                stop_sequences=["never in this story", word]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == word
    assert final.content[0].text == text[:text.index(word)]
    whole = client.messages.create(model=MODEL, max_tokens=12, messages=QUESTION, extra_body=GREEDY,
                                   stop_sequences=[word])
    assert whole.stop_reason == "stop_sequence" and whole.stop_sequence == word
    assert whole.content[0].text == final.content[0].text


def test_a_forced_tool_use_round_trip(client):
    """tool_choice {type: tool} (one call) makes a streamed tool_use whose input follows input_schema; its
    tool_result sent back gets a text answer; count_tokens counts the tools."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    with client.messages.stream(model=MODEL, max_tokens=40, messages=ask, tools=[WEATHER], extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True}) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        called = stream.get_final_message()
    assert called.stop_reason == "tool_use" and "input_json_delta" in deltas
    uses = [b for b in called.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    answer = client.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER], extra_body=GREEDY,
                                    tool_choice={"type": "none"}, messages=ask + [
        {"role": "assistant", "content": called.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "18 degrees and sunny"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text.strip()
    with_tools = client.messages.count_tokens(model=MODEL, messages=ask, tools=[WEATHER]).input_tokens
    assert with_tools > len(chat_prompt(ask[0]["content"]))  # the tools are part of the counted prompt


def test_output_config_format_makes_the_answer_json_following_the_schema(client):
    """output_config.format {type: json_schema}: the text block is JSON valid against the schema."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    answer = client.messages.create(
        model=MODEL, max_tokens=30, extra_body=GREEDY, messages=[
            {"role": "user", "content": "Which city is the capital of France? Answer in JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert answer.stop_reason == "end_turn" and [b.type for b in answer.content] == ["text"]
    jsonschema.validate(json.loads(answer.content[0].text), schema)


def test_an_unsupported_field_is_refused_in_anthropic_shape(client):
    """An unknown thinking type, an image block and an unknown model are refused in Anthropic's error shape,
    naming what."""
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model=MODEL, max_tokens=4, messages=QUESTION,
                               extra_body={"thinking": {"type": "sometimes"}})
    assert exc.value.status_code == 400 and exc.value.body["type"] == "error"
    assert exc.value.body["error"]["type"] == "invalid_request_error"
    assert exc.value.body["error"]["message"].startswith("thinking.type:")
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
    assert "messages[0].content[0]" in exc.value.message and "'image'" in exc.value.message
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.messages.create(model="claude-sonnet-5", max_tokens=4, messages=QUESTION)
    assert exc.value.body["error"]["type"] == "not_found_error"


def test_the_api_key_works_as_x_api_key_and_a_wrong_one_is_refused_in_anthropic_shape(server):
    """x-api-key carries the key; a wrong key is a 401 in Anthropic's shape there and in OpenAI's on /v1."""
    by_header = anthropic.Anthropic(base_url=server, api_key=None, default_headers={"x-api-key": KEY},
                                    max_retries=0, timeout=60)
    assert by_header.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as exc:
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.count_tokens(
            model=MODEL, messages=QUESTION)
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server + "/v1/messages", headers={"x-api-key": "wrong", "anthropic-version": "2023-06-01"},
                   json={"model": MODEL, "max_tokens": 4, "messages": QUESTION})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(server + "/v1/chat/completions", headers={"x-api-key": "wrong"}, json={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape stays there


@pytest.mark.parametrize("params", [message_create_params.MessageCreateParamsBase,
                                    beta_message_create_params.MessageCreateParamsBase], ids=["messages", "beta"])
def test_every_request_key_of_the_sdk_is_honoured_or_refused_by_name(client, params):
    """Each key of the SDK's request type is in one of the sets, and each refused one is answered with a 400
    whose message starts with its name."""
    keys = set(typing.get_type_hints(params))
    assert not MESSAGES_HONOURED & set(MESSAGES_ACCEPTED) and not (MESSAGES_HONOURED | set(MESSAGES_ACCEPTED)) & set(
        MESSAGES_REFUSED)
    assert keys <= MESSAGES_HONOURED | set(MESSAGES_ACCEPTED) | set(MESSAGES_REFUSED), \
        keys - MESSAGES_HONOURED - set(MESSAGES_ACCEPTED) - set(MESSAGES_REFUSED)
    for key in sorted(keys & set(MESSAGES_REFUSED)):
        with pytest.raises(anthropic.BadRequestError) as exc:
            client.messages.create(model=MODEL, max_tokens=4, messages=QUESTION,
                                   extra_body={key: REFUSED_VALUES.get(key, {"id": "x"})})
        assert exc.value.body["error"]["message"].startswith(f"{key}: "), (key, exc.value.body)


def test_engine_failures_keep_anthropic_shape_before_and_during_a_stream():
    """With the scripted engine: an engine that refuses is a 503 overloaded_error with Retry-After; a choice that
    fails after the stream started ends it with an `error` event and nothing after it."""
    tok = load_tokenizer()
    engine = FakeEngine(tok)
    body = {"model": MODEL, "max_tokens": 8, "messages": QUESTION}
    with TestClient(create_app(engine, tok, served_model_names=[MODEL])) as http:
        engine.fail_with = EngineError("the queue is full", retry_after=2.0)
        r = http.post("/v1/messages", json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error"
        engine.fail_with, engine.fail_after = None, 1
        r = http.post("/v1/messages", json={**body, "stream": True})
    events = [block.split("\n") for block in r.text.split("\n\n") if block]
    assert [e[0] for e in events] == ["event: message_start", "event: content_block_start",
                                      "event: content_block_delta", "event: error"]
    assert '"type": "api_error"' in events[-1][1] and "scripted failure" in events[-1][1]


def test_turns_that_do_not_fit_together_are_refused_and_tool_results_reach_the_prompt():
    """With the scripted engine: a last assistant turn (prefill), a tool_result answering no tool_use and a
    tool_use in a user turn are 400s naming the block; a tool round trip renders the result (marked when it is an
    error) into the prompt, and consecutive user turns are one turn."""
    tok = load_tokenizer()
    engine = FakeEngine(tok)
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "no network"}],
              "is_error": True}
    cases = {"messages[1]": QUESTION + [{"role": "assistant", "content": "Once upon"}],
             "messages[0].content[0].tool_use_id": [{"role": "user", "content": [result]}],
             "messages[0].content[0]": [{"role": "user", "content": [use]}]}
    with TestClient(create_app(engine, tok, served_model_names=[MODEL])) as http:
        for where, messages in cases.items():
            r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": messages})
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(where + ":"), (where, r.text)
        assert engine.submitted == []
        r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "tools": [WEATHER], "messages": [
            {"role": "user", "content": "Weather in Paris?"}, {"role": "user", "content": "Be brief."},
            {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]})
    assert r.status_code == 200, r.text
    prompt = tok.decode(list(engine.submitted[-1].prompt_token_ids))
    assert "Error: no network" in prompt and '"city": "Paris"' in prompt
    assert "Weather in Paris?\nBe brief." in prompt and prompt.count("<|im_start|>user") == 2  # question, result


def test_a_stop_sequence_spanning_several_tokens_is_never_streamed(client, story):
    """A stop sequence of three words (several tokens) that the greedy answer reaches: no text_delta carries any
    of it, the streamed deltas join to the non-streamed text, which is the answer up to the sequence."""
    text = story.content[0].text
    stop = " ".join(text.split()[2:5])
    tok = load_tokenizer()
    assert len(tok.encode(stop)) - len(tok.encode("")) >= 3 and stop in text
    kwargs = dict(model=MODEL, max_tokens=12, messages=QUESTION, extra_body=GREEDY, stop_sequences=[stop])
    with client.messages.stream(**kwargs) as stream:
        deltas = [e.delta.text for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    whole = client.messages.create(**kwargs)
    assert "".join(deltas) == whole.content[0].text == text[:text.index(stop)]
    assert final.stop_reason == whole.stop_reason == "stop_sequence" and final.stop_sequence == stop


CONTEXT = 64  # the scripted engine's context in the invalid-value tests


def anthropic_error(r, status: int, kind: str = "invalid_request_error", field: str | None = None) -> str:
    """The message of an error answer in Anthropic's shape, after checking the status, shape and type, and that
    the message starts with `field` when one is given."""
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
    assert field is None or body["error"]["message"].startswith(field + ":"), body
    return body["error"]["message"]


@pytest.fixture
def scripted():
    """A TestClient of an app over the scripted engine (a 64-token context) and the engine."""
    tok = load_tokenizer()
    engine = FakeEngine(tok, max_model_len=CONTEXT)
    with TestClient(create_app(engine, tok, served_model_names=[MODEL])) as http:
        yield http, engine


def serves_on(http) -> None:
    """The server is healthy and answers a plain Messages request."""
    assert http.get("/health").status_code == 200
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": QUESTION})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2, r.text


@pytest.mark.parametrize("value", [100000000, 2147483647, 1e18, 1e300])
def test_a_huge_max_tokens_is_clamped_to_the_context_left(scripted, value):
    """max_tokens far past the context (an integral JSON number too) generates until the context is full, whole
    and streamed: output_tokens is the context left and the stop_reason says the context ran out."""
    http, _ = scripted
    body = {"model": MODEL, "max_tokens": value, "messages": QUESTION}
    r = http.post("/v1/messages", content=json.dumps(body))
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert usage["output_tokens"] == CONTEXT - prompt > 0
    assert r.json()["stop_reason"] == "model_context_window_exceeded"
    r = http.post("/v1/messages", content=json.dumps({**body, "stream": True}))
    [delta] = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {\"type\": \"message_d")]
    assert delta["delta"]["stop_reason"] == "model_context_window_exceeded"
    assert delta["usage"]["output_tokens"] == CONTEXT - prompt
    serves_on(http)


def test_max_tokens_0_and_1_answer_no_token_and_one_token(scripted):
    """max_tokens 0 answers with no content and 0 output tokens, 1 with one token; both stop at max_tokens."""
    http, _ = scripted
    for n in (0, 1):
        r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": n, "messages": QUESTION})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["output_tokens"] == n and r.json()["stop_reason"] == "max_tokens"
        assert len(r.json()["content"]) == n


@pytest.mark.parametrize("path,raw,status,kind,field", [
    ("/v1/messages", {"temperature": -1}, 400, "invalid_request_error", "temperature"),
    ("/v1/messages", {"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ("/v1/messages", {"top_p": 2}, 400, "invalid_request_error", "top_p"),
    ("/v1/messages", {"top_k": -1}, 400, "invalid_request_error", "top_k"),
    ("/v1/messages", {"max_tokens": -1}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/messages", {"max_tokens": True}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/messages", {"max_tokens": 2.5}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/messages", {"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/messages", {"messages": None}, 400, "invalid_request_error", "messages"),
    ("/v1/messages", {"messages": []}, 400, "invalid_request_error", "messages"),
    ("/v1/messages", {"messages": [{"role": "user", "content": []}]}, 400, "invalid_request_error",
     "messages[0].content"),
    ("/v1/messages", {"model": "no-such-model"}, 404, "not_found_error", None),
    ("/v1/messages", '{"model": "x", "max_tokens": ', 400, "invalid_request_error", None),
    ("/v1/messages", "", 400, "invalid_request_error", None),
    ("/v1/messages", "[1, 2]", 400, "invalid_request_error", None),
    ("/v1/messages/count_tokens", {"messages": None}, 400, "invalid_request_error", "messages"),
    ("/v1/messages/count_tokens", {"model": "no-such-model"}, 404, "not_found_error", None),
    ("/v1/messages/count_tokens", '{"messages": [', 400, "invalid_request_error", None),
])
def test_invalid_values_are_4xx_in_anthropic_shape_and_the_server_serves_on(scripted, path, raw, status, kind,
                                                                             field):
    """Out-of-range sampling values, a bad or missing max_tokens, missing or empty messages, an unknown model and
    bodies that are not a JSON object: a 4xx in Anthropic's error shape (naming the field when there is one),
    nothing reaches the engine, and a plain request is answered after it."""
    http, engine = scripted
    if isinstance(raw, dict):
        body = {"model": MODEL, "max_tokens": 4, "messages": QUESTION, **raw}
        raw = json.dumps({k: v for k, v in body.items() if v is not None})
    anthropic_error(http.post(path, content=raw), status, kind, field)
    assert engine.submitted == []
    serves_on(http)


def test_an_empty_user_message_is_served_on_the_rendered_template(scripted):
    """An empty text turn still renders the chat template's turn markers: it is answered (and counted alike)."""
    http, engine = scripted
    empty = [{"role": "user", "content": ""}]
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": empty})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2, r.text
    counted = http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": empty}).json()
    assert counted["input_tokens"] == len(engine.submitted[-1].prompt_token_ids) > 0
