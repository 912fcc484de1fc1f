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
