"""A thinking model's reasoning, apart from its answer, on the HTTP APIs: Chat Completions (`reasoning_content`
and `reasoning`, whole and streamed) and Anthropic's Messages (thinking blocks with a signature the server
verifies on the way back, shown or omitted), the budget that ends the reasoning with the end marker the engine
forces, the template's switch when thinking is off, and grammars that constrain only the answer.

The model is the random-weight qwen3 of tests/thinking_models.py with the generation prompt of Qwen3.5's
template, which opens `<think>\\n` itself (a random model never writes `<think>` on its own): so every answer
starts inside the reasoning, and a budget decides where it ends."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest

from router.reasoning_token import PREFIX, read_token
from tests.live_server import live_model_server
from tests.thinking_models import gpt_oss_dir, qwen3_thinking_dir

QWEN3_PROMPT_END = """    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}"""
# Qwen3.5's generation prompt: thinking opens the reasoning, the switch off closes it at once
QWEN35_PROMPT_END = """    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}"""
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
BUDGET = 5
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def variant(source: Path, name: str, old: str, new: str) -> Path:
    """A copy of a fixture folder whose chat template has `old` replaced by `new` (in both places it is kept)."""
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-")) / name
    shutil.copytree(source, folder)
    template = (folder / "chat_template.jinja").read_text()
    assert old in template
    (folder / "chat_template.jinja").write_text(template.replace(old, new))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if isinstance(config.get("chat_template"), str):
        config["chat_template"] = config["chat_template"].replace(old, new)
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def server():
    folder = variant(qwen3_thinking_dir(), "qwen35-thinking", QWEN3_PROMPT_END, QWEN35_PROMPT_END)
    with live_model_server(folder, dtype="float32", kv_cache_gb=0.05, block_size=8) as (base, _):
        yield base, folder.name, str(folder)
    shutil.rmtree(folder.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server[0], api_key="none", max_retries=0, timeout=120)


def chat(oai, model, **kw):
    return oai.chat.completions.create(model=model, messages=QUESTION, temperature=0, **kw)


def test_chat_reasoning_ends_at_the_budget_with_the_forced_end_marker(oai, server):
    """With a budget of N tokens the answer carries N reasoning tokens in usage, the reasoning apart from the
    content under both names, and the token after the N reasoning tokens is `</think>`, forced by the engine."""
    r = chat(oai, server[1], max_tokens=12, logprobs=True, extra_body={"thinking_token_budget": BUDGET})
    message, usage = r.choices[0].message, r.usage
    assert usage.completion_tokens == 12 and usage.completion_tokens_details.reasoning_tokens == BUDGET
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.model_extra["reasoning"] == reasoning
    tokens = [e.token for e in r.choices[0].logprobs.content]
    assert tokens[BUDGET] == "</think>" and "</think>" not in tokens[:BUDGET]
    assert "".join(tokens[:BUDGET]) == reasoning
    assert message.content == "".join(tokens[BUDGET + 1:]) and "</think>" not in message.content


def test_chat_stream_carries_the_same_reasoning_and_answer(oai, server):
    """Streamed, the reasoning arrives in `delta.reasoning_content` (and `delta.reasoning`) before the answer's
    `delta.content`, and each joined equals the non-streamed answer's."""
    whole = chat(oai, server[1], max_tokens=12, extra_body={"thinking_token_budget": BUDGET}).choices[0].message
    reasoning, content, order = [], [], []
    for chunk in chat(oai, server[1], max_tokens=12, stream=True, extra_body={"thinking_token_budget": BUDGET}):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning_content"):
                assert extra["reasoning"] == extra["reasoning_content"]
                reasoning.append(extra["reasoning_content"])
                order.append("r")
            if choice.delta.content:
                content.append(choice.delta.content)
                order.append("c")
    assert "".join(reasoning) == whole.model_extra["reasoning_content"]
    assert "".join(content) == whole.content
    assert order == sorted(order, key=lambda k: k != "r")  # every reasoning piece before the first answer piece


def test_without_a_budget_the_reasoning_runs_to_max_tokens(oai, server):
    """A model that never closes its reasoning spends every token on it: all of them are reasoning tokens, the
    content is empty, and the finish is length."""
    r = chat(oai, server[1], max_tokens=8)
    assert r.usage.completion_tokens_details.reasoning_tokens == 8 and r.choices[0].message.content == ""
    assert r.choices[0].finish_reason == "length"


def test_two_choices_reason_alike_and_apart(oai, server):
    """n=2 greedy choices, batched in the engine: both have the same reasoning and answer as one alone."""
    one = chat(oai, server[1], max_tokens=10, extra_body={"thinking_token_budget": 3}).choices[0].message
    two = chat(oai, server[1], max_tokens=10, n=2, extra_body={"thinking_token_budget": 3})
    for choice in two.choices:
        assert choice.message.model_extra["reasoning_content"] == one.model_extra["reasoning_content"]
        assert choice.message.content == one.content
    assert two.usage.completion_tokens_details.reasoning_tokens == 6


def test_thinking_off_renders_the_template_switch(oai, server):
    """reasoning_effort "none" sets the template's switch off: the prompt closes an empty reasoning section, so
    the model answers directly: no reasoning tokens, and the prompt is longer by the closed section's tokens."""
    on = chat(oai, server[1], max_tokens=4)
    off = chat(oai, server[1], max_tokens=4, reasoning_effort="none")
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    assert "reasoning_content" not in off.choices[0].message.model_extra
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    explicit = chat(oai, server[1], max_tokens=4, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert explicit.usage.prompt_tokens == off.usage.prompt_tokens and explicit.choices[0].message.content == \
        off.choices[0].message.content


def test_a_json_schema_constrains_the_answer_after_free_reasoning(oai, server):
    """With response_format json_schema the reasoning is free text (the same as without the schema) and the
    answer after the end marker is JSON that validates."""
    free = chat(oai, server[1], max_tokens=24, extra_body={"thinking_token_budget": BUDGET}).choices[0].message
    fmt = {"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA}}
    r = chat(oai, server[1], max_tokens=24, response_format=fmt, extra_body={"thinking_token_budget": BUDGET})
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == free.model_extra["reasoning_content"]
    jsonschema.validate(json.loads(message.content), SCHEMA)


def test_a_required_tool_call_follows_free_reasoning(oai, server):
    """tool_choice "required": the reasoning is free text, the call after it is a valid call of the tool."""
    tool = {"type": "function", "function": {"name": "check", "parameters": SCHEMA}}
    r = chat(oai, server[1], max_tokens=64, tools=[tool], tool_choice="required", parallel_tool_calls=False,
             extra_body={"thinking_token_budget": BUDGET})
    choice = r.choices[0]
    assert choice.message.model_extra["reasoning_content"]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "check"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_anthropic_thinking_block_then_text_with_a_signature_that_verifies(claude, server):
    """thinking enabled with budget_tokens: a thinking block (its text, this server's signature of it) then the
    text block; usage counts the thinking tokens; streamed, the same blocks arrive as thinking_delta events, a
    signature_delta just before the block closes, then text."""
    kw = dict(model=server[1], max_tokens=12, messages=QUESTION, thinking={"type": "enabled", "budget_tokens": BUDGET},
              extra_body={"temperature": 0})
    answer = claude.messages.create(**kw)
    thinking, text = answer.content
    assert thinking.type == "thinking" and thinking.thinking and text.type == "text"
    assert read_token(thinking.signature, server[1]) == thinking.thinking
    assert answer.usage.output_tokens_details.thinking_tokens == BUDGET and answer.usage.output_tokens == 12
    with claude.messages.stream(**kw) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        final = stream.get_final_message()
    assert final.content[0].thinking == thinking.thinking and final.content[0].signature == thinking.signature
    assert final.content[1].text == text.text
    deltas = [d for kind, d in kinds if kind == "content_block_delta"]
    assert deltas.index("signature_delta") > max(i for i, d in enumerate(deltas) if d == "thinking_delta")
    assert deltas.index("signature_delta") < deltas.index("text_delta")


def test_anthropic_omitted_thinking_travels_in_the_signature_and_comes_back(claude, server):
    """thinking.display "omitted" (Claude Code's default): the block's text is empty and its signature carries the
    reasoning; sent back in the next turn it is accepted, and a block whose text was changed under this server's
    signature is a 400 naming the signature."""
    answer = claude.messages.create(model=server[1], max_tokens=10, messages=QUESTION, extra_body={"temperature": 0},
                                    thinking={"type": "adaptive", "display": "omitted"})
    block = answer.content[0]
    assert block.type == "thinking" and block.thinking == "" and block.signature.startswith(PREFIX)
    assert read_token(block.signature, server[1])
    turns = QUESTION + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in answer.content]},
                        {"role": "user", "content": "And 3 + 3?"}]
    again = claude.messages.create(model=server[1], max_tokens=4, messages=turns, extra_body={"temperature": 0})
    assert again.stop_reason == "max_tokens"
    changed = json.loads(json.dumps(turns))
    changed[1]["content"][0]["thinking"] = "I was told to say 5."
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(model=server[1], max_tokens=4, messages=changed, extra_body={"temperature": 0})
    assert "messages[1].content[0].signature" in exc.value.message


def test_anthropic_thinking_disabled_answers_without_reasoning(claude, server):
    """thinking disabled: the template's switch off, no thinking block, no thinking tokens."""
    answer = claude.messages.create(model=server[1], max_tokens=4, messages=QUESTION, extra_body={"temperature": 0},
                                    thinking={"type": "disabled"})
    assert [b.type for b in answer.content] == ["text"]
    assert answer.usage.output_tokens_details.thinking_tokens == 0


def test_harmony_analysis_is_reasoning_and_final_is_the_answer():
    """gpt-oss (harmony channels): a prompt that opens an analysis message starts inside the reasoning; at the
    budget the engine closes it and opens the final channel, whose text is the answer."""
    opened = "<|start|>assistant<|channel|>analysis<|message|>"
    folder = variant(gpt_oss_dir(), "gpt-oss-analysis", "<|start|>assistant\n{%- endif -%}",
                     opened + "\n{%- endif -%}")
    try:
        with live_model_server(folder, dtype="float32", kv_cache_gb=0.05, block_size=8) as (base, _):
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
            r = client.chat.completions.create(model=folder.name, messages=QUESTION, temperature=0, max_tokens=16,
                                               logprobs=True, extra_body={"thinking_token_budget": BUDGET})
    finally:
        shutil.rmtree(folder.parent, ignore_errors=True)
    message = r.choices[0].message
    assert r.usage.completion_tokens_details.reasoning_tokens == BUDGET
    tokens = [e.token for e in r.choices[0].logprobs.content]
    assert "".join(tokens[:BUDGET]) == message.model_extra["reasoning_content"]
    forced = "<|end|><|start|>assistant<|channel|>final<|message|>"
    after = "".join(tokens[BUDGET:])
    assert after.startswith(forced), tokens
    assert message.content == after[len(forced):].replace("<|return|>", "").replace("<|end|>", "")


def test_speculation_gives_the_same_reasoning_and_answer(oai, server):
    """Prompt-lookup speculation (drafts verified in one pass) over a budgeted reasoning: the same reasoning,
    the same forced end, the same answer as plain decoding."""
    kw = dict(max_tokens=16, extra_body={"thinking_token_budget": BUDGET})
    plain = chat(oai, server[1], **kw).choices[0].message
    spec = chat(oai, server[1], max_tokens=16, extra_body={"thinking_token_budget": BUDGET, "speculative": {
        "method": "prompt_lookup", "num_draft_tokens": 4}}).choices[0].message
    assert spec.model_extra["reasoning_content"] == plain.model_extra["reasoning_content"]
    assert spec.content == plain.content


def test_prefill_and_decode_workers_give_the_single_node_answer(oai, server, claude):
    """On 1P1D (the prefill worker samples the first reasoning token, the decode worker resumes mid-reasoning),
    chat and Messages answers equal the single-node ones: reasoning, forced end, answer, counts."""
    from tests.cluster_helpers import running_cluster
    from tests.thinking_models import load

    kw = dict(max_tokens=12, extra_body={"thinking_token_budget": BUDGET})
    single = chat(oai, server[1], **kw)
    thinking = {"type": "enabled", "budget_tokens": BUDGET}
    single_msg = claude.messages.create(model=server[1], max_tokens=12, messages=QUESTION, thinking=thinking,
                                        extra_body={"temperature": 0})
    folder = Path(server[2])
    with running_cluster(1, 1, loaded=load(folder)) as (base, client, _):
        model = client.model_name
        pd = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        got = chat(pd, model, **kw)
        msg = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=120).messages.create(
            model=model, max_tokens=12, messages=QUESTION, thinking=thinking, extra_body={"temperature": 0})
        huge = chat(pd, model, max_tokens=6, extra_body={"thinking_token_budget": 2**64})  # past any int on the wire
    assert huge.usage.completion_tokens_details.reasoning_tokens == 6  # clamped to max_tokens: it never binds
    assert got.choices[0].message.model_extra["reasoning_content"] == \
        single.choices[0].message.model_extra["reasoning_content"]
    assert got.choices[0].message.content == single.choices[0].message.content
    assert got.usage.completion_tokens_details.reasoning_tokens == BUDGET
    assert [b.model_dump() for b in msg.content] == [b.model_dump() for b in single_msg.content]


def test_responses_reasoning_item_then_message_whole_and_streamed(oai, server):
    """Responses: a `reasoning` item (its text as a reasoning_text part, and with the include its
    encrypted_content) before the message; usage counts the reasoning tokens; streamed, the SDK's events build
    the same items (reasoning_text deltas, then the message's text)."""
    kw = dict(model=server[1], input="What is 2 + 2?", max_output_tokens=12, temperature=0,
              reasoning={"effort": "high"}, include=["reasoning.encrypted_content"],
              extra_body={"thinking_token_budget": BUDGET})
    whole = oai.responses.create(**kw)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text
    assert reasoning.encrypted_content and whole.usage.output_tokens_details.reasoning_tokens == BUDGET
    with oai.responses.stream(**kw) as stream:
        events = list(stream)  # cut by max_output_tokens: it ends with response.incomplete
    kinds = [e.type for e in events]
    final = events[-1].response
    assert kinds[-1] == "response.incomplete"
    assert "response.reasoning_text.delta" in kinds
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert final.output[0].content[0].text == reasoning.content[0].text
    assert final.output[1].content[0].text == message.content[0].text
    again = oai.responses.create(model=server[1], max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "What is 2 + 2?"},
        {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content},
        {"role": "assistant", "content": message.content[0].text},
        {"role": "user", "content": "And 3 + 3?"}])
    assert again.status == "incomplete"


def test_harmony_tools_and_a_call_turns_reasoning_render_through_gpt_oss_template():
    """gpt-oss (for which mlx-lm has no tool parser) renders its tools, an earlier call (`to=functions.NAME` on
    the commentary channel) and that turn's reasoning (its analysis message) with its own template, and its
    calls are read by the Hermes parser (the engine writes harmony calls in that form)."""
    import asyncio

    from router.openai.request import ChatCompletionRequest
    from router.params import prepare_chat
    from router.tokenizer import RouterTokenizer

    tok = RouterTokenizer.from_path(gpt_oss_dir())
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    req = ChatCompletionRequest.model_validate({"model": "m", "tools": [tool], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "I should look it up.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})
    prepared = asyncio.run(prepare_chat(req, tok, request_id="r", model="m", max_model_len=4096, arrival_time=0))
    assert prepared.tool_parser.name == "json_tools" and prepared.tool_parser.native
    text = prepared.prompt_text
    assert "namespace functions" in text and "type get_weather" in text and "<tool_call>" not in text
    assert "<|channel|>analysis<|message|>I should look it up.<|end|>" in text
    assert 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' in text


def test_responses_output_text_logprobs_are_the_answers_tokens_only(oai, server):
    """Responses logprobs describe the output_text: its own tokens, not the reasoning's nor the forced end
    marker's; whole and streamed alike."""
    kw = dict(model=server[1], input="What is 2 + 2?", max_output_tokens=14, temperature=0,
              include=["message.output_text.logprobs"], extra_body={"thinking_token_budget": BUDGET})
    whole = oai.responses.create(**kw)
    part = whole.output[1].content[0]
    assert len(part.logprobs) == 14 - BUDGET - 1 and "".join(p.token for p in part.logprobs) == part.text
    with oai.responses.stream(**kw) as stream:
        streamed = [p.token for e in stream if e.type == "response.output_text.delta" for p in e.logprobs]
    assert streamed == [p.token for p in part.logprobs]
