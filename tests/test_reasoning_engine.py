"""Reasoning in the engine, on the random-weight thinking models of tests/thinking_models.py: the split of each
output into reasoning and answer, the reasoning count, the end marker forced at the budget through the mask, a
grammar that constrains the answer only, stop strings on the answer only, and the same tokens whatever runs them:
batched or alone, continued after a worker died, speculated. (The prefill/decode handoff: test_reasoning_cluster.)

A random model never writes `</think>` by itself, so these tests drive the markers with budgets, logit_bias and
prompts that end inside reasoning, and compare with the model's free greedy output: before the budget nothing
constrains it, so the first tokens must be the free run's."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cluster.request import FinishReason, continue_request
from tests.engine_helpers import run
from tests.reasoning_helpers import (EOS, SCHEMA, decode, engine, free, grammar, joined, prompt, qwen3, reasoning,
                                     request)

def test_a_budget_gives_exactly_that_many_reasoning_tokens_then_the_end_marker_then_the_answer():
    _, _, end = qwen3()
    r = run(engine(), [request("r", 14, ignore_eos=True, reasoning=reasoning(budget=5))])["r"]
    assert tuple(r.token_ids[:5]) == free()[:5]  # nothing constrains the reasoning before the budget
    assert r.token_ids[5] == end and end not in r.token_ids[:5]
    assert [o.num_reasoning_tokens for o in r.outputs] == [1, 2, 3, 4, 5] + [5] * 9
    assert joined(r, "reasoning_text") == decode(r.token_ids[:5])
    assert r.text == decode(r.token_ids[6:]) and r.text  # the answer, without the marker
    assert r.final.finish_reason is FinishReason.LENGTH and len(r.token_ids) == 14  # max_tokens counts all


def test_without_a_budget_the_output_is_the_free_runs_and_all_of_it_reasoning():
    r = run(engine(), [request("r", 10, ignore_eos=True, reasoning=reasoning())])["r"]
    assert tuple(r.token_ids) == free()[:10]
    assert r.text == "" and joined(r, "reasoning_text") == decode(r.token_ids)
    assert r.final.num_reasoning_tokens == 10


def test_max_tokens_counts_reasoning_tokens_too():
    r = run(engine(), [request("r", 4, ignore_eos=True, reasoning=reasoning(budget=10))])["r"]
    assert len(r.token_ids) == 4 and r.final.finish_reason is FinishReason.LENGTH
    assert r.final.num_reasoning_tokens == 4 and r.text == ""


def test_the_forced_end_marker_is_the_only_token_allowed_even_against_a_bias_and_eos_then_ends_the_answer():
    _, _, end = qwen3()
    r = run(engine(), [request("r", 8, logit_bias=((EOS, 100.0),), reasoning=reasoning(budget=0))])["r"]
    assert r.token_ids == [end, EOS] and r.final.finish_reason is FinishReason.STOP
    assert r.final.num_reasoning_tokens == 0 and r.text == "" and joined(r, "reasoning_text") == ""
    # EOS inside reasoning ends the sequence as usual
    r = run(engine(), [request("e", 8, logit_bias=((EOS, 100.0),), reasoning=reasoning(budget=3))])["e"]
    assert r.token_ids == [EOS] and r.final.finish_reason is FinishReason.STOP and r.final.num_reasoning_tokens == 0


def test_a_model_that_opens_reasoning_itself_is_closed_at_the_budget_and_again_each_time_it_reopens():
    _, start, end = qwen3()
    r = run(engine(), [request("r", 9, prompt(inside=False), ignore_eos=True, logit_bias=((start, 100.0),),
                               reasoning=reasoning(budget=2, inside=False))])["r"]
    # opened, two reasoning tokens (the biased start token again, as content), closed; each reopening closed
    assert r.token_ids == [start, start, start, end, start, end, start, end, start]
    assert r.final.num_reasoning_tokens == 2


def test_a_grammar_constrains_the_answer_after_the_reasoning_and_not_the_reasoning():
    _, _, end = qwen3()
    r = run(engine(), [request("r", 40, grammar=grammar(), reasoning=reasoning(budget=6))])["r"]
    assert tuple(r.token_ids[:6]) == free()[:6]  # free tokens, not the grammar's
    assert r.token_ids[6] == end
    assert r.final.finish_reason is FinishReason.STOP  # the grammar completed
    jsonschema.validate(json.loads(r.text), SCHEMA)
    assert r.text == decode(r.token_ids[7:]) and r.final.num_reasoning_tokens == 6
    # the same grammar without reasoning constrains the first token already
    plain = run(engine(), [request("p", 40, grammar=grammar())])["p"]
    assert plain.text.startswith("{") and plain.token_ids[:6] != r.token_ids[:6]


def test_with_a_grammar_the_first_token_may_open_reasoning_and_the_answer_keeps_the_grammar():
    _, start, end = qwen3()
    bias = ((start, 100.0),)
    r = run(engine(), [request("r", 40, prompt(inside=False), grammar=grammar(), logit_bias=bias,
                               reasoning=reasoning(budget=2, inside=False))])["r"]
    assert r.token_ids[:4] == [start, start, start, end]  # opened (the mask allows the marker), 2 free, closed
    jsonschema.validate(json.loads(r.text), SCHEMA)  # the biased start token no longer passes the grammar
    assert start not in r.token_ids[4:] and r.final.num_reasoning_tokens == 2


def test_stop_strings_end_the_answer_but_never_the_reasoning():
    base = run(engine(), [request("b", 20, ignore_eos=True, reasoning=reasoning(budget=8))])["b"]
    thought, answer = joined(base, "reasoning_text"), base.text
    in_thought = next(thought[i:i + 3] for i in range(len(thought) - 3) if thought[i:i + 3] not in answer)
    r = run(engine(), [request("t", 20, ignore_eos=True, stop=(in_thought,), reasoning=reasoning(budget=8))])["t"]
    assert r.token_ids == base.token_ids and joined(r, "reasoning_text") == thought  # not stopped by reasoning
    cut = answer[len(answer) // 2:][:3]
    r = run(engine(), [request("a", 20, ignore_eos=True, stop=(cut,), reasoning=reasoning(budget=8))])["a"]
    assert r.final.finish_reason is FinishReason.STOP and r.final.stop_string == cut
    assert r.text == answer[:answer.find(cut)] and joined(r, "reasoning_text") == thought


def mixed_requests():
    """Reasoning requests of every kind beside a plain one, different lengths, one with a grammar."""
    return [request("b3", 12, ignore_eos=True, reasoning=reasoning(budget=3)),
            request("b0", 10, prompt("Name a fruit."), ignore_eos=True, reasoning=reasoning(budget=0)),
            request("free", 9, prompt("Say hello."), ignore_eos=True, reasoning=reasoning()),
            request("json", 40, prompt("Is it sunny?"), grammar=grammar(), reasoning=reasoning(budget=4)),
            request("plain", 11, prompt("Count to three.", inside=False), ignore_eos=True)]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlapped", "serial"])
def test_batched_requests_give_what_each_gives_alone(async_scheduling):
    batch = run(engine(async_scheduling=async_scheduling), mixed_requests())
    for r in mixed_requests():
        alone = run(engine(async_scheduling=async_scheduling), [r])[r.request_id]
        got = batch[r.request_id]
        assert got.token_ids == alone.token_ids, r.request_id
        assert (got.text, joined(got, "reasoning_text")) == (alone.text, joined(alone, "reasoning_text"))
        assert got.final.num_reasoning_tokens == alone.final.num_reasoning_tokens


@pytest.mark.parametrize("cut", [2, 3, 4, 7])
def test_a_continuation_after_some_tokens_goes_on_with_the_same_tokens_count_and_grammar(cut):
    """As the router re-runs a request whose worker died: prompt plus the tokens streamed so far. Cut inside the
    reasoning, right at the forced marker, and inside the answer (4 reasoning tokens, the marker at index 4)."""
    whole = [request("r", 30, ignore_eos=True, reasoning=reasoning(budget=4)),
             request("j", 40, grammar=grammar(), reasoning=reasoning(budget=4))]
    for r in whole:
        full = run(engine(), [r])[r.request_id]
        again = continue_request(r, full.token_ids[:cut])
        rest = run(engine(), [again])[r.request_id]
        assert rest.token_ids == full.token_ids[cut:], r.request_id
        assert rest.final.num_reasoning_tokens == 4 and rest.final.finish_reason is full.final.finish_reason
        assert full.text.endswith(rest.text) and rest.text
    jsonschema.validate(json.loads(full.text), SCHEMA)  # the grammar's answer, resumed where the cut left it
