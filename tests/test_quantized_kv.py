"""Quantized KV blocks on the real model: 8- and 4-bit, quantized from token 0.

What a quantized-KV request's output may depend on. The K/V of a token are computed in float and then
rounded to 4 or 8 bits. The float values depend, in their last bits, on the batch shape: a BLAS matmul rounds a
row differently depending on how many rows it has (OpenBLAS's x86_64 kernels do; which rows differ varies by
kernel, so by CPU). With float KV those last bits stay last bits. With quantized KV a value that lies near a
quantization step rounds to the neighbouring step, the next layers see a perturbation of the size of the
quantization error, and the logprobs move by about that much: up to about 1.5 nats with 4-bit KV (measured),
so a near-tie can flip to another token. So a quantized-KV request may produce different output depending on
which other requests share its steps and on whether its prefix came from the prefix cache. What holds and is
tested here: logprobs stay within a measured bound of the request computed alone, tokens differ only where
that run had a near-tie, the same batch gives bitwise the same output twice, and a cached block is reused
bitwise as it was computed.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from cluster.kv.hashing import block_hashes
from tests.engine_helpers import chat_prompt, greedy, make_engine, run

FACT = "Remember this: the locker code is 4826.\n\n"
FILLER = "The weather report said the sky was grey and the wind was calm over the quiet harbour town. "
QUESTION = "\n\nWhat is the locker code? Answer with the four digits."

# 37, 79 and 107 tokens: one, two and three full 32-token blocks
PROMPTS = {
    "a": "List four fruits and their colours.",
    "b": "Give three tips for learning to cook. " * 6,
    "c": "Describe a small harbour town at dawn, the boats, the gulls and the fish market. " * 4,
}
TOP = 5
# Bound on how far a logprob (the chosen token's, or an alternative both runs list) of a batched or
# prefix-reusing run may be from the same request run alone, in nats. Measured worst cases (8 prompts, batches of
# 2 and 8, prefix reuse, 10 tokens; OpenBLAS kernels Haswell (also what Zen CPUs get), SkylakeX, Sandybridge,
# Nehalem, and without OpenBLAS): 0.31 with 8-bit and 1.47 with 4-bit KV, both on Haswell; the others stay
# under 0.11 and 0.41. The bounds are about three times that. A planted bug (scales of two blocks swapped for one
# row of a batch, or in a cached prefix) moves a logprob by several nats and puts a token outside the top 5.
TOLERANCE = {8: 1.0, 4: 5.0}
# Bound on |quantized - float| for the first token's logprob of the sky prompt below, in nats (measured worst on
# SkylakeX, Sandybridge, Nehalem and without OpenBLAS: 0.02 with 8-bit, 0.38 with 4-bit KV).
QUANTIZATION_ERROR = {8: 0.25, 4: 1.5}


def assert_close_to_cold(cold, other, tol: float) -> int:
    """Compare `other` with the `cold` run token by token; returns the number of steps that agreed.

    While the tokens agree, the chosen token's logprob and every alternative both runs list are within `tol`.
    At the first token that differs, each run must rank the other's token within `tol` of its own choice (a
    near-tie rounded the other way); after that the two runs continue different texts and are not compared."""
    assert len(cold.logprobs) == len(other.logprobs) > 0
    for step, (c, o) in enumerate(zip(cold.logprobs, other.logprobs)):
        assert all(math.isfinite(v) for _, v in c.top + o.top)
        ctop, otop = dict(c.top), dict(o.top)
        for token in ctop.keys() & otop.keys():
            assert abs(ctop[token] - otop[token]) <= tol, (step, token, ctop[token], otop[token])
        if c.token_id != o.token_id:
            assert c.logprob - ctop.get(o.token_id, -math.inf) <= tol, (step, c.top, o.top)
            assert o.logprob - otop.get(c.token_id, -math.inf) <= tol, (step, c.top, o.top)
            return step
        assert abs(c.logprob - o.logprob) <= tol, (step, c.logprob, o.logprob)
    return len(cold.logprobs)


def requests(names, max_tokens=10):
    return [greedy(k, chat_prompt(PROMPTS[k]), max_tokens, logprobs=TOP, ignore_eos=True) for k in names]


@pytest.mark.parametrize("kv_bits", [8, 4])
def test_quantized_first_token_and_finite_logprobs(kv_bits):
    """8- and 4-bit KV (group size 64) rank the float run's first token for a short prompt among their top 3,
    with a logprob within the quantization bound of the float run's, and every logprob they report is finite.
    (Not the same token: which token wins a near-tie under 4-bit KV depends on the CPU's BLAS kernel.)"""
    prompt = chat_prompt("Explain why the sky is blue in two sentences.")
    req = greedy("r", prompt, 12, logprobs=3, ignore_eos=True)
    plain = run(make_engine(), [req])["r"]
    quant = run(make_engine(kv_bits=kv_bits, kv_group_size=64), [req])["r"]
    first = dict(quant.logprobs[0].top)
    assert plain.token_ids[0] in first
    assert abs(first[plain.token_ids[0]] - plain.logprobs[0].logprob) <= QUANTIZATION_ERROR[kv_bits]
    assert len(quant.logprobs) == 12 and all(math.isfinite(lp.logprob) and all(math.isfinite(v) for _, v in lp.top)
                                             for lp in quant.logprobs)


@pytest.mark.slow
@pytest.mark.parametrize("kv_bits,group_size", [(None, 64), (8, 64), (4, 32)])
def test_fact_recalled_after_3000_tokens_of_filler(kv_bits, group_size):
    """A fact stated in the first 50 tokens is recalled after ~2900 tokens of neutral filler.

    Documented limit: 4-bit KV with group size 64 recalled "4296" here (float attention over dequantized
    blocks); with group size 32 (one scale and bias per 32 values) it recalls "4826"."""
    prompt = chat_prompt(FACT + FILLER * 150 + QUESTION)
    assert len(prompt) > 2800
    engine = make_engine(kv_bits=kv_bits, kv_group_size=group_size, kv_cache_gb=0.5, enable_prefix_caching=False)
    res = run(engine, [greedy("r", prompt, 12, logprobs=0)])["r"]
    assert "4826" in res.text
    assert all(math.isfinite(lp.logprob) for lp in res.logprobs)


@pytest.mark.parametrize("kv_bits", [8, 4])
def test_quantized_batching_and_prefix_reuse_stay_close_to_runs_alone(kv_bits):
    """Three prompts prefilled and decoded in one batch, then again with their cached prefix blocks (two of
    them batched together, one alone), each compared with the same prompt run alone on an engine without prefix
    caching: logprobs within the bound, a different token only at a near-tie (see `assert_close_to_cold`)."""
    tol = TOLERANCE[kv_bits]
    cold = {k: run(make_engine(kv_bits=kv_bits, enable_prefix_caching=False), requests(k))[k] for k in PROMPTS}
    engine = make_engine(kv_bits=kv_bits)
    batched = run(engine, requests("abc"))
    reused = run(engine, requests("bc")) | run(engine, requests("a"))
    for k in PROMPTS:
        assert batched[k].final.num_cached_tokens == 0
        assert reused[k].final.num_cached_tokens == 32 * (len(chat_prompt(PROMPTS[k])) // 32)
        assert_close_to_cold(cold[k], batched[k], tol)
        assert_close_to_cold(cold[k], reused[k], tol)


def _key(res):
    return res.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in res.logprobs]


@pytest.mark.parametrize("kv_bits", [8, 4])
def test_quantized_output_repeats_exactly_for_the_same_batch(kv_bits):
    """The same three requests in the same batch give identical tokens and bitwise identical logprobs on a fresh
    engine and on one whose small pool was just used by other requests, so that they get other block ids and
    blocks still holding the old requests' KV."""
    config = dict(kv_bits=kv_bits, enable_prefix_caching=False, num_blocks=12)  # 11 usable; the three need 9
    fresh = run(make_engine(**config), requests("abc"))
    used = make_engine(**config)
    run(used, [greedy("x", chat_prompt("Name two rivers in Europe. " * 12), 40),
               greedy("y", chat_prompt("Write a haiku about the sea. " * 8), 40)])
    again = run(used, requests("abc"))
    for k in PROMPTS:
        assert _key(again[k]) == _key(fresh[k])


def _cached_block_bytes(engine, prompt):
    """The bytes of the prompt's cached full blocks, all layers, as `KVStore.read_blocks` returns them."""
    hashes = block_hashes(prompt, engine.block_size, engine.scheduler.extra_key(None))
    ids = engine.pool.find_cached_prefix(hashes, prompt, engine.block_size)
    assert len(ids) == len(prompt) // engine.block_size
    return engine.store.read_blocks(ids, range(engine.spec.num_layers))


@pytest.mark.parametrize("kv_bits", [8, 4])
def test_cached_quantized_blocks_are_reused_bitwise(kv_bits):
    """A prompt's quantized blocks hold the same bytes when computed alone on two engines (at different block
    ids), and a batch that reuses them from the prefix cache leaves them byte for byte as they were."""
    c = chat_prompt(PROMPTS["c"])
    first = make_engine(kv_bits=kv_bits)
    run(first, [greedy("c", c, 2)])
    expected = _cached_block_bytes(first, c)
    second = make_engine(kv_bits=kv_bits)
    # other blocks first, so c's land at other ids; salted, so c shares none of them (a prefix hit on the chat
    # template's system prompt would compute c's rest in other chunks, whose float sums may differ by a bit)
    run(second, [dataclasses.replace(r, cache_salt="filler") for r in requests("ab", 4)])
    run(second, [greedy("c", c, 2)])
    got = _cached_block_bytes(second, c)
    assert all(np.array_equal(x, y) for x, y in zip(expected, got))
    longer = chat_prompt(PROMPTS["c"] + "Then the rain began.")
    out = run(second, [greedy("l", longer, 3)] + requests("b", 3))
    assert out["l"].final.num_cached_tokens == expected[0].shape[1]
    assert all(np.array_equal(x, y) for x, y in zip(expected, _cached_block_bytes(second, c)))
