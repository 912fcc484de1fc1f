"""Harmony reasoning in the engine (gpt-oss's channels) on the random-weight gpt_oss fixture: a prompt that ends in
an analysis message, the budget's forced `<|end|><|start|>assistant<|channel|>final<|message|>`, the final
channel as the answer under a grammar, and a generation prompt whose output begins with a header. (The state
machine's reading of whole harmony outputs, tool calls included: test_reasoning_state.)"""

from __future__ import annotations

import functools
import json

import jsonschema
import llguidance

from cluster.reasoning import harmony_ids
from cluster.request import FinishReason, GenerateRequest, ReasoningParams, SamplingParams
from tests.engine_helpers import make_engine, run
from tests.thinking_models import gpt_oss_dir, load

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
COMPACT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


@functools.lru_cache(maxsize=1)
def gpt_oss():
    """(loaded, start_ids, end_ids) of the gpt_oss harmony fixture."""
    loaded = load(gpt_oss_dir())
    return (loaded, *harmony_ids(loaded[1]))


def prompt(in_analysis: bool = True) -> tuple[int, ...]:
    """The real gpt-oss template's prompt (ending `<|start|>assistant`), then `<|channel|>analysis<|message|>`."""
    tokenizer = gpt_oss()[0][1]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True)
    tail = tokenizer.encode("<|channel|>analysis<|message|>", add_special_tokens=False) if in_analysis else []
    return tuple(ids) + tuple(tail)


def request(rid: str, max_tokens: int, budget=None, inside=True, **kw) -> GenerateRequest:
    _, start_ids, end_ids = gpt_oss()
    rp = ReasoningParams("harmony", start_ids, end_ids, inside, budget)
    return GenerateRequest(rid, prompt(inside), SamplingParams(max_tokens=max_tokens, temperature=0, reasoning=rp,
                                                               **kw))


def engine():
    return make_engine(gpt_oss()[0], num_blocks=128, block_size=8)


def joined(result, field: str) -> str:
    return "".join(getattr(o, field) for o in result.outputs)


def test_the_budget_closes_the_analysis_and_opens_the_final_answer():
    _, _, end_ids = gpt_oss()
    tokenizer = gpt_oss()[0][1]
    free = GenerateRequest("f", prompt(), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    free_tokens = run(engine(), [free])["f"].token_ids
    r = run(engine(), [request("r", 20, budget=5, ignore_eos=True)])["r"]
    n = len(end_ids)
    assert r.token_ids[:5] == free_tokens and tuple(r.token_ids[5:5 + n]) == end_ids
    assert joined(r, "reasoning_text") == tokenizer.decode(r.token_ids[:5])
    assert r.text == tokenizer.decode(r.token_ids[5 + n:]) and r.text  # headers and specials excluded
    assert r.final.num_reasoning_tokens == 5


def test_a_grammar_constrains_the_final_channel_only():
    _, _, end_ids = gpt_oss()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=COMPACT)
    r = run(engine(), [request("r", 40, budget=3, grammar=grammar)])["r"]
    assert tuple(r.token_ids[3:3 + len(end_ids)]) == end_ids
    assert r.final.finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads(r.text), SCHEMA)


def test_output_that_begins_with_a_header_is_neither_reasoning_nor_answer_until_a_message_starts():
    """From `<|start|>assistant` the output is a header; a random model never writes `<|message|>`, so nothing it
    writes is text."""
    r = run(engine(), [request("r", 8, inside=False, ignore_eos=True)])["r"]
    assert len(r.token_ids) == 8 and r.text == "" and joined(r, "reasoning_text") == ""
    assert r.final.num_reasoning_tokens == 0
