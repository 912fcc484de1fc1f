"""The text and size checks of the Responses and Messages endpoints (POST /v1/responses, /v1/messages and
/v1/messages/count_tokens), as tests/test_router_text.py checks them on the chat and completions endpoints: a
lone surrogate in any of their fields is a 400 naming it, in each API's error shape; a body far over the context
is refused after bounded work (413 past the body limit, else a context 400 after tokenizing about the context's
worth); more turns than the context has tokens are refused by their number. Served by the scripted engine."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from router.app import create_app
from router.tokenizer import RouterTokenizer
from tests.router_fakes import MODEL, CharTokenizer, FakeEngine, load_tokenizer
from tests.test_router_text import EIGHT_MB, MARK, CountingTokenizer, assert_400_naming, with_surrogate

MESSAGES, COUNT, RESPONSES = "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"
USER = [{"role": "user", "content": "Hi"}]
TOOL = {"name": "get_weather", "description": "Weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}}}
FUNCTION = {"type": "function", "name": "get_weather", "parameters": TOOL["input_schema"]}


def message_body(**kw) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": USER, **kw}


def response_body(**kw) -> dict:
    return {"model": MODEL, "max_output_tokens": 2, "input": "Hi", **kw}


ROUND_TRIP = [{"role": "user", "content": "Weather?"},
              {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                 "input": {"city": MARK}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}]

SURROGATE_CASES = [
    (MESSAGES, message_body(messages=[{"role": "user", "content": MARK}]), "messages[0].content"),
    (MESSAGES, message_body(messages=[{"role": "user", "content": [{"type": "text", "text": "a " + MARK}]}]),
     "messages[0].content[0].text"),
    (MESSAGES, message_body(system=MARK), "system"),
    (MESSAGES, message_body(stop_sequences=["ok", MARK]), "stop_sequences[1]"),
    (MESSAGES, message_body(tools=[{**TOOL, "description": MARK}]), "tools[0].description"),
    (MESSAGES, message_body(messages=ROUND_TRIP, tools=[TOOL]), "messages[1].content[0].input.city"),
    (MESSAGES, message_body(metadata={"user_id": MARK}), "metadata.user_id"),
    (COUNT, {"model": MODEL, "messages": [{"role": "user", "content": MARK}]}, "messages[0].content"),
    (RESPONSES, response_body(input=MARK), "input"),
    (RESPONSES, response_body(instructions=MARK), "instructions"),
    (RESPONSES, response_body(input=[{"role": "user", "content": [{"type": "input_text", "text": MARK}]}]),
     "input[0].content[0].text"),
    (RESPONSES, response_body(input=[{"type": "function_call", "call_id": "c1", "name": "get_weather",
                                      "arguments": json.dumps({"city": MARK})}]), "input[0].arguments"),
    (RESPONSES, response_body(tools=[{**FUNCTION, "description": MARK}]), "tools[0].description"),
    (RESPONSES, response_body(metadata={MARK: "v"}), "metadata.\\ud800"),
]


@pytest.mark.parametrize("path,body,field", SURROGATE_CASES)
def test_a_lone_surrogate_in_any_field_of_the_agent_apis_is_a_400_naming_it(path, body, field):
    """A lone surrogate in a turn's text (string or block), the system prompt or instructions, a stop sequence, a
    tool's description, a tool call's input or arguments, or metadata: a 400 in the endpoint's own error shape
    whose message starts with the field's JSON path; nothing reaches the engine and the server serves on."""
    tok = RouterTokenizer(CharTokenizer())
    engine = FakeEngine(tok)
    raw = with_surrogate(body)
    with TestClient(create_app(engine, tok, served_model_names=[MODEL])) as http:
        assert_400_naming(http.post(path, content=raw), field)
        assert engine.submitted == [] and http.get("/health").status_code == 200
        fine = http.post(path, json=message_body() if path != RESPONSES else response_body())
        assert fine.status_code == 200, fine.text


@pytest.fixture(scope="module")
def counting():
    """A RouterTokenizer over the real tokenizer (the CharTokenizer without it) that counts its work."""
    wrapper = CountingTokenizer(load_tokenizer()._tok)
    return wrapper, RouterTokenizer(wrapper)


def context_error(r, path: str) -> str:
    """The message of a context-length 400, after checking its shape (Anthropic's on the Messages paths)."""
    assert r.status_code == 400, r.text
    body = r.json()
    if path == RESPONSES:
        assert body["error"]["code"] == "context_length_exceeded" and body["error"]["param"] == "input", body
    else:
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"]


@pytest.mark.parametrize("path", [MESSAGES, COUNT, RESPONSES])
def test_an_8mb_prompt_is_refused_after_bounded_tokenization(counting, path):
    """An 8 MB prompt under a 32 MiB body limit against an 8192-token context is a context 400 after tokenizing
    only about the context's worth of text (count_tokens too: it is not counted whole); by default the body
    limit sized to the context refuses it with a 413 before any tokenization."""
    wrapper, tok = counting
    engine = FakeEngine(tok, max_model_len=8192)
    text = "The quick brown fox jumps over the lazy dog. " * (EIGHT_MB // 45)
    raw = json.dumps(response_body(input=text) if path == RESPONSES else
                     message_body(messages=[{"role": "user", "content": text}]))
    with TestClient(create_app(engine, tok, served_model_names=[MODEL], max_body_bytes=32 * 1024 * 1024)) as c:
        wrapper.reset()
        message = context_error(c.post(path, content=raw), path)
        assert "at most 8191 tokens" in message
        assert 0 < wrapper.encoded_chars <= 16 * 8192 < len(text) // 50
        assert engine.submitted == [] and c.get("/health").status_code == 200
    with TestClient(create_app(engine, tok, served_model_names=[MODEL])) as c:
        wrapper.reset()
        r = c.post(path, content=raw)
        assert r.status_code == 413 and "shorten the request" in r.json()["error"]["message"], r.text
        assert wrapper.encoded_chars == 0


@pytest.mark.parametrize("path", [MESSAGES, COUNT, RESPONSES])
def test_more_turns_than_the_context_has_tokens_are_refused_by_their_number(counting, path):
    """8193 turns (or input items) against an 8192-token context cannot fit: a context 400 naming their number,
    with no turn rendered or tokenized."""
    wrapper, tok = counting
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(8193)]
    body = response_body(input=turns) if path == RESPONSES else message_body(messages=turns)
    with TestClient(create_app(FakeEngine(tok, max_model_len=8192), tok, served_model_names=[MODEL])) as c:
        wrapper.reset()
        message = context_error(c.post(path, json=body), path)
        assert "8193" in message and "8192 tokens" in message
        assert wrapper.rendered_messages == 0 and wrapper.encoded_chars == 0


def test_count_tokens_counts_what_fits_and_refuses_what_leaves_no_room_as_messages_does(counting):
    """count_tokens answers the prompt a Messages request gets; a prompt just over the context is the 400 that
    Messages gives, with its exact token count in the message."""
    _, tok = counting
    engine = FakeEngine(tok, max_model_len=256)
    fits = [{"role": "user", "content": "hello " * 100}]
    over = [{"role": "user", "content": "hello " * 300}]
    with TestClient(create_app(engine, tok, served_model_names=[MODEL])) as c:
        counted = c.post(COUNT, json={"model": MODEL, "messages": fits}).json()["input_tokens"]
        assert c.post(MESSAGES, json=message_body(messages=fits)).status_code == 200
        assert counted == len(engine.submitted[-1].prompt_token_ids) > 100
        n = len(tok.render_chat(over)[1])
        assert n > 256
        for path in (COUNT, MESSAGES):
            message = context_error(c.post(path, json=message_body(messages=over)), path)
            assert f"the prompt has {n} tokens" in message
