"""Claude Code's own requests, as recorded from its current release (tests/fixtures/agents, re-recorded by
scripts/agents/record.py), answered as Claude Code needs: its first request of a session and the one that carries
a tool's result, with its default settings (adaptive thinking shown as omitted, an effort level, context edits
that keep all thinking, a deferred tool, cache_control, a system turn inside messages, a ~20k-token prompt)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from router.app import create_app
from tests.router_fakes import MODEL, FakeEngine, load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "agents"


def recorded(name: str, run: str | None = None) -> dict:
    """A recorded request (from its own file, or the `run` entry of agents_other_requests.json)."""
    data = json.loads((FIXTURES / name).read_text())
    if run is not None:
        data = next(r for r in data if r["run"] == run and r["method"] == "POST")
    return data


def anthropic_events(body: str) -> list[tuple[str, dict]]:
    """(event name, data) of an Anthropic SSE body, checking each event's framing."""
    events = []
    for block in body.strip("\n").split("\n\n"):
        lines = block.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        name, data = lines[0][7:], json.loads(lines[1][6:])
        assert data["type"] == name
        events.append((name, data))
    return events


@pytest.fixture(scope="module")
def engine():
    return FakeEngine(load_tokenizer(), max_model_len=131072, tokens_per_delta=8192)  # ~119k tokens to the limit


@pytest.fixture(scope="module")
def client(engine):
    app = create_app(engine, engine.tok, served_model_names=[MODEL, "claude-*"])
    with TestClient(app) as c:
        yield c


@pytest.mark.parametrize("name, run", [("claude_code_first_request.json", None),
                                       ("claude_code_tool_result_request.json", None),
                                       ("agents_other_requests.json", "claude-custom")],
                         ids=["first", "tool-result", "custom-model"])
def test_each_recorded_request_is_answered_as_a_well_formed_stream(client, engine, name, run):
    """Posted as recorded (path, query, headers, body; the model id answered through a `claude-*` alias, or
    the served name Claude Code was configured with): a 200 stream of Anthropic's events in order, ending in
    message_stop, with a thinking configuration, effort and context edits the server satisfies."""
    req = recorded(name, run)
    body = req["body"]
    if not body["model"].startswith("claude"):
        body["model"] = MODEL
    headers = {k: v for k, v in req["headers"].items()
               if k.lower() in ("anthropic-version", "anthropic-beta", "content-type", "user-agent", "x-app")}
    r = client.post(req["path"], params=req["query"], headers=headers, json=body)
    assert r.status_code == 200, r.text[:2000]
    events = anthropic_events(r.text)
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["model"] == body["model"] and start["usage"]["input_tokens"] > 1000
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("max_tokens", "model_context_window_exceeded")  # the script runs on
    submitted = engine.submitted[-1]
    assert submitted.sampling.max_tokens <= body["max_tokens"]
    deferred = [t["name"] for t in body["tools"] if t.get("defer_loading")]
    prompt = engine.tok.decode(list(submitted.prompt_token_ids))
    assert deferred and not any(f'"{name}"' in prompt for name in deferred)  # not loaded: not shown
    assert '"Read"' in prompt and '"Bash"' in prompt


def test_a_deferred_tool_is_shown_once_a_tool_reference_loads_it(client, engine):
    """A tool sent with defer_loading is left out of the prompt until a tool_result's tool_reference names it,
    as a tool search loads it; then the model sees it and may call it."""
    body = recorded("claude_code_first_request.json")["body"]
    deferred = next(t["name"] for t in body["tools"] if t.get("defer_loading"))
    body["messages"] += [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "ToolSearch",
                                           "input": {"query": deferred}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "tool_reference", "tool_name": deferred}]}]}]
    r = client.post("/v1/messages", json={**body, "stream": False})
    assert r.status_code == 200, r.text[:2000]
    prompt = engine.tok.decode(list(engine.submitted[-1].prompt_token_ids))
    assert f'"{deferred}"' in prompt and f"Tool loaded: {deferred}" in prompt
