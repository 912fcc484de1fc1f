"""Prefix-cache cases of shared/cases.md (P1, P2, P4, P5) on the real model, float32, greedy."""

from __future__ import annotations

import pytest

from tests.engine_helpers import greedy, make_engine, real_model, run

B = 32


def tokens(n: int, seed_text: str = "The quick brown fox jumps over the lazy dog while ") -> list[int]:
    _, tokenizer, _ = real_model()
    ids = tokenizer.encode(seed_text)
    return (ids * (n // len(ids) + 1))[:n]


def cold(prompt: list[int], n: int = 12) -> list[int]:
    return run(make_engine(enable_prefix_caching=False), [greedy("cold", prompt, n, ignore_eos=True)])["cold"].token_ids


@pytest.mark.parametrize("length", [3 * B, 3 * B + 7])
def test_same_prompt_twice_p1(length):
    prompt = tokens(length)
    engine = make_engine()
    first = run(engine, [greedy("1", prompt, 12, ignore_eos=True)])["1"]
    second = run(engine, [greedy("2", prompt, 12, ignore_eos=True)])["2"]
    assert second.token_ids == first.token_ids == cold(prompt)
    cached = second.final.num_cached_tokens
    assert cached == ((length - 1) // B) * B and cached <= length - 1
    assert first.final.num_cached_tokens == 0


@pytest.mark.parametrize("short", [2 * B, 2 * B + 5])
def test_strict_prefix_of_longer_prompt_p2(short):
    longer = tokens(4 * B + 3)
    prompt = longer[:short]
    engine = make_engine()
    run(engine, [greedy("long", longer, 4, ignore_eos=True)])
    res = run(engine, [greedy("short", prompt, 12, ignore_eos=True)])["short"]
    assert res.token_ids == cold(prompt)
    assert res.final.num_cached_tokens == ((short - 1) // B) * B
    assert res.token_ids[0] != longer[short] or cold(prompt)[0] == longer[short]


@pytest.mark.parametrize("shared", [1, B - 1, B, B + 1])
def test_shared_prefix_then_different_text_p4(shared):
    base = tokens(shared)
    a = base + tokens(40, "Alpha beta gamma delta epsilon ")
    b = base + tokens(40, "Zebras and giraffes walk across ")
    engine = make_engine()
    run(engine, [greedy("a", a, 4, ignore_eos=True)])
    res = run(engine, [greedy("b", b, 12, ignore_eos=True)])["b"]
    assert res.token_ids == cold(b)
    assert res.final.num_cached_tokens == (shared // B) * B


def test_eviction_counts_only_the_run_from_position_zero_p5():
    engine = make_engine(num_blocks=9)  # 8 usable blocks
    x = tokens(4 * B, "Remember the locker code and the blue door. ")
    run(engine, [greedy("x", x, 1)])
    for i in range(3):  # unrelated prompts push X's blocks out, head first (LRU)
        run(engine, [greedy(f"u{i}", tokens(2 * B, f"Unrelated text number {i} about rivers. "), 1)])
    res = run(engine, [greedy("x2", x, 12, ignore_eos=True)])["x2"]
    assert res.token_ids == cold(x)
    assert res.final.num_cached_tokens % B == 0 and res.final.num_cached_tokens <= 3 * B
    again = run(engine, [greedy("x3", x, 12, ignore_eos=True)])["x3"]
    assert again.token_ids == res.token_ids and again.final.num_cached_tokens == 3 * B
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


def test_cache_salt_separates_tenants():
    prompt = tokens(3 * B)
    engine = make_engine()
    run(engine, [greedy("a", prompt, 2)])
    from cluster.request import GenerateRequest, SamplingParams

    salted = GenerateRequest("b", tuple(prompt), SamplingParams(max_tokens=2, temperature=0), cache_salt="tenant-b")
    assert run(engine, [salted])["b"].final.num_cached_tokens == 0
