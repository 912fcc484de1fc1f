"""Speculative decoding of sequences with reasoning gives plain decoding's greedy tokens: a draft position where plain
decoding forces the end marker is verified under that forced token, and a grammar's draft masks start only once
the answer has begun. The drafters propose the model's own tokens, so drafts are accepted (a random model's output
never repeats, and prompt lookup would draft nothing)."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.request import GenerateRequest, SamplingParams
from cluster.speculation import Draft
from decode_node.speculative import DecodeSpeculator
from tests.engine_helpers import run
from tests.reasoning_helpers import engine, free, grammar, joined, prompt, qwen3, reasoning


class OwnTokensDrafter:
    """Drafts a fixed continuation of each request (by id), from the sequence's output length on; `wrong_last`
    makes the last token of each draft wrong, so every step also rejects one."""

    method = "prompt_lookup"
    cost_per_token = 0.0

    def __init__(self, continuations: dict[str, tuple[int, ...]], wrong_last: bool):
        self.continuations, self.wrong_last = continuations, wrong_last
        self.proposed: list[tuple[str, int, tuple[int, ...]]] = []

    def propose(self, seqs, num_tokens):
        out = []
        for seq, k in zip(seqs, num_tokens):
            n = seq.num_output_tokens
            draft = list(self.continuations[seq.request_id][n:n + k])
            if draft and self.wrong_last:
                draft[-1] = (draft[-1] + 1) % 49000
            self.proposed.append((seq.request_id, n, tuple(draft)))
            out.append(Draft(tuple(draft)))
        return out

    def release(self, seq) -> None:
        pass

    def reset(self) -> None:
        pass


def requests(k: int = 4):
    spec = dict(temperature=0, speculative_method="prompt_lookup", num_draft_tokens=k)
    return [GenerateRequest("b3", prompt(), SamplingParams(max_tokens=16, ignore_eos=True,
                                                           reasoning=reasoning(budget=3), **spec)),
            GenerateRequest("b0", prompt("Name a fruit."), SamplingParams(max_tokens=10, ignore_eos=True,
                                                                          reasoning=reasoning(budget=0), **spec)),
            GenerateRequest("json", prompt("Is it sunny?"), SamplingParams(max_tokens=40, grammar=grammar(),
                                                                           reasoning=reasoning(budget=3), **spec))]


def speculated(drafter) -> dict:
    core = engine()
    core.speculator = DecodeSpeculator({"prompt_lookup": drafter}, core.config)
    results = run(core, requests())
    assert core.speculator.num_accepted_tokens > 0
    return results


@pytest.fixture(scope="module")
def plain():
    """The same requests decoded without speculation."""
    unspeculated = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, speculative_method=None,
                                                                        num_draft_tokens=None)) for r in requests()]
    return run(engine(), unspeculated)


def assert_same(results, plain):
    for rid, want in plain.items():
        got = results[rid]
        assert got.token_ids == want.token_ids, rid
        assert (got.text, joined(got, "reasoning_text")) == (want.text, joined(want, "reasoning_text")), rid
        assert got.final.num_reasoning_tokens == want.final.num_reasoning_tokens, rid


def test_drafts_of_the_plain_output_are_accepted_across_the_forced_end_marker(plain):
    drafter = OwnTokensDrafter({rid: tuple(r.token_ids) for rid, r in plain.items()}, wrong_last=True)
    assert_same(speculated(drafter), plain)
    # a draft of b3 spanned the forced position (output index 3) and was verified there
    assert any(rid == "b3" and n <= 3 < n + len(d) for rid, n, d in drafter.proposed)


def test_drafts_that_skip_the_forced_end_marker_are_rejected_there(plain):
    """The drafts are the model's free continuation, which writes no end marker: at the forced position the
    verify step's mask allows the marker alone, so the free token is rejected and the marker emitted."""
    _, _, end = qwen3()
    free_run = {"b3": free(24), "b0": free(24, "Name a fruit."), "json": ()}
    drafter = OwnTokensDrafter(free_run, wrong_last=False)
    assert_same(speculated(drafter), plain)
    assert plain["b3"].token_ids[3] == end and free_run["b3"][3] != end
    assert any(rid == "b3" and n <= 3 < n + len(d) for rid, n, d in drafter.proposed)


def test_a_sequence_with_a_grammar_drafts_only_once_its_answer_has_begun(plain):
    drafter = OwnTokensDrafter({rid: tuple(r.token_ids) for rid, r in plain.items()}, wrong_last=True)
    speculated(drafter)
    answer_start = plain["json"].token_ids.index(qwen3()[2]) + 1  # after the end marker
    steps = [n for rid, n, d in drafter.proposed if rid == "json" and d]
    assert steps and min(steps) >= answer_start
