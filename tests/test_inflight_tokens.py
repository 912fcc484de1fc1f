"""The overlapped loop keeps a token sampled on the device out of a sequence's token ids until it is read back:
`Sequence.token_ids` only ever holds real token ids, the token in flight is counted in `num_inflight_tokens`,
and the counters that include it (`num_tokens`, `num_output_tokens`, `num_uncomputed`) schedule the sequence as
if the token were there. Checked on the random-weight model with requests that arrive while others decode, are
preempted for blocks, aborted with a token in flight, stopped by stop strings and stop ids and cut at
max_tokens: every token id ever written into a sequence is valid, and the outputs equal those of the engine that
reads every step back."""

from __future__ import annotations

from cluster.request import FinishReason, GenerateRequest, SamplingParams
from cluster.sequence import Sequence
from tests.engine_helpers import Result, fast_model, make_engine


class CheckedTokens(list):
    """A list of token ids that refuses, as it is written, anything but an int in [0, vocab)."""

    vocab = 0

    def _check(self, tokens) -> None:
        for t in tokens:
            assert type(t) is int and 0 <= t < self.vocab, f"not a token id: {t!r}"

    def append(self, token) -> None:
        self._check([token])
        super().append(token)

    def extend(self, tokens) -> None:
        tokens = list(tokens)
        self._check(tokens)
        super().extend(tokens)

    def insert(self, index, token) -> None:
        self._check([token])
        super().insert(index, token)

    def __iadd__(self, tokens):
        self.extend(tokens)
        return self

    def __setitem__(self, index, value) -> None:
        self._check(value if isinstance(index, slice) else [value])
        super().__setitem__(index, value)


def _requests(prompt: list[int]) -> list[GenerateRequest]:
    """Greedy and seeded requests of different lengths and stop rules over shifted prompts."""
    out = []
    for i in range(9):
        p = tuple((prompt * 3)[i:36 + 6 * i])
        kind = i % 3
        if kind == 0:  # cut at max_tokens
            sp = SamplingParams(max_tokens=18 + i, temperature=0, ignore_eos=True)
        elif kind == 1:  # a seeded sample, stopped by a stop string when its text has one
            sp = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=i, stop=("e",), ignore_eos=True)
        else:  # a stop token id that the greedy output may or may not reach
            sp = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=(prompt[3],), ignore_eos=True)
        out.append(GenerateRequest(f"r{i}", p, sp))
    return out


def _run(loaded, overlap: bool, aborts: dict[str, int], num_blocks: int = 10):
    """Run the requests (the last three arriving two steps late) on an engine of `num_blocks` - 1 usable
    16-token blocks (so sequences are preempted), aborting each request of `aborts` once it received that many
    tokens. Checks after every step that the live sequences hold valid token ids only. Returns (results,
    events), where events counts the aborts and preemptions that found a token in flight and the steps that
    left tokens on the device."""
    engine = make_engine(loaded, async_scheduling=overlap, num_blocks=num_blocks, block_size=16)
    vocab = loaded[2].vocab_size
    CheckedTokens.vocab = vocab
    free = engine.pool.num_free_blocks
    requests = _requests(loaded[1].encode("Tell me a story about a lighthouse keeper and the storm at sea"))
    results = {r.request_id: Result() for r in requests}
    events = {"aborted_in_flight": 0, "preempted_in_flight": 0, "steps_in_flight": 0}
    preempt = engine.scheduler._preempt

    def preempting(seq: Sequence) -> None:
        events["preempted_in_flight"] += seq.num_inflight_tokens
        preempt(seq)

    engine.scheduler._preempt = preempting

    def add(request: GenerateRequest) -> None:
        assert engine.add_request(request) is None
        seq = engine.sequences[request.request_id]
        seq.token_ids = CheckedTokens(seq.token_ids)

    for r in requests[:6]:
        add(r)
    step = 0
    while engine.has_work() or step < 3:
        if step == 2:
            for r in requests[6:]:
                add(r)
        for out in engine.step():
            results[out.request_id].add(out)
        events["steps_in_flight"] += engine._inflight is not None
        for seq in engine.sequences.values():
            assert isinstance(seq.token_ids, CheckedTokens)
            assert all(type(t) is int and 0 <= t < vocab for t in seq.token_ids)
            assert seq.num_inflight_tokens in (0, 1)
            assert seq.num_tokens == len(seq.token_ids) + seq.num_inflight_tokens
            assert seq.num_output_tokens == len(seq.output_token_ids) + seq.num_inflight_tokens
        for rid, k in aborts.items():
            seq = engine.sequences.get(rid)
            if seq is not None and len(results[rid].token_ids) >= k:
                events["aborted_in_flight"] += seq.num_inflight_tokens
                results[rid].add(engine.abort(rid))
        step += 1
    assert engine.pool.num_free_blocks == free
    assert not engine.sequences
    return results, events


def test_token_ids_hold_real_tokens_only_and_outputs_equal_the_loop_that_reads_every_step_back():
    loaded = fast_model()
    aborts = {"r0": 4, "r3": 7, "r7": 3}
    serial, _ = _run(loaded, False, aborts)
    overlapped, events = _run(loaded, True, aborts)

    def seen(results):
        return {rid: (r.token_ids, r.text, r.final.finish_reason, r.final.num_output_tokens, r.final.stop_string)
                for rid, r in results.items()}

    assert seen(overlapped) == seen(serial)
    # the cases the loop must get right did happen, with a token in flight
    assert events["steps_in_flight"] > 10
    assert events["aborted_in_flight"] == len(aborts)
    assert events["preempted_in_flight"] >= 1
    reasons = [r.final.finish_reason for r in overlapped.values()]
    assert reasons.count(FinishReason.ABORT) == len(aborts)
    assert FinishReason.LENGTH in reasons
    assert any(r.final.stop_string == "e" for r in overlapped.values())
    for rid, r in overlapped.items():
        assert len(r.token_ids) == r.final.num_output_tokens, rid
