"""Codex CLI's own requests to POST /v1/responses, as recorded from its release 0.171.0 (tests/fixtures/agents,
re-recorded by scripts/agents/record.py), answered as Codex needs them.

With a custom model provider (`wire_api = "responses"`, the served model's name in config.toml), Codex sends
function tools, a namespace of functions (`multi_agent_v1`), the hosted `web_search` tool, reasoning settings, an
`include` of reasoning.encrypted_content, its `client_metadata`, and ids on every item; it looks a called tool up
by (namespace, name) and sends the call back with its namespace. Its default model's requests (an
`additional_tools` item, custom tools) and remote compaction are refused with a 400 that says what to do. The
engine is scripted (its answer is a given text), so what is tested is the door: validation, translation into the
chat request (the prompt the engine gets) and the answers' shape (each stream event validates as the SDK's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import AsyncIterator

import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from cluster.request import FinishReason, GenerateRequest, RequestOutput
from router.app import create_app
from router.responses.endpoints import chat_body
from router.reasoning_token import make_token, read_token, TokenChanged
from router.responses.request import ResponsesRequest
from tests.router_fakes import MODEL, FakeEngine, load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "agents"
SPAWN = {"message": "Look at the tests", "fork_context": False}


def recorded(name: str, run: str | None = None) -> dict:
    """The body of a recorded request (from its own file, or the POST of the `run` entry of
    agents_other_requests.json), with the served model's name where Codex sent the configured one."""
    data = json.loads((FIXTURES / name).read_text())
    if run is not None:
        data = next(r for r in data if r.get("run") == run and r["method"] == "POST")
    assert data["path"] == "/v1/responses"
    body = data["body"]
    if body["model"] == "SmolLM2-135M-Instruct":
        body["model"] = MODEL
    return body


def hermes_call(name: str, arguments: dict) -> str:
    """A tool call as the model writes it in the Hermes form the served model's parser reads."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


class ScriptedEngine(FakeEngine):
    """A FakeEngine that answers every request with `answer` (a few tokens per delta), finished by a stop."""

    answer = "It printed hi."

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Yield `answer` in deltas of 3 tokens; the last one finishes with stop."""
        self.submitted.append(request)
        ids = self.tok.encode(self.answer)
        for at in range(0, len(ids), 3):
            chunk = ids[at:at + 3]
            yield RequestOutput(request.request_id, tuple(chunk), self.tok.decode(chunk),
                                finish_reason=FinishReason.STOP if at + 3 >= len(ids) else None,
                                num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=at + len(chunk))


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine(load_tokenizer(), max_model_len=131072)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, engine.tok, served_model_names=[MODEL, "gpt-*"])) as c:
        yield c


@pytest.fixture
def answer(engine):
    """Set the scripted engine's answer for one test."""
    def set_answer(text: str) -> None:
        engine.answer = text
    yield set_answer
    engine.answer = ScriptedEngine.answer


def events_of(body: str) -> list[dict]:
    """The events of a Responses SSE body, checking the framing (`event: <type>` then `data: <json>` of that
    type), the sequence numbers (0, 1, ...) and that each validates as one of the SDK's stream events."""
    events, adapter = [], TypeAdapter(ResponseStreamEvent)
    for block in body.strip("\n").split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[6:])
        assert event["type"] == name[7:] and event["sequence_number"] == len(events)
        adapter.validate_python(event)
        events.append(event)
    return events


def prompt_of(engine) -> str:
    """The text of the prompt the engine got last."""
    return engine.tok.decode(list(engine.submitted[-1].prompt_token_ids))


@pytest.mark.parametrize("name", ["codex_custom_model_first_request.json",
                                  "codex_custom_model_tool_result_request.json"], ids=["first", "tool-result"])
def test_each_recorded_custom_model_request_is_answered_as_a_well_formed_stream(client, engine, name):
    """Posted as recorded: a 200 stream of the Responses events in order, each an SDK event, ending in
    response.completed whose Response (tools, reasoning and prompt_cache_key echoed) validates; the prompt shows
    the model every function, the namespace's under their flat names, and not the hosted web_search tool."""
    body = recorded(name)
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text[:2000]
    events = events_of(r.text)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "It printed hi." and final.model == MODEL and final.usage.input_tokens > 5000
    assert [t.type for t in final.tools] == [t["type"] for t in body["tools"]]
    assert final.reasoning.summary == "auto" and final.prompt_cache_key == body["prompt_cache_key"]
    prompt = prompt_of(engine)
    for tool in ("exec_command", "update_goal", "multi_agent_v1__spawn_agent", "multi_agent_v1__wait_agent"):
        assert f'"{tool}"' in prompt
    assert '"web_search"' not in prompt and "external_web_access" not in prompt
    if "tool_result" in name:  # the echoed call and its output are the assistant's and the tool's turns
        assert '"name": "exec_command"' in prompt and "Process exited with code 0" in prompt


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_call_of_a_namespaced_function_is_an_item_with_its_name_and_namespace(client, answer, stream):
    """The model calls multi_agent_v1__spawn_agent (its flat name): the function_call item says name
    "spawn_agent" and namespace "multi_agent_v1", as Codex looks tools up, in the stream's added and done events
    as in the Response; a call of a plain function has no namespace."""
    answer(hermes_call("multi_agent_v1__spawn_agent", SPAWN) + "\n" + hermes_call("exec_command", {"cmd": "ls"}))
    body = {**recorded("codex_custom_model_first_request.json"), "stream": stream}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text[:2000]
    if stream:
        events = events_of(r.text)
        items = [e["item"] for e in events if e["type"] in ("response.output_item.added", "response.output_item.done")]
        assert [(i["name"], i.get("namespace")) for i in items] == [("spawn_agent", "multi_agent_v1")] * 2 + \
            [("exec_command", None)] * 2
        done = [e["name"] for e in events if e["type"] == "response.function_call_arguments.done"]
        assert done == ["spawn_agent", "exec_command"]
    final = events[-1]["response"] if stream else r.json()
    spawn, plain = Response.model_validate(final).output
    assert (spawn.type, spawn.name, spawn.namespace, json.loads(spawn.arguments)) == \
        ("function_call", "spawn_agent", "multi_agent_v1", SPAWN)
    assert (plain.name, plain.namespace) == ("exec_command", None) and "namespace" not in final["output"][1]


def test_a_namespaced_call_sent_back_is_rendered_under_its_flat_name(client, engine):
    """The recorded tool-result request with the call of spawn_agent that Codex echoes (with our item id and its
    namespace) and its output: accepted, and the assistant turn calls multi_agent_v1__spawn_agent; a call in
    Codex's `functions` namespace is the plain function."""
    body = recorded("codex_custom_model_tool_result_request.json")
    call, output = body["input"][4], body["input"][5]
    call.update(name="spawn_agent", namespace="multi_agent_v1", arguments=json.dumps(SPAWN), id="fc_0123")
    output.update(namespace="multi_agent_v1", output="agent spawned: explorer-1")
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text[:2000]
    prompt = prompt_of(engine)
    assert '"name": "multi_agent_v1__spawn_agent"' in prompt and "agent spawned: explorer-1" in prompt
    call.update(name="exec_command", namespace="functions", arguments='{"cmd": "echo hi"}')
    assert client.post("/v1/responses", json=body).status_code == 200
    assert '"name": "exec_command"' in prompt_of(engine) and "functions__" not in prompt_of(engine)


@pytest.mark.parametrize("choice, words", [
    ({"type": "web_search"}, "web_search"),
    ({"type": "web_search_preview"}, "web_search_preview"),
    ({"type": "allowed_tools", "mode": "required", "tools": [{"type": "web_search"}]}, "built-in"),
], ids=["web_search", "web_search_preview", "allowed-only-hosted"])
def test_a_choice_that_forces_a_hosted_tool_is_refused_naming_tool_choice(client, engine, choice, words):
    """A tool_choice that only a hosted tool could meet: a 400 naming tool_choice; nothing reaches the engine."""
    before = len(engine.submitted)
    r = client.post("/v1/responses", json={**recorded("codex_custom_model_first_request.json"),
                                           "tool_choice": choice})
    assert r.status_code == 400, r.text[:1000]
    error = r.json()["error"]
    assert error["param"] == "tool_choice" and words in error["message"] and len(engine.submitted) == before


def test_required_with_only_hosted_tools_is_refused_and_auto_answers_in_text(client):
    """With web_search the only tool: "required" is a 400 naming tool_choice (no call can be made); "auto" is
    answered in text, the hosted tool left out."""
    body = {"model": MODEL, "input": "Search the web", "tools": [{"type": "web_search"}]}
    r = client.post("/v1/responses", json={**body, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice" and "web_search" in r.text
    r = client.post("/v1/responses", json={**body, "tool_choice": "auto"})
    assert r.status_code == 200 and r.json()["output"][0]["type"] == "message"
    assert r.json()["tools"] == [{"type": "web_search"}]


@pytest.mark.parametrize("kind", ["local_shell", "shell", "apply_patch", "computer_use_preview"])
def test_a_tool_the_client_runs_from_its_own_call_items_is_refused_naming_it(client, kind):
    """Built-in tools the client runs (local_shell_call, computer_call ... items) cannot be left out quietly: the
    model could not do what the client offers. A 400 naming tools[1], saying to declare a function instead."""
    body = {"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}, {"type": kind}]}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[1]", r.text
    assert "function tool" in r.json()["error"]["message"]


def test_tool_choice_and_allowed_tools_name_namespaced_functions(client, engine, answer):
    """tool_choice {"type": "function", "name", "namespace"} forces the flat function (only it is shown, in
    the forced form); an allowed_tools list naming a namespace's function, or the namespace itself, shows the
    model those functions only."""
    answer(hermes_call("multi_agent_v1__wait_agent", {"targets": ["a"]}))
    body = recorded("codex_custom_model_first_request.json")
    r = client.post("/v1/responses", json={**body, "stream": False, "tool_choice": {
        "type": "function", "name": "wait_agent", "namespace": "multi_agent_v1"}})
    assert r.status_code == 200, r.text[:1000]
    [call] = r.json()["output"]
    assert (call["name"], call["namespace"]) == ("wait_agent", "multi_agent_v1")
    allowed = {"type": "allowed_tools", "mode": "auto", "tools": [
        {"type": "function", "name": "close_agent", "namespace": "multi_agent_v1"},
        {"type": "function", "name": "exec_command"}, {"type": "web_search"}]}
    assert client.post("/v1/responses", json={**body, "tool_choice": allowed}).status_code == 200
    prompt = prompt_of(engine)
    assert '"multi_agent_v1__close_agent"' in prompt and '"exec_command"' in prompt
    assert '"multi_agent_v1__spawn_agent"' not in prompt and '"update_goal"' not in prompt
    allowed["tools"] = [{"type": "namespace", "name": "multi_agent_v1"}]
    assert client.post("/v1/responses", json={**body, "tool_choice": allowed}).status_code == 200
    prompt = prompt_of(engine)
    assert '"multi_agent_v1__spawn_agent"' in prompt and '"exec_command"' not in prompt


def _namespace(*tools) -> dict:
    return {"type": "namespace", "name": "ns", "description": "A namespace", "tools": list(tools)}


FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize("tools, param, words", [
    ([_namespace()], "tools[0].tools", "non-empty"),
    ([{"type": "namespace", "name": "ns", "description": ""}], "tools[0].tools", "non-empty"),
    ([_namespace(FUNCTION, {"type": "custom", "name": "exec"})], "tools[0].tools[1]", "custom"),
    ([{**FUNCTION, "name": "ns__f"}, _namespace(FUNCTION)], "tools[1].tools[0]", "ns__f"),
    ([_namespace(FUNCTION, FUNCTION)], "tools[0].tools[1]", "ns__f"),
    ([{**_namespace(FUNCTION), "name": "n" * 62}], "tools[0].tools[0].name", "64"),
    ([{"type": "custom", "name": "exec"}], "tools[0]", "custom"),
    ([FUNCTION], "tool_choice", "namespace"),
], ids=["empty", "no-tools", "custom-inside", "collision", "duplicate", "too-long", "custom", "choice-unknown"])
def test_bad_namespaces_are_refused_naming_the_tool(client, tools, param, words):
    """A namespace without functions, a custom tool inside one, two functions the model would see under one name
    and a flat name past 64 characters: a 400 naming the tool; so is a choice of a namespace's function that no
    namespace declares."""
    body = {"model": MODEL, "input": "Hi", "tools": tools}
    if param == "tool_choice":
        body["tool_choice"] = {"type": "function", "name": "f", "namespace": "other"}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_remote_compaction_is_refused_with_what_to_do(client):
    """POST /v1/responses/compact and a compaction_trigger item (the recorded remote compaction request, cut to
    the items a custom provider sends): a 400 in OpenAI's shape that says to configure a custom model provider,
    which compacts on the client."""
    r = client.post("/v1/responses/compact", json={"model": MODEL, "input": "Hi"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert "model_providers" in error["message"] and 'wire_api = "responses"' in error["message"]
    body = recorded("agents_other_requests.json", run="codex-openai")
    items = [i for i in body["input"] if i["type"] in ("message", "compaction_trigger")]
    r = client.post("/v1/responses", json={**body, "model": MODEL, "input": items})
    assert r.status_code == 400 and r.json()["error"]["param"] == f"input[{len(items) - 1}]"
    assert "compaction_trigger" in r.text and "model_providers" in r.text
    r = client.post("/v1/responses", json={"model": MODEL, "input": [
        {"type": "compaction", "encrypted_content": "x"}, {"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0]"


@pytest.mark.parametrize("name", ["codex_first_request.json", "codex_tool_result_request.json"])
def test_default_model_requests_get_a_400_naming_the_additional_tools_item(client, name):
    """Codex's default-model flavour carries its tools in an additional_tools item (with custom tools): a 400
    naming that item and saying to declare the tools in tools, not a crash."""
    r = client.post("/v1/responses", json=recorded(name))
    assert r.status_code == 400, r.text[:1000]
    error = r.json()["error"]
    assert error["param"] == "input[0]" and "additional_tools" in error["message"], error


def test_reasoning_settings_map_to_the_chat_request():
    """reasoning.effort is the chat request's reasoning_effort (max as xhigh); summary, context and mode are
    taken; the default model's {"effort": "low", "context": "all_turns"} and text.verbosity low are accepted."""
    for effort, chat in (("low", "low"), ("none", "none"), ("max", "xhigh")):
        req = ResponsesRequest.model_validate({"input": "Hi", "reasoning": {"effort": effort, "summary": "auto",
                                                                           "context": "all_turns", "mode": "pro"}})
        assert chat_body(req, MODEL)["reasoning_effort"] == chat
    req = ResponsesRequest.model_validate({"input": "Hi", "reasoning": {"summary": "auto"},
                                           "text": {"verbosity": "low"}})
    assert "reasoning_effort" not in chat_body(req, MODEL) and req.text.echo()["verbosity"] == "low"


def conversation(*reasoning_items) -> list[dict]:
    """A tool loop as Codex sends it back: the user's question, the reasoning items given, a call, its output."""
    return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Run echo hi"}]},
            *reasoning_items,
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "exec_command",
             "arguments": '{"cmd": "echo hi"}', "status": "completed"},
            {"type": "function_call_output", "id": "fco_1", "call_id": "c1", "output": "hi"}]


def _assistant(body: dict) -> dict:
    return next(m for m in body["messages"] if m["role"] == "assistant")


@pytest.mark.parametrize("item, text", [
    ({"content": [{"type": "reasoning_text", "text": "I should run it."}],
      "summary": [{"type": "summary_text", "text": "Plan"}]}, "I should run it."),
    ({"summary": [{"type": "summary_text", "text": "Plan: run it."}]}, "Plan: run it."),
    ({"summary": [], "encrypted_content": make_token("Run it with exec_command.", MODEL)}, "Run it with exec_command."),
    ({"summary": [], "encrypted_content": "gAAAAABo-openai-opaque"}, None),
], ids=["content", "summary", "our-token", "foreign-token"])
def test_a_reasoning_item_is_the_next_assistant_turns_reasoning(item, text):
    """A reasoning item sent back (with Codex's id and status) gives its text to the assistant turn after it as
    reasoning_content: its reasoning_text parts, else its summary, else the text of this server's
    encrypted_content; another server's token is left out."""
    req = ResponsesRequest.model_validate({"input": conversation({"type": "reasoning", "id": "rs_1",
                                                                  "status": "completed", **item}),
                                           "include": ["reasoning.encrypted_content"]})
    assert _assistant(chat_body(req, MODEL)).get("reasoning_content") == text


def test_reasoning_context_current_turn_drops_earlier_turns_reasoning():
    """reasoning.context "current_turn": the reasoning of turns before the last user message is left out; the
    current turn's is kept; "all_turns" keeps both."""
    first = conversation({"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "old"}]})
    later = conversation({"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "new"}]})
    for context, kept in (("current_turn", [None, "new"]), ("all_turns", ["old", "new"])):
        req = ResponsesRequest.model_validate({"input": first + later, "reasoning": {"context": context}})
        assistants = [m for m in chat_body(req, MODEL)["messages"] if m["role"] == "assistant"]
        assert [m.get("reasoning_content") for m in assistants] == kept


def test_a_changed_reasoning_token_is_refused_naming_it(client):
    """An encrypted_content of this server's form whose text was changed: a 400 naming it; a token made for
    another served model fails the same way."""
    token = make_token("Run it.", MODEL)
    assert read_token(token, MODEL) == "Run it." and read_token("other", MODEL) is None
    forged = token.split(".")[0] + "." + make_token("Delete it.", MODEL).split(".")[1] + "." + token.split(".")[2]
    for bad in (forged, make_token("Run it.", "another-model")):
        with pytest.raises(TokenChanged):
            read_token(bad, MODEL)
        item = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": bad}
        r = client.post("/v1/responses", json={"model": MODEL, "input": conversation(item)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[1].encrypted_content", r.text


def test_reasoning_reaches_a_thinking_models_template():
    """End to end on a thinking model's real chat template (Qwen3's): the reasoning item's text is rendered in
    the assistant turn of the current tool loop, inside its think markers; reasoning.effort "none" switches
    thinking off through the template (its empty think block), "high" leaves it on."""
    from cluster.model import load_tokenizer as load
    from router.tokenizer import RouterTokenizer
    from tests.thinking_models import qwen3_thinking_dir

    tok = RouterTokenizer(load(qwen3_thinking_dir()))
    qwen = ScriptedEngine(tok, max_model_len=4096)
    item = {"type": "reasoning", "id": "rs_1", "summary": [],
            "content": [{"type": "reasoning_text", "text": "The user wants the shell output."}]}
    body = {"model": MODEL, "input": conversation(item), "tools": [
        {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}}]}
    with TestClient(create_app(qwen, tok, served_model_names=[MODEL])) as http:
        assert http.post("/v1/responses", json=body).status_code == 200
        prompt = tok.decode(list(qwen.submitted[-1].prompt_token_ids))
        assert "<think>\nThe user wants the shell output.\n</think>" in prompt
        for effort, off in (("none", True), ("high", False)):
            r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "reasoning": {"effort": effort}})
            assert r.status_code == 200, r.text
            prompt = tok.decode(list(qwen.submitted[-1].prompt_token_ids))
            assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") == off, (effort, prompt)


def test_codex_fields_and_item_extras_are_accepted_with_the_same_answer(client, engine):
    """store true, service_tier, truncation auto, prompt-cache options, moderation, image options, background
    options, access programs, client_metadata and text.verbosity: accepted, and the prompt is the same as
    without them; items' id, status and phase are taken."""
    base = {"model": MODEL, "input": [
        {"type": "message", "id": "msg_1", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "id": "msg_2", "role": "assistant", "phase": "final_answer", "status": "completed",
         "content": [{"type": "output_text", "text": "Hello"}]},
        {"type": "message", "role": "user", "content": "Bye"}]}
    assert client.post("/v1/responses", json=base).status_code == 200
    plain = engine.submitted[-1].prompt_token_ids
    extras = {"store": True, "service_tier": "flex", "truncation": "auto", "prompt_cache_retention": "24h",
              "prompt_cache_options": {"ttl": "12h"}, "moderation": {"model": "omni-moderation-latest"},
              "image": {"context_compression": "enabled"}, "background_options": {"completion_window": "2h"},
              "access_programs": {"cyber": "standard"}, "client_metadata": {"turn_id": "t1"},
              "text": {"verbosity": "low"}}
    r = client.post("/v1/responses", json={**base, **extras, "stream": False})
    assert r.status_code == 200, r.text
    assert engine.submitted[-1].prompt_token_ids == plain
    answer = Response.model_validate(r.json())
    assert answer.store is False and answer.service_tier == "default" and answer.text.verbosity == "low"

