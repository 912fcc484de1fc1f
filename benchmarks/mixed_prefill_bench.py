"""Mixed prefill: prompts of mixed lengths arriving at once, mlx-pd vs mlx_lm.server.

    mlx-pd bench mixed-prefill --out mixed-prefill.json --markdown mixed-prefill.md
    mlx-pd bench mixed-prefill --fast-model --rounds 6

Both servers run on one model folder (benchmarks/engine_pair.py) and stay up throughout. A round, on one server:
`--prompts` unique prompts (default 8) whose lengths are spread evenly from `--min-prompt-tokens` to
`--max-prompt-tokens`
(default 100 to 2000, `prompt_lengths`), each asking for `--output-tokens` tokens (default 1, EOS blocked), are
sent at once (concurrency = the number of prompts), in a fixed order that alternates short and long ones
(`send_order`: shortest, longest, second shortest, ...). Each prompt starts with its own tag, so no prompt hits a
prefix cache beyond the chat template's first tokens. From one round:

- prefill throughput = the prompts' tokens (the servers' `usage.prompt_tokens`; the client's count of the
  rendered chat when a server sends none) / the time from the first send to the last first token;
- TTFT p50 and max over the prompts.

Each server first runs one unmeasured round (warm-up), then the measured rounds in ABBA order (ours, theirs,
theirs, ours, ...); each row is the median over a server's rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from typing import Callable, Sequence

from benchmarks.engine_pair import (NAMES, abba, add_pair_args, chat_token_counter, fmt_ms, fmt_ratio, long_prompt,
                                    median, model_dir_of, pair, summarize, suppressed_ids)
from benchmarks.loadgen import WorkloadConfig, run_load
from benchmarks.stats import RequestRecord, percentile

KEYS = ("prefill_tok_s", "ttft_p50_s", "ttft_max_s", "window_s")


def prompt_lengths(n: int, lo: int, hi: int) -> list[int]:
    """`n` token lengths spread evenly from `lo` to `hi` (both included; rounded to integers), ascending.
    Raises ValueError unless 1 <= lo <= hi and n >= 1 (n = 1 gives [lo])."""
    if n < 1 or not 1 <= lo <= hi:
        raise ValueError(f"need n >= 1 and 1 <= lo <= hi, got n={n}, lo={lo}, hi={hi}")
    if n == 1:
        return [lo]
    return [round(lo + i * (hi - lo) / (n - 1)) for i in range(n)]


def send_order(lengths: Sequence[int]) -> list[int]:
    """`lengths` (ascending) reordered shortest, longest, second shortest, second longest, ..."""
    out, lo, hi = [], 0, len(lengths) - 1
    while lo <= hi:
        out.append(lengths[lo])
        if lo != hi:
            out.append(lengths[hi])
        lo, hi = lo + 1, hi - 1
    return out


def round_stats(records: Sequence[RequestRecord], client_tokens: Sequence[int]) -> dict:
    """Prefill throughput and TTFTs of one round's records (in send order; `client_tokens` the client's count of
    each rendered prompt, used where a server sent no usage). See the module doc. `error` is the first request's
    error, or None; with an error the throughput is NaN."""
    errors = [r.error or "no first token" for r in records if not r.ok or r.ttft_s is None]
    tokens = [r.prompt_tokens if r.prompt_tokens is not None else c for r, c in zip(records, client_tokens)]
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    window = math.nan
    if not errors and records:
        window = max(r.start_s + r.ttft_s for r in records) - min(r.start_s for r in records)
    return {"prefill_tok_s": sum(tokens) / window if window > 0 else math.nan, "window_s": window,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_max_s": max(ttfts, default=math.nan),
            "prompt_tokens": tokens, "client_prompt_tokens": list(client_tokens), "ttft_s": [r.ttft_s for r in records],
            "server_counted": sum(r.prompt_tokens is not None for r in records), "error": errors[0] if errors else None}


def add_args(p: argparse.ArgumentParser) -> None:
    """The options of `mlx-pd bench mixed-prefill`."""
    p.add_argument("--prompts", type=int, default=8, help="prompts arriving at once (default 8)")
    p.add_argument("--min-prompt-tokens", type=int, default=100, help="the shortest prompt's tokens (default 100)")
    p.add_argument("--max-prompt-tokens", type=int, default=2000, help="the longest prompt's tokens (default 2000)")
    p.add_argument("--output-tokens", type=int, default=1, help="output tokens per request (default 1)")
    add_pair_args(p, rounds=4)


def _round_prompts(lengths: Sequence[int], tag: str, count: Callable[[str], int],
                   seed: int) -> tuple[list[str], list[int]]:
    """One round's prompts (unique by `tag`) and the client's token count of each as a rendered chat."""
    texts = [long_prompt(n, f"{tag} p{i}", count, seed) for i, n in enumerate(lengths)]
    return texts, [count(t) for t in texts]


def run(args, log=None) -> dict:
    """Start both servers, warm each up with one round, run the ABBA rounds; returns the JSON-ready result."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.output_tokens < 1 or args.rounds < 1:
        raise ValueError("--output-tokens and --rounds must be >= 1")
    lengths = send_order(prompt_lengths(args.prompts, args.min_prompt_tokens, args.max_prompt_tokens))
    from benchmarks.compare import machine_info
    model_dir = model_dir_of(args)
    suppress = suppressed_ids(args, model_dir)
    count = chat_token_counter(model_dir)
    result = {"machine": machine_info(), "model_dir": model_dir, "dtype": args.dtype, "lengths_sent": lengths,
              "output_tokens": args.output_tokens, "rounds": args.rounds, "suppressed_token_ids": list(suppress),
              "servers": {n: {"rounds": []} for n in NAMES}}

    def one(url: str, texts: list[str], client_tokens: list[int]) -> dict:
        cfg = WorkloadConfig(url=url, max_tokens=args.output_tokens, suppress_token_ids=suppress)
        records, _ = asyncio.run(run_load(cfg, texts, concurrency=len(texts), progress=False))
        return round_stats(records, client_tokens)

    with pair(model_dir, args.dtype, log) as servers:
        result["commands"] = {n: s.argv for n, s in servers.items()}
        warm = _round_prompts(lengths, f"warm {args.seed}", count, args.seed)
        for name in NAMES:
            got = one(servers[name].url, *warm)
            log(f"{name} warm-up round: {got['prefill_tok_s']:.0f} prompt tok/s, error {got['error']}")
        prompts = [_round_prompts(lengths, f"r{r} {args.seed}", count, args.seed) for r in range(args.rounds)]
        for r, name in abba(args.rounds):
            got = one(servers[name].url, *prompts[r])
            got["round"] = r
            result["servers"][name]["rounds"].append(got)
            if not args.no_progress:
                log(f"round {r + 1}/{args.rounds} {name}: {got['prefill_tok_s']:.0f} prompt tok/s, TTFT p50 "
                    f"{fmt_ms(got['ttft_p50_s'])} / max {fmt_ms(got['ttft_max_s'])} ms"
                    + (f", error {got['error']}" if got["error"] else ""))
    result["machine"]["loadavg_end"] = os.getloadavg()
    for s in result["servers"].values():
        s["prompt_tokens_total"] = median([sum(g["prompt_tokens"]) for g in s["rounds"] if g["error"] is None])
    return summarize(result, KEYS, tables)


def tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for the terminal and Markdown: one row per server (medians over its rounds), then the
    ratios ours/theirs (throughput: higher is better; times: lower)."""
    head = ["server", "prefill tok/s", "TTFT p50 ms", "TTFT max ms", "send to last first token ms", "prompt tok",
            "rounds", "errors"]
    rows = []
    for name, s in result["servers"].items():
        m = s["median"]
        total = s.get("prompt_tokens_total")
        rows.append([name, "-" if m["prefill_tok_s"] != m["prefill_tok_s"] else f"{m['prefill_tok_s']:.0f}",
                     fmt_ms(m["ttft_p50_s"]), fmt_ms(m["ttft_max_s"]), fmt_ms(m["window_s"]),
                     "-" if total is None or total != total else f"{total:.0f}", str(len(s["rounds"])),
                     str(s["errors"])])
    r = result["ratios"]
    rows.append(["ratio ours/theirs"] + [fmt_ratio(r[k]) for k in KEYS] + ["", "", ""])
    lengths = sorted(result["lengths_sent"])
    title = (f"Mixed prefill: {len(lengths)} prompts of {lengths[0]}-{lengths[-1]} tokens at once, "
             f"{result['output_tokens']} output token(s) each (medians over rounds)")
    return [(title, head, rows)]
