"""Reasoning written between answer text and tool calls (a thinking model that thinks again after a call, as
Anthropic's `between_tools` and a reopened `<think>` give it) keeps its place: the whole answer lists thinking
blocks / reasoning items where the stream sends them, in every API; a tool call written inside the reasoning is
never a call. A scripted engine emits the reasoning and answer deltas."""

from __future__ import annotations

import json

import anthropic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from fastapi.testclient import TestClient
from openai.types.responses import Response
from pydantic import TypeAdapter

from cluster.request import FinishReason, RequestOutput
from router.app import create_app
from tests.router_fakes import MODEL, FakeEngine, load_tokenizer

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
PLAN = [("r", "think"), ("a", "Let me call. "), ("a", CALL), ("r", "more thought"), ("a", "done")]


class ScriptedEngine(FakeEngine):
    """Emits `plan`: ("r", reasoning text) and ("a", answer text) deltas, then stops."""

    plan: list = PLAN

    async def generate(self, request):
        self.submitted.append(request)
        n = n_reasoning = 0
        for i, (kind, text) in enumerate(self.plan):
            ids = tuple(self.tok.encode(text))
            n += len(ids)
            n_reasoning += len(ids) if kind == "r" else 0
            yield RequestOutput(request.request_id, ids, text if kind == "a" else "",
                                finish_reason=FinishReason.STOP if i == len(self.plan) - 1 else None,
                                num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=n,
                                reasoning_text=text if kind == "r" else "", num_reasoning_tokens=n_reasoning)


@pytest.fixture
def engine():
    return ScriptedEngine(load_tokenizer())


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine, engine.tok, served_model_names=[MODEL])) as c:
        yield c


def events(body: str) -> list[dict]:
    return [json.loads(line[6:]) for block in body.split("\n\n") for line in block.split("\n")[:2]
            if line.startswith("data: ") and line[6:] != "[DONE]"]


def test_messages_whole_answer_orders_blocks_as_the_stream(client):
    body = {"model": MODEL, "max_tokens": 100, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "get_weather", "input_schema": SCHEMA}]}
    whole = client.post("/v1/messages", json=body).json()
    kinds = [(b["type"], b.get("thinking") or b.get("text") or b.get("name")) for b in whole["content"]]
    assert kinds == [("thinking", "think"), ("text", "Let me call."), ("tool_use", "get_weather"),
                     ("thinking", "more thought"), ("text", "done")]
    snapshot, bufs = None, {}  # the SDK's own accumulator of stream events
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    for event in events(client.post("/v1/messages", json={**body, "stream": True}).text):
        snapshot = accumulate_event(event=adapter.validate_python(event), current_snapshot=snapshot, json_bufs=bufs)
    streamed = [b.model_dump(exclude_none=True, exclude={"id"}) for b in snapshot.content]  # ids are per call
    assert streamed == [b.model_dump(exclude_none=True, exclude={"id"})
                        for b in anthropic.types.Message.model_validate(whole).content]


def test_responses_whole_answer_orders_items_as_the_stream(client):
    body = {"model": MODEL, "input": "x", "max_output_tokens": 100,
            "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]}
    whole = Response.model_validate(client.post("/v1/responses", json=body).json())
    assert [i.type for i in whole.output] == ["reasoning", "message", "function_call", "reasoning", "message"]
    final = Response.model_validate(events(client.post("/v1/responses", json={**body, "stream": True}).text)[-1][
        "response"])
    def shape(r):
        return [(i.type, i.content[0].text if getattr(i, "content", None) else getattr(i, "name", None))
                for i in r.output]
    assert shape(final) == shape(whole)
    assert whole.usage.output_tokens_details.reasoning_tokens == sum(
        len(load_tokenizer().encode(t)) for k, t in PLAN if k == "r")


def test_a_call_written_inside_the_reasoning_is_not_a_call(client, engine):
    engine.plan = [("r", "I will call " + CALL), ("a", "ok")]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 100, "tools": tools,
                                                  "messages": [{"role": "user", "content": "x"}]}).json()
    message = r["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"] == "ok" and CALL in message["reasoning_content"]
    assert r["choices"][0]["finish_reason"] == "stop"
