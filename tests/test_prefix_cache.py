"""Prefix-cache cases on the real model, float32, greedy: the same prompt twice, a strict prefix of a longer
prompt, shared prefixes, eviction, a stop string, random prompts, a cached prefix extended across chunks, and
chats that share only the head of a block."""

from __future__ import annotations

import pytest

from cluster.kv.manager import MIN_PARTIAL_TOKENS
from tests.engine_helpers import chat_prompt, fast_model, greedy, make_engine, real_model, run

B = 32


def hit_of(common: int) -> int:
    """The tokens a prompt takes from the cache when its first `common` tokens (at most its length - 1) are
    cached: whole blocks, then the head of the next one if it covers at least MIN_PARTIAL_TOKENS."""
    whole = (common // B) * B
    return common if common - whole >= MIN_PARTIAL_TOKENS else whole


def tokens(n: int, seed_text: str = "The quick brown fox jumps over the lazy dog while ") -> list[int]:
    _, tokenizer, _ = real_model()
    ids = tokenizer.encode(seed_text)
    return (ids * (n // len(ids) + 1))[:n]


def cold(prompt: list[int], n: int = 12) -> list[int]:
    return run(make_engine(enable_prefix_caching=False), [greedy("cold", prompt, n, ignore_eos=True)])["cold"].token_ids


@pytest.mark.parametrize("length,cached", [(3 * B, 3 * B - 1), (3 * B + 7, 3 * B)])
def test_same_prompt_twice(length, cached):
    """All but the last token come from the cache where the blocks holding them are full (the last block's
    head is copied); a prompt ending in a block never filled takes only its whole blocks."""
    prompt = tokens(length)
    engine = make_engine()
    first = run(engine, [greedy("1", prompt, 12, ignore_eos=True)])["1"]
    second = run(engine, [greedy("2", prompt, 12, ignore_eos=True)])["2"]
    assert second.token_ids == first.token_ids == cold(prompt)
    assert second.final.num_cached_tokens == cached
    assert first.final.num_cached_tokens == 0


@pytest.mark.parametrize("short", [2 * B, 2 * B + 5])
def test_strict_prefix_of_longer_prompt_equals_cold(short):
    longer = tokens(4 * B + 3)
    prompt = longer[:short]
    engine = make_engine()
    run(engine, [greedy("long", longer, 4, ignore_eos=True)])
    res = run(engine, [greedy("short", prompt, 12, ignore_eos=True)])["short"]
    assert res.token_ids == cold(prompt)
    assert res.final.num_cached_tokens == hit_of(short - 1)
    assert res.token_ids[0] != longer[short] or cold(prompt)[0] == longer[short]


@pytest.mark.parametrize("shared", [1, B - 1, B, B + 1])
def test_shared_prefix_then_different_text(shared):
    """A shared prefix of 1, B-1, B or B+1 tokens, then different text: the answer equals cold, and
    `num_cached_tokens` is the KV actually reused: whole blocks, plus the shared head of the next block when it
    covers at least MIN_PARTIAL_TOKENS (B-1 shared tokens: B-1, where a cache of whole blocks only reuses and
    reports 0; B+1: B, its one extra token being recomputed)."""
    base = tokens(shared)
    a = base + tokens(40, "Alpha beta gamma delta epsilon ")
    b = base + tokens(40, "Zebras and giraffes walk across ")
    engine = make_engine()
    run(engine, [greedy("a", a, 4, ignore_eos=True)])
    res = run(engine, [greedy("b", b, 12, ignore_eos=True)])["b"]
    assert res.token_ids == cold(b)
    assert res.final.num_cached_tokens == hit_of(shared)


def test_eviction_counts_only_the_run_from_position_zero():
    engine = make_engine(num_blocks=9)  # 8 usable blocks
    x = tokens(4 * B, "Remember the locker code and the blue door. ")
    run(engine, [greedy("x", x, 1)])
    for i in range(3):  # unrelated prompts push X's blocks out, head first (LRU)
        run(engine, [greedy(f"u{i}", tokens(2 * B, f"Unrelated text number {i} about rivers. "), 1)])
    res = run(engine, [greedy("x2", x, 12, ignore_eos=True)])["x2"]
    assert res.token_ids == cold(x)
    assert res.final.num_cached_tokens % B == 0 and res.final.num_cached_tokens <= 3 * B
    again = run(engine, [greedy("x3", x, 12, ignore_eos=True)])["x3"]
    # every block of x is cached again: 3 whole ones and the head of the 4th (all but the last token)
    assert again.token_ids == res.token_ids and again.final.num_cached_tokens == 4 * B - 1
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


def test_cache_salt_separates_tenants():
    prompt = tokens(3 * B)
    engine = make_engine()
    run(engine, [greedy("a", prompt, 2)])
    from cluster.request import GenerateRequest, SamplingParams

    salted = GenerateRequest("b", tuple(prompt), SamplingParams(max_tokens=2, temperature=0), cache_salt="tenant-b")
    assert run(engine, [salted])["b"].final.num_cached_tokens == 0


def test_stop_string_then_shared_prefix():
    """A request that ended on a stop string leaves no block holding tokens past the stop; later requests
    sharing its prefix equal cold."""
    _, tokenizer, _ = real_model()
    prompt = tokens(2 * B + 3, "Write the numbers one by one: one, two, three, ")
    engine = make_engine()
    full = run(make_engine(enable_prefix_caching=False), [greedy("f", prompt, 40, ignore_eos=True)])["f"]
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 6]
    first = run(engine, [greedy("s", prompt, 40, ignore_eos=True, stop=(stop,))])["s"]
    assert first.final.finish_reason.value == "stop" and stop not in first.text
    delivered = prompt + first.token_ids
    for block in engine.pool.blocks:
        if block.block_hash is not None:  # every cached block holds only prompt or delivered tokens
            i = next(i for i in range(0, len(delivered), B) if tuple(delivered[i:i + B]) == block.token_ids)
            assert i + B <= len(delivered) - 1  # the last delivered token was never fed, so never cached
    follow = delivered + tokens(10, " and then the story continued ")
    res = run(engine, [greedy("n", follow, 12, ignore_eos=True)])["n"]
    assert res.token_ids == cold(follow) and res.final.num_cached_tokens > 0


def test_random_prompts_two_rounds_equal_cold():
    """16 prompts of random characters (mixed scripts) run twice through one engine with the prefix cache: both
    rounds equal cold runs without it, and the second round hits the cache. On the fast random-weight model
    (block hashing, cache hits and batching are the same code for every model): the real model's 16 x 512
    characters without OpenBLAS outlasted the per-test time limit on a loaded machine."""
    import random

    loaded = fast_model()
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz      .,;ÄéΩ東京"
    prompts = [loaded[1].encode("".join(rng.choice(alphabet) for _ in range(512))) for _ in range(16)]
    reqs = lambda tag: [greedy(f"{tag}{i}", p, 6) for i, p in enumerate(prompts)]  # noqa: E731
    colds = run(make_engine(loaded, enable_prefix_caching=False, max_num_seqs=16), reqs("c"))
    engine = make_engine(loaded, max_num_seqs=16, kv_cache_gb=1.0)  # room for both rounds' blocks
    for rnd in ("a", "b"):
        got = run(engine, reqs(rnd))
        assert [got[f"{rnd}{i}"].token_ids for i in range(16)] == [colds[f"c{i}"].token_ids for i in range(16)]
    assert sum(got[f"b{i}"].final.num_cached_tokens for i in range(16)) > 0


def test_cached_prefix_extended_across_chunk_boundaries():
    """With a 64-token chunk: a cached 59-token prefix extended by 3, 5
    (total exactly one chunk) and 64 tokens equals a run with one unlimited chunk."""
    base = tokens(59)
    for extra in (3, 5, 64):
        prompt = base + tokens(extra, "Extension words keep coming here ")
        engine = make_engine(prefill_chunk_size=64)
        run(engine, [greedy("p", base, 1)])
        got = run(engine, [greedy("x", prompt, 8, logprobs=0)])["x"]
        whole = run(make_engine(prefill_chunk_size=8192, enable_prefix_caching=False),
                    [greedy("w", prompt, 8, logprobs=0)])["w"]
        assert got.token_ids == whole.token_ids and got.final.num_cached_tokens == 32
        assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(got.logprobs, whole.logprobs))


def test_constant_hash_collisions_fall_back_to_misses(monkeypatch):
    """With every block hash forced equal, lookups compare token ids and miss; output equals cold."""
    import cluster.kv.hashing as hashing

    monkeypatch.setattr(hashing, "hash_block", lambda parent, token_ids: 42)
    engine = make_engine()
    a, b = tokens(3 * B + 1), tokens(3 * B + 1, "Completely different words about cats and dogs ")
    run(engine, [greedy("a", a, 2)])
    res = run(engine, [greedy("b", b, 12, ignore_eos=True)])["b"]
    assert res.final.num_cached_tokens == 0 and res.token_ids == cold(b)
    again = run(engine, [greedy("a2", a, 12, ignore_eos=True)])["a2"]
    assert again.token_ids == cold(a) and again.final.num_cached_tokens <= B


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_chats_sharing_only_a_system_prompt_reuse_the_head_of_its_block(kv_bits):
    """Two chats whose templates share a system prompt shorter than a block (no whole block in common): the
    second takes the shared tokens from the head of the first's cached block (copied into a block of its own,
    float or 8-bit KV) and answers as a cold run does; the first chat asked again still answers as before (its
    cached block was read, never written), and every block is free at the end."""
    a = chat_prompt("What is the capital of France? Answer in one word.")
    b = chat_prompt("Name three rivers that flow through Europe.")
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common % B >= MIN_PARTIAL_TOKENS and common < len(b) - 1  # the case: a head, not whole blocks
    engine = make_engine(kv_bits=kv_bits)
    first = run(engine, [greedy("a", a, 12, ignore_eos=True)])["a"]
    got = run(engine, [greedy("b", b, 12, ignore_eos=True)])["b"]
    reference = run(make_engine(kv_bits=kv_bits, enable_prefix_caching=False),
                    [greedy("ref", b, 12, ignore_eos=True)])["ref"]
    assert got.token_ids == reference.token_ids
    assert got.final.num_cached_tokens == hit_of(common) == common
    again = run(engine, [greedy("a2", a, 12, ignore_eos=True)])["a2"]
    assert again.token_ids == first.token_ids
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


def test_a_head_hit_waiting_for_blocks_gives_its_source_back():
    """A prompt whose head hit was found while too few blocks were free is not admitted until they are; the
    cached block held for the copy is let go each time (no block leaks), and the prompt, once admitted,
    answers as a cold run does."""
    engine = make_engine(num_blocks=8)  # 7 usable blocks
    head = tokens(2 * B + 4)  # two full blocks cached
    run(engine, [greedy("seed", head, 1)])
    # 4 blocks in all: beside the 2 cached ones, too few are left for the follower's 4 new ones until it ends
    long_running = greedy("long", tokens(3 * B, "Blocks are taken by a long prompt here. "), 20, ignore_eos=True)
    follower = greedy("f", head[:B + 16] + tokens(3 * B, "A follower prompt needs three blocks more "), 8,
                      ignore_eos=True, logprobs=0)
    got = run(engine, [long_running, follower])
    ref = run(make_engine(enable_prefix_caching=False),
              [greedy("r", follower.prompt_token_ids, 8, ignore_eos=True, logprobs=0)])["r"]
    # the logprobs too: this repetitive text's greedy tokens survive 16 wrong positions of KV, its logprobs not
    assert got["f"].token_ids == ref.token_ids
    assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(got["f"].logprobs, ref.logprobs))
    assert got["f"].final.num_cached_tokens == B + 16
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in engine.pool.blocks[1:])


def test_a_prompt_that_does_not_fit_leaves_the_pool_the_counters_and_itself_as_they_were():
    """While a prompt with a whole-block and a head hit waits for blocks, every step looks its hit up again and
    finds it does not fit: it holds no KV, pins none of the cached blocks (their reference counts stay 0), its
    own counters and hashes stay unset, and the prefix-cache counters do not move until it is admitted."""
    engine = make_engine(fast_model(), num_blocks=8)  # 7 usable blocks
    head = tokens(2 * B + 4)
    run(engine, [greedy("seed", head, 1)])
    cached = [b.block_id for b in engine.pool.blocks[1:] if b.block_hash is not None]
    engine.add_request(greedy("long", tokens(3 * B, "Blocks are taken by a long prompt here. "), 20, ignore_eos=True))
    engine.step()  # the long prompt is admitted and holds its blocks
    engine.add_request(greedy("f", head[:B + 16] + tokens(3 * B, "A follower prompt needs three blocks more "), 8,
                              ignore_eos=True))
    matcher = engine.scheduler.prefix
    counters = (matcher.queries, matcher.hits)
    waited = 0
    while engine.sequences["f"] in engine.scheduler.waiting:
        follower = engine.sequences["f"]
        assert not engine.kv.has("f") and (matcher.queries, matcher.hits) == counters
        assert (follower.num_computed_tokens, follower.num_cached_tokens, follower.block_hashes) == (0, 0, [])
        assert all(engine.pool.blocks[b].ref_cnt == 0 for b in cached if engine.pool.blocks[b].block_hash)
        engine.step()
        waited += 1
    assert waited > 1  # it did wait
    assert engine.sequences["f"].num_cached_tokens == B + 16 and matcher.hits == counters[1] + B + 16
