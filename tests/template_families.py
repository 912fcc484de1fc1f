"""The chat templates of current model families (tests/fixtures/templates/) and what the router should make of
them, for tests/test_family_templates.py.

Each `Family` names its fixture template (byte for byte as llama.cpp vendors it; see the fixtures' README.md),
the special tokens its real tokenizer has that the template writes or mlx-lm looks up (think markers, tool-call
markers, role headers), and the expectations:

    parser, native        the mlx-lm tool parser the router picks (router/tool_calls.py) and whether the template
                          renders the tools itself (False: the Hermes fallback of router/tool_prompt.py)
    inferred              what `mlx_lm.tokenizer_utils._infer_tool_parser` says of the tokenizer (None: it knows
                          no parser for the template's format)
    output, calls,        a model answer written in the family's own tool-call format, the calls the router's
    content               parser reads from it and the content left
    history_parses        the previous call the template writes into the prompt is read back by that parser
    keeps_reasoning       an assistant tool-call turn's reasoning after the last user message stays in the prompt
    reasoning, switch     what `router.reasoning.reasoning_support` finds: "think" or None, and the on/off variable
    on, off               how the generation prompt ends with thinking on (reasoning_effort "high") and off
                          ("none"); `on_inside`/`off_inside` whether the engine is told the prompt ends inside
                          reasoning (`ReasoningParams.starts_inside`, None: no reasoning parameters at all)

`tokenizer(family)` gives a RouterTokenizer over mlx-lm's `TokenizerWrapper` of SmolLM2's tokenizer (the default
model's) with the family's special tokens added and its template set: the same interface a served model's
tokenizer has, built in memory in a fraction of a second. Its BOS and EOS stay SmolLM2's (`<|im_start|>`,
`<|im_end|>`), so templates that write `bos_token`/`eos_token` write those.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

FIXTURES = Path(__file__).parent / "fixtures" / "templates"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CALL = ("get_weather", {"city": "Paris", "days": 2})
CALL_ID = "call_9f3b2c1d0e4a5b6c7d8e9f01"  # the router's own form, as clients send it back
REASONING = "The user wants the forecast, so I call the tool."
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": REASONING,
     "tool_calls": [{"id": CALL_ID, "type": "function",
                     "function": {"name": CALL[0], "arguments": json.dumps(CALL[1])}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": "18 C"},
]
QUESTION = HISTORY[:2]

HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
QWEN_CODER_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
                   "</parameter>\n</function>\n</tool_call>")
NEMOTRON_CALL = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]</TOOLCALL>'
PYTHONIC_CALL = '<|tool_call_start|>[get_weather(city="Paris", days=2)]<|tool_call_end|>'

GLM = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>", "</think>",
       "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>",
       "</tool_response>")
KIMI = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
MISTRAL = ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
           "[TOOL_CALLS]", "[ARGS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]")
QWEN = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
LFM = ("<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>", "<|tool_call_end|>",
       "<|tool_response_start|>", "<|tool_response_end|>")


@dataclass(frozen=True)
class Family:
    """One model family's template and what the router should make of it (module docstring)."""

    name: str
    template: str
    specials: tuple[str, ...]
    parser: str
    native: bool
    inferred: Optional[str]
    output: str
    calls: tuple[tuple[str, dict], ...]
    content: Optional[str]
    history_parses: bool
    keeps_reasoning: bool
    reasoning: Optional[str]
    switch: Optional[str]
    on: str
    off: str
    on_inside: Optional[bool]
    off_inside: Optional[bool]


FAMILIES = [
    Family("qwen3.5", "Qwen3.5-4B.jinja", QWEN,
           parser="qwen3_coder", native=True, inferred="qwen3_coder",
           output="I will look it up.\n\n" + QWEN_CODER_CALL, calls=(CALL,), content="I will look it up.",
           history_parses=True, keeps_reasoning=True, reasoning="think", switch="enable_thinking",
           on="<|im_start|>assistant\n<think>\n", off="<|im_start|>assistant\n<think>\n\n</think>\n\n",
           on_inside=True, off_inside=False),
    Family("glm-4.6", "GLM-4.6.jinja", GLM,
           parser="glm47", native=True, inferred="glm47",
           output=("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days"
                   "</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"), calls=(CALL,), content=None,
           history_parses=True, keeps_reasoning=True, reasoning="think", switch="enable_thinking",
           on="Weather in Paris?<|assistant|>", off="Weather in Paris?/nothink<|assistant|>\n<think></think>",
           on_inside=False, off_inside=False),
    Family("glm-4.7", "GLM-4.7-Flash.jinja", GLM,
           parser="glm47", native=True, inferred="glm47",
           output=("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
                   "<arg_value>2</arg_value></tool_call>"), calls=(CALL,), content=None,
           history_parses=True, keeps_reasoning=True, reasoning="think", switch="enable_thinking",
           on="<|assistant|><think>", off="<|assistant|></think>", on_inside=True, off_inside=False),
    Family("kimi-k2", "moonshotai-Kimi-K2.jinja", KIMI,
           parser="kimi_k2", native=True, inferred="kimi_k2",
           output=('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                   '{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|>'), calls=(CALL,),
           content=None, history_parses=True, keeps_reasoning=False, reasoning=None, switch=None,
           on="<|im_assistant|>assistant<|im_middle|>", off="<|im_assistant|>assistant<|im_middle|>",
           on_inside=None, off_inside=None),
    # the template writes the client's call id where Kimi's parser needs "functions.NAME:IDX", so a history call
    # with any other id does not read back
    Family("kimi-k2-thinking", "moonshotai-Kimi-K2-Thinking.jinja", KIMI + ("<think>", "</think>"),
           parser="kimi_k2", native=True, inferred="kimi_k2",
           output=('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                   '{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|>'), calls=(CALL,),
           content=None, history_parses=False, keeps_reasoning=True, reasoning="think", switch=None,
           on="<|im_assistant|>assistant<|im_middle|>", off="<|im_assistant|>assistant<|im_middle|>",
           on_inside=False, off_inside=False),
    Family("minimax-m2", "MiniMax-M2.jinja",
           ("]~!b[", "]~b]", "[e~[", "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"),
           parser="minimax_m2", native=True, inferred="minimax_m2",
           output=('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                   '<parameter name="days">2</parameter>\n</invoke>\n</minimax:tool_call>'), calls=(CALL,),
           content=None, history_parses=True, keeps_reasoning=True, reasoning="think", switch=None,
           on="]~b]ai\n<think>\n", off="]~b]ai\n<think>\n", on_inside=True, off_inside=True),
    Family("gemma-4", "google-gemma-4-31B-it.jinja",
           ("<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>", "<|tool>", "<tool|>", "<|tool_call>",
            "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>'),
           parser="gemma4", native=True, inferred="gemma4",
           output='<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>', calls=(CALL,),
           content=None, history_parses=True, keeps_reasoning=True, reasoning="think", switch="enable_thinking",
           on="<|turn>model\n", off="<|turn>model\n<|channel>thought\n<channel|>", on_inside=False,
           off_inside=False),
    # mlx-lm knows no [THINK] markers; the router finds them itself. No switch: the template's default system
    # prompt (left out when the client sends a system message) asks for [THINK]...[/THINK]; off = budget 0
    Family("ministral-3", "mistralai-Ministral-3-14B-Reasoning-2512.jinja", MISTRAL + ("[THINK]", "[/THINK]"),
           parser="mistral", native=True, inferred="mistral",
           output='[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}', calls=(CALL,), content=None,
           history_parses=True, keeps_reasoning=False, reasoning="think", switch=None,
           on="[INST]Weather in Paris?[/INST]", off="[INST]Weather in Paris?[/INST]", on_inside=False,
           off_inside=False),
    # the template takes call ids of 9 letters or digits only (the router maps the client's) and writes a history
    # call as NAME[CALL_ID]ID[ARGS]..., which the router reads without the id
    Family("mistral-small-3.2", "Mistral-Small-3.2-24B-Instruct-2506.jinja",
           MISTRAL + ("[CALL_ID]", "[TOOL_CONTENT]"),
           parser="mistral", native=True, inferred="mistral",
           output='[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}', calls=(CALL,), content=None,
           history_parses=True, keeps_reasoning=False, reasoning=None, switch=None,
           on="[INST]Weather in Paris?[/INST]", off="[INST]Weather in Paris?[/INST]", on_inside=None,
           off_inside=None),
    # llama.cpp vendors Unsloth's edit of the template, which renders no tools: the Hermes fallback
    Family("smollm3", "HuggingFaceTB-SmolLM3-3B.jinja", ("<think>", "</think>"),
           parser="json_tools", native=False, inferred=None,
           output=HERMES_CALL, calls=(CALL,), content=None,
           history_parses=True, keeps_reasoning=False, reasoning="think", switch="enable_thinking",
           on="Weather in Paris?<|im_end|>\n<|im_start|>assistant\n",
           off="Weather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n",
           on_inside=False, off_inside=False),
    # mlx-lm has no parser for <TOOLCALL>[...]</TOOLCALL>: the Hermes fallback, so the model's own format stays
    # content; the template switches thinking only by /think and /no_think in the messages, yet the router takes
    # the text "enable_thinking" in it (a namespace field) for the switch
    Family("nemotron-nano-v2", "NVIDIA-Nemotron-Nano-v2.jinja",
           ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<think>", "</think>", "<TOOLCALL>", "</TOOLCALL>",
            "<AVAILABLE_TOOLS>", "</AVAILABLE_TOOLS>", "<TOOL_RESPONSE>", "</TOOL_RESPONSE>"),
           parser="json_tools", native=False, inferred=None,
           output=NEMOTRON_CALL, calls=(), content=NEMOTRON_CALL,
           history_parses=True, keeps_reasoning=False, reasoning="think", switch="enable_thinking",
           on="<SPECIAL_11>Assistant\n<think>\n", off="<SPECIAL_11>Assistant\n<think>\n", on_inside=True,
           off_inside=True),
    Family("nemotron-3-nano", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", QWEN,
           parser="qwen3_coder", native=True, inferred="qwen3_coder",
           output="I will look it up.\n" + QWEN_CODER_CALL, calls=(CALL,), content="I will look it up.",
           history_parses=True, keeps_reasoning=True, reasoning="think", switch="enable_thinking",
           on="<|im_start|>assistant\n<think>\n", off="<|im_start|>assistant\n<think></think>",
           on_inside=True, off_inside=False),
    Family("granite-4.0", "ibm-granite-granite-4.0.jinja",
           ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>"),
           parser="json_tools", native=True, inferred="json_tools",
           output="Checking.\n" + HERMES_CALL, calls=(CALL,), content="Checking.",
           history_parses=True, keeps_reasoning=False, reasoning=None, switch=None,
           on="<|start_of_role|>assistant<|end_of_role|>", off="<|start_of_role|>assistant<|end_of_role|>",
           on_inside=None, off_inside=None),
    # the template drops an assistant turn's tool calls (LFM2 writes them into the content)
    Family("lfm2", "LFM2-8B-A1B.jinja", LFM,
           parser="pythonic", native=True, inferred="pythonic",
           output=PYTHONIC_CALL, calls=(CALL,), content=None,
           history_parses=False, keeps_reasoning=False, reasoning=None, switch=None,
           on="<|im_start|>assistant\n", off="<|im_start|>assistant\n", on_inside=None, off_inside=None),
    Family("lfm2.5", "LFM2.5-8B-A1B.jinja", ("<think>", "</think>") + LFM,
           parser="pythonic", native=True, inferred="pythonic",
           output=PYTHONIC_CALL, calls=(CALL,), content=None,
           history_parses=True, keeps_reasoning=True, reasoning="think", switch=None,
           on="<|im_start|>assistant\n", off="<|im_start|>assistant\n", on_inside=False, off_inside=False),
]
BY_NAME = {f.name: f for f in FAMILIES}


@functools.lru_cache(maxsize=1)
def _smollm2():
    from tests.thinking_models import _smollm2_tokenizer

    return _smollm2_tokenizer()


def tokenizer(family: Family):
    """The family's RouterTokenizer (module docstring), built once per session."""
    return _tokenizer(family.name)


@functools.lru_cache(maxsize=None)
def _tokenizer(name: str):
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

    from router.tokenizer import RouterTokenizer

    family = BY_NAME[name]
    hf = copy.deepcopy(_smollm2())
    hf.add_tokens(list(family.specials), special_tokens=True)
    hf.chat_template = (FIXTURES / family.template).read_text(encoding="utf-8")
    return RouterTokenizer(TokenizerWrapper(hf, BPEStreamingDetokenizer))
