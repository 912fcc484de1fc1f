"""The reasoning state machine (cluster/reasoning.py) fed token by token, without a model: which tokens are
reasoning, answer or marker, the count, the forced end marker at the budget, a grammar's share of the tokens, the
draft rules; harmony's channels and its canonical tool calls; ReasoningParams' checks, wire form and
continuations."""

from __future__ import annotations

import json

import pytest

from cluster.protocol import from_wire, to_wire
from cluster.reasoning import Channel, ThinkState, ends_inside, harmony_ids, start_reasoning
from cluster.request import GenerateRequest, ReasoningParams, SamplingParams, continue_request

S, E = 900, 901  # one-token markers
START, END = (10, 11), (12, 13)  # two-token markers (as gemma4's `<|channel>thought` / `<channel|>`)


def think(start=(S,), end=(E,), inside=False, budget=None, constrained=False) -> ThinkState:
    return start_reasoning(ReasoningParams("think", tuple(start), tuple(end), inside, budget), constrained, None)


def feed_all(state, tokens):
    """[(channel, token)] of every piece the tokens release, in order."""
    return [(p.channel, p.token) for t in tokens for p in state.feed(t)]


R, A = Channel.REASONING, Channel.ANSWER


def test_single_token_markers_are_dropped_and_the_text_between_them_is_reasoning():
    state = think()
    assert feed_all(state, [5, S, 6, 7, E, 8]) == [(A, 5), (R, 6), (R, 7), (A, 8)]
    assert state.count == 2 and not state.inside


def test_a_prompt_that_ends_inside_reasoning_makes_the_first_tokens_reasoning():
    state = think(inside=True)
    assert feed_all(state, [6, E, 8]) == [(R, 6), (A, 8)] and state.count == 1


def test_a_multi_token_marker_is_held_until_it_completes_or_cannot():
    state = think(START, END, inside=True)
    assert state.feed(12) == []  # may begin the end marker: held
    assert state.count == 0
    assert feed_all(state, [5]) == [(R, 12), (R, 5)]  # it did not: both are reasoning
    assert feed_all(state, [12, 12, 13, 7]) == [(R, 12), (A, 7)]  # 12 12 13: the first 12 is content
    assert state.count == 3 and not state.inside
    # held tokens left at the end are released as what they were
    state = think(START, END)
    state.feed(10)
    assert [(p.channel, p.token) for p in state.finish()] == [(A, 10)]


def test_without_a_grammar_a_start_marker_opens_reasoning_again_in_the_answer():
    state = think(inside=True)
    assert feed_all(state, [1, E, 2, S, 3, E, 4]) == [(R, 1), (A, 2), (R, 3), (A, 4)]
    assert state.count == 2


def test_at_the_budget_the_end_marker_is_forced_and_the_count_stops_there():
    state = think(inside=True, budget=2)
    assert state.forced_token() is None
    state.feed(5)
    state.feed(6)
    assert state.forced_token() == E and state.count == 2
    state.feed(E)
    assert state.forced_token() is None and not state.inside and state.count == 2


def test_budget_zero_inside_forces_the_end_marker_as_the_first_tokens():
    state = think(START, END, inside=True, budget=0)
    assert state.forced_token() == 12
    state.feed(12)
    assert state.forced_token() == 13
    state.feed(13)
    assert state.forced_token() is None and not state.inside and state.count == 0


def test_a_held_part_of_the_end_marker_counts_and_only_the_rest_is_forced():
    state = think(START, END, inside=True, budget=2)
    state.feed(5)
    state.feed(12)  # the model began the end marker itself: 5 + a held 12 reach the budget
    assert state.forced_token() == 13
    state.feed(13)
    assert not state.inside and state.count == 1  # at most the budget: the held token was the marker


def test_a_section_opened_after_the_budget_is_spent_is_closed_at_once():
    state = think(inside=True, budget=1)
    for token in (5, E, 6, S):
        state.feed(token)
    assert state.inside and state.forced_token() == E and state.count == 1


def test_with_a_grammar_only_answer_tokens_reach_it_and_the_answer_never_reopens_reasoning():
    state = think(START, END, constrained=True)
    # the first token may open reasoning: the grammar's tokens plus the start marker's first token
    assert state.grammar_applies() and state.also_allowed() == (10,)
    assert not state.grammar_consumes(10) and state.grammar_consumes(5)
    state.feed(10)
    assert state.forced_token() == 11 and not state.grammar_consumes(11)  # the rest of the marker is forced
    state.feed(11)
    assert state.inside and not state.grammar_applies() and not state.grammar_consumes(5)
    for token in (5, 12, 13):
        state.feed(token)
    assert state.grammar_applies() and state.also_allowed() == () and state.grammar_consumes(10)
    assert feed_all(state, [10, 11, 6]) == [(A, 10), (A, 11), (A, 6)]  # a start marker in the answer is answer


def test_draft_rules_no_drafts_while_forced_or_before_a_grammar_governs():
    state = think(inside=True, budget=3, constrained=True)
    assert state.draft_limit() == 0  # inside: the grammar's draft masks cannot follow the marker
    state = think(inside=True, budget=3)
    assert state.draft_limit() is None  # free: forced positions get their mask (forced_along)
    assert state.forced_along([5, 6, 7, E, 9]) == [None, None, None, E, None, None]
    assert state.count == 0 and state.inside  # the state itself did not move
    state = think(inside=True, budget=0)
    assert state.draft_limit() == 0
    state = think(constrained=True)
    state.feed(5)  # the answer began under the grammar
    assert state.draft_limit() is None and think(inside=True).forced_along([1, 2]) is None


def test_ends_inside_compares_the_last_start_and_end_markers_of_a_prompt():
    assert ends_inside([1, S, 2], (S,), (E,)) and not ends_inside([1, S, 2, E], (S,), (E,))
    assert ends_inside([S, E, 3, S], (S,), (E,)) and not ends_inside([1, 2], (S,), (E,))
    assert ends_inside([10, 11, 5], START, END) and not ends_inside([10, 11, 12, 13], START, END)


# -- harmony -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def harmony():
    """(tokenizer, ReasoningParams) of the gpt-oss fixture."""
    from tests.thinking_models import gpt_oss_dir, load

    tokenizer = load(gpt_oss_dir())[1]
    start_ids, end_ids = harmony_ids(tokenizer)
    return tokenizer, ReasoningParams("harmony", start_ids, end_ids)


def split_text(tokenizer, params, text, constrained=False):
    """Feed `text` tokenized through a harmony state and an OutputText; (answer, reasoning, state)."""
    from cluster.detokenizer import OutputText

    state = start_reasoning(params, constrained, tokenizer.decode)
    out = OutputText(tokenizer, (), reasoning=state)
    ids = tokenizer.encode(text, add_special_tokens=False)
    eos = {tokenizer.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")}
    answer, reasoning = "", ""
    for token in ids:
        delta = out.finish(token) if token in eos else out.add(token)
        answer, reasoning = answer + delta.text, reasoning + delta.reasoning
        if token in eos:
            break
    else:
        delta = out.finish()
        answer, reasoning = answer + delta.text, reasoning + delta.reasoning
    return answer, reasoning, state


def test_harmony_analysis_is_reasoning_and_final_is_the_answer_headers_excluded(harmony):
    tokenizer, params = harmony
    answer, reasoning, state = split_text(tokenizer, params, "<|channel|>analysis<|message|>Add two and two."
                                          "<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>")
    assert reasoning == "Add two and two." and answer == "It is 4."
    assert state.count == len(tokenizer.encode("Add two and two.", add_special_tokens=False))


def test_harmony_function_call_becomes_the_canonical_hermes_form(harmony):
    tokenizer, params = harmony
    text = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
    answer, reasoning, _ = split_text(tokenizer, params, text)
    assert reasoning == "Need weather."
    assert answer == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    body = answer.removeprefix("<tool_call>").removesuffix("</tool_call>")
    assert json.loads(body) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    # the recipient in the role part of the header (as the chat template writes earlier calls), then a preamble
    text = ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.f<|channel|>commentary "
            "json<|message|>{}<|call|>")
    answer, reasoning, _ = split_text(tokenizer, params, text)
    assert reasoning == "" and answer == 'Checking.<tool_call>{"name": "f", "arguments": {}}</tool_call>'


def test_a_harmony_call_cut_short_stays_unclosed(harmony):
    tokenizer, params = harmony
    text = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a":'
    answer, _, _ = split_text(tokenizer, params, text)
    assert answer == '<tool_call>{"name": "f", "arguments": {"a":'


def test_harmony_budget_forces_the_closing_sequence_into_the_final_channel(harmony):
    tokenizer, params = harmony
    state = start_reasoning(ReasoningParams("harmony", params.start_ids, params.end_ids, budget=2), True,
                            tokenizer.decode)
    for token in tokenizer.encode("<|channel|>analysis<|message|>", add_special_tokens=False):
        assert state.forced_token() is None
        state.feed(token)
    assert state.inside and not state.grammar_applies()
    state.feed(5)
    state.feed(6)
    forced = []
    while state.forced_token() is not None:
        forced.append(state.forced_token())
        state.feed(forced[-1])
    assert tuple(forced) == params.end_ids and state.count == 2
    assert state.grammar_applies() and state.grammar_consumes(7)  # the final channel: the grammar's answer


# -- ReasoningParams ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, message", [
    (dict(format="xml"), "format"),
    (dict(start_ids=()), "start_ids"),
    (dict(end_ids=(S,)), "differ"),
    (dict(budget=-1), "budget"),
    (dict(starts_inside=1), "starts_inside"),
    (dict(format="harmony"), "harmony needs the 7"),
])
def test_reasoning_params_refuse_bad_values_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        ReasoningParams(**{**dict(format="think", start_ids=(S,), end_ids=(E,)), **fields})


def test_reasoning_params_travel_inside_sampling_params_on_the_wire():
    sp = SamplingParams(max_tokens=5, reasoning=ReasoningParams("think", START, END, True, 7))
    assert from_wire(SamplingParams, to_wire(sp)) == sp
    assert from_wire(SamplingParams, to_wire(SamplingParams())).reasoning is None


def test_a_continuation_replays_the_streamed_tokens_into_reasoning_and_grammar():
    rp = ReasoningParams("think", (S,), (E,), True, 4)
    request = GenerateRequest("r", (1, 2, 3), SamplingParams(max_tokens=10, grammar="start: /x/", reasoning=rp))
    again = continue_request(request, [5, 6])
    assert again.prompt_token_ids == (1, 2, 3, 5, 6) and again.sampling.max_tokens == 8
    assert again.sampling.reasoning.num_generated == 2 and again.sampling.grammar_prefix == (5, 6)
    assert again.sampling.reasoning.starts_inside  # the original prompt's: the replay starts there
    twice = continue_request(again, [7])
    assert twice.sampling.reasoning.num_generated == 3 and twice.sampling.grammar_prefix == (5, 6, 7)
    assert continue_request(request, []) is request and continue_request(request, list(range(10))) is None
    with pytest.raises(ValueError, match="grammar_prefix"):
        SamplingParams(grammar="start: /x/", grammar_prefix=(5,), reasoning=rp)
