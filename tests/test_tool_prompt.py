"""Rendering tools and tool-call turns (router/tool_prompt.py, through router/params.py): SmolLM2's plain
ChatML template gets the Hermes fallback; a template that renders tools gets them natively; inconsistent tool
turns are refused with a 400 naming the message field."""

from __future__ import annotations

import asyncio
import json

import pytest

from router.errors import APIError
from router.openai.request import ChatCompletionRequest
from router.params import prepare_chat
from router.tool_calls import tool_parser_for
from router.tool_prompt import template_renders_tools
from tests.router_fakes import load_tokenizer
from tests.tool_helpers import WEATHER, call, hermes_tokenizer

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [call("call_a", "get_weather", {"city": "Paris"}),
                                                          call("call_b", "get_weather", {"city": "Rome"})]},
    {"role": "tool", "tool_call_id": "call_a", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "21 C"}]},
]


def prepare(tok, **body):
    body.setdefault("max_tokens", 8)
    req = ChatCompletionRequest.model_validate(body)
    return asyncio.run(prepare_chat(req, tok, request_id="r", model="m", max_model_len=2048, arrival_time=0.0))


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer()


@pytest.fixture(scope="module")
def hermes():
    return hermes_tokenizer()


def test_smollm2_template_cannot_render_tools_so_the_fallback_is_used(smollm2):
    assert not template_renders_tools(smollm2.wrapped)
    parser = tool_parser_for(smollm2)
    assert (parser.name, parser.native, parser.markers_are_special) == ("json_tools", False, False)


def test_fallback_renders_tools_section_tool_call_turns_with_null_content_and_tool_results(smollm2):
    prepared = prepare(smollm2, messages=HISTORY, tools=[WEATHER])
    text = prepared.prompt_text
    system = text[:text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    signatures = json.loads(system[system.index("<tools>\n") + 8:system.index("\n</tools>")])
    assert signatures == [WEATHER["function"]]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
            '<|im_end|>') in text
    # both results in one user turn, then the generation prompt
    assert text.endswith("<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n21 C\n"
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert prepared.tool_parser is tool_parser_for(smollm2) and prepared.tools == (WEATHER,)


def test_fallback_without_a_system_message_adds_one_and_tool_choice_none_shows_no_tools(smollm2):
    text = prepare(smollm2, messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER]).prompt_text
    assert text.startswith("<|im_start|>system\n# Tools\n")
    none = prepare(smollm2, messages=HISTORY[1:], tools=[WEATHER], tool_choice="none")
    assert "# Tools" not in none.prompt_text and none.tool_parser is None
    assert '<tool_call>\n{"name": "get_weather"' in none.prompt_text  # the history is still shown


def test_a_template_that_renders_tools_gets_them_natively_with_arguments_as_objects(hermes):
    assert template_renders_tools(hermes.wrapped)
    parser = tool_parser_for(hermes)
    assert (parser.name, parser.native) == ("json_tools", True)
    text = prepare(hermes, messages=HISTORY, tools=[WEATHER]).prompt_text
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in text  # the template's own `tools | tojson`
    # the template wrote the arguments with tojson: they reached it as an object, not as JSON text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n21 C\n</tool_response>" in text


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": "Hi"}, {"role": "tool", "tool_call_id": "call_zz", "content": "x"}],
     "messages[1].tool_call_id"),
    (HISTORY[:3] + [{"role": "tool", "content": "18 C"}], "messages[3].tool_call_id"),
    ([{"role": "user", "content": "Hi", "tool_calls": [call("c", "get_weather", {})]}], "messages[0].tool_calls"),
    ([{"role": "user", "content": "Hi", "tool_call_id": "c"}], "messages[0].tool_call_id"),
])
def test_inconsistent_tool_turns_are_refused_naming_the_message_field(smollm2, messages, param):
    with pytest.raises(APIError) as exc:
        prepare(smollm2, messages=messages, tools=[WEATHER])
    assert exc.value.status == 400 and exc.value.param == param and param in exc.value.message


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
])
def test_tool_choice_and_tools_that_do_not_fit_are_refused(smollm2, body, param):
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER], **body}
    with pytest.raises(APIError) as exc:
        prepare(smollm2, **body)
    assert exc.value.status == 400 and exc.value.param == param
