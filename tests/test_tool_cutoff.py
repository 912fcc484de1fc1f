"""A tool call cut off by max_tokens, through HTTP on all three APIs (Chat Completions, Anthropic Messages,
Responses), streamed and not: the scripted engine writes a chosen text (Hermes `<tool_call>` calls, the format
SmolLM2's tool prompt asks for) and stops at max_tokens inside a call. The answer keeps the calls completed
before the cut one and the text before its start marker, holds no markup of the cut call in any text (no
streamed delta carried any), ends as the API says a max_tokens cut ends, and still counts every token
generated."""

from __future__ import annotations

import json

import anthropic.types
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from starlette.testclient import TestClient

from router.app import create_app
from tests.router_fakes import MODEL, FakeEngine, load_tokenizer

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
QUESTION = "What is the weather in Paris and in Rome?"


def call_text(city: str) -> str:
    """One get_weather call for `city` in the Hermes form."""
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


# (what the model writes, the text its output is cut just after, the answer's text, its calls' cities)
CASES = {
    "forced call cut mid-arguments": (call_text("Paris"), '"Pa', "", []),
    "a complete call, then a second one cut": (call_text("Paris") + "\n" + call_text("Rome"), '"Ro', "", ["Paris"]),
    "text, then a call cut": ("Let me look that up.\n" + call_text("Oslo"), '"name": "get', "Let me look that up.", []),
    "text, then a cut start marker": ("Let me look that up.\n" + call_text("Oslo"), "<tool", "Let me look that up.",
                                      []),
}


@pytest.fixture(scope="module")
def scripted():
    """A TestClient of an app over the scripted engine, the engine and the tokenizer."""
    tok = load_tokenizer()
    engine = FakeEngine(tok)
    with TestClient(create_app(engine, tok, served_model_names=[MODEL])) as http:
        yield http, engine, tok


def script(engine: FakeEngine, tok, text: str, cut_after: str) -> int:
    """Make the engine write `text`; the number of tokens whose text first holds `cut_after` (max_tokens for
    an output cut there), checked to end inside the text's last call or its start marker."""
    ids = tok.encode(text)
    engine.script = ids
    n = next(k for k in range(1, len(ids) + 1) if cut_after in tok.decode(ids[:k]))
    written = tok.decode(ids[:n])
    assert written.count("<tool") > written.count("</tool_call>") or written.endswith("<tool"), written
    return n


def sse_payloads(body: str) -> list[dict]:
    """The JSON payloads of an SSE body, named events or not ([DONE] left out)."""
    out = []
    for block in body.split("\n\n"):
        data = [line[len("data: "):] for line in block.split("\n") if line.startswith("data: ")]
        if data and data[0] != "[DONE]":
            out.append(json.loads(data[0]))
    return out


def openai_answer(http, tool_choice: str, max_tokens: int, stream: bool) -> tuple:
    """Chat Completions' answer as (content, [(name, arguments)], finish_reason, completion_tokens), whole or
    assembled from its chunks."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens,
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}],
            "tool_choice": tool_choice, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        answer = ChatCompletion.model_validate(r.json())
        choice = answer.choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or ()]
        return choice.message.content or "", calls, choice.finish_reason, answer.usage.completion_tokens
    chunks = sse_payloads(r.text)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join(d["delta"].get("content") or "" for d in deltas)
    names, arguments = {}, {}
    for d in deltas:
        for tc in d["delta"].get("tool_calls") or ():
            if tc.get("id"):
                names[tc["index"]] = tc["function"]["name"]
            arguments[tc["index"]] = arguments.get(tc["index"], "") + tc["function"].get("arguments", "")
    calls = [(names[i], json.loads(arguments[i])) for i in sorted(names)]
    assert [d["finish_reason"] for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    return text, calls, deltas[-1]["finish_reason"], chunks[-1]["usage"]["completion_tokens"]


def anthropic_answer(http, tool_choice: str, max_tokens: int, stream: bool) -> tuple:
    """The Messages answer as (text, [(name, input)], stop_reason, output_tokens), whole or assembled from its
    events."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens,
            "tools": [{"name": "get_weather", "input_schema": CITY}],
            "tool_choice": {"type": "any" if tool_choice == "required" else "auto"}, "stream": stream}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        answer = anthropic.types.Message.model_validate(r.json())
        text = "".join(b.text for b in answer.content if b.type == "text")
        calls = [(b.name, b.input) for b in answer.content if b.type == "tool_use"]
        return text, calls, answer.stop_reason, answer.usage.output_tokens
    events = sse_payloads(r.text)
    text = "".join(e["delta"]["text"] for e in events
                   if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta")
    starts = {e["index"]: e["content_block"]["name"] for e in events
              if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use"}
    inputs = {i: "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
                         and e["index"] == i and e["delta"]["type"] == "input_json_delta") for i in starts}
    calls = [(starts[i], json.loads(inputs[i])) for i in sorted(starts)]
    final = next(e for e in events if e["type"] == "message_delta")
    assert events[-1]["type"] == "message_stop"
    return text, calls, final["delta"]["stop_reason"], final["usage"]["output_tokens"]


def responses_answer(http, tool_choice: str, max_tokens: int, stream: bool) -> tuple:
    """The Responses answer as (message text, [(name, arguments)], (status, incomplete reason), output_tokens),
    whole or from the stream (whose deltas and added items must agree with its final response)."""
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": max_tokens, "tool_choice": tool_choice,
            "tools": [{"type": "function", "name": "get_weather", "parameters": CITY}], "stream": stream}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = sse_payloads(r.text)
        streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        added = [e["item"]["name"] for e in events
                 if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"]
        assert events[-1]["type"] == "response.incomplete"
        answer = Response.model_validate(events[-1]["response"])
    else:
        answer = Response.model_validate(r.json())
    text = "".join(part.text for item in answer.output if item.type == "message" for part in item.content)
    calls = [(item.name, json.loads(item.arguments)) for item in answer.output if item.type == "function_call"]
    if stream:
        assert (streamed, added) == (text, [name for name, _ in calls])
    how = (answer.status, answer.incomplete_details.reason if answer.incomplete_details else None)
    return text, calls, how, answer.usage.output_tokens


APIS = {"openai": (openai_answer, "length"), "anthropic": (anthropic_answer, "max_tokens"),
        "responses": (responses_answer, ("incomplete", "max_output_tokens"))}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", sorted(APIS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_call_cut_by_max_tokens_leaves_no_markup_and_keeps_what_came_before_it(scripted, case, api, stream):
    """Forced (tool_choice required) or auto, alone, after a complete call or after text, the cut call leaves
    nothing in the answer: the text before it and the complete calls stay, the answer ends as a max_tokens
    cut, and the output token count is every token the engine generated."""
    http, engine, tok = scripted
    text, cut_after, kept_text, kept_cities = CASES[case]
    max_tokens = script(engine, tok, text, cut_after)
    ask, ended = APIS[api]
    tool_choice = "required" if case.startswith("forced") else "auto"
    answer = ask(http, tool_choice, max_tokens, stream)
    assert answer == (kept_text, [("get_weather", {"city": c}) for c in kept_cities], ended, max_tokens)


def test_a_cut_call_leaves_no_logprobs_in_the_streamed_responses_message_text(scripted):
    """Streamed, each of Responses' output_text logprobs rides with the text delta after its token: those of the
    dropped call's tokens are among neither the deltas' logprobs nor the finished message's."""
    http, engine, tok = scripted
    text, cut_after, kept_text, _ = CASES["text, then a call cut"]
    max_tokens = script(engine, tok, text, cut_after)
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": max_tokens, "top_logprobs": 1, "stream": True,
            "include": ["message.output_text.logprobs"],
            "tools": [{"type": "function", "name": "get_weather", "parameters": CITY}]}
    events = sse_payloads(http.post("/v1/responses", json=body).text)
    deltas = [lp["token"] for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    part = Response.model_validate(events[-1]["response"]).output[0].content[0]
    assert part.text == kept_text
    assert "".join(deltas).rstrip() == "".join(lp.token for lp in part.logprobs).rstrip() == kept_text
