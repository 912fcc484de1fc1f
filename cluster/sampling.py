"""Token sampling for a batch whose rows each have their own SamplingParams, batch-wide on the device.

`sample_tokens` builds one lazy graph for the whole batch [B, V]: the rows' per-row parameters become
vectors ([B, 1], a neutral value for a row that does not use a filter), so no step runs an array op per row.
Order of operations (as in vLLM and HF transformers): the grammar masks (bool [B, V], cluster/grammar.py:
disallowed tokens become -inf; applied first, which equals vLLM's order of applying them after the logits
processors because every later adjustment keeps -inf at -inf), logit_bias (one scatter-add), repetition
penalty (CTRL, Keskar et al. 2019: divide positive logits of seen tokens by the penalty, multiply negative
ones; the seen tokens are one scattered bool [B, V]), presence/frequency penalties (OpenAI's formula:
logit -= presence * [count > 0] + frequency * count over generated tokens; the counts are one scatter-add
into [B, V]), each built only when some row uses it. Then one argmax for the greedy rows and, for the others,
temperature, top-k, top-p (nucleus, Holtzman et al. 2019), min-p (scaled by the top probability) and one
Gumbel-max categorical draw (`mx.random.categorical`) per row, vectorized with `mx.vmap` over the rows' own
PRNG keys: a row splits its key exactly as `mx.random.split(key)` would alone, so a seeded row draws the same
tokens whatever its neighbours. `adjusted` / `probabilities` (speculative decoding) run the same batch code on
one row, so they give exactly the distribution `sample_tokens` draws from.
Reported logprobs are log-softmax of the raw model logits (vLLM's default), in float32, computed for all rows
that want them with one logsumexp, one gather and one argpartition.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from cluster.request import SamplingParams, TokenLogprob

_split_rows = mx.vmap(mx.random.split)  # keys uint32 [S, 2] -> [S, 2, 2]: row s is mx.random.split(keys[s])
_draw_rows = mx.vmap(lambda row, key: mx.random.categorical(row, key=key))  # [S, V], [S, 2] -> uint32 [S]


def make_key(seed: Optional[int]) -> mx.array:
    """A PRNG key for one sequence: from `seed`, or fresh from the global generator."""
    if seed is None:
        seed = int(mx.random.randint(0, 2**31 - 1, ()).item())
    return mx.random.key(seed & 0xFFFFFFFFFFFFFFFF)


def advance_key(key: mx.array) -> mx.array:
    """`key` as it is after one draw by `sample` (the first half of its split), for a token sampled elsewhere."""
    return mx.random.split(key)[0]


def apply_mask(row: mx.array, mask: Optional[mx.array]) -> mx.array:
    """`row` (float32 [..., vocab]) with the tokens `mask` (bool, same shape; True = allowed) refuses set to
    -inf; `row` itself when `mask` is None (a free row)."""
    return row if mask is None else mx.where(mask, row, mx.array(-float("inf"), dtype=row.dtype))


def _flat_ids(rows: Sequence[int], ids: Sequence[Sequence[int]], vocab: int) -> Optional[mx.array]:
    """The positions `row * vocab + id` (int32) of `ids[i]` in row `rows[i]` of a flattened [B, vocab] array,
    ids >= vocab left out; None when there are none."""
    parts = [np.asarray(tokens, dtype=np.int64) for tokens in ids]
    parts = [p[p < vocab] + r * vocab for r, p in zip(rows, parts)]
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return mx.array(flat.astype(np.int32)) if flat.size else None


def adjust_logits(logits: mx.array, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
                  outputs: Sequence[Sequence[int]], masks: Optional[mx.array] = None) -> mx.array:
    """`logits` (float32 [B, V]) after the grammar `masks` (bool [B, V], True = allowed; None: no row is
    constrained), logit_bias, repetition penalty and presence/frequency penalties (module docstring), each
    row with its own `params[b]` and token history `prompts[b]` / `outputs[b]`. Lazy: one where and at most
    one scatter per adjustment that some row uses; a row that uses none is its masked logits exactly."""
    rows = apply_mask(logits, masks)
    if not any(p.logit_bias or p.needs_penalties for p in params):
        return rows
    batch, vocab = rows.shape
    biased = [(b, p.logit_bias) for b, p in enumerate(params) if p.logit_bias]
    if biased:
        pairs = [(b * vocab + t, v) for b, bias in biased for t, v in bias if t < vocab]
        if pairs:
            flat = rows.reshape(-1).at[mx.array([i for i, _ in pairs], dtype=mx.int32)].add(
                mx.array([v for _, v in pairs], dtype=mx.float32))
            rows = flat.reshape(batch, vocab)
    repeating = [b for b, p in enumerate(params) if p.repetition_penalty != 1.0]
    seen_ids = _flat_ids([b for b in repeating for _ in range(2)],
                         [ids for b in repeating for ids in (prompts[b], outputs[b])], vocab)
    if seen_ids is not None:
        seen = mx.zeros((batch * vocab,), dtype=mx.bool_)
        seen[seen_ids] = True
        penalty = mx.array([p.repetition_penalty for p in params], dtype=rows.dtype)[:, None]
        rows = mx.where(seen.reshape(batch, vocab), mx.where(rows > 0, rows / penalty, rows * penalty), rows)
    counted = [b for b, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty) and outputs[b]]
    count_ids = _flat_ids(counted, [outputs[b] for b in counted], vocab)
    if count_ids is not None:
        counts = mx.zeros((batch * vocab,), dtype=mx.float32).at[count_ids].add(1.0).reshape(batch, vocab)
        presence = mx.array([p.presence_penalty for p in params], dtype=mx.float32)[:, None]
        frequency = mx.array([p.frequency_penalty for p in params], dtype=mx.float32)[:, None]
        rows = rows + -(presence * (counts > 0) + frequency * counts)
    return rows


def filter_logits(rows: mx.array, params: Sequence[SamplingParams]) -> mx.array:
    """Temperature, then top-k, top-p and min-p of `rows` (float32 [S, V], already adjusted), row s with
    `params[s]` (non-greedy); removed entries become -inf. Lazy and batch-wide: each filter runs only when some
    row uses it, with a neutral value for the rows that do not (top-k: no cut; top-p: a limit of +inf, so
    float rounding of the cumulative mass never cuts a row with top_p = 1; min-p: 0).
    Per row: top-k keeps the logits >= the k-th largest (ties kept); top-p keeps, in descending order, the
    tokens whose preceding probability mass is < top_p; min-p drops the tokens whose probability is below
    min_p times the top probability."""
    size, vocab = rows.shape
    rows = rows / mx.array([p.temperature for p in params], dtype=rows.dtype)[:, None]
    neg_inf = mx.array(-float("inf"), dtype=rows.dtype)
    ks = [p.top_k if p.top_k < vocab else 0 for p in params]
    if any(ks):
        k_max = max(ks)
        top = mx.sort(mx.topk(rows, k_max, axis=-1), axis=-1)  # [S, k_max] ascending: the k-th largest at k_max - k
        kth = mx.take_along_axis(top, mx.array([k_max - k if k else 0 for k in ks], dtype=mx.int32)[:, None],
                                 axis=-1)
        kth = mx.where(mx.array([k > 0 for k in ks])[:, None], kth, neg_inf)
        rows = mx.where(rows < kth, neg_inf, rows)
    if any(p.top_p < 1.0 for p in params):
        order = mx.argsort(-rows, axis=-1)
        probs = mx.softmax(mx.take_along_axis(rows, order, axis=-1), axis=-1)
        limit = mx.array([p.top_p if p.top_p < 1.0 else math.inf for p in params], dtype=probs.dtype)[:, None]
        # keep tokens until the mass before them reaches top_p
        keep_sorted = (mx.cumsum(probs, axis=-1) - probs) < limit
        keep = mx.put_along_axis(mx.zeros(rows.shape, dtype=mx.bool_), order, keep_sorted, axis=-1)
        rows = mx.where(keep, rows, neg_inf)
    if any(p.min_p > 0 for p in params):
        probs = mx.softmax(rows, axis=-1)
        min_p = mx.array([p.min_p for p in params], dtype=probs.dtype)[:, None]
        rows = mx.where(probs < min_p * probs.max(axis=-1, keepdims=True), neg_inf, rows)
    return rows


def sample_tokens(logits: mx.array, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
                  outputs: Sequence[Sequence[int]], keys: Sequence[Optional[mx.array]],
                  masks: Optional[mx.array] = None) -> tuple[mx.array, list[Optional[mx.array]]]:
    """One token per row, lazily (nothing is evaluated, nothing read on the host).

    logits: float32 [B, V]. `params`, `prompts`, `outputs`: each row's SamplingParams and token history (for
    the penalties). `keys`: each row's PRNG key (uint32 [2]; None for a greedy row). `masks`: bool [B, V] of
    the tokens each row's grammar allows (`cluster.grammar.Grammars.masks`; all True for a free row), or None
    when no row is constrained.
    Returns (tokens int32 [B], keys): the successor keys as a new list (row b's successor is the first half
    of `mx.random.split(keys[b])`, the second half draws its token; None stays None); `keys` is not changed.
    The caller evaluates the returned keys with the tokens (else each step's keys hang on the last graph).
    Greedy rows are the argmax of their adjusted logits; the others draw from `probabilities`."""
    rows = adjust_logits(logits, params, prompts, outputs, masks)
    new_keys = list(keys)
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    if not sampled:
        return mx.argmax(rows, axis=-1).astype(mx.int32), new_keys
    every = len(sampled) == len(params)
    index = None if every else mx.array(sampled, dtype=mx.int32)
    chosen = rows if every else mx.take(rows, index, axis=0)
    filtered = filter_logits(chosen, params if every else [params[b] for b in sampled])
    split = _split_rows(mx.stack([keys[b] for b in sampled]))  # [S, 2, 2]
    drawn = _draw_rows(filtered, split[:, 1]).astype(mx.int32)
    for b, key in zip(sampled, mx.split(split[:, 0].reshape(-1), len(sampled))):
        new_keys[b] = key
    if every:
        return drawn, new_keys
    tokens = mx.argmax(rows, axis=-1).astype(mx.int32)
    tokens[index] = drawn
    return tokens, new_keys


def sample(logits: mx.array, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
           outputs: Sequence[Sequence[int]], keys: list[Optional[mx.array]],
           masks: Optional[mx.array] = None) -> tuple[list[int], list[Optional[TokenLogprob]]]:
    """Sample one token per row and read it on the host: `sample_tokens`, evaluated with the logprobs.

    logits: float32 [B, vocab]; `prompts`/`outputs`, `masks` as in `sample_tokens`. `keys`: each row's PRNG
    key, replaced in place by its successor (None for greedy rows).
    Returns the token ids and, for rows with `logprobs` set, their TokenLogprob (of the raw logits).
    """
    tokens, new_keys = sample_tokens(logits, params, prompts, outputs, keys, masks)
    keys[:] = new_keys
    want = [b for b, p in enumerate(params) if p.logprobs is not None]
    arrays: tuple[Optional[mx.array], ...] = ()
    if want:
        index = None if len(want) == len(params) else mx.array(want, dtype=mx.int32)
        arrays = _logprob_arrays(logits if index is None else logits[index], tokens if index is None
                                 else tokens[index], max(params[b].logprobs for b in want))
    mx.eval(tokens, *[k for k in keys if k is not None], *[a for a in arrays if a is not None])
    token_list = tokens.tolist()
    result: list[Optional[TokenLogprob]] = [None] * len(params)
    if want:
        entries = _logprob_entries([token_list[b] for b in want], arrays, [params[b].logprobs for b in want])
        for b, entry in zip(want, entries):
            result[b] = entry
    return token_list, result


def _logprob_arrays(logits: mx.array, tokens: mx.array, k_max: int
                    ) -> tuple[mx.array, Optional[mx.array], Optional[mx.array]]:
    """Lazy: the logprob (float32 [R]) of `tokens` (int32 [R]) under `logits` (float32 [R, vocab]) and the
    top-`k_max` token ids and logprobs of each row ([R, k_max], best first; None when k_max is 0)."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    if not k_max:
        return chosen, None, None
    idx = mx.argpartition(-logprobs, k_max - 1, axis=-1)[:, :k_max]
    vals = mx.take_along_axis(logprobs, idx, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return chosen, mx.take_along_axis(idx, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)


def _logprob_entries(tokens: Sequence[int], arrays: tuple[mx.array, Optional[mx.array], Optional[mx.array]],
                     ks: Sequence[int]) -> list[TokenLogprob]:
    """TokenLogprob per row from `_logprob_arrays`' (evaluated) arrays; row r keeps its top `ks[r]`."""
    chosen, idx, vals = arrays
    ids = idx.tolist() if idx is not None else [[]] * len(tokens)
    lps = vals.tolist() if vals is not None else [[]] * len(tokens)
    return [TokenLogprob(token, lp, tuple(zip(i[:k], v[:k])))
            for token, lp, i, v, k in zip(tokens, chosen.tolist(), ids, lps, ks)]


def token_logprobs(logits: mx.array, tokens: Sequence[int], ks: Sequence[int]) -> list[TokenLogprob]:
    """The logprob of `tokens[r]` under row r of `logits` (float32 [R, vocab], raw model logits) with the
    top-`ks[r]` alternatives, as `sample` reports them."""
    arrays = _logprob_arrays(logits, mx.array(list(tokens), dtype=mx.int32), max(ks, default=0))
    mx.eval(*[a for a in arrays if a is not None])
    return _logprob_entries(list(tokens), arrays, ks)


def adjusted(row: mx.array, params: SamplingParams, prompt: Sequence[int], output: Sequence[int],
             mask: Optional[mx.array] = None) -> mx.array:
    """`row` [vocab] after logit_bias, penalties and the grammar `mask` (bool [vocab], None: free), given the
    output so far (as `sample_tokens` applies them: `adjust_logits` on one row)."""
    return adjust_logits(row[None], [params], [prompt], [output], None if mask is None else mask[None])[0]


def probabilities(row: mx.array, params: SamplingParams, prompt: Sequence[int], output: Sequence[int],
                  mask: Optional[mx.array] = None) -> mx.array:
    """The distribution `sample_tokens` draws the next token from (a non-greedy row): float32 [vocab] after
    logit_bias, penalties, the grammar `mask` (bool [vocab], None: free), temperature, top-k, top-p and min-p,
    given the output so far. Used by speculative decoding, whose acceptance rule needs these probabilities
    explicitly."""
    return mx.softmax(filter_logits(adjusted(row, params, prompt, output, mask)[None], [params])[0])


def prompt_logprobs(logits: mx.array, targets: Sequence[int], k: int) -> list[TokenLogprob]:
    """Logprobs of `targets` under `logits` [T, vocab] (row t predicts targets[t]), with top-k each."""
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    tgt = mx.array(list(targets), dtype=mx.int32)
    chosen = mx.take_along_axis(lp, tgt[:, None], axis=-1)[:, 0]
    top_idx = mx.argsort(-lp, axis=-1)[:, :k] if k else None
    top_val = mx.take_along_axis(lp, top_idx, axis=-1) if k else None
    chosen_l = chosen.tolist()
    ti = top_idx.tolist() if k else [[]] * len(chosen_l)
    tv = top_val.tolist() if k else [[]] * len(chosen_l)
    return [TokenLogprob(t, c, tuple(zip(i, v))) for t, c, i, v in zip(targets, chosen_l, ti, tv)]
