"""Statistics of a benchmark run: per-request records in, percentiles and rates out.

A run is a list of :class:`RequestRecord` (one per request, errors included) plus the wall-clock
span over which they ran. :func:`summarize` turns that into a flat dict of numbers:

    requests, errors, duration_s, request_throughput (req/s), output_throughput (tok/s),
    output_tokens_mean, prompt_tokens_mean, cached_tokens_mean (from usage; NaN when not sent),
    prefix_hit_rate (cached / prompt tokens, summed over requests that report both),
    for each of ttft_s, tpot_s, itl_s, e2e_s: {p50, p90, p99, mean, max},
    and with SLOs given, goodput: {slo_s, good_requests, attainment, request_goodput, output_goodput}

Goodput follows vLLM's benchmark_serving (``--goodput ttft:500 tpot:50``, from DistServe, Zhong et al.
2024): a request is *good* when it succeeded and met every given SLO (TTFT, TPOT, E2E; a one-token
answer has no TPOT and meets a TPOT SLO); request_goodput = good requests / duration (req/s),
output_goodput = their output tokens / duration, attainment = good / all requests.

Percentiles use linear interpolation between closest ranks (NumPy's default "linear" method), so
p50 of [1, 2, 3, 4] is 2.5 and p99 of 1..100 is 99.01. Failed requests count in `errors` and in
nothing else; TPOT needs at least two output tokens.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

PERCENTILES = (50, 90, 99)
METRICS = ("ttft_s", "tpot_s", "itl_s", "e2e_s")
SLO_NAMES = {"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s"}  # per-request metrics an SLO may bound


@dataclass
class RequestRecord:
    """What one request did, times in seconds from the moment it was sent.

    `ttft_s` is the time to the first chunk with non-empty content; `itls_s` the gaps between
    successive content chunks; `output_tokens` the server's `usage.completion_tokens` when it sent
    one, else the number of content chunks (`content_chunks`).
    """

    index: int
    prompt: str = ""
    start_s: float = 0.0  # send time, relative to the start of the run
    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None
    itls_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    content_chunks: int = 0
    usage_tokens: Optional[int] = None
    prompt_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None  # prompt tokens the server's prefix cache served (usage, when sent)
    finish_reason: Optional[str] = None
    text: str = ""
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        """True when the request finished without an error and produced output."""
        return self.error is None and self.e2e_s is not None

    @property
    def tpot_s(self) -> Optional[float]:
        """Time per output token after the first: (e2e - ttft) / (output tokens - 1)."""
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        """A JSON-ready dict, with the derived `tpot_s`."""
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        return d


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) by linear interpolation; NaN for no values.

    >>> percentile([1, 2, 3, 4], 50)
    2.5
    >>> percentile([10], 99)
    10.0
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    data = sorted(float(v) for v in values)
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float]:
    """{p50, p90, p99, mean, max} of `values` (all NaN when empty)."""
    vals = [float(v) for v in values]
    out = {f"p{p}": percentile(vals, p) for p in PERCENTILES}
    out["mean"] = sum(vals) / len(vals) if vals else math.nan
    out["max"] = max(vals) if vals else math.nan
    return out


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def parse_slos(items: Sequence[str]) -> dict[str, float]:
    """SLOs from the command line, vLLM's form ``NAME:MILLISECONDS`` -> {metric: seconds}.

    >>> parse_slos(["ttft:500", "tpot:50"])
    {'ttft_s': 0.5, 'tpot_s': 0.05}
    """
    out = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name.strip().lower() not in SLO_NAMES:
            raise ValueError(f"SLO {item!r}: expected NAME:MS with NAME one of {', '.join(SLO_NAMES)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"SLO {item!r}: the bound must be > 0 ms")
        out[SLO_NAMES[name.strip().lower()]] = ms / 1000.0
    return out


def meets_slos(rec: RequestRecord, slos: dict[str, float]) -> bool:
    """True when `rec` succeeded and met every SLO in `slos` ({metric: seconds}); see the module doc."""
    if not rec.ok:
        return False
    for metric, bound in slos.items():
        value = getattr(rec, metric)
        if value is not None and value > bound:
            return False
        if value is None and metric != "tpot_s":
            return False
    return True


def goodput(records: Sequence[RequestRecord], duration_s: float, slos: dict[str, float]) -> dict:
    """Requests (and their output tokens) per second that met every SLO; see the module doc."""
    good = [r for r in records if meets_slos(r, slos)]
    rate = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: math.nan)
    return {"slo_s": dict(slos), "good_requests": len(good),
            "attainment": len(good) / len(records) if records else math.nan,
            "request_goodput": rate(len(good)), "output_goodput": rate(sum(r.output_tokens for r in good))}


def prefix_hit_rate(records: Sequence[RequestRecord]) -> float:
    """Cached prompt tokens / prompt tokens over the requests whose usage reported both; NaN if none did."""
    pairs = [(r.prompt_tokens, r.cached_tokens) for r in records
             if r.ok and r.prompt_tokens is not None and r.cached_tokens is not None]
    total = sum(p for p, _ in pairs)
    return sum(c for _, c in pairs) / total if total else math.nan


def summarize(records: Sequence[RequestRecord], duration_s: float, slos: Optional[dict[str, float]] = None) -> dict:
    """Aggregate `records` that ran over `duration_s` wall-clock seconds (see the module doc)."""
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    per_metric = {
        "ttft_s": [r.ttft_s for r in ok if r.ttft_s is not None],
        "tpot_s": [r.tpot_s for r in ok if r.tpot_s is not None],
        "itl_s": [gap for r in ok for gap in r.itls_s],
        "e2e_s": [r.e2e_s for r in ok],
    }
    summary = {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else math.nan,
        "output_throughput": tokens / duration_s if duration_s > 0 else math.nan,
        "output_tokens_total": tokens,
        "output_tokens_mean": tokens / len(ok) if ok else math.nan,
        "prompt_tokens_mean": _mean([r.prompt_tokens for r in ok if r.prompt_tokens is not None]),
        "cached_tokens_mean": _mean([r.cached_tokens for r in ok if r.cached_tokens is not None]),
        "prefix_hit_rate": prefix_hit_rate(ok),
    }
    for name in METRICS:
        summary[name] = distribution(per_metric[name])
    if slos:
        summary["goodput"] = goodput(records, duration_s, slos)
    return summary


def merge_rounds(rounds: Sequence[tuple[Sequence[RequestRecord], float]],
                 slos: Optional[dict[str, float]] = None) -> dict:
    """Summarize several rounds as one run: records pooled, durations added (gaps between rounds excluded)."""
    records = [r for recs, _ in rounds for r in recs]
    return summarize(records, sum(d for _, d in rounds), slos)
