"""Constrained decoding in the engine (cluster/grammar.py) on the real SmolLM2 model, greedy: grammar-masked
rows beside free rows in one batch, with speculative decoding, across a prefill/decode pair, and the ways a
constrained request ends (stop, length, error). One engine serves every single-node case."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import jsonschema
import llguidance
import pytest

from cluster.grammar import Grammars
from cluster.protocol import from_wire, to_wire
from cluster.request import FinishReason, GenerateRequest, SamplingParams
from cluster.topology import parse_topology
from decode_node.drafters import PromptLookupDrafter
from decode_node.speculative import DecodeSpeculator
from tests.cluster_helpers import topology_text
from tests.engine_helpers import chat_prompt, greedy, make_engine, real_model, run
from tests.speculation_helpers import run_checked

# the JSON layout the model writes by itself; no free whitespace, so the grammar is complete at the last brace
COMPACT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
# at most two spaces or newlines between tokens
BOUNDED_WHITESPACE = {"item_separator": ",", "key_separator": ":", "whitespace_pattern": r"[ \n]{0,2}"}


def obj(properties: dict, **extra) -> dict:
    """A closed JSON object schema requiring every property."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False,
            **extra}


def text(n: int) -> dict:
    return {"type": "string", "maxLength": n}


def integer(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


# (schema, compile options, question): each has a nested object or an array, and an enum
CASES = [
    (obj({"name": text(24), "age": integer(0, 120), "role": {"enum": ["admin", "user", "guest"]},
          "address": obj({"city": text(20), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}), COMPACT,
     "Give a JSON record for Alice, age 30, an admin living in Paris (zip 75001)."),
    (obj({"product": text(24), "currency": {"enum": ["USD", "EUR", "GBP"]},
          "colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "black"]}, "maxItems": 3},
          "size": obj({"w": integer(0, 999), "h": integer(0, 999)})}), COMPACT,
     "Describe a red and black chair priced in euros as JSON, with its size."),
    (obj({"answer": {"enum": ["yes", "no"]},
          "reasons": {"type": "array", "items": text(40), "minItems": 1, "maxItems": 2}}), BOUNDED_WHITESPACE,
     "Is the sky blue? Answer in JSON with reasons."),
    (obj({"city": text(12), "country": text(12), "population": obj({"millions": integer(0, 100)}),
          "landmarks": {"type": "array", "items": text(12), "maxItems": 1}}), COMPACT,
     "Tell me about Paris as JSON."),
]
FREE = ["What is 2+2?", "Name a fruit.", "Write a haiku about rain.", "Say hello."]


def constrained(i: int, max_tokens: int = 96, **kw) -> GenerateRequest:
    schema, options, question = CASES[i]
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    return greedy(f"c{i}", chat_prompt(f"{question} Use the keys {', '.join(schema['properties'])}."), max_tokens,
                  grammar=grammar, **kw)


def free(i: int) -> GenerateRequest:
    return greedy(f"f{i}", chat_prompt(FREE[i]), 12)


def speculative(request: GenerateRequest) -> GenerateRequest:
    return dataclasses.replace(request, sampling=dataclasses.replace(
        request.sampling, speculative_method="prompt_lookup", num_draft_tokens=4))


def assert_valid(result, i: int) -> None:
    assert result.final.finish_reason is FinishReason.STOP, (result.final, result.text)
    jsonschema.validate(json.loads(result.text), CASES[i][0])


@pytest.fixture(scope="module")
def engine():
    """The real model with a prompt-lookup speculator that only requests asking for it use."""
    engine = make_engine()
    engine.speculator = DecodeSpeculator({"prompt_lookup": PromptLookupDrafter()}, engine.config)
    return engine


@pytest.fixture(scope="module")
def mixed(engine):
    """Four constrained and four free requests run as one batch of eight."""
    requests = [constrained(0), free(0), constrained(1), free(1), constrained(2), free(2), constrained(3), free(3)]
    return run(engine, requests)


def test_constrained_rows_follow_their_schemas_and_free_rows_are_untouched_in_one_batch(engine, mixed):
    for i in range(len(CASES)):
        assert_valid(mixed[f"c{i}"], i)
        # a JSON object's grammar is complete at its last brace: the sequence stops there, with no EOS to sample
        assert mixed[f"c{i}"].text.endswith("}") and mixed[f"c{i}"].token_ids[-1] not in engine.scheduler.eos_ids
    alone = run(engine, [free(i) for i in range(len(FREE))])
    for i in range(len(FREE)):
        assert mixed[f"f{i}"].token_ids == alone[f"f{i}"].token_ids
    # the same requests without grammars write something else: the masks changed the constrained rows
    unconstrained = run(engine, [dataclasses.replace(constrained(0), sampling=SamplingParams(max_tokens=8,
                                                                                               temperature=0))])
    assert unconstrained["c0"].token_ids != mixed["c0"].token_ids[:8]
    assert engine.grammars.num_constrained >= 4 and engine.grammars.mask_seconds > 0


def test_speculative_rows_verify_drafts_against_the_grammar_and_match_plain_decoding(engine, mixed):
    """The batch of eight with prompt-lookup speculation on every row: each row's tokens are its plain greedy
    tokens, so constrained rows validate and free rows equal their output without constrained neighbours."""
    requests = [speculative(r) for i in range(len(CASES)) for r in (constrained(i), free(i))]
    draft_masks = engine.grammars.num_draft_mask_rows
    results = run_checked(engine, requests)
    proposed = accepted = 0
    for i in range(len(CASES)):
        result = results[f"c{i}"]
        assert result.token_ids == mixed[f"c{i}"].token_ids  # greedy speculation emits plain greedy's tokens
        assert_valid(result, i)
        proposed += result.seq.speculation.proposed_total
        accepted += result.seq.speculation.accepted_total
    for i in range(len(FREE)):
        assert results[f"f{i}"].token_ids == mixed[f"f{i}"].token_ids
    assert proposed > 0 and engine.grammars.num_draft_mask_rows > draft_masks
    print(f"\nconstrained rows: {accepted}/{proposed} prompt-lookup drafts accepted ({accepted / proposed:.0%})")


def test_the_draft_model_drafts_only_tokens_the_grammar_allows(engine):
    """A sampled constrained request drafting with the draft model: its q is the grammar-masked distribution,
    so no draft token is one the grammar refuses (before the grammar is complete), and the output is valid."""
    from decode_node.drafters import DraftModelDrafter
    from tests.speculation_helpers import draft_parts

    drafter = DraftModelDrafter(*draft_parts(), engine, cost_per_token=0.05)
    refused, propose = [], drafter.propose

    def checked_propose(seqs, num_tokens):
        drafts = propose(seqs, num_tokens)
        for seq, draft in zip(seqs, drafts):
            n = seq.grammar.valid_prefix(draft.tokens)
            after = seq.grammar.matcher.deep_copy()
            after.consume_tokens(list(draft.tokens[:n]))
            refused.extend(draft.tokens[n:] if not after.is_stopped() else ())
        return drafts

    drafter.propose = checked_propose
    engine.speculator = DecodeSpeculator({"prompt_lookup": PromptLookupDrafter(), "draft_model": drafter},
                                         engine.config)
    schema = obj({"answer": {"enum": ["yes", "no"]}, "confidence": integer(0, 9)})
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)
    request = GenerateRequest("s", tuple(chat_prompt("Is the sky blue? Answer in JSON.")), SamplingParams(
        max_tokens=24, temperature=0.7, seed=7, grammar=grammar, speculative_method="draft_model", num_draft_tokens=2))
    result = run_checked(engine, [request])["s"]
    assert result.final.finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads(result.text), schema)
    assert result.seq.speculation.proposed_total > 0 and refused == []


def test_prefill_decode_pair_samples_the_first_token_under_the_grammar_and_resumes_it(mixed):
    """A 1P1D cluster in this process (workers over tcp loopback, the router's client without HTTP) serving the
    batch of eight at once: the prefill worker samples each first token (under the grammar for constrained
    rows), the decode worker replays it into its matcher; every row's tokens are those of the single engine, so
    constrained rows validate and free rows equal their output without constrained neighbours."""
    from cluster.launch.workers import make_worker
    from router.cluster_client import ClusterEngineClient

    loaded = real_model()
    topology = parse_topology(topology_text(routing="local_prefill_max_tokens = 0"), name="structured-1p1d")
    workers = {w.name: make_worker(topology, w.name, loaded) for w in topology.workers}
    requests = [r for i in range(len(CASES)) for r in (constrained(i), free(i))]

    async def generate():
        client = ClusterEngineClient(topology, loaded[2].model_id, loaded[2].max_model_len, revision=loaded[2].revision)

        async def one(request):
            return [out async for out in client.generate(request)]
        try:
            assert await client.wait_ready(60), "a worker never answered"
            return dict(zip([r.request_id for r in requests], await asyncio.gather(*map(one, requests))))
        finally:
            await client.close()

    try:
        for w in workers.values():
            w.start()
        results = asyncio.run(generate())
    finally:
        for w in workers.values():
            w.stop()
    prefill, decode = workers["prefill-0"], workers["decode-0"]
    for rid, outputs in results.items():
        first = next(o.token_ids for o in outputs if o.token_ids)
        assert list(first) == mixed[rid].token_ids[:1], rid  # the prefill worker's token, then decode's
        assert [t for o in outputs for t in o.token_ids] == mixed[rid].token_ids, rid
        assert outputs[-1].finish_reason is mixed[rid].final.finish_reason
    for i in range(len(CASES)):
        jsonschema.validate(json.loads("".join(o.text for o in results[f"c{i}"])), CASES[i][0])
    assert prefill.engine.grammars.num_mask_rows == len(CASES)  # the first tokens' masks, on the prefill worker
    assert decode.engine.grammars.num_mask_rows == sum(len(mixed[f"c{i}"].token_ids) - 1 for i in range(len(CASES)))
    assert decode.stats().constrained_requests == len(CASES) and prefill.engine.grammars.mask_seconds > 0


def test_a_grammar_that_does_not_compile_fails_its_request_and_the_engine_serves_the_next(engine):
    bad = greedy("bad", chat_prompt("Say yes."), 8, grammar=llguidance.LLMatcher.grammar_from_lark("start: foo"))
    out = engine.add_request(bad)
    assert out.finished and out.finish_reason is FinishReason.ERROR and out.token_ids == ()
    assert "does not compile" in out.error and "foo" in out.error and "bad" not in engine.sequences
    after = run(engine, [greedy("next", chat_prompt("Say yes."), 3)])["next"]
    assert after.final.finish_reason is FinishReason.LENGTH and len(after.token_ids) == 3


def test_max_tokens_cuts_a_constrained_object_with_length(engine, mixed):
    result = run(engine, [constrained(0, max_tokens=6)])["c0"]
    assert result.final.finish_reason is FinishReason.LENGTH
    assert result.token_ids == mixed["c0"].token_ids[:6]
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.text)


def test_a_preempted_constrained_sequence_keeps_its_matcher_and_its_output(engine, mixed):
    engine.add_request(constrained(2))
    seq, out = engine.sequences["c2"], []
    while len(seq.token_ids) - seq.num_prompt_tokens < 8:
        out += engine.step()
    engine.scheduler._preempt(seq)  # blocks freed, counters at 0: prompt and output are recomputed
    while engine.has_work():
        out += engine.step()
    assert [t for o in out for t in o.token_ids] == mixed["c2"].token_ids
    assert out[-1].finish_reason is FinishReason.STOP and engine.scheduler.num_preemptions >= 1


def test_a_request_moved_after_streaming_resumes_its_grammar_from_the_tokens_so_far(engine, mixed):
    """A request the router moves to another decode worker carries the streamed tokens in its prompt and, for
    its grammar, as `grammar_prefix`: the new matcher replays them and the output goes on where it stopped."""
    whole = mixed["c1"].token_ids
    first = constrained(1)
    moved = dataclasses.replace(first, prompt_token_ids=first.prompt_token_ids + tuple(whole[:5]),
                                sampling=dataclasses.replace(first.sampling, max_tokens=96 - 5,
                                                             grammar_prefix=tuple(whole[:5])))
    rest = run(engine, [moved])["c1"]
    assert rest.token_ids == whole[5:] and rest.final.finish_reason is FinishReason.STOP
    # without the prefix the grammar starts over, and the token after the streamed ones is refused or differs
    restarted = dataclasses.replace(moved, sampling=dataclasses.replace(moved.sampling, grammar_prefix=()))
    assert run(engine, [restarted])["c1"].token_ids != whole[5:]
    # a prefix the grammar refuses fails the request at once, naming the cause
    refused = dataclasses.replace(moved, sampling=dataclasses.replace(moved.sampling, grammar_prefix=tuple(whole[1:5])))
    out = engine.add_request(refused)
    assert out.finish_reason is FinishReason.ERROR and "does not follow" in out.error


def test_every_eos_id_of_the_model_ends_a_matched_grammar():
    """A model whose EOS set has two ids (SmolLM2's <|im_end|> and <|endoftext|>): the tokenizer of the
    grammars knows both, and a grammar that may end is ended by the second one too (pushed by logit_bias,
    which cannot make the mask allow it earlier)."""
    model, tokenizer, spec = real_model()
    assert Grammars(tokenizer, spec.vocab_size, {2, 0}).tokenizer.eos_tokens == [0, 2]
    engine = make_engine((model, tokenizer, dataclasses.replace(spec, eos_token_ids=(2, 0))), kv_cache_gb=0.05)
    grammar = llguidance.LLMatcher.grammar_from_lark('start: "yes" " "*')
    result = run(engine, [greedy("eos", chat_prompt("Say yes."), 8, grammar=grammar, logit_bias=((0, 100.0),))])["eos"]
    assert result.final.finish_reason is FinishReason.STOP and result.token_ids[-1] == 0
    assert result.text == "yes"


def test_ignore_eos_with_a_grammar_is_refused_naming_both():
    with pytest.raises(ValueError, match="ignore_eos.*grammar"):
        SamplingParams(ignore_eos=True, grammar=llguidance.LLMatcher.grammar_from_lark('start: "a"'))


def test_the_grammar_travels_with_the_request_over_the_wire():
    request = constrained(2)
    assert from_wire(GenerateRequest, to_wire(request)) == request


def test_engine_stats_add_up_constrained_requests_of_decode_workers_and_mask_time_of_all():
    from cluster.engine_client import EngineStats
    from cluster.stats import WorkerStats

    stats = EngineStats.from_reports([  # the prefill worker's requests start again on the decode workers
        WorkerStats(role="prefill", kv_block_size=32, constrained_requests=3, grammar_mask_seconds=0.25),
        WorkerStats(role="decode", kv_block_size=32, constrained_requests=2, grammar_mask_seconds=1.5),
        WorkerStats(role="decode", kv_block_size=32, constrained_requests=1, grammar_mask_seconds=0.5)])
    assert stats.constrained_requests == 3 and stats.grammar_mask_seconds == pytest.approx(2.25)
