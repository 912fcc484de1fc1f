"""Interference: what a long prompt's prefill does to streams that are already decoding, mlx-pd vs mlx_lm.server.

    mlx-pd bench interference --out interference.json --markdown interference.md
    mlx-pd bench interference --fast-model --rounds 4

Both servers run on one model folder (benchmarks/engine_pair.py) and stay up throughout. A round, on one server:
`--streams` greedy streaming requests (short unique prompts, `--stream-tokens` output tokens each, EOS blocked)
start together; once every stream has `--after-tokens` tokens, a unique prompt of about `--long-tokens` tokens
arrives (`--long-max-tokens` output tokens). The client records the arrival time of every content chunk of every
stream and of the long request. From one round:

- idle ITL p50: the streams' gaps between consecutive tokens that lie wholly between the moment every stream had
  half of `--after-tokens` tokens (decode is steady) and the long prompt's arrival;
- prefill ITL p50 and max: the streams' gaps that overlap the long prompt's prefill, from its arrival to its first
  token (a gap that begins before the arrival or ends after the first token counts: a stall is one long gap);
- long TTFT: from sending the long prompt to its first content chunk.

Each server first runs one unmeasured round (warm-up: the long prompt's shapes too), then the measured rounds in
ABBA order (ours, theirs, theirs, ours, ...); each row is the median over a server's rounds. A round whose streams
had all finished before the long prompt's first token is flagged (`streams_outlived_prefill` false): raise
`--stream-tokens` then.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Callable, Optional, Sequence

import httpx

from benchmarks.engine_pair import (NAMES, abba, add_pair_args, chat_token_counter, fmt_ms, fmt_ratio, long_prompt,
                                    median, model_dir_of, pair, summarize, suppressed_ids)
from benchmarks.loadgen import WorkloadConfig, make_prompts
from benchmarks.sse import SSEParser, parse_chunk
from benchmarks.stats import percentile

KEYS = ("idle_itl_p50_s", "prefill_itl_p50_s", "prefill_itl_max_s", "long_ttft_s")


# -- windows over token arrival times (pure) -------------------------------------------------------------------

def gaps(arrivals: Sequence[float]) -> list[tuple[float, float]]:
    """(start, end) of each gap between consecutive arrival times of one stream."""
    return list(zip(arrivals[:-1], arrivals[1:]))


def steady_from(streams: Sequence[Sequence[float]], tokens: int) -> Optional[float]:
    """The moment every stream had at least `tokens` tokens (the latest of their `tokens`-th arrivals); None when
    some stream never got that many."""
    if tokens < 1 or any(len(s) < tokens for s in streams):
        return None
    return max(s[tokens - 1] for s in streams)


def window_stats(streams: Sequence[Sequence[float]], arrive: float, first: Optional[float],
                 steady: Optional[float]) -> dict:
    """Inter-token latencies of `streams` (each a sorted list of arrival times, seconds) around a long prompt that
    arrived at `arrive` and got its first token at `first` (None: never), decode steady from `steady`.

    Returns idle_itl_p50_s (gaps wholly inside [steady, arrive]), prefill_itl_p50_s and prefill_itl_max_s (gaps
    overlapping (arrive, first)), the number of gaps behind each, and streams_outlived_prefill (every stream had a
    token at or after `first`). Missing windows give NaN and 0 gaps."""
    idle = [b - a for s in streams for a, b in gaps(s) if steady is not None and a >= steady and b <= arrive]
    busy = [] if first is None else [b - a for s in streams for a, b in gaps(s) if b > arrive and a < first]
    return {"idle_itl_p50_s": percentile(idle, 50), "idle_gaps": len(idle),
            "prefill_itl_p50_s": percentile(busy, 50), "prefill_itl_max_s": max(busy, default=float("nan")),
            "prefill_gaps": len(busy),
            "streams_outlived_prefill": first is not None and all(s and s[-1] >= first for s in streams)}


# -- one round on one server ------------------------------------------------------------------------------------

async def stream_times(client: httpx.AsyncClient, cfg: WorkloadConfig, prompt: str, times: list[float],
                       on_token: Callable[[], None] = lambda: None) -> dict:
    """Send one streaming chat request; append `time.perf_counter()` to `times` at each chunk with content (and
    call `on_token`). Returns {error, finish_reason, completion_tokens, prompt_tokens}; never raises for server or
    network errors."""
    out = {"error": None, "finish_reason": None, "completion_tokens": None, "prompt_tokens": None}
    try:
        async with client.stream("POST", cfg.endpoint, json=cfg.body(prompt)) as resp:
            if resp.status_code != 200:
                out["error"] = f"HTTP {resp.status_code}: {(await resp.aread()).decode('utf-8', 'replace')[:300]}"
                return out
            parser = SSEParser()
            async for line in resp.aiter_lines():
                for data in parser.feed(line):
                    chunk = parse_chunk(data)
                    if chunk.content:
                        times.append(time.perf_counter())
                        on_token()
                    out["error"] = chunk.error or out["error"]
                    out["finish_reason"] = chunk.finish_reason or out["finish_reason"]
                    if chunk.usage_tokens is not None:
                        out["completion_tokens"], out["prompt_tokens"] = chunk.usage_tokens, chunk.prompt_tokens
    except (httpx.HTTPError, OSError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    if out["error"] is None and not times:
        out["error"] = "the stream ended without any content"
    return out


async def one_round(url: str, stream_prompts: Sequence[str], long_text: str, *, stream_tokens: int,
                    after_tokens: int, long_max_tokens: int, suppress: tuple[int, ...],
                    timeout_s: float = 600.0) -> dict:
    """One round on the server at `url` (see the module doc); returns the window statistics, the long request's
    TTFT and token counts, and `error` (None when every request succeeded and the long prompt arrived)."""
    streams_cfg = WorkloadConfig(url=url, max_tokens=stream_tokens, suppress_token_ids=suppress)
    long_cfg = WorkloadConfig(url=url, max_tokens=long_max_tokens, suppress_token_ids=suppress)
    times: list[list[float]] = [[] for _ in stream_prompts]
    ready = asyncio.Event()

    def check() -> None:
        if all(len(t) >= after_tokens for t in times):
            ready.set()

    width = len(stream_prompts) + 1
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0)) as client:
        tasks = [asyncio.create_task(stream_times(client, streams_cfg, p, times[i], check))
                 for i, p in enumerate(stream_prompts)]
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait({waiter, *tasks}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        long_times: list[float] = []
        arrive = time.perf_counter()
        if ready.is_set():
            long = await stream_times(client, long_cfg, long_text, long_times)
        else:
            waiter.cancel()
            long = {"error": f"the streams did not all reach {after_tokens} tokens"}
        streams = await asyncio.gather(*tasks)
    first = long_times[0] if long_times else None
    stats = window_stats(times, arrive, first, steady_from(times, max(1, after_tokens // 2)))
    errors = [s["error"] for s in streams if s["error"]] + ([long["error"]] if long["error"] else [])
    return {**stats, "long_ttft_s": (first - arrive) if first is not None else float("nan"),
            "long_prompt_tokens": long.get("prompt_tokens"), "stream_tokens": [len(t) for t in times],
            "error": errors[0] if errors else None}


# -- the scenario ---------------------------------------------------------------------------------------------

def add_args(p: argparse.ArgumentParser) -> None:
    """The options of `mlx-pd bench interference`."""
    p.add_argument("--streams", type=int, default=4, help="streams decoding when the long prompt arrives (default 4)")
    p.add_argument("--stream-tokens", type=int, default=256, help="output tokens per stream (default 256)")
    p.add_argument("--after-tokens", type=int, default=32,
                   help="the long prompt arrives once every stream has this many tokens (default 32)")
    p.add_argument("--long-tokens", type=int, default=1500, help="the long prompt's length in tokens (default 1500)")
    p.add_argument("--long-max-tokens", type=int, default=4,
                   help="output tokens of the long request (default 4; only its first counts)")
    add_pair_args(p, rounds=4)


def _prompts(args, count: Callable[[str], int], r: int) -> tuple[list[str], str]:
    tag = "warm" if r < 0 else f"r{r}"
    streams = make_prompts(args.streams, args.seed + 17 * (r + 1), tag=f"stream {tag}")
    return streams, long_prompt(args.long_tokens, f"long {tag} {args.seed}", count, args.seed)


def run(args, log=None) -> dict:
    """Start both servers, warm each up with one round, run the ABBA rounds; returns the JSON-ready result."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if min(args.streams, args.stream_tokens, args.after_tokens, args.long_tokens, args.long_max_tokens,
           args.rounds) < 1:
        raise ValueError("--streams, --stream-tokens, --after-tokens, --long-tokens, --long-max-tokens and --rounds "
                         "must be >= 1")
    if args.after_tokens >= args.stream_tokens:
        raise ValueError("--after-tokens must be below --stream-tokens")
    from benchmarks.compare import machine_info

    model_dir = model_dir_of(args)
    suppress = suppressed_ids(args, model_dir)
    count = chat_token_counter(model_dir)
    kw = dict(stream_tokens=args.stream_tokens, after_tokens=args.after_tokens, long_max_tokens=args.long_max_tokens,
              suppress=suppress)
    result = {"machine": machine_info(), "model_dir": model_dir, "dtype": args.dtype, "streams": args.streams,
              "stream_tokens": args.stream_tokens, "after_tokens": args.after_tokens, "long_tokens": args.long_tokens,
              "long_max_tokens": args.long_max_tokens, "rounds": args.rounds, "suppressed_token_ids": list(suppress),
              "servers": {n: {"rounds": []} for n in NAMES}}
    with pair(model_dir, args.dtype, log) as servers:
        result["commands"] = {n: s.argv for n, s in servers.items()}
        warm_streams, warm_long = _prompts(args, count, -1)
        for name in NAMES:
            warm = asyncio.run(one_round(servers[name].url, warm_streams, warm_long, **kw))
            log(f"{name} warm-up round: long TTFT {fmt_ms(warm['long_ttft_s'])} ms, error {warm['error']}")
        prompts = [_prompts(args, count, r) for r in range(args.rounds)]
        for r, name in abba(args.rounds):
            streams, long_text = prompts[r]
            got = asyncio.run(one_round(servers[name].url, streams, long_text, **kw))
            got["round"] = r
            result["servers"][name]["rounds"].append(got)
            if not args.no_progress:
                log(f"round {r + 1}/{args.rounds} {name}: idle ITL p50 {fmt_ms(got['idle_itl_p50_s'])} ms, prefill "
                    f"ITL p50 {fmt_ms(got['prefill_itl_p50_s'])} / max {fmt_ms(got['prefill_itl_max_s'])} ms, long "
                    f"TTFT {fmt_ms(got['long_ttft_s'])} ms" + (f", error {got['error']}" if got["error"] else ""))
    result["machine"]["loadavg_end"] = os.getloadavg()
    for s in result["servers"].values():
        ok = [g for g in s["rounds"] if g["error"] is None]
        s["long_prompt_tokens"] = median([g["long_prompt_tokens"] for g in ok])
        s["rounds_streams_outlived_prefill"] = sum(g["streams_outlived_prefill"] for g in ok)
    return summarize(result, KEYS, tables)


def tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for the terminal and Markdown: one row per server (medians over its rounds), then the
    ratios ours/theirs (lower is better for every column)."""
    head = ["server", "idle ITL p50 ms", "prefill ITL p50 ms", "prefill ITL max ms", "long TTFT ms",
            "long prompt tok", "rounds (streams outlived prefill)", "errors"]
    rows = []
    for name, s in result["servers"].items():
        m = s["median"]
        tokens = s.get("long_prompt_tokens")
        rows.append([name, fmt_ms(m["idle_itl_p50_s"]), fmt_ms(m["prefill_itl_p50_s"]), fmt_ms(m["prefill_itl_max_s"]),
                     fmt_ms(m["long_ttft_s"]), "-" if tokens is None or tokens != tokens else f"{tokens:.0f}",
                     f"{len(s['rounds'])} ({s['rounds_streams_outlived_prefill']})", str(s["errors"])])
    r = result["ratios"]
    rows.append(["ratio ours/theirs"] + [fmt_ratio(r[k]) for k in KEYS] + ["", "", ""])
    title = (f"Interference: {result['streams']} streams of {result['stream_tokens']} tokens, a "
             f"{result['long_tokens']}-token prompt after {result['after_tokens']} tokens (medians over rounds)")
    return [(title, head, rows)]
