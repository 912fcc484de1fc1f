"""Batch-wide sampling (cluster/sampling.py) on random logits, no model: equal to the per-row reference
implementation below (the rule the engine sampled with one row at a time), reproducible per seed whatever the
batch neighbours, and drawing from exactly the distribution `probabilities` reports."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from cluster.request import SamplingParams
from cluster.sampling import adjusted, probabilities, sample, sample_tokens, token_logprobs

NEG_INF = -float("inf")


# -- the per-row reference: one row at a time, as sampling was written before it was batched ----------------

def ref_penalize(row, params, prompt, output):
    if params.logit_bias:
        ids = mx.array([t for t, _ in params.logit_bias if t < row.shape[0]], dtype=mx.int32)
        bias = mx.array([b for t, b in params.logit_bias if t < row.shape[0]], dtype=mx.float32)
        if ids.size:
            row = row.at[ids].add(bias)
    if params.repetition_penalty != 1.0:
        seen = sorted(set(prompt) | set(output))
        if seen:
            ids = mx.array(seen, dtype=mx.int32)
            vals = row[ids]
            row[ids] = mx.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output:
        counts = Counter(output)
        ids = mx.array(list(counts), dtype=mx.int32)
        cnt = mx.array(list(counts.values()), dtype=mx.float32)
        row = row.at[ids].add(-(params.presence_penalty + params.frequency_penalty * cnt))
    return row


def ref_filter(row, params):
    row = row / params.temperature
    neg_inf = mx.array(NEG_INF, dtype=row.dtype)
    if params.top_k and params.top_k < row.shape[0]:
        row = mx.where(row < mx.sort(row)[-params.top_k], neg_inf, row)
    if params.top_p < 1.0:
        order = mx.argsort(-row)
        probs = mx.softmax(row[order])
        keep_sorted = (mx.cumsum(probs) - probs) < params.top_p
        keep = mx.zeros(row.shape, dtype=mx.bool_).at[order].add(keep_sorted)
        row = mx.where(keep, row, neg_inf)
    if params.min_p > 0:
        probs = mx.softmax(row)
        row = mx.where(probs < params.min_p * probs.max(), neg_inf, row)
    return row


def ref_sample(logits, params, prompts, outputs, keys, masks=None):
    """Tokens and logprobs (token, logprob, top pairs) per row; `keys` advanced in place."""
    rows = []
    for b, p in enumerate(params):
        row = logits[b] if masks is None else mx.where(masks[b], logits[b], NEG_INF)
        if p.logit_bias or p.needs_penalties:
            row = ref_penalize(row, p, prompts[b], outputs[b])
        if p.greedy:
            rows.append(mx.argmax(row))
        else:
            keys[b], sub = mx.random.split(keys[b])
            rows.append(mx.random.categorical(ref_filter(row, p), key=sub))
    tokens = mx.stack(rows).tolist()
    logprobs = []
    for b, p in enumerate(params):
        if p.logprobs is None:
            logprobs.append(None)
            continue
        lp = logits[b] - mx.logsumexp(logits[b])
        top = ()
        if p.logprobs:
            top = tuple(zip(mx.argsort(-lp)[:p.logprobs].tolist(), mx.sort(lp)[::-1][:p.logprobs].tolist()))
        logprobs.append((tokens[b], lp[tokens[b]].item(), top))
    return tokens, logprobs


# -- helpers ---------------------------------------------------------------------------------------------------

def random_batch(batch: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    logits = mx.array(rng.normal(0, 3, (batch, vocab)).astype(np.float32))
    prompts = [rng.integers(0, vocab, 24).tolist() for _ in range(batch)]
    outputs = [rng.integers(0, vocab, 10).tolist() for _ in range(batch)]
    return logits, prompts, outputs


MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.2, top_k=5),
    SamplingParams(temperature=0.7, min_p=0.1),
    SamplingParams(temperature=0, repetition_penalty=1.3, logit_bias=((3, 5.0), (7, -2.0), (10**6, 1.0))),
    SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=-0.5),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5, logit_bias=((1, 100.0),)),
    SamplingParams(temperature=1.5, top_p=0.5, repetition_penalty=0.8),
    SamplingParams(temperature=0, logprobs=3),
    SamplingParams(temperature=0.6, top_k=1, logprobs=0),
    SamplingParams(temperature=1.1, top_p=0.95, logprobs=5, repetition_penalty=1.2, presence_penalty=-1.0),
]


def keys_for(params, base: int = 0):
    return [None if p.greedy else mx.random.key(base + b) for b, p in enumerate(params)]


def draws(logits_row: mx.array, params: SamplingParams, rows: int, steps: int) -> np.ndarray:
    """Token counts [V] of rows * steps draws from one row's logits, each batch row with its own key."""
    batch = mx.broadcast_to(logits_row, (rows, logits_row.shape[0]))
    keys = [mx.random.key(1000 + r) for r in range(rows)]
    counts = np.zeros(logits_row.shape[0], dtype=np.int64)
    for _ in range(steps):
        tokens, keys = sample_tokens(batch, [params] * rows, [()] * rows, [()] * rows, keys)
        mx.eval(tokens, *keys)
        counts += np.bincount(np.array(tokens), minlength=logits_row.shape[0])
    return counts


# -- tests -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_masks", [False, True])
def test_mixed_batch_equals_the_per_row_reference(with_masks):
    """A batch mixing greedy, temperature, top-k, top-p, min-p, logit_bias, penalties and logprobs rows gives
    the reference's tokens, keys and logprobs step after step, with and without grammar masks."""
    logits, prompts, outputs = random_batch(len(MIXED), 1000, seed=0)
    masks = mx.array(np.random.default_rng(1).random((len(MIXED), 1000)) < 0.6) if with_masks else None
    ref_keys, keys = keys_for(MIXED), keys_for(MIXED)
    for step in range(4):
        ref_tokens, ref_lps = ref_sample(logits, MIXED, prompts, outputs, ref_keys, masks)
        tokens, lps = sample(logits, MIXED, prompts, outputs, keys, masks)
        assert tokens == ref_tokens
        for got, want in zip(lps, ref_lps):
            assert (got is None) == (want is None)
            if got is not None:
                assert (got.token_id, [t for t, _ in got.top]) == (want[0], [t for t, _ in want[2]])
                assert np.allclose([got.logprob, *[v for _, v in got.top]], [want[1], *[v for _, v in want[2]]],
                                   atol=1e-5)
        for key, ref_key in zip(keys, ref_keys):
            assert (key is None and ref_key is None) or np.array_equal(np.array(key), np.array(ref_key))
        outputs = [out + [t] for out, t in zip(outputs, tokens)]


def test_greedy_rows_are_the_argmax_of_each_row():
    """All-greedy rows (plain, and with penalties or masks) are bit-identical to one argmax per row."""
    logits, prompts, outputs = random_batch(64, 4096, seed=2)
    plain = [SamplingParams(temperature=0)] * 64
    tokens, keys = sample_tokens(logits, plain, prompts, outputs, [None] * 64)
    assert tokens.dtype == mx.int32 and tokens.shape == (64,) and keys == [None] * 64
    assert tokens.tolist() == [mx.argmax(logits[b]).item() for b in range(64)]
    penalized = [SamplingParams(temperature=0, repetition_penalty=1.0 + b / 16, frequency_penalty=(b % 5) / 4)
                 for b in range(64)]
    masks = mx.array(np.random.default_rng(3).random((64, 4096)) < 0.5)
    tokens, _ = sample_tokens(logits, penalized, prompts, outputs, [None] * 64, masks)
    assert tokens.tolist() == ref_sample(logits, penalized, prompts, outputs, [None] * 64, masks)[0]


def test_seeded_row_draws_the_same_tokens_whatever_its_neighbours():
    """A seeded row draws the same tokens alone and in batches of 2 and 40 rows with different neighbours
    (greedy, other seeds, other filters, penalties) at different positions."""
    vocab = 2048
    logits, _, _ = random_batch(40, vocab, seed=4)
    row = logits[0]
    mine = SamplingParams(temperature=0.9, top_p=0.95, seed=7)

    def run(batch_logits, params, position, steps=6):
        keys = [None if p.greedy else mx.random.key(b * 31 + 3) for b, p in enumerate(params)]
        keys[position] = mx.random.key(7)
        outputs = [[] for _ in params]
        got = []
        for _ in range(steps):
            tokens, keys = sample_tokens(batch_logits, params, [()] * len(params), outputs, keys)
            mx.eval(tokens, *[k for k in keys if k is not None])
            got.append(tokens.tolist()[position])
            outputs = [out + [t] for out, t in zip(outputs, tokens.tolist())]
        return got

    alone = run(row[None], [mine], 0)
    pair = run(mx.stack([logits[1], row]), [SamplingParams(temperature=0), mine], 1)
    others = [SamplingParams(temperature=0.5 + b / 40, top_k=b % 7, min_p=(b % 3) / 10,
                             repetition_penalty=1.1 if b % 4 == 0 else 1.0) for b in range(40)]
    others[23] = mine
    crowd = run(mx.concatenate([logits[1:24], row[None], logits[24:]]), others, 23)
    assert alone == pair == crowd
    assert len(set(alone)) > 1  # the row samples, it is not stuck on one token


def test_keys_advance_as_one_split_per_draw_and_the_input_list_is_unchanged():
    """Each sampled row's successor key is the first half of `mx.random.split(key)`; greedy rows keep None;
    `sample_tokens` returns a new list and leaves the caller's list alone."""
    logits, prompts, outputs = random_batch(len(MIXED), 500, seed=5)
    keys = keys_for(MIXED)
    before = list(keys)
    _, new_keys = sample_tokens(logits, MIXED, prompts, outputs, keys)
    assert keys == before
    for key, new in zip(keys, new_keys):
        assert (key is None) == (new is None)
        if key is not None:
            assert np.array_equal(np.array(new), np.array(mx.random.split(key)[0]))


def test_probabilities_and_adjusted_equal_the_per_row_reference():
    """`probabilities` and `adjusted` (speculative decoding's view) are bit-identical to the reference's
    filtered softmax and penalized logits, masked or not."""
    logits, prompts, outputs = random_batch(len(MIXED), 700, seed=6)
    masks = mx.array(np.random.default_rng(7).random((len(MIXED), 700)) < 0.5)
    for b, p in enumerate(MIXED):
        for mask in (None, masks[b]):
            row = logits[b] if mask is None else mx.where(mask, logits[b], NEG_INF)
            want = ref_penalize(row, p, prompts[b], outputs[b]) if p.logit_bias or p.needs_penalties else row
            assert mx.array_equal(adjusted(logits[b], p, prompts[b], outputs[b], mask), want).item()
            if not p.greedy:
                got = probabilities(logits[b], p, prompts[b], outputs[b], mask)
                assert mx.array_equal(got, mx.softmax(ref_filter(want, p))).item()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=1.3, min_p=0.08),
    SamplingParams(temperature=0.7, top_k=6, top_p=0.9, min_p=0.02),
], ids=["top_k", "top_p", "min_p", "all_filters"])
def test_draws_cover_exactly_the_filtered_support_with_its_distribution(params):
    """8192 draws (512 rows with their own keys, 16 steps) land only on the tokens the reference filter
    keeps, hit each of them, and their frequencies are within 0.03 total variation of `probabilities`."""
    logits_row = mx.array(np.random.default_rng(8).normal(0, 1.5, 24).astype(np.float32))
    expected = np.array(probabilities(logits_row, params, (), ()), dtype=np.float64)
    support = set(np.nonzero(np.array(ref_filter(logits_row, params)) > NEG_INF)[0].tolist())
    assert support == set(np.nonzero(expected)[0].tolist()) and 1 < len(support) < 24
    counts = draws(logits_row, params, rows=512, steps=16)
    assert set(np.nonzero(counts)[0].tolist()) == support
    assert 0.5 * np.abs(counts / counts.sum() - expected).sum() < 0.03


def test_top_k_of_one_is_greedy_and_top_p_cuts_where_the_reference_cuts():
    """top_k=1 rows draw the argmax; a top_p row in a batch with a top_p=1 row keeps exactly the reference's
    nucleus while its neighbour keeps the full vocabulary."""
    logits, _, _ = random_batch(32, 3000, seed=9)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 32
    tokens, _ = sample_tokens(logits, params, [()] * 32, [()] * 32, [mx.random.key(b) for b in range(32)])
    assert tokens.tolist() == mx.argmax(logits, axis=-1).tolist()
    cut, full = SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=1.0)
    for b in range(4):
        nucleus = probabilities(logits[b], cut, (), ())
        assert mx.array_equal(nucleus > 0, ref_filter(logits[b], cut) > NEG_INF).item()
        assert 1 < (nucleus > 0).sum().item() < 3000
        assert (probabilities(logits[b], full, (), ()) > 0).all().item()


def test_masked_tokens_are_never_drawn_even_with_bias_and_penalties():
    """Grammar masks hold for greedy and sampled rows although a positive logit_bias, a repetition penalty
    below 1 and a negative presence penalty push the refused tokens up."""
    vocab, batch = 64, 128
    rng = np.random.default_rng(10)
    logits = mx.array(rng.normal(0, 2, (batch, vocab)).astype(np.float32))
    allowed = rng.random((batch, vocab)) < 0.2
    allowed[:, 0] = True
    refused = [int(np.nonzero(~allowed[b])[0][0]) for b in range(batch)]
    params = [SamplingParams(temperature=0 if b % 3 == 0 else 2.0, logit_bias=((refused[b], 100.0),),
                             repetition_penalty=0.5, presence_penalty=-2.0) for b in range(batch)]
    history = [[refused[b]] * 3 for b in range(batch)]
    keys = [None if p.greedy else mx.random.key(b) for b, p in enumerate(params)]
    for _ in range(8):
        tokens, keys = sample_tokens(logits, params, history, history, keys, mx.array(allowed))
        mx.eval(tokens, *[k for k in keys if k is not None])
        assert all(allowed[b, t] for b, t in enumerate(tokens.tolist()))


def test_token_logprobs_match_per_row_log_softmax_with_each_rows_top_k():
    """`token_logprobs` gives each row its own number of alternatives (0 to 5), best first, with the
    log-softmax values of the raw logits."""
    logits, _, _ = random_batch(6, 900, seed=11)
    tokens, ks = [5, 17, 200, 899, 0, 42], [0, 1, 5, 2, 3, 0]
    for r, entry in enumerate(token_logprobs(logits, tokens, ks)):
        lp = np.array(logits[r] - mx.logsumexp(logits[r]))
        best = np.argsort(-lp)[:ks[r]]
        assert entry.token_id == tokens[r] and abs(entry.logprob - lp[tokens[r]]) < 1e-5
        assert [t for t, _ in entry.top] == best.tolist()
        assert np.allclose([v for _, v in entry.top], lp[best], atol=1e-5)
