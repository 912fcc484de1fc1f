"""Shared pieces of the tool tests: a Hermes-style chat template (the json_tools format, as Qwen2.5's template
writes it, cut down), a RouterTokenizer over the real model with it, and small tools and conversations."""

from __future__ import annotations

import json

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def hermes_tokenizer():
    """A RouterTokenizer over the default model's tokenizer (a fresh copy) with HERMES_TEMPLATE."""
    from cluster.gguf_import import ensure_default_model
    from cluster.model import load_tokenizer
    from router.tokenizer import RouterTokenizer

    wrapper = load_tokenizer(ensure_default_model(progress=False))
    wrapper._tokenizer.chat_template = HERMES_TEMPLATE
    return RouterTokenizer(wrapper)


def call(call_id: str, name: str, arguments: dict) -> dict:
    """An assistant-message tool call as the openai client sends it (arguments as JSON text)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def weather_few_shot(city: str, cities=("Paris", "Rome")) -> list[dict]:
    """A conversation where the assistant answered each weather question with a get_weather call, ending with a
    question about `city`: greedy SmolLM2 goes on with a call for `city`."""
    messages = []
    for i, previous in enumerate(cities):
        messages.append({"role": "user", "content": f"What is the weather in {previous}?"})
        messages.append({"role": "assistant", "content": None,
                         "tool_calls": [call(f"call_{i}", "get_weather", {"city": previous})]})
    messages.append({"role": "user", "content": f"What is the weather in {city}?"})
    return messages
