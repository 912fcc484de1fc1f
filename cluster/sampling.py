"""Token sampling for a batch whose rows each have their own SamplingParams.

Order of operations per row (as in vLLM and HF transformers): logit_bias, repetition penalty (CTRL,
Keskar et al. 2019: divide positive logits of seen tokens by the penalty, multiply negative ones),
presence/frequency penalties (OpenAI's formula: logit -= presence * [count > 0] + frequency * count, over
generated tokens), the grammar mask of a constrained row (cluster/grammar.py: disallowed tokens become -inf,
as vLLM's structured outputs apply it after the logits processors), then greedy argmax, or temperature,
top-k, top-p (nucleus, Holtzman et al. 2019), min-p (scaled by the top probability) and a categorical draw
with the row's own PRNG key.
Reported logprobs are log-softmax of the raw model logits (vLLM's default), in float32.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import mlx.core as mx

from cluster.request import SamplingParams, TokenLogprob


def make_key(seed: Optional[int]) -> mx.array:
    """A PRNG key for one sequence: from `seed`, or fresh from the global generator."""
    if seed is None:
        seed = int(mx.random.randint(0, 2**31 - 1, ()).item())
    return mx.random.key(seed & 0xFFFFFFFFFFFFFFFF)


def advance_key(key: mx.array) -> mx.array:
    """`key` as it is after one draw by `sample` (the first half of its split), for a token sampled elsewhere."""
    return mx.random.split(key)[0]


def _penalize(row: mx.array, params: SamplingParams, prompt: Sequence[int], output: Sequence[int]) -> mx.array:
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
            vals = mx.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
            row[ids] = vals
    if (params.presence_penalty or params.frequency_penalty) and output:
        counts = Counter(output)
        ids = mx.array(list(counts), dtype=mx.int32)
        cnt = mx.array(list(counts.values()), dtype=mx.float32)
        row = row.at[ids].add(-(params.presence_penalty + params.frequency_penalty * cnt))
    return row


def apply_mask(row: mx.array, mask: Optional[mx.array]) -> mx.array:
    """`row` (float32 [..., vocab]) with the tokens `mask` (bool, same shape; True = allowed) refuses set to
    -inf; `row` itself when `mask` is None (a free row)."""
    return row if mask is None else mx.where(mask, row, mx.array(-float("inf"), dtype=row.dtype))


def _filter(row: mx.array, params: SamplingParams) -> mx.array:
    """Temperature then top-k, top-p and min-p; removed entries become -inf. row: [V] float32."""
    row = row / params.temperature
    neg_inf = mx.array(-float("inf"), dtype=row.dtype)
    if params.top_k and params.top_k < row.shape[0]:
        kth = mx.sort(row)[-params.top_k]
        row = mx.where(row < kth, neg_inf, row)
    if params.top_p < 1.0:
        order = mx.argsort(-row)
        probs = mx.softmax(row[order])
        cum = mx.cumsum(probs)
        keep_sorted = (cum - probs) < params.top_p  # keep tokens until the mass before them reaches top_p
        keep = mx.zeros(row.shape, dtype=mx.bool_).at[order].add(keep_sorted)
        row = mx.where(keep, row, neg_inf)
    if params.min_p > 0:
        probs = mx.softmax(row)
        row = mx.where(probs < params.min_p * probs.max(), neg_inf, row)
    return row


def sample(logits: mx.array, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
           outputs: Sequence[Sequence[int]], keys: list[Optional[mx.array]],
           masks: Optional[mx.array] = None) -> tuple[list[int], list[Optional[TokenLogprob]]]:
    """Sample one token per row.

    logits: float32 [B, vocab]. `prompts`/`outputs`: each row's token history (for penalties).
    `keys`: each row's PRNG key, replaced in place by its successor (None for greedy rows).
    `masks`: bool [B, vocab] of the tokens each row's grammar allows (`cluster.grammar.Grammars.masks`; all
    True for a free row), or None when no row is constrained. It is applied to the whole batch in one `where`
    before the per-row adjustments: logit_bias and the penalties keep a -inf logit at -inf, so this equals
    masking after them, and free rows are computed exactly as without.
    Returns the token ids and, for rows with `logprobs` set, their TokenLogprob (of the raw logits).
    """
    masked = logits if masks is None else apply_mask(logits, masks)
    rows = []
    for b, p in enumerate(params):
        row = masked[b]
        if p.logit_bias or p.needs_penalties:
            row = _penalize(row, p, prompts[b], outputs[b])
        if p.greedy:
            rows.append(mx.argmax(row))
        else:
            keys[b], sub = mx.random.split(keys[b])
            rows.append(mx.random.categorical(_filter(row, p), key=sub))
    tokens = mx.stack(rows)
    mx.eval(tokens, *[k for k in keys if k is not None])
    token_list = tokens.tolist()
    result: list[Optional[TokenLogprob]] = [None] * len(params)
    want = [b for b, p in enumerate(params) if p.logprobs is not None]
    if want:
        entries = token_logprobs(logits[mx.array(want)], [token_list[b] for b in want],
                                 [params[b].logprobs for b in want])
        for b, entry in zip(want, entries):
            result[b] = entry
    return token_list, result


def token_logprobs(logits: mx.array, tokens: Sequence[int], ks: Sequence[int]) -> list[TokenLogprob]:
    """The logprob of `tokens[r]` under row r of `logits` (float32 [R, vocab], raw model logits) with the
    top-`ks[r]` alternatives, as `sample` reports them."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(list(tokens), dtype=mx.int32)[:, None], axis=-1)[:, 0]
    mx.eval(logprobs, chosen)
    out = []
    for r, (token, lp, k) in enumerate(zip(tokens, chosen.tolist(), ks)):
        top: tuple[tuple[int, float], ...] = ()
        if k:
            idx = mx.argpartition(-logprobs[r], k - 1)[:k]
            vals = logprobs[r][idx]
            order = mx.argsort(-vals)
            top = tuple(zip(idx[order].tolist(), vals[order].tolist()))
        out.append(TokenLogprob(token, lp, top))
    return out


def adjusted(row: mx.array, params: SamplingParams, prompt: Sequence[int], output: Sequence[int],
             mask: Optional[mx.array] = None) -> mx.array:
    """`row` [vocab] after logit_bias, penalties and the grammar `mask` (bool [vocab], None: free), given the
    output so far (as `sample` applies them)."""
    if params.logit_bias or params.needs_penalties:
        row = _penalize(row, params, prompt, output)
    return apply_mask(row, mask)


def probabilities(row: mx.array, params: SamplingParams, prompt: Sequence[int], output: Sequence[int],
                  mask: Optional[mx.array] = None) -> mx.array:
    """The distribution `sample` draws the next token from (a non-greedy row): float32 [vocab] after logit_bias,
    penalties, the grammar `mask` (bool [vocab], None: free), temperature, top-k, top-p and min-p, given the
    output so far. Used by speculative decoding, whose acceptance rule needs these probabilities explicitly."""
    return mx.softmax(_filter(adjusted(row, params, prompt, output, mask), params))


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
