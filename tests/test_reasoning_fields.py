"""The reasoning fields of each API refused when they cannot mean anything, each with a 400 that names the field:
an unknown thinking type, a negative budget, enabled thinking without a budget, a template variable the router
sets itself; and accepted on a model that does not think (the served SmolLM2), where they change nothing."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from router.app import create_app
from tests.router_fakes import MODEL, FakeEngine, load_tokenizer

QUESTION = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client():
    tok = load_tokenizer()
    with TestClient(create_app(FakeEngine(tok), tok, served_model_names=[MODEL])) as c:
        yield c


@pytest.mark.parametrize("thinking, field", [
    ({"type": "sometimes"}, "thinking.type"),
    ({"type": "enabled", "budget_tokens": -1}, "thinking.budget_tokens"),
    ({"type": "enabled"}, "thinking"),
    ({"type": "adaptive", "display": "loud"}, "thinking.display"),
])
def test_a_messages_thinking_that_cannot_be_served_is_a_400_naming_it(client, thinking, field):
    r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": QUESTION,
                                          "thinking": thinking})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith(field), error


@pytest.mark.parametrize("extra, param", [
    ({"thinking_token_budget": -5}, "thinking_token_budget"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ({"chat_template_kwargs": {"raise_exception": 1}}, "chat_template_kwargs.raise_exception"),
    ({"chat_template_kwargs": {"namespace": 1}}, "chat_template_kwargs.namespace"),
])
def test_a_chat_reasoning_field_that_cannot_be_served_is_a_400_naming_it(client, extra, param):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_reasoning_fields_on_a_model_that_does_not_think_change_nothing(client):
    """Every reasoning control, on a model without reasoning: the same answer, no reasoning, 0 reasoning tokens."""
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "temperature": 0}
    plain = client.post("/v1/chat/completions", json=body).json()
    for extra in ({"reasoning_effort": "high"}, {"reasoning_effort": "none"}, {"thinking_token_budget": 0},
                  {"chat_template_kwargs": {"enable_thinking": True}}):
        r = client.post("/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"] == plain["choices"][0]["message"]
        assert r.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive", "display": "omitted"},
                     {"type": "disabled"}, {"type": "between_tools"}):
        r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": QUESTION,
                                              "thinking": thinking, "output_config": {"effort": "max"}})
        assert r.status_code == 200, r.text
        assert [b["type"] for b in r.json()["content"]] == ["text"]


def test_reasoning_sent_back_changed_under_this_servers_token_is_a_400(client):
    """A Responses reasoning item whose text is not the one its encrypted_content carries, and an Anthropic
    thinking block whose text is not the one its signature carries, were changed after the server sent them:
    400s naming the field; sent back unchanged, both are accepted."""
    from router.reasoning_token import make_token

    token = make_token("two plus two is four", MODEL)
    item = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": token,
            "content": [{"type": "reasoning_text", "text": "two plus two is five"}]}
    body = {"model": MODEL, "max_output_tokens": 2, "input": [
        {"role": "user", "content": "2 + 2?"}, item, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3 + 3?"}]}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[1].content", r.text
    item["content"][0]["text"] = "two plus two is four"
    assert client.post("/v1/responses", json=body).status_code == 200
    turns = [{"role": "user", "content": "2 + 2?"},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "two plus two is five",
                                                "signature": token}, {"type": "text", "text": "4"}]},
             {"role": "user", "content": "and 3 + 3?"}]
    r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": turns})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages[1].content[0].signature: ")
    turns[1]["content"][0]["thinking"] = "two plus two is four"
    assert client.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": turns}).status_code == 200


def test_anthropic_server_tools_are_left_out_unless_forced_and_client_schema_tools_are_refused(client):
    """A server tool (web_search_..., which Anthropic's servers run) beside a custom tool is left out of the prompt
    and the request served; a tool_choice naming it is a 400 naming tool_choice; an Anthropic-defined tool the
    client runs (bash_...) is a 400 naming it, since the model could not use it left out."""
    custom = {"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    body = {"model": MODEL, "max_tokens": 2, "messages": QUESTION, "tools": [custom, search]}
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    r = client.post("/v1/messages", json={**body, "tool_choice": {"type": "tool", "name": "web_search"}})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("tool_choice: ")
    r = client.post("/v1/messages", json={**body, "tools": [custom, {"type": "bash_20250124", "name": "bash"}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("tools[1]"), r.text
