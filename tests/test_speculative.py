"""Speculative decoding on the real model: greedy output equals plain decoding token for token with both
drafters, at batch 1 and 4, on a second chat turn from the prefix cache, with quantized KV, after
preemption and after a KV hand-over; stops inside an accepted draft block end the sequence exactly there."""

from __future__ import annotations

import mlx.core as mx
import pytest

from cluster.connector import ExternalPrefix, NoConnector
from cluster.kv.layout import BatchLayout
from cluster.kv.store import KVStore
from cluster.request import FinishReason, GenerateRequest, SamplingParams
from cluster.runner import BatchItem, Logits, ModelRunner
from decode_node.drafters import check_same_tokenizer
from tests.engine_helpers import chat_prompt, make_engine, real_model, run
from tests.speculation_helpers import (DRAFTERS, REPEAT, REWRITE, draft_parts, plain, prompts, run_checked,
                                       speculative_engine, speculative_greedy)


class PromptComputedElsewhere(NoConnector):
    """A role that already holds these requests' prompt KV (under their ids) and their first tokens, as a
    decode worker holds what a prefill worker sent."""

    def __init__(self, first_tokens: dict[str, int]):
        self.first_tokens = first_tokens

    def external_prefix(self, seq):
        first = self.first_tokens.get(seq.request_id)
        return None if first is None else ExternalPrefix(first)


def assert_same(spec, ref) -> None:
    assert spec.token_ids == ref.token_ids
    assert spec.text == ref.text
    assert spec.final.finish_reason == ref.final.finish_reason
    assert spec.final.num_output_tokens == len(spec.token_ids)


def drafted(engine) -> None:
    assert engine.speculator.num_draft_tokens > 0 and engine.speculator.num_accepted_tokens > 0, "speculation never ran"


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("method", DRAFTERS)
def test_greedy_equals_plain_at_batch_1(method, k):
    prompt = chat_prompt(REWRITE)
    ref = plain([prompt], 32)[0]
    engine = speculative_engine()
    got = run_checked(engine, [speculative_greedy("a", prompt, 32, method, k)])["a"]
    assert_same(got, ref)
    drafted(engine)
    assert max(n for n, _ in got.steps) > 1  # some steps emitted several tokens
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


@pytest.mark.parametrize("method", DRAFTERS)
def test_greedy_equals_plain_at_batch_4_with_per_sequence_lengths(method):
    """Four sequences in one batch, each with its own maximum draft length (2, 4, 8, 4) and acceptance."""
    ps = prompts(4)
    refs = plain(ps, 24)
    engine = speculative_engine()
    requests = [speculative_greedy(f"b{i}", p, 24, method, k) for i, (p, k) in enumerate(zip(ps, (2, 4, 8, 4)))]
    got = run_checked(engine, requests)
    for i, ref in enumerate(refs):
        assert_same(got[f"b{i}"], ref)
    drafted(engine)
    accepted = [got[f"b{i}"].seq.speculation.accepted_total for i in range(4)]
    assert len(set(accepted)) > 1  # each sequence accepts its own number of tokens


@pytest.mark.parametrize("method", DRAFTERS)
def test_second_chat_turn_from_the_prefix_cache(method):
    """Turn 2 = turn 1 + the reply + a new message: served from the prefix cache (the draft model reuses its
    own KV of the cached blocks too), equal to a cold plain run."""
    _, tokenizer, _ = real_model()
    messages = [{"role": "user", "content": REWRITE}]
    turn1 = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    engine = speculative_engine()
    first = run_checked(engine, [speculative_greedy("t1", turn1, 40, method, 4)])["t1"]
    assert_same(first, plain([turn1], 40)[0])
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": "Now repeat your answer word for word."}]
    turn2 = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    fed = []
    draft = engine.speculator.drafters["draft_model"]
    forward = draft.runner.forward
    draft.runner.forward = lambda items: fed.append(sum(len(it.token_ids) for it in items)) or forward(items)
    second = run_checked(engine, [speculative_greedy("t2", turn2, 40, method, 4)])["t2"]
    ref = plain([turn2], 40, config={"enable_prefix_caching": False})[0]
    assert_same(second, ref)
    assert second.final.num_cached_tokens >= len(turn1) // 32 * 32 > 0
    drafted(engine)
    if method == "draft_model":  # its first forward (the draft prefill) skipped blocks of the prefix cache
        assert fed[0] <= len(turn2) - second.final.num_cached_tokens


@pytest.mark.parametrize("method", DRAFTERS)
def test_stops_inside_accepted_blocks(method):
    """EOS, a stop string and max_tokens 1..8, all in one batch: outputs equal plain decoding (no token after
    the stop), finish reasons match, counts equal the tokens delivered and the logprob entries."""
    repeat, rewrite = chat_prompt(REPEAT), chat_prompt(REWRITE)
    eos_ref, full_ref = plain([repeat], 32, logprobs=1)[0], plain([rewrite], 40, logprobs=1)[0]
    assert eos_ref.final.finish_reason is FinishReason.STOP and len(eos_ref.token_ids) < 32
    stop = " next Tuesday"
    assert stop in full_ref.text
    requests = [speculative_greedy("eos", repeat, 32, method, 8, logprobs=1),
                speculative_greedy("stop", rewrite, 40, method, 8, logprobs=1, stop=(stop,))]
    requests += [speculative_greedy(f"m{m}", rewrite, m, method, 4, logprobs=1) for m in range(1, 9)]
    engine = speculative_engine()
    got = run_checked(engine, requests)
    assert_same(got["eos"], eos_ref)
    stopped = got["stop"]
    assert stopped.text == full_ref.text[:full_ref.text.index(stop)]
    assert stopped.final.finish_reason is FinishReason.STOP
    assert stopped.token_ids == full_ref.token_ids[:len(stopped.token_ids)]
    for m in range(1, 9):
        r = got[f"m{m}"]
        assert r.token_ids == full_ref.token_ids[:m] and r.final.finish_reason is FinishReason.LENGTH
    for r in got.values():
        assert len(r.token_ids) == r.final.num_output_tokens == len(r.logprobs) <= r.seq.max_tokens
        assert [lp.token_id for lp in r.logprobs] == r.token_ids
    drafted(engine)
    assert max(n for n, _ in got["m8"].steps) > 1  # the limit landed inside a multi-token block
    if method == "prompt_lookup":  # the stop token came inside an accepted block: later accepted ones dropped
        assert any(accepted + 1 > n for n, accepted in got["eos"].steps[-1:] + got["stop"].steps[-1:])


@pytest.mark.parametrize("method", DRAFTERS)
def test_penalties_and_logit_bias_see_the_drafts_before_them(method):
    """Greedy with repetition/frequency penalties and a logit bias: verification penalizes each draft row with
    the output plus the drafts before it, so the output still equals plain decoding."""
    prompt = chat_prompt(REPEAT)
    kw = dict(repetition_penalty=1.2, frequency_penalty=0.5, logit_bias=((578, 5.0),))
    ref = plain([prompt], 24, **kw)[0]
    engine = speculative_engine()
    got = run_checked(engine, [speculative_greedy("r", prompt, 24, method, 4, **kw)])["r"]
    assert_same(got, ref)
    drafted(engine)


@pytest.mark.parametrize("method", DRAFTERS)
def test_quantized_kv_with_prefix_caching(method):
    """8-bit KV and the prefix cache together: a shared system prompt, two requests one after the other."""
    _, tokenizer, _ = real_model()
    system = {"role": "system", "content": "You are a careful editor. Keep the user's wording where you can. " * 3}
    ps = [tokenizer.apply_chat_template([system, {"role": "user", "content": t}], add_generation_prompt=True)
          for t in (REWRITE, REPEAT)]
    refs = [plain([p], 24, config={"kv_bits": 8, "enable_prefix_caching": False})[0] for p in ps]
    engine = speculative_engine(kv_bits=8)
    first = run_checked(engine, [speculative_greedy("q0", ps[0], 24, method, 4)])["q0"]
    second = run_checked(engine, [speculative_greedy("q1", ps[1], 24, method, 4)])["q1"]
    assert_same(first, refs[0])
    assert_same(second, refs[1])
    assert second.final.num_cached_tokens > 0
    drafted(engine)


@pytest.mark.parametrize("method", DRAFTERS)
def test_preemption_with_speculation(method):
    """A pool too small for all sequences and their draft room: preempted sequences recompute (the draft's KV
    too) and every output equals plain decoding."""
    _, tokenizer, _ = real_model()
    ps = [tokenizer.encode(f"Story number {i}: once upon a time, once upon a time") for i in range(4)]
    refs = plain(ps, 40, ignore_eos=True)
    engine = speculative_engine(block_size=8, num_blocks=24)
    requests = [speculative_greedy(f"p{i}", p, 40, method, 4, ignore_eos=True) for i, p in enumerate(ps)]
    got = run_checked(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for i, ref in enumerate(refs):
        assert got[f"p{i}"].token_ids == ref.token_ids
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks
    drafted(engine)


def test_prefilled_sequence_gets_its_draft_prefill_here():
    """A sequence admitted with its prompt KV already in the pool (as from a prefill worker): the draft model
    computes the prompt's draft KV on this engine, in chunks, and the output equals plain decoding; the draft
    KV then equals a fresh draft-model prefill of the same tokens."""
    prompt = chat_prompt(REWRITE)
    ref = plain([prompt], 24)[0]
    engine = speculative_engine(prefill_chunk_size=16)
    table = list(engine.kv.reserve("h", engine.kv.lookup((), (), 0), -(-(len(prompt) + 1) // engine.block_size),
                                   len(prompt) + 1).block_table)
    logits = engine.runner.forward([BatchItem(table, 0, prompt, Logits.LAST)])[0]
    first = int(mx.argmax(logits).item())
    engine.connector = PromptComputedElsewhere({"h": first})
    request = speculative_greedy("h", prompt, 24, "draft_model", 4)
    assert engine.add_request(request, remote_prefill=True) is None
    seq = engine.sequences["h"]
    outputs = []
    while seq.speculation.proposed_total == 0:  # the draft prefill takes ceil(prompt / 16) steps, then it drafts
        outputs += engine.step()
    assert not seq.finished and 1 < len(outputs) <= -(-len(prompt) // 16)  # in chunks of at most 16
    assert [first] + [t for o in outputs for t in o.token_ids] == ref.token_ids[:seq.num_output_tokens]
    # the draft KV of positions [0, num_draft_computed) equals a fresh prefill of the same tokens
    model, _, spec = draft_parts()
    n = seq.num_draft_computed
    fresh = KVStore(spec, 8, 32)
    ModelRunner(model, fresh).forward([BatchItem([1, 2, 3, 4, 5, 6, 7], 0, seq.token_ids[:n], Logits.NONE)])
    ours = engine.speculator.drafters["draft_model"].store
    layout = BatchLayout.build([engine.kv.block_table(seq.request_id)], [0], [n], engine.block_size)
    mine = ours.keys[3][layout.gather_slots[0]]
    theirs = fresh.keys[3][BatchLayout.build([[1, 2, 3, 4, 5, 6, 7]], [0], [n], 32).gather_slots[0]]
    assert mx.allclose(mine, theirs, atol=1e-4).item()


@pytest.mark.parametrize("method", DRAFTERS)
def test_sampling_with_speculation_is_seeded_and_well_formed(method):
    prompt = chat_prompt(REWRITE)
    sp = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=5, logprobs=0, speculative_method=method,
                        num_draft_tokens=4)
    first = run_checked(speculative_engine(), [GenerateRequest("s", tuple(prompt), sp)])["s"]
    again = run_checked(speculative_engine(), [GenerateRequest("s", tuple(prompt), sp)])["s"]
    assert first.token_ids == again.token_ids and first.text == again.text
    assert len(first.token_ids) == first.final.num_output_tokens == len(first.logprobs)
    assert first.seq.speculation.proposed_total > 0


def test_requests_for_a_missing_drafter_are_refused_and_tokenizers_checked():
    engine = make_engine()
    with pytest.raises(ValueError, match="draft_model.*not available"):
        engine.add_request(speculative_greedy("x", [5, 6, 7], 4, "draft_model", 4))
    assert run(engine, [speculative_greedy("y", [5, 6, 7], 4, "draft_model", 0)])["y"].final.num_output_tokens == 4
    _, tokenizer, _ = real_model()

    class Other:
        def get_vocab(self):
            vocab = dict(tokenizer.get_vocab())
            vocab["<extra>"] = len(vocab)
            return vocab

    check_same_tokenizer(tokenizer, tokenizer)
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_same_tokenizer(tokenizer, Other())
