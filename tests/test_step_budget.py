"""The step's token budget (cluster/step_budget.py) and the decode-first schedule built on it: every decoding
sequence gets its token in every step while prompts are prefilled, the budget holds, chunks stay on block
boundaries, prompts of different lengths are grouped into forwards with bounded padding, and the running batch
follows the KV budget."""

from __future__ import annotations

import pytest

from cluster.config import EngineConfig
from cluster.runner import MAX_PADDING, pack_prefill
from cluster.kv.plan import AUTO_MAX_SEQS, AUTO_MIN_SEQS, auto_max_num_seqs
from cluster.step_budget import StepBudget
from tests.engine_helpers import fast_model, greedy, make_engine


def test_no_time_bound_when_no_stream_waits_and_one_block_before_any_prompt_step_is_timed():
    """With no stream waiting on the step the prompt gets the whole token budget; while streams decode but no
    step with prompt tokens has been timed yet, a long prompt gets one block, never the whole budget."""
    b = StepBudget(2048, 2048, 32)
    assert b.prefill_allowance(10) == 2038 and b.time_left(streaming=False) is None
    assert b.chunk(4000, 2038, 0, 0, None) == 2038 // 32 * 32
    b.observe(10, [], 0.05)  # the decode step is known, the chunk cost is not
    assert b.time_left(streaming=True) == 0.0
    assert b.chunk(4000, 2038, 0, 0, b.time_left(True)) == 32
    b.observe(10, [(0, 64)], 0.05 + 64 * 0.001)
    assert b.time_left(streaming=False) is None
    assert b.chunk(4000, 2048, 0, 0, b.time_left(False)) == 2048  # nothing streams: full chunks


def test_chunk_cost_fit_recovers_a_cost_that_grows_with_position():
    """Steps timed from a known cost (2 ms a chunk, 0.2 ms a token, 0.5 us per earlier position read once a
    chunk, 50 ns a token-position) at growing positions: the fit predicts unseen chunks within 2%, and the tokens that fit the ITL target shrink as the
    prompt's position grows, in whole blocks, at least one."""
    def cost(p, n):
        return 0.002 + 0.0002 * n + 0.5e-6 * p + 50e-9 * n * (p + n / 2)

    b = StepBudget(4096, 2048, 32, itl_target_s=0.1)
    b.observe(4, [], 0.05)
    for p, n in [(0, 256), (256, 64), (320, 32), (352, 512), (864, 128), (992, 96), (1088, 1024), (2112, 32),
                 (2144, 160), (2304, 64)]:
        b.observe(4, [(p, n)], 0.05 + cost(p, n))
    for p, n in [(0, 32), (4000, 64), (16000, 160), (500, 1000)]:
        assert b.chunk_seconds(p, n) == pytest.approx(cost(p, n), rel=0.02)
    left = b.time_left(streaming=True)
    assert left == pytest.approx(0.05)
    fits = [b.tokens_within(left, p, floor=True) for p in (0, 2000, 8000, 32000, 10**6)]
    assert fits == sorted(fits, reverse=True) and fits[0] > fits[2] and fits[-1] == 32
    assert all(n % 32 == 0 for n in fits)
    assert all(cost(p, n) <= left * 1.02 for p, n in zip((0, 2000, 8000), fits))  # at 32k one block is over
    assert b.tokens_within(left, 10**6, floor=False) == 0


def test_chunk_keeps_short_prompts_whole_and_cuts_long_ones_on_block_boundaries():
    b = StepBudget(2048, 2048, 32, long_prefill_threshold=256)
    assert b.whole_room(2000) == 256 and b.whole_room(150) == 150 and b.whole_room(-5) == 0
    assert b.chunk(20, 64, whole_room=256) == 20  # fits
    assert b.chunk(200, 64, whole_room=256) == 200  # short: whole past the time bound
    assert b.chunk(200, 64, whole_room=56) == 64  # short, but the step's short prompts took the threshold
    assert b.chunk(200, 64, whole_room=0) == 64  # a prompt already partly computed: the allowance
    assert b.chunk(300, 64, whole_room=256) == 64  # over the threshold: not short
    assert b.chunk(1500, 100, whole_room=256) == 96  # long: whole blocks of the allowance
    assert b.chunk(1500, 20, whole_room=256) == 0  # less than a block left: not this step
    assert b.chunk(1500, -40, whole_room=0) == 0  # a short prompt overran the allowance: nothing more
    assert b.chunk(5000, 4096, whole_room=256) == 2048  # never more than a chunk
    b.observe(4, [], 0.05)
    b.observe(4, [(0, 100)], 0.05 + 100 * 0.001)  # 1 ms a token
    assert b.chunk(1500, 2048, 0, 0, time_left=0.07) == 64  # 70 ms: two blocks
    assert b.chunk(1500, 2048, 0, 0, time_left=0.0) == 32  # the floor: one block
    assert b.chunk(1500, 2048, 0, 0, time_left=0.0, floor=False) == 0  # a later chunk of the step: none
    assert b.chunk(200, 2048, 256, 0, time_left=0.0, floor=False) == 200  # short: whole past the bound


def test_short_prompts_waiting_together_share_one_step_up_to_the_threshold():
    """Streams decode with one block of prompt tokens allowed beside them; five 60-token prompts arrive at
    once. Each step takes whole short prompts while their tokens add up to at most the threshold (four of
    them, 240 tokens), the fifth runs whole in the next step, every stream keeps its token in every step, and
    the greedy outputs equal each prompt's run alone."""
    loaded = fast_model()
    tok = loaded[1]
    engine = make_engine(loaded, itl_target_ms=0.001, max_num_batched_tokens=1024, long_prefill_token_threshold=256)
    steps = _recording(engine)
    for i in range(2):
        engine.add_request(greedy(f"s{i}", tok.encode(f"Stream {i} says hello"), 40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    text = tok.encode("Short questions about the sea and the sky, asked again and again. ") * 8
    prompts = {f"q{i}": text[i:60 + i] for i in range(5)}
    for rid, ids in prompts.items():
        engine.add_request(greedy(rid, ids, 6, ignore_eos=True))
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    admitted = [sorted(s.request_id for s, _ in batch.prefill)
                for decoding, _, batch in steps if batch is not None and batch.prefill and decoding]
    assert admitted[:2] == [["q0", "q1", "q2", "q3"], ["q4"]]
    for decoding, _, batch in steps:
        if batch is not None:
            assert decoding <= {s.request_id for s, _ in batch.decode}
            assert batch.num_prefill_tokens <= 256 or not decoding
    for rid, ids in prompts.items():
        alone = make_engine(loaded)
        alone.add_request(greedy(rid, ids, 6, ignore_eos=True))
        solo: list[int] = []
        while alone.has_work():
            for out in alone.step():
                solo.extend(out.token_ids)
        assert got[rid] == solo, rid


def test_auto_max_num_seqs_follows_the_pool():
    """One sequence per 256 pool tokens, within [16, 256]."""
    block = 1000  # bytes of one 32-token block
    assert auto_max_num_seqs(64 * 8 * block, block, 32) == 64
    assert auto_max_num_seqs(10 * block, block, 32) == AUTO_MIN_SEQS
    assert auto_max_num_seqs(10**12, block, 32) == AUTO_MAX_SEQS
    assert auto_max_num_seqs(64 * (8 * block + 500), block, 32, state_bytes=500) == 64


def test_default_engine_runs_at_least_64_sequences_where_the_pool_holds_them():
    engine = make_engine(fast_model(), kv_cache_gb=1.0)
    assert engine.config.max_num_seqs >= 64
    assert engine.config.max_num_batched_tokens >= engine.config.max_num_seqs + engine.config.block_size
    small = make_engine(fast_model(), num_blocks=40)
    assert small.config.max_num_seqs == AUTO_MIN_SEQS
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_engine(fast_model(), num_blocks=40, max_num_seqs=100, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="itl_target_ms"):
        EngineConfig(itl_target_ms=0)


class _Item:
    def __init__(self, n: int):
        self.token_ids = [0] * n


@pytest.mark.parametrize("lengths", [[2000, 100, 1500, 300, 800, 1200, 600, 1000], [500, 480, 520, 450], [32] * 5])
def test_packed_prefill_forwards_keep_padding_bounded(lengths):
    groups = pack_prefill([(f"r{i}", _Item(n)) for i, n in enumerate(lengths)])
    assert sorted(len(item.token_ids) for g in groups for _, item in g) == sorted(lengths)
    for g in groups:
        real = sum(len(item.token_ids) for _, item in g)
        assert len(g) * max(len(item.token_ids) for _, item in g) <= real * (1 + MAX_PADDING)
    exact = pack_prefill([(i, _Item(n)) for i, n in enumerate(lengths)], exact=True)
    assert all(len({len(item.token_ids) for _, item in g}) == 1 for g in exact)


def _recording(engine):
    """Wrap the scheduler so every scheduled batch is recorded with the sequences decoding before it (less
    those whose token still on the device is their last)."""
    steps = []
    schedule = engine.scheduler.schedule

    def wrapped(*args):
        decoding = {s.request_id for s in engine.scheduler.running
                    if not s.is_prefilling and s.num_output_tokens < s.max_tokens}
        prefilling = any(s.is_prefilling for s in engine.scheduler.running) or bool(engine.scheduler.waiting)
        batch = schedule(*args)
        steps.append((decoding, prefilling, batch))
        return batch

    engine.scheduler.schedule = wrapped
    return steps


def _streams_then_long(engine, tok, stream_tokens: int, warm_steps: int, long_tokens: int, long_max_tokens: int) -> None:
    """Start four greedy streams of `stream_tokens` tokens, step `warm_steps` times so they decode, then add a
    `long_tokens`-token prompt ("long") asking for `long_max_tokens` tokens."""
    for i in range(4):
        engine.add_request(greedy(f"s{i}", tok.encode(f"Stream {i} says hello"), stream_tokens, ignore_eos=True))
    for _ in range(warm_steps):
        engine.step()
    text = tok.encode("The long document goes on and on about many things. ")
    engine.add_request(greedy("long", (text * (long_tokens // len(text) + 1))[:long_tokens], long_max_tokens,
                              ignore_eos=True))


def test_decoding_sequences_are_never_skipped_while_a_long_prompt_is_prefilled():
    """Four streams decode; a 1,500-token prompt arrives. Every step runs every stream's token, the prompt
    advances by block-aligned chunks within the ITL-bounded allowance beside them, and the budget holds."""
    loaded = fast_model()
    tok = loaded[1]
    engine = make_engine(loaded, itl_target_ms=0.001, max_num_batched_tokens=512)  # one block per step
    steps = _recording(engine)
    _streams_then_long(engine, tok, 60, 6, 1500, 2)
    prefill_steps = 0
    while engine.has_work():
        engine.step()
    bs = engine.config.block_size
    for decoding, prefilling, batch in steps:
        assert batch is not None or not decoding
        if batch is None:  # the last step only reads back the tokens of the one before
            continue
        assert batch.num_decode_tokens + batch.num_prefill_tokens <= engine.config.max_num_batched_tokens
        assert decoding <= {s.request_id for s, _ in batch.decode}
        for seq, n in batch.prefill:
            if seq.request_id == "long" and decoding:
                prefill_steps += 1
                end = seq.num_computed_tokens  # after the step
                assert end % bs == 0 or end >= 1500, "a chunk ended inside a block"
                assert n <= bs or len(decoding) == 0  # the measured steps leave one block beside the streams
    assert prefill_steps >= 1500 // bs - 2  # the long prompt advanced beside the streams, a block at a time


def test_prompts_of_different_lengths_arriving_while_others_decode_equal_their_solo_runs():
    """Greedy, with prompt-lookup speculation on half of the requests: two streams decode, three prompts of 40,
    300 and 700 tokens arrive together, then one of 1,100 tokens, under a small token budget and ITL target (so
    prompts are cut into chunks beside decode steps and packed into forwards by length). Every answer equals the
    same request run alone without speculation, the steps mixed decode tokens and prompt chunks, drafts were
    verified, and the padding computed stayed within its bound."""
    from decode_node.drafters import PromptLookupDrafter
    from decode_node.speculative import DecodeSpeculator
    from tests.engine_helpers import Result

    loaded = fast_model()
    tok = loaded[1]
    text = tok.encode("The quick brown fox jumps over the lazy dog while the cat watches the birds. ")
    prompts = {"s0": text[:12], "s1": (text * 2)[:30], "a": (text * 4)[:40], "b": (text * 30)[:300],
               "c": (text * 60)[7:707], "d": (text * 90)[3:1103]}
    spec = {"s1", "b", "d"}

    def request(rid):
        kw = {"speculative_method": "prompt_lookup", "num_draft_tokens": 4} if rid in spec else {}
        return greedy(rid, prompts[rid], 24, ignore_eos=True, **kw)

    solo = {}
    for rid in prompts:
        engine = make_engine(loaded)
        engine.add_request(greedy(rid, prompts[rid], 24, ignore_eos=True))
        res = Result()
        while engine.has_work():
            for out in engine.step():
                res.add(out)
        solo[rid] = res.token_ids

    engine = make_engine(loaded, itl_target_ms=0.001, max_num_batched_tokens=384, prefill_chunk_size=256)
    engine.speculator = DecodeSpeculator({"prompt_lookup": PromptLookupDrafter()}, engine.config)
    steps = _recording(engine)
    results = {rid: Result() for rid in prompts}
    arrivals = {0: ["s0", "s1"], 3: ["a", "b", "c"], 6: ["d"]}
    for i in range(10_000):
        for rid in arrivals.get(i, ()):
            assert engine.add_request(request(rid)) is None
        if i > max(arrivals) and not engine.has_work():
            break
        for out in engine.step():
            results[out.request_id].add(out)
    for rid in prompts:
        assert results[rid].token_ids == solo[rid], rid
    mixed = [b for _, _, b in steps if b is not None and b.decode and b.prefill]
    assert len(mixed) >= 10
    assert engine.speculator.num_draft_tokens > 0
    runner = engine.runner
    assert runner.num_prefill_tokens >= sum(map(len, prompts.values())) - engine.scheduler.prefix_hits
    assert runner.num_padding_tokens <= runner.num_prefill_tokens * MAX_PADDING


def test_overlapped_loop_gives_what_reading_every_step_back_gives():
    """Tokens left on the device for a step (the overlapped loop) change nothing a client sees: greedy,
    seeded-temperature, stop-token, max_tokens and logprobs requests (the last read back every step) decode in
    one batch with the loop on and off; their tokens, finish reasons and counts are equal, the tokens computed
    past a stop are dropped, and every block is free again."""
    from cluster.request import GenerateRequest, SamplingParams

    loaded = fast_model()
    prompt = loaded[1].encode("Tell me a story about a lighthouse keeper and the storm")
    ref = make_engine(loaded, async_scheduling=False)
    ref.add_request(greedy("probe", prompt, 8, ignore_eos=True))
    probe = []
    while ref.has_work():
        probe += [t for out in ref.step() for t in out.token_ids]

    def requests():
        return [greedy("g", prompt, 12, ignore_eos=True),
                GenerateRequest("t", tuple(prompt), SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9,
                                                                   seed=7, ignore_eos=True)),
                greedy("stop", prompt, 12, ignore_eos=True, stop_token_ids=(probe[3],)),
                greedy("short", prompt[:9], 5, ignore_eos=True),
                greedy("lp", prompt[2:], 6, ignore_eos=True, logprobs=2)]

    results = {}
    for overlap in (False, True):
        engine = make_engine(loaded, async_scheduling=overlap)
        free = engine.pool.num_free_blocks
        got = {r.request_id: [] for r in requests()}
        finals = {}
        for r in requests():
            engine.add_request(r)
        while engine.has_work():
            for out in engine.step():
                got[out.request_id] += out.token_ids
                if out.finished:
                    finals[out.request_id] = (out.finish_reason, out.num_output_tokens)
        assert engine.pool.num_free_blocks == free
        results[overlap] = (got, finals)
    assert results[True] == results[False]
    got, finals = results[True]
    at = probe.index(probe[3]) + 1
    assert got["stop"] == probe[:at] and finals["stop"][1] == at < 12
    assert len(got["short"]) == 5 and len(got["g"]) == 12


def test_one_prompt_at_a_time_is_cut_into_chunks_so_prompts_finish_in_arrival_order():
    """Three 300-token prompts arrive at once at an engine with 64-token chunks and room for more in the
    budget: no step computes part of two prompts (the others wait instead of all advancing slowly), and their
    first tokens come out in arrival order."""
    loaded = fast_model()
    engine = make_engine(loaded, prefill_chunk_size=64)
    steps = _recording(engine)
    text = loaded[1].encode("A long prompt about rivers, mountains and the weather over the valley. ")
    for i in range(3):
        engine.add_request(greedy(f"p{i}", (text * 30)[i:300 + i], 2, ignore_eos=True))
    first, partial = [], []
    while engine.has_work():
        for out in engine.step():
            if out.token_ids and out.request_id not in first:
                first.append(out.request_id)
        batch = steps[-1][2]  # just run: a prompt still short of its end got a partial chunk
        partial.append(0 if batch is None else sum(s.num_computed_tokens < s.num_prompt_tokens for s, _ in batch.prefill))
    assert first == ["p0", "p1", "p2"]
    assert max(partial) == 1


class _Steps(list):
    """The fake clock's record of steps; `now` holds the clock's reading (a one-element list)."""


def _fake_clock(engine, decode_s: float, chunk_s: float, token_s: float, attend_s: float) -> list:
    """Drive `engine`'s step timer from a fake clock: a step costs `decode_s` when it decodes, plus for each
    prompt chunk of n tokens from position p `chunk_s + token_s * n + attend_s * n * (p + n / 2)` (a token's
    cost grows with its position, as attention's does). Returns the list that records, per executed step,
    (its fake seconds, the streams waiting on it: decoding or with a token still on the device)."""
    now = [0.0]
    steps = _Steps()
    execute = engine.runner.execute

    def timed(batch, *args, **kwargs):
        waiting = {s.request_id for s in engine.scheduler.running
                   if not s.is_prefilling and (s.num_output_tokens < s.max_tokens or s.num_inflight_tokens)}
        cost = decode_s if batch.decode else 0.0
        cost += sum(chunk_s + token_s * n + attend_s * n * (p + n / 2) for p, n in batch.prefill_spans)
        now[0] += cost
        steps.append((cost, waiting))
        return execute(batch, *args, **kwargs)

    engine.runner.execute = timed
    engine.clock = lambda: now[0]
    steps.now = now  # type: ignore[attr-defined]
    return steps


@pytest.mark.parametrize("stream_tokens", [400, 60])
def test_a_long_prompt_never_stretches_a_stream_gap_past_the_itl_target_whatever_its_position(stream_tokens):
    """A fake clock whose per-token prompt cost grows with the token's position (no timing of real work): four
    streams decode while a 4,000-token prompt prefills. Every step that a stream waits on (decoding, or with
    its last token still on the device in the overlapped loop) stays within the ITL target (twice the decode
    step), at the prompt's start and at 4k alike, and the prompt still finishes. With 60-token streams they end
    while the prompt is being computed: the step that reads back their last tokens is bounded too, and once
    nothing streams the rest of the prompt goes in full chunks."""
    loaded = fast_model()
    tok = loaded[1]
    engine = make_engine(loaded, kv_cache_gb=0.5, prefill_slowdown=None)  # the ITL target alone
    decode_s = 0.010
    steps = _fake_clock(engine, decode_s, chunk_s=0.0005, token_s=0.00005, attend_s=4e-8)
    _streams_then_long(engine, tok, stream_tokens, 8, 4000, 2)
    got: list[int] = []
    while engine.has_work():
        for out in engine.step():
            if out.request_id == "long":
                got.extend(out.token_ids)
    assert len(got) == 2
    waited = [cost for cost, waiting in steps[8:] if waiting]
    assert len(waited) >= 20
    assert max(waited) <= 2 * decode_s * 1.05, max(waited)
    if stream_tokens == 60:  # the rest ran with nothing streaming: whole chunks
        assert max(cost for cost, waiting in steps if not waiting) > 4 * decode_s


def test_a_long_prompt_beside_streams_finishes_within_its_slowdown_and_the_gaps_within_twice_the_target():
    """The same fake clock, with a prefill slowdown of 2: a 4,000-token prompt arrives while four streams
    decode. The ITL target's share of each step alone would take the prompt almost four times its time alone
    (one block a step beside each decode step); with the slowdown bound its chunks grow, so its TTFT stays
    within 2x (plus rounding) of its time alone, while no step that a stream waits on exceeds twice the ITL
    target."""
    loaded = fast_model()
    tok = loaded[1]
    engine = make_engine(loaded, kv_cache_gb=0.5, prefill_slowdown=2.0)
    decode_s, chunk_s, token_s, attend_s = 0.010, 0.0005, 0.00005, 4e-8
    steps = _fake_clock(engine, decode_s, chunk_s, token_s, attend_s)
    _streams_then_long(engine, tok, 2000, 8, 4000, 1)
    arrived, first = steps.now[0], None
    while first is None:
        for out in engine.step():
            if out.request_id == "long" and out.token_ids:
                first = steps.now[0]
    chunk = engine.config.prefill_chunk_size
    solo = sum(chunk_s + token_s * min(chunk, 4000 - p) + attend_s * min(chunk, 4000 - p) * (p + min(chunk, 4000 - p) / 2)
               for p in range(0, 4000, chunk))
    assert first - arrived <= 2.0 * solo * 1.1 + 4 * decode_s, (first - arrived, solo)
    waited = [cost for cost, waiting in steps[8:] if waiting]
    assert max(waited) <= 2 * (2 * decode_s) * 1.05, max(waited)
    assert max(waited) > 2 * decode_s * 1.05  # the streams' steps did stretch past the ITL target


def test_chunk_cost_fit_never_prices_a_long_chunk_like_one_block():
    """Every step so far was one block at a growing position, so chunks and context alone explain the times
    exactly; the fit must still charge per token, so a 2,048-token chunk is never predicted to fit where one
    block barely does."""
    b = StepBudget(4096, 2048, 32)
    b.observe(4, [], 0.010)
    for p in range(4000, 6000, 32):
        b.observe(4, [(p, 32)], 0.010 + 2e-6 * p)  # exactly the context read: nothing per token shows
    left = b.chunk_seconds(6000, 32) * 1.2
    assert b.tokens_within(left, 6000, floor=True) <= 64
    assert b.chunk_seconds(6000, 2048) > 10 * b.chunk_seconds(6000, 32)
