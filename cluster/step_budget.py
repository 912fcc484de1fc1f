"""One engine step's work (`ScheduledBatch`) and its budget: how many prompt tokens may run beside the decode
tokens (`StepBudget`), in tokens and, while streams decode, in time (`PrefillCost`).

Every step carries one token (plus its drafts) for every decoding sequence first; prompt chunks fill the rest
of `max_num_batched_tokens` (vLLM's token budget). While streams decode, the prompt chunks of a step are also
bounded by time, so that the streams' inter-token latency (ITL) stays within a target:

    seconds for prompt chunks = itl_target - t_decode
    a chunk of n tokens from position p costs   c_chunk + c_token * n + c_context * p + c_attend * n * (p + n/2)

`t_decode` is the measured time of a step of decode tokens alone (an exponential moving average). The chunk cost is
fitted online (`PrefillCost`: least squares with forgetting, coefficients kept non-negative) from the engine's own
steps: a chunk reads its prompt's earlier KV once (c_context) and a prompt token's cost grows with its position, as
attention reads every earlier position, so a long prompt's chunks shrink as it advances and the step stays within
the target wherever one block at the prompt's position still fits in it. `itl_target` is `itl_target_ms`, or by
default twice `t_decode` (a stream's ITL at most doubles while a prompt prefills). A stream whose token is still on
the device (the overlapped loop) is waiting on the step too, so it counts as streaming even when it gets no new
token in the step. Before the cost is known (no step with prompt tokens timed yet), a streaming step takes one
block of a long prompt: never the whole budget.

A long prompt computed beside streams also has a plan (`prefill_slowdown`, default 1.25): it should finish
within that many times its predicted time alone. While it is on schedule its chunks get the ITL target's share;
when it falls behind, its chunks fill the step up to 90% of twice the ITL target, so the streams' worst gap
stays under twice the target while the prompt catches up (vLLM and SGLang bound a step by tokens only; this
is the TTFT side of the same budget).

Chunk ends stay on block boundaries, at least one block per step for the first time-bounded prompt so prompts
always progress (where one block at the prompt's position costs more than the target, the step takes that
long: the floor). A prompt of at most `long_prefill_token_threshold` tokens still to compute when it is admitted
is never cut (vLLM's threshold of the same name): it goes whole in one step even past the time bound, so short
requests keep their TTFT, and short prompts waiting together share one step while their tokens add up to at
most the threshold. With nothing streaming (and always on a prefill worker, which never decodes) prompts go in
full `prefill_chunk_size` chunks, as many as the budget holds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional, Sequence as Seq

from cluster.sequence import Sequence

_CATCH_UP = 0.9  # a prompt behind its plan fills steps to this share of twice the ITL target (the rest: the
# chunk cost prediction's error)
_EMA = 0.3  # weight of the newest measurement in the decode step's moving average
_FORGET = 0.85  # weight each older prompt-step observation keeps at every new one (PrefillCost)
_REFIT_EVERY = 4  # prompt steps between fits (a fit costs ~0.2 ms of Python; the forgetting is slower than this)
_SCALES = (1.0, 1024.0, 2.0 ** 14, 2.0 ** 20)  # feature scales: chunks, tokens, context, token-positions
_NUM_FEATURES = len(_SCALES)


@dataclass
class ScheduledBatch:
    """The work of one step: (sequence, number of tokens to compute from num_computed_tokens on). `decode`: the
    decoding sequences, each with 1 + the draft tokens it may verify (blocks are reserved for all of them);
    `prefill`: prompt chunks. `prefill_spans`: (start position, tokens) of each prompt chunk, taken when the
    batch is built (the chunk cost's features)."""

    decode: list[tuple[Sequence, int]]
    prefill: list[tuple[Sequence, int]]
    prefill_spans: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self):
        if not self.prefill_spans:
            self.prefill_spans = [(seq.num_computed_tokens, n) for seq, n in self.prefill]

    @property
    def items(self) -> list[tuple[Sequence, int]]:
        """Every (sequence, tokens) of the step, decode first."""
        return self.decode + self.prefill

    @property
    def num_decode_tokens(self) -> int:
        """Decode and draft tokens of the step."""
        return sum(n for _, n in self.decode)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens of the step."""
        return sum(n for _, n in self.prefill)


def chunk_features(spans: Seq[tuple[int, int]]) -> tuple[float, ...]:
    """The cost model's features of a step's prompt chunks, each (start position, tokens): (chunks, tokens,
    context positions p read once per chunk (its earlier KV gathered), token-positions n * (p + n/2), i.e.
    attention's work), scaled to similar magnitudes."""
    chunks = sum(1 for _, n in spans if n)
    tokens = sum(n for _, n in spans)
    context = sum(p for p, n in spans if n)
    attend = sum(n * (p + n / 2) for p, n in spans)
    return chunks / _SCALES[0], tokens / _SCALES[1], context / _SCALES[2], attend / _SCALES[3]


class PrefillCost:
    """Seconds that a step's prompt chunks add to it: c_chunk * chunks + c_token * tokens + c_context * context +
    c_attend * token-positions (`chunk_features`), fitted by least squares over the observed steps, each older
    step's weight multiplied by `forget` at every new one (so the fit follows a machine whose speed changes), with
    every coefficient kept at or above 0 (the best fit over the subsets of features whose solution is non-
    negative). `predict` is None until a step with prompt tokens was observed."""

    def __init__(self, forget: float = _FORGET):
        self.forget = forget
        self._xx = [[0.0] * _NUM_FEATURES for _ in range(_NUM_FEATURES)]  # weighted sum of x x^T
        self._xy = [0.0] * _NUM_FEATURES  # weighted sum of x y
        self._yy = 0.0
        self._coef: Optional[tuple[float, ...]] = None
        self._fitted_at = 0  # num_observed at the last fit
        self.num_observed = 0
        self.largest_chunk = 0.0  # the largest chunk seen lately, in tokens (decays with `forget`)

    def observe(self, spans: Seq[tuple[int, int]], seconds: float) -> None:
        """Record that prompt chunks `spans` ((start, tokens) each) took `seconds` of a step."""
        x = chunk_features(spans)
        if not x[1]:
            return
        f = self.forget
        for i in range(_NUM_FEATURES):
            self._xy[i] = f * self._xy[i] + x[i] * seconds
            for j in range(_NUM_FEATURES):
                self._xx[i][j] = f * self._xx[i][j] + x[i] * x[j]
        self._yy = f * self._yy + seconds * seconds
        self.largest_chunk = max(f * self.largest_chunk, max(n for _, n in spans))
        self.num_observed += 1

    @property
    def coefficients(self) -> Optional[tuple[float, ...]]:
        """(c_chunk, c_token, c_context, c_attend) in seconds per scaled feature (`chunk_features`), or None before any
        observation; fitted again once `_REFIT_EVERY` steps were observed since the last fit."""
        if self.num_observed == 0:
            return None
        if self._coef is None or self.num_observed - self._fitted_at >= _REFIT_EVERY:
            self._coef, self._fitted_at = self._fit(), self.num_observed
        return self._coef

    def predict(self, spans: Seq[tuple[int, int]]) -> Optional[float]:
        """Seconds that prompt chunks `spans` would add to a step; None before any observation."""
        coef = self.coefficients
        if coef is None:
            return None
        return sum(c * x for c, x in zip(coef, chunk_features(spans)))

    def _fit(self) -> tuple[float, ...]:
        best, best_err = (0.0,) * _NUM_FEATURES, float("inf")
        for subset in _SUBSETS:
            sol = _solve([[self._xx[i][j] for j in subset] for i in subset], [self._xy[i] for i in subset])
            if sol is None or min(sol) < 0:
                continue
            coef = [0.0] * _NUM_FEATURES
            for i, c in zip(subset, sol):
                coef[i] = c
            if coef[1] <= 0 and coef[3] <= 0:
                continue  # charges nothing per token (see _SUBSETS)
            # weighted residual: yy - 2 c.xy + c^T xx c
            err = self._yy - 2 * sum(c * b for c, b in zip(coef, self._xy)) + sum(
                coef[i] * self._xx[i][j] * coef[j] for i in range(_NUM_FEATURES) for j in range(_NUM_FEATURES))
            if err < 0.95 * best_err - 1e-12 * self._yy:  # a richer fit is taken when it fits clearly better
                best, best_err = tuple(coef), err
        return best  # type: ignore[return-value]


# the fits tried, simplest first, those with a cost per token before the others (with one observation every
# subset fits it exactly, and the per-token one extrapolates best); a richer fit must fit clearly better. Every
# fit charges each token something (tokens or token-positions): a fit by chunks and context alone would price a
# 2,048-token chunk like a 32-token one, which is what it sees when every step is one block.
_SUBSETS = tuple(sorted((c for k in range(1, _NUM_FEATURES + 1) for c in itertools.combinations(range(_NUM_FEATURES), k)
                         if 1 in c or 3 in c), key=lambda c: (1 not in c, len(c))))
# (the tokens-only fit is always valid while any step had prompt tokens, so a fit always exists)


def _solve(a: list[list[float]], b: list[float]) -> Optional[list[float]]:
    """x with a x = b (Gaussian elimination with partial pivoting), or None when `a` is (nearly) singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max(abs(v) for row in a for v in row) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            k = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= k * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


class StepBudget:
    """The per-step prompt allowance (see the module docstring). Times in seconds.

    `max_batched_tokens`: tokens per step at most (decode tokens, drafts and prompt tokens together);
    `chunk_size`: a prompt's tokens per step at most (`prefill_chunk_size`); `block_size`: chunk ends stay on
    block boundaries; `itl_target_s`: None = twice the measured decode step; `long_prefill_threshold`: a prompt
    with at most this many tokens left runs whole.
    """

    def __init__(self, max_batched_tokens: int, chunk_size: int, block_size: int,
                 itl_target_s: Optional[float] = None, long_prefill_threshold: int = 256,
                 prefill_slowdown: Optional[float] = None):
        self.max_batched_tokens, self.chunk_size, self.block_size = max_batched_tokens, chunk_size, block_size
        self.itl_target_s, self.long_prefill_threshold = itl_target_s, long_prefill_threshold
        self.prefill_slowdown = prefill_slowdown
        self.decode_step_s: Optional[float] = None  # t_decode
        self.prefill_cost = PrefillCost()

    @property
    def target_s(self) -> Optional[float]:
        """The ITL target in seconds: `itl_target_s`, or twice the measured decode step (None before one)."""
        if self.itl_target_s is not None:
            return self.itl_target_s
        return None if self.decode_step_s is None else 2 * self.decode_step_s

    def prefill_allowance(self, num_decode_tokens: int) -> int:
        """Prompt tokens the next step may compute beside `num_decode_tokens` decode and draft tokens by the
        token budget alone (the time bound applies per chunk: `time_left`, `chunk`)."""
        return max(0, self.max_batched_tokens - num_decode_tokens)

    def time_left(self, streaming: bool) -> Optional[float]:
        """Seconds the next step's prompt chunks may take: None (no time bound) when no stream waits on the
        step; else the ITL target less the decode step (0.0 before both are measured: the step then takes
        the one-block floor)."""
        if not streaming:
            return None
        target = self.target_s
        if target is None or self.decode_step_s is None or self.prefill_cost.coefficients is None:
            return 0.0
        return max(0.0, target - self.decode_step_s)

    def chunk_seconds(self, start: int, num_tokens: int) -> float:
        """Predicted seconds of a chunk of `num_tokens` prompt tokens from position `start` (0.0 before any
        prompt step was timed)."""
        return self.prefill_cost.predict([(start, num_tokens)]) or 0.0

    def solo_seconds(self, start: int, end: int) -> float:
        """Predicted seconds to compute prompt positions [start, end) alone, in `chunk_size` chunks (0.0 before
        any prompt step was timed)."""
        return sum(self.chunk_seconds(p, min(self.chunk_size, end - p)) for p in range(start, end, self.chunk_size))

    def plan(self, start: int, now: float) -> Optional[tuple[float, int]]:
        """The prefill plan of a prompt whose chunks beside streams start at position `start` at time `now`:
        (now, start). Its deadline is `prefill_slowdown` times its predicted time alone from there, predicted
        again at every step from the latest cost fit (`stretch`). None: no slowdown bound."""
        return None if self.prefill_slowdown is None else (now, start)

    def stretch(self, time_left: Optional[float], start: int, end: int, plan: Optional[tuple[float, int]],
                now: float) -> Optional[float]:
        """The seconds a long prompt's chunk may take this step under its `plan` (`plan`), positions [start, end)
        still to compute: the ITL target's share `time_left` while the prompt is on schedule (the share of its work
        alone that is done is at least the share of its planned time gone, the plan being `prefill_slowdown` times
        its predicted time alone), else as much as keeps the step within 90% of twice the ITL target (a margin for
        the prediction's error), so it catches up. (A steady share would miss the deadline whenever small chunks
        cost more per token than the whole-chunk prediction assumes.) Returns `time_left` unchanged when there is no
        time bound, no plan or no cost known."""
        if time_left is None or plan is None or self.decode_step_s is None or self.target_s is None:
            return time_left
        if self.prefill_cost.coefficients is None:
            return time_left
        started, first = plan
        solo = self.solo_seconds(first, end)
        if solo <= 0:
            return time_left
        done = 1.0 - self.solo_seconds(start, end) / solo
        due = (now - started) / (self.prefill_slowdown * solo)
        if done >= due:
            return time_left
        return max(time_left, _CATCH_UP * 2 * self.target_s - self.decode_step_s)

    def tokens_within(self, seconds: float, start: int, floor: bool) -> int:
        """The most prompt tokens from position `start` whose chunk fits in `seconds`, in whole blocks (in
        whole chunks when `chunk_size` is under a block), at most `chunk_size` and at most twice the largest
        chunk timed lately (`PrefillCost.largest_chunk`); with `floor`, at least one unit even past `seconds`
        (so the prompt progresses)."""
        unit = min(self.block_size, self.chunk_size)
        # at most twice the largest chunk seen lately: a fit over chunks of one size cannot tell what a token
        # costs apart from what a chunk costs, so the chunk grows step by step and the fit sees each size
        largest = 2 * int(self.prefill_cost.largest_chunk)
        lo, hi = 0, max(1, min(self.chunk_size, largest) // unit)  # units: the answer is in [lo, hi]
        if self.prefill_cost.coefficients is not None:
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.chunk_seconds(start, mid * unit) <= seconds:
                    lo = mid
                else:
                    hi = mid - 1
        return max(lo, 1 if floor else 0) * unit

    def chunk(self, remaining: int, allowance: int, whole_room: int, start: int = 0,
              time_left: Optional[float] = None, floor: bool = True) -> int:
        """Tokens of a prompt with `remaining` tokens left from position `start` to run in this step, given
        `allowance` prompt tokens left in the step's token budget, `time_left` seconds left for prompt chunks
        (None: no time bound; `time_left`) and `whole_room` tokens that short prompts may still take whole past
        the time bound (the step's new prompts start with `whole_room(room)` and subtract what each takes; 0
        for a prompt already partly computed). A prompt that fits runs whole; a short one (at most
        `long_prefill_threshold` tokens) runs whole when it fits `whole_room`, even past the time bound; a
        longer one gets what fits, in whole blocks (0: not this step; `floor`: at least one block by time, for
        the step's first time-bounded chunk). At most `chunk_size`."""
        limit = max(0, min(allowance, self.chunk_size))
        if time_left is not None:
            limit = min(limit, self.tokens_within(time_left, start, floor))
        if remaining <= limit:
            return remaining
        if remaining <= min(self.long_prefill_threshold, self.chunk_size, whole_room):
            return remaining
        unit = min(self.block_size, self.chunk_size)  # a chunk size below a block cuts in its own steps
        return limit // unit * unit

    def whole_room(self, room: int) -> int:
        """Prompt tokens that the step's new short prompts may take together past the time bound, with `room`
        tokens left in the step's token budget: `long_prefill_threshold`, within the budget."""
        return max(0, min(self.long_prefill_threshold, room))

    def observe(self, num_decode_tokens: int, prefill_spans: Seq[tuple[int, int]], seconds: float) -> None:
        """Record one step's wall time: a decode-only step updates t_decode; a step with prompt chunks
        (`prefill_spans`: (start, tokens) each) feeds the chunk cost its time less t_decode when it also
        decoded."""
        if not any(n for _, n in prefill_spans):
            if num_decode_tokens:
                self.decode_step_s = _ema(self.decode_step_s, seconds)
            return
        decode = (self.decode_step_s or 0.0) if num_decode_tokens else 0.0
        self.prefill_cost.observe(prefill_spans, max(seconds - decode, 0.0))


def _ema(old: Optional[float], new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new
