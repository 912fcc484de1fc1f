"""The real chat templates of current model families (tests/fixtures/templates/, tests/template_families.py) through
the router: a tool conversation renders through the router's own prompt path, the tool parser is the one mlx-lm
infers, the family's own tool-call format parses (whole and streamed), the call the template writes into the
history reads back, and thinking is found and switched as the template does. Families whose format the router
cannot handle are checked for what it does instead."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import re

import pytest
from fastapi.testclient import TestClient

from cluster.detokenizer import OutputText
from cluster.reasoning import start_reasoning
from cluster.request import FinishReason, RequestOutput
from router.app import create_app
from router.openai.request import ChatCompletionRequest
from router.params import prepare_chat
from router.reasoning import reasoning_support
from router.tool_calls import ContentDelta, ToolCallArguments, ToolCallStarted, infer_parser_name, tool_parser_for
from router.tool_prompt import short_call_ids, short_call_ids_for, template_refuses_long_call_ids, tools_section
from tests.template_families import (BY_NAME, CALL, CALL_ID, FAMILIES, FIXTURES, HERMES_CALL, HISTORY, QUESTION,
                                     REASONING, WEATHER, tokenizer)
from tests.router_fakes import MODEL, FakeEngine, parse_sse

IDS = [f.name for f in FAMILIES]


def prepare(family, **body):
    """The router's PreparedRequest of a chat request to the family's tokenizer."""
    req = ChatCompletionRequest.model_validate({"max_tokens": 8, **body})
    return asyncio.run(prepare_chat(req, tokenizer(family), request_id="r", model="m", max_model_len=8192,
                                    arrival_time=0.0))


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(parser, text, rng):
    """(content, calls) of `text` fed to a ToolCallStream in random pieces, finished as "stop"."""
    cuts = sorted(rng.sample(range(1, len(text)), min(12, len(text) - 1)))
    stream = parser.stream([WEATHER])
    events = [e for a, b in zip([0] + cuts, cuts + [len(text)]) for e in stream.feed(text[a:b])]
    events += stream.finish("stop")
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallArguments):
            args[e.index] = args.get(e.index, "") + e.text
    calls = [(e.name, json.loads(args[e.index])) for e in events if isinstance(e, ToolCallStarted)]
    return content or None, calls


def test_each_fixture_is_the_file_its_readme_row_names_byte_for_byte():
    """Every template fixture has a row in the fixtures' README whose git blob id matches the file's bytes, and
    every family's template is one of them."""
    readme = (FIXTURES / "README.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `([^`]+\.jinja)` \|.*?\| `([0-9a-f]{40})` \|", readme, re.MULTILINE))
    files = sorted(p.name for p in FIXTURES.glob("*.jinja"))
    assert sorted(rows) == files
    for name in files:
        data = (FIXTURES / name).read_bytes()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == rows[name], name
    assert {f.template for f in FAMILIES} == set(files)


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_a_tool_conversation_renders_through_the_routers_prompt_path(family):
    """A conversation with a tool, a previous call and its result renders through the router's chat path with the
    family's template; the prompt names the tool, its description and parameters and holds the result, the
    tools come from the template itself or from the Hermes fallback as the parser says, and a tool-call turn's
    reasoning stays only where the template keeps it."""
    prepared = prepare(family, messages=HISTORY, tools=[WEATHER])
    text = prepared.prompt_text
    for needle in ("get_weather", "Weather of a city", "city", "days", "18 C"):
        assert needle in text, needle
    assert prepared.tool_parser.name == family.parser and prepared.tool_parser.native == family.native
    assert (tools_section([WEATHER]) in text) == (not family.native)
    assert (REASONING in text) == family.keeps_reasoning


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_the_router_picks_the_tool_parser_mlx_lm_infers_from_the_template(family):
    """The parser the router uses is mlx-lm's inference from the template (or the json_tools fallback where mlx-lm
    infers none or the template renders no tools)."""
    from mlx_lm.tokenizer_utils import _infer_tool_parser

    tok = tokenizer(family)
    assert _infer_tool_parser(tok.wrapped._tokenizer) == family.inferred
    assert infer_parser_name(tok.wrapped) == family.inferred
    parser = tool_parser_for(tok)
    assert (parser.name, parser.native) == (family.parser, family.native)


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_an_answer_in_the_familys_own_call_format_parses_whole_and_streamed(family):
    """A model answer written in the family's tool-call format gives the expected calls and content, whole and
    fed in random pieces; a format the router cannot read stays content."""
    parser = tool_parser_for(tokenizer(family))
    content, calls = parser.parse(family.output, [WEATHER], "stop")
    assert (content, calls_of(calls)) == (family.content, list(family.calls))
    rng = random.Random(family.name)
    for _ in range(10):
        assert streamed(parser, family.output, rng) == (family.content, list(family.calls))


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_the_call_the_template_writes_into_the_history_reads_back(family):
    """The previous call as the template renders it in the prompt is read back into the same call by the parser
    the router picks (template and parser agree), except where the family's rendering and parser disagree."""
    prepared = prepare(family, messages=HISTORY, tools=[WEATHER])
    _, calls = prepared.tool_parser.parse(prepared.prompt_text, [WEATHER])
    assert calls_of(calls) == ([CALL] if family.history_parses else [])


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_thinking_support_and_its_switch_are_found_in_the_tokenizer_and_template(family):
    """The router finds the family's reasoning format (think markers) and on/off variable as expected."""
    support = reasoning_support(tokenizer(family).wrapped)
    assert (support.format, support.switch) == (family.reasoning, family.switch)


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_the_generation_prompt_opens_or_closes_reasoning_as_the_template_does(family):
    """With thinking on (reasoning_effort high, and by default) and off (reasoning_effort none) the prompt ends as
    the template writes it, and the engine is told whether the answer starts inside reasoning; a thinking model
    without a switch is told a budget of 0 instead."""
    default = prepare(family, messages=QUESTION)
    for effort, end, inside in (("high", family.on, family.on_inside), ("none", family.off, family.off_inside)):
        prepared = prepare(family, messages=QUESTION, reasoning_effort=effort)
        assert prepared.prompt_text.endswith(end), (effort, prepared.prompt_text[-80:])
        params = prepared.requests[0].sampling.reasoning
        assert (params.starts_inside if params else None) == inside
        if effort == "none" and params is not None:
            assert params.budget == (0 if family.switch is None else None)
        if effort == "high":
            assert prepared.prompt_text == default.prompt_text


def test_gemma_4_thinks_by_default_because_its_switch_is_set_on():
    """Gemma 4's template thinks only when `enable_thinking` is set; a request without reasoning_effort has the
    switch on (the router sets it, as mlx-lm's wrapper does for the think markers it knows), so it gets the
    `<|think|>` system line, and one with reasoning_effort none does not."""
    gemma = BY_NAME["gemma-4"]
    assert "<|turn>system\n<|think|>\n" in prepare(gemma, messages=QUESTION).prompt_text
    assert "<|think|>" not in prepare(gemma, messages=QUESTION, reasoning_effort="none").prompt_text


def test_gemma_4_continues_the_model_turn_after_a_tool_result():
    """After a tool result Gemma 4's template opens no new model turn: the prompt ends with the result."""
    assert prepare(BY_NAME["gemma-4"], messages=HISTORY, tools=[WEATHER]).prompt_text.endswith(
        "<|tool_response>response:get_weather{value:<|\"|>18 C<|\"|>}<tool_response|>")


def test_nemotron_nano_v2_thinking_follows_no_think_in_the_messages_not_the_switch_the_router_finds():
    """Nemotron Nano v2's template reads /think and /no_think in the messages only; `enable_thinking`, which the
    router takes for its switch from a namespace field of that name, changes nothing, so reasoning_effort none
    plans thinking off while the prompt still opens reasoning."""
    nano = BY_NAME["nemotron-nano-v2"]
    off = prepare(nano, messages=QUESTION, reasoning_effort="none")
    assert off.prompt_text.endswith("<SPECIAL_11>Assistant\n<think>\n")
    assert off.requests[0].sampling.reasoning.starts_inside
    no_think = [{"role": "system", "content": "Be brief. /no_think"}, QUESTION[1]]
    prepared = prepare(nano, messages=no_think)
    assert prepared.prompt_text.endswith("<SPECIAL_11>Assistant\n<think></think>")
    assert not prepared.requests[0].sampling.reasoning.starts_inside


def test_nemotron_nano_v2_gets_the_hermes_fallback_whose_calls_parse():
    """mlx-lm has no parser for Nemotron Nano v2's <TOOLCALL> format, so the router shows the tools Hermes-style
    and reads calls in that form."""
    parser = tool_parser_for(tokenizer(BY_NAME["nemotron-nano-v2"]))
    _, calls = parser.parse(HERMES_CALL, [WEATHER], "stop")
    assert calls_of(calls) == [CALL]


def test_smollm3_writes_its_reasoning_mode_into_the_system_turn():
    """SmolLM3's template says `/think` or `/no_think` in its system turn, as the switch is on or off."""
    smol = BY_NAME["smollm3"]
    assert "Reasoning Mode: /think\n" in prepare(smol, messages=QUESTION, reasoning_effort="high").prompt_text
    assert "Reasoning Mode: /no_think\n" in prepare(smol, messages=QUESTION, reasoning_effort="none").prompt_text


TOOLU_ID = "toolu_01A09q90qw90lq917835lq9"  # an Anthropic tool_use id, as an Anthropic client sends it back
LONDON = ("get_weather", {"city": "London"})
TWO_CALLS = [
    QUESTION[1],
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": CALL_ID, "type": "function", "function": {"name": CALL[0], "arguments": json.dumps(CALL[1])}},
        {"id": TOOLU_ID, "type": "function", "function": {"name": LONDON[0], "arguments": json.dumps(LONDON[1])}}]},
    {"role": "tool", "tool_call_id": TOOLU_ID, "content": "12 C"},  # the results in the other order
    {"role": "tool", "tool_call_id": CALL_ID, "content": "18 C"},
]
MISTRAL_HISTORY_CALL = re.compile(r"\[TOOL_CALLS\]get_weather\[CALL_ID\]([^\[]*)\[ARGS\](\{[^}]*\})")
MISTRAL_RESULT = re.compile(r"\[TOOL_RESULTS\]([^\[]*)\[TOOL_CONTENT\]([^\[]*)\[/TOOL_RESULTS\]")


def test_mistral_small_3_2_renders_client_call_ids_in_its_own_form_each_result_paired_with_its_call():
    """Mistral Small 3.2's template takes only call ids of 9 letters or digits; a conversation whose calls carry
    the ids clients send back (the router's `call_...`, Anthropic's `toolu_...`) renders with each id written in
    that form, distinct ids distinct, each result under the id of the call it answers; the next turn's prompt
    writes the same ids, the history's calls read back, and the model's next call parses, written with or
    without a call id of its own, whole and streamed."""
    mistral = BY_NAME["mistral-small-3.2"]
    text = prepare(mistral, messages=TWO_CALLS, tools=[WEATHER]).prompt_text
    calls = {json.loads(args)["city"]: short for short, args in MISTRAL_HISTORY_CALL.findall(text)}
    results = dict(MISTRAL_RESULT.findall(text))
    assert set(calls) == {"Paris", "London"} and calls["Paris"] != calls["London"]
    assert all(len(short) == 9 and short.isascii() and short.isalnum() for short in calls.values())
    assert results == {calls["Paris"]: "18 C", calls["London"]: "12 C"}
    later = TWO_CALLS + [{"role": "assistant", "content": "18 C and 12 C."}, {"role": "user", "content": "Thanks"}]
    again = prepare(mistral, messages=later, tools=[WEATHER]).prompt_text
    assert MISTRAL_HISTORY_CALL.findall(again) == MISTRAL_HISTORY_CALL.findall(text)
    assert MISTRAL_RESULT.findall(again) == MISTRAL_RESULT.findall(text)
    parser = tool_parser_for(tokenizer(mistral))
    _, read_back = parser.parse(text, [WEATHER])
    assert calls_of(read_back) == [CALL, LONDON]
    rng = random.Random("mistral-call-id")
    for output in (mistral.output, mistral.output.replace("[ARGS]", "[CALL_ID]a1B2c3D4e[ARGS]")):
        content, parsed = parser.parse(output, [WEATHER], "stop")
        assert (content, calls_of(parsed)) == (None, [CALL])
        for _ in range(5):
            assert streamed(parser, output, rng) == (None, [CALL])


def test_call_ids_in_mistrals_form_are_kept_derived_or_told_apart():
    """An id of 9 letters or digits stays as it is; any other gets 9 letters or digits derived from the id itself,
    so the same in every request; an id whose form is already taken by an earlier one of the conversation gets
    another, so no two ids share one."""
    first = short_call_ids([CALL_ID])[CALL_ID]
    assert len(first) == 9 and first.isascii() and first.isalnum()
    ids = short_call_ids(["abc123XYZ", "toolu_x", CALL_ID, "toolu_x", first])
    assert list(ids) == ["abc123XYZ", "toolu_x", CALL_ID, first]
    assert ids["abc123XYZ"] == "abc123XYZ" and ids[CALL_ID] == first
    assert ids[first] != first and len(set(ids.values())) == 4
    assert all(len(v) == 9 and v.isascii() and v.isalnum() for v in ids.values())


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_only_mistral_templates_get_call_ids_in_mistrals_form(family):
    """The router maps call ids for the templates read with the mistral parser; of all the families' templates
    only Mistral Small 3.2's refuses an OpenAI-style id that a 9-character one passes (the probe that catches
    such a template whatever its parser)."""
    tok = tokenizer(family)
    assert template_refuses_long_call_ids(tok.wrapped) == (family.name == "mistral-small-3.2")
    assert short_call_ids_for(tok) == (family.parser == "mistral")


def test_mistral_small_3_2_takes_anthropic_and_responses_call_ids_back():
    """Over Anthropic's Messages (a tool_use id `toolu_...`) and the Responses API (a call_id), a Mistral Small
    3.2 conversation holding a call and its result is served, not refused by the template, the result under the
    call's id in the prompt."""
    mistral = tokenizer(BY_NAME["mistral-small-3.2"])
    engine = FakeEngine(mistral)
    arguments = json.dumps(CALL[1])
    anthropic_body = {"model": MODEL, "max_tokens": 4, "tools": [
        {"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER["function"]["parameters"]}],
        "messages": [{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": TOOLU_ID, "name": CALL[0],
                                                        "input": CALL[1]}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": TOOLU_ID,
                                                   "content": "18 C"}]}]}
    responses_body = {"model": MODEL, "max_output_tokens": 4, "tools": [{"type": "function", **WEATHER["function"]}],
                      "input": [{"role": "user", "content": "Weather in Paris?"},
                                {"type": "function_call", "call_id": CALL_ID, "name": CALL[0],
                                 "arguments": arguments},
                                {"type": "function_call_output", "call_id": CALL_ID, "output": "18 C"}]}
    with TestClient(create_app(engine, mistral, served_model_names=[MODEL])) as client:
        for path, body in (("/v1/messages", anthropic_body), ("/v1/responses", responses_body)):
            r = client.post(path, json=body)
            assert r.status_code == 200, r.text
            prompt = mistral.decode(engine.submitted[-1].prompt_token_ids)
            (short, _), = MISTRAL_HISTORY_CALL.findall(prompt)
            assert MISTRAL_RESULT.findall(prompt) == [(short, "18 C")]


def test_kimi_k2_thinking_reads_back_a_history_call_only_with_kimis_own_call_id_and_heads_the_result_by_name():
    """Kimi K2 Thinking's template writes the client's call id into the history call; the kimi_k2 parser reads it
    back only when the id has Kimi's form `functions.NAME:IDX`. The tool result's header carries the function
    name the router hands the template (`<|im_system|>get_weather`), where a client's message without a name
    would give `<|im_system|>tool`."""
    kimi = BY_NAME["kimi-k2-thinking"]
    history = json.loads(json.dumps(HISTORY).replace(CALL_ID, "functions.get_weather:0"))
    prepared = prepare(kimi, messages=history, tools=[WEATHER])
    _, calls = prepared.tool_parser.parse(prepared.prompt_text, [WEATHER])
    assert calls_of(calls) == [CALL]
    assert "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n18 C<|im_end|>" in (
        prepared.prompt_text)


def test_lfm2_drops_the_previous_tool_call_from_the_history():
    """LFM2's template renders an assistant turn's content only, so a previous call sent as `tool_calls` leaves an
    empty assistant turn."""
    text = prepare(BY_NAME["lfm2"], messages=HISTORY, tools=[WEATHER]).prompt_text
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n<|tool_response_start|>18 C" in text
    assert text.count("Paris") == 1  # the user's question only


class SplittingEngine(FakeEngine):
    """Answers every request with `answer`'s tokens, one per delta, split into reasoning and answer by the engine's
    own machinery: the reasoning state of the request's ReasoningParams (cluster/reasoning.py) behind
    `cluster.detokenizer.OutputText`, as the engine runs them."""

    answer = ""

    async def generate(self, request):
        self.submitted.append(request)
        sp = request.sampling
        wrapper = self.tok.wrapped
        state = start_reasoning(sp.reasoning, False, wrapper.decode) if sp.reasoning is not None else None
        text = OutputText(wrapper, request.prompt_token_ids, sp.stop, sp.skip_special_tokens, state)
        ids = wrapper.encode(self.answer, add_special_tokens=False)
        for i, token in enumerate(ids):
            delta = text.add(token)
            answer, reasoning = delta.text, delta.reasoning
            last = i == len(ids) - 1
            if last:
                tail = text.finish()
                answer, reasoning = answer + tail.text, reasoning + tail.reasoning
            yield RequestOutput(request.request_id, (token,), answer,
                                finish_reason=FinishReason.STOP if last else None,
                                num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=i + 1,
                                reasoning_text=reasoning, num_reasoning_tokens=state.count if state else 0)


def test_ministral_3_reasoning_in_think_brackets_comes_apart_from_the_answer_whole_and_streamed():
    """Ministral 3 writes `[THINK]reasoning[/THINK]answer`; the router finds those markers (single tokens mlx-lm
    does not know), so over Chat Completions the reasoning arrives as `reasoning_content` and the answer as
    `content`, whole and streamed, and a tool call after the reasoning is still a call."""
    ministral = tokenizer(BY_NAME["ministral-3"])
    engine = SplittingEngine(ministral)
    engine.answer = f"[THINK]{REASONING}[/THINK]It is 18 C in Paris."
    body = {"model": MODEL, "max_tokens": 64, "messages": QUESTION}
    with TestClient(create_app(engine, ministral, served_model_names=[MODEL])) as client:
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert (whole["reasoning_content"], whole["content"]) == (REASONING, "It is 18 C in Paris.")
        reasoning, content = "", ""
        for chunk in parse_sse(client.post("/v1/chat/completions", json={**body, "stream": True}).text)[:-1]:
            for choice in chunk["choices"]:
                reasoning += choice["delta"].get("reasoning_content") or ""
                content += choice["delta"].get("content") or ""
        assert (reasoning, content) == (REASONING, "It is 18 C in Paris.")
        engine.answer = f"[THINK]{REASONING}[/THINK]" + BY_NAME["ministral-3"].output
        called = client.post("/v1/chat/completions", json={**body, "tools": [WEATHER]}).json()["choices"][0]
        assert called["message"]["reasoning_content"] == REASONING and called["finish_reason"] == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in called["message"]["tool_calls"]] == [CALL]
