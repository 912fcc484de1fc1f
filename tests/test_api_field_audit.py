"""Nothing a client sends is silently ignored: every key of the openai SDK's request types for Chat Completions
and Completions (and of its chat messages) is honoured, accepted as metadata, or refused with a 400 naming it
(router/openai/fields.py); the refused ones are sent to the app to check. Served by the FakeEngine: what is tested
is the HTTP layer."""

from __future__ import annotations

import json
import typing

import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import ChatCompletionMessageParam
from openai.types.chat import completion_create_params as chat_params
from starlette.testclient import TestClient

from router.app import create_app
from router.openai.fields import (CHAT_HONOURED, CHAT_ACCEPTED, CHAT_REFUSED, COMPLETION_HONOURED, COMPLETION_ACCEPTED,
                                COMPLETION_REFUSED, MESSAGE_REFUSED)
from router.openai.request import ChatCompletionRequest, ChatMessage, CompletionRequest
from tests.router_fakes import MODEL, FakeEngine, load_tokenizer

# A value of each refused field that asks for something this server does not do, and one it may have.
REFUSED_VALUES = {
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"], "web_search_options": {},
    "functions": [{"name": "f"}], "function_call": "auto", "best_of": 2, "suffix": "end"}
ALLOWED_VALUES = {"modalities": ["text"], "best_of": 1, "suffix": ""}
# A value of each accepted field that a client sends by default or as a hint: the request is served.
ACCEPTED_VALUES = {
    "prediction": {"type": "content", "content": "x"}, "store": True, "service_tier": "flex", "verbosity": "low",
    "moderation": {"model": "omni-moderation-latest"}, "prompt_cache_options": {"ttl": "1h"},
    "prompt_cache_retention": "24h", "user": "u", "metadata": {"k": "v"}, "safety_identifier": "s",
    "prompt_cache_key": "k"}
MESSAGE_VALUES = {"audio": {"id": "audio_1"}, "function_call": {"name": "f", "arguments": "{}"},
                  "refusal": "I cannot."}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}


def sdk_keys(module) -> set[str]:
    keys: set[str] = set()
    for name in ("CompletionCreateParamsBase", "CompletionCreateParamsStreaming",
                 "CompletionCreateParamsNonStreaming"):
        for cls in getattr(module, name).__mro__:
            keys.update(getattr(cls, "__annotations__", {}))
    return keys


@pytest.fixture(scope="module")
def client():
    tok = load_tokenizer()
    with TestClient(create_app(FakeEngine(tok), tok, served_model_names=[MODEL])) as c:
        yield c


@pytest.mark.parametrize("module, honoured, accepted, refused, model", [
    (chat_params, CHAT_HONOURED, CHAT_ACCEPTED, CHAT_REFUSED, ChatCompletionRequest),
    (completion_params, COMPLETION_HONOURED, COMPLETION_ACCEPTED, COMPLETION_REFUSED, CompletionRequest),
])
def test_every_sdk_request_key_is_honoured_accepted_with_a_stated_effect_or_refused(module, honoured, accepted,
                                                                                    refused, model):
    keys = sdk_keys(module)
    assert "stream" in keys and "model" in keys
    metadata = set(accepted)
    assert all(isinstance(effect, str) and effect for effect in accepted.values())
    unaudited = keys - honoured - metadata - set(refused)
    assert not unaudited, f"decide for {sorted(unaudited)} in router/openai/fields.py"
    assert not (honoured & metadata) and not (honoured & set(refused)) and not (metadata & set(refused))
    assert honoured <= set(model.model_fields)  # an honoured field is read by the request model
    assert set(refused) <= set(model.model_fields)  # and a refused one is seen, to be refused


def test_every_sdk_message_key_is_honoured_or_refused():
    keys: set[str] = set()
    for member in typing.get_args(ChatCompletionMessageParam):
        keys.update(member.__annotations__)
    honoured = {"role", "content", "name", "tool_calls", "tool_call_id"}
    assert keys <= honoured | set(MESSAGE_REFUSED), keys - honoured - set(MESSAGE_REFUSED)
    assert honoured | set(MESSAGE_REFUSED) <= set(ChatMessage.model_fields)


@pytest.mark.parametrize("field", sorted(CHAT_REFUSED))
def test_each_refused_chat_field_is_a_400_naming_it(client, field):
    r = client.post("/v1/chat/completions", json={**CHAT, field: REFUSED_VALUES[field]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: ")
    if field in ALLOWED_VALUES:
        assert client.post("/v1/chat/completions", json={**CHAT, field: ALLOWED_VALUES[field]}).status_code == 200


def test_accepted_chat_fields_are_served_together_with_the_same_answer(client):
    """Every accepted chat field, with a value agent clients send, at once: 200, and the same text as without."""
    assert set(ACCEPTED_VALUES) == set(CHAT_ACCEPTED)
    plain = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0})
    hinted = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0, **ACCEPTED_VALUES})
    assert plain.status_code == hinted.status_code == 200, hinted.text
    assert hinted.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


@pytest.mark.parametrize("field", sorted(COMPLETION_REFUSED))
def test_each_refused_completion_field_is_a_400_naming_it(client, field):
    r = client.post("/v1/completions", json={**COMPLETION, field: REFUSED_VALUES[field]})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert client.post("/v1/completions", json={**COMPLETION, field: ALLOWED_VALUES[field]}).status_code == 200


@pytest.mark.parametrize("field", sorted(MESSAGE_REFUSED))
def test_each_refused_message_field_is_a_400_naming_it(client, field):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello",
                                                    field: MESSAGE_VALUES[field]}]
    r = client.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == f"messages[1].{field}"


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "file", "file": {"file_id": "file-1"}},
])
def test_non_text_content_parts_are_refused_naming_the_message(client, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, part]}]
    r = client.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[0].content" and part["type"] in r.json()["error"]["message"]


def test_metadata_fields_are_accepted(client):
    body = {**CHAT, "user": "u1", "metadata": {"k": "v"}, "safety_identifier": "s", "prompt_cache_key": "p",
            "store": False, "service_tier": "default"}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert client.post("/v1/completions", json={**COMPLETION, "user": "u1"}).status_code == 200


def test_published_schema_has_the_tool_fields_and_not_the_refused_ones(client):
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls", "response_format"} <= set(chat)
    assert not set(CHAT_REFUSED) & set(chat)
    assert {"tool_calls", "tool_call_id"} <= set(schemas["ChatMessage"]["properties"])
    assert "tool_calls" in schemas["ChatMessageOut"]["properties"]
    assert {"name", "schema", "strict"} <= set(schemas["JsonSchemaFormat"]["properties"])


def test_published_schema_documents_the_responses_and_messages_endpoints_and_their_fields(client):
    """/openapi.json documents POST /v1/responses, /v1/messages and /v1/messages/count_tokens: their request
    bodies carry every honoured and metadata key of the audits and none of the refused ones, with the tool and
    format shapes; their answers and errors have each API's own shape."""
    from router.anthropic.fields import MESSAGES_HONOURED, MESSAGES_ACCEPTED, MESSAGES_REFUSED
    from router.responses.fields import RESPONSES_HONOURED, RESPONSES_ACCEPTED, RESPONSES_REFUSED

    published = client.get("/openapi.json").json()
    schemas = published["components"]["schemas"]
    bodies = {"/v1/responses": ("ResponsesRequest", "ResponseObject", "ErrorResponse"),
              "/v1/messages": ("MessagesRequest", "MessageResponse", "AnthropicErrorResponse"),
              "/v1/messages/count_tokens": ("CountTokensRequest", "CountTokensResponse", "AnthropicErrorResponse")}
    for path, (request, answer, error) in bodies.items():
        op = published["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + request)
        assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + answer)
        for status in ("400", "404", "413", "503"):
            assert op["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith("/" + error)
    responses = set(schemas["ResponsesRequest"]["properties"])
    assert RESPONSES_HONOURED | set(RESPONSES_ACCEPTED) == responses and not set(RESPONSES_REFUSED) & responses
    messages = set(schemas["MessagesRequest"]["properties"])
    assert MESSAGES_HONOURED | set(MESSAGES_ACCEPTED) == messages and not set(MESSAGES_REFUSED) & messages
    assert set(schemas["CountTokensRequest"]["properties"]) < messages
    assert {"name", "parameters", "strict"} <= set(schemas["FunctionTool"]["properties"])
    assert {"type", "name", "schema", "strict"} <= set(schemas["TextFormat"]["properties"])
    assert {"name", "input_schema", "description"} <= set(schemas["ToolParam"]["properties"])
    assert {"format"} <= set(schemas["OutputConfigParam"]["properties"])
    assert {"call_id", "arguments", "output"} <= set(schemas["InputItem"]["properties"])
    turn = json.dumps(schemas["MessageParam"])
    assert all(f"/{block}" in turn for block in ("TextBlockParam", "ToolUseBlockParam", "ToolResultBlockParam"))
