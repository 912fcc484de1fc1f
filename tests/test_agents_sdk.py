"""The OpenAI Agents SDK (`agents`) running a two-step tool loop against a real single-node server (real
SmolLM2, greedy), over Chat Completions and over the Responses API: the agent calls a `@function_tool`, gets
its result and answers in text.

A 135M model does not call tools reliably by itself, so the first turn forces the call
(`ModelSettings(tool_choice=<the function's name>)`, enforced by the server's grammar); the SDK then resets
tool_choice (`Agent.reset_tool_choice`, on by default) and runs the model again on the tool's result
(`tool_use_behavior="run_llm_again"`), which answers in text.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import agents
import jsonschema
import pytest
from agents import (Agent, ItemHelpers, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                    function_tool)
from openai import AsyncOpenAI

from tests.live_server import live_server

agents.set_tracing_disabled(True)  # before anything runs: the SDK's trace exporter would call an outside host

MODEL = "SmolLM2-135M-Instruct"
REPORT = "Sunny, 24 degrees"


@pytest.fixture(scope="module")
def server():
    with live_server(max_model_len=1024, max_num_seqs=4) as (base, _):
        yield base


def weather_agent(base: str, api: str, calls: list[str]) -> Agent:
    """An agent whose `get_weather` tool records each city it is called with; its model talks to `base` over
    `api` ("chat" or "responses"), its first turn forced to call get_weather."""

    @function_tool
    def get_weather(city: Literal["Paris", "London"]) -> str:
        """The current weather in a city.

        Args:
            city: The city.
        """
        calls.append(city)
        return f"{REPORT} in {city}"

    client = AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    model_cls = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    return Agent(name="weather", instructions="You tell the weather. Use the tool, then answer in one sentence.",
                 tools=[get_weather], model=model_cls(model=MODEL, openai_client=client),
                 tool_use_behavior="run_llm_again", reset_tool_choice=True,
                 model_settings=ModelSettings(tool_choice="get_weather", parallel_tool_calls=False, temperature=0,
                                              max_tokens=40))


async def run_agent(agent: Agent, streamed: bool):
    """Run the agent on one question, streamed (every stream event consumed) or not; the run's result."""
    question = "What is the weather in Paris?"
    if not streamed:
        return await Runner.run(agent, question, max_turns=4)
    result = Runner.run_streamed(agent, question, max_turns=4)
    async for _ in result.stream_events():
        pass
    return result


@pytest.mark.parametrize("api,streamed", [("chat", False), ("responses", True)])
def test_agent_calls_the_tool_then_answers(server, api, streamed):
    """Turn 1 calls get_weather with arguments valid for its schema; the SDK runs the function (really called,
    once, with a city of its enum) and turn 2 answers in text, which ends the run (over Chat Completions as
    `Runner.run` calls it, over the Responses API streamed as `Runner.run_streamed` consumes it)."""
    calls: list[str] = []
    agent = weather_agent(server, api, calls)
    result = asyncio.run(run_agent(agent, streamed))
    assert calls in (["Paris"], ["London"])
    [call] = [item for item in result.new_items if item.type == "tool_call_item"]
    [output] = [item for item in result.new_items if item.type == "tool_call_output_item"]
    tool = agent.tools[0]
    jsonschema.validate(json.loads(call.raw_item.arguments), tool.params_json_schema)
    assert output.output == f"{REPORT} in {calls[0]}"
    assert result.new_items[-1].type == "message_output_item"
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert ItemHelpers.text_message_output(result.new_items[-1]) == result.final_output
    first, second = result.raw_responses  # two model calls: the tool call, then the answer
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens  # + the tool's output
