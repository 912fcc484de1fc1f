"""Tables for `mlx-pd bench prefix` and `bench chat` (terminal and Markdown), from their result dicts."""

from __future__ import annotations

import sys


def prefix_tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    from benchmarks.report import _ms, _num

    header = ["server", "kind", "n", "TTFT p50", "TTFT p99", "TTFT max", "prompt tok", "cached tok (min-max)",
              "errors"]
    rows = []
    for name, s in result["servers"].items():
        for kind, k in s["kinds"].items():
            cached = [c for c in k["cached_tokens"] if c is not None]
            span = f"{min(cached)}-{max(cached)}" if cached else "-"
            rows.append([name, kind, str(k["n"]), _ms(k["ttft_s"]["p50"]), _ms(k["ttft_s"]["p99"]),
                         _ms(k["ttft_s"]["max"]), _num(k["prompt_tokens_mean"], 0), span, str(k["errors"])])
        rows.append([name, "cold p50 / cached p50", "", _num(s["cold_over_cached_p50"], 1) + "x", "", "", "", "", ""])
    return [(f"TTFT in ms, cold vs cached system prompt (max_tokens {result['max_tokens']})", header, rows)]


def chat_tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    from benchmarks.report import _ms, _num

    pct = lambda x: "-" if x != x else f"{100 * x:.1f}%"  # noqa: E731
    h1 = ["server", "requests", "errors", "TTFT p50", "TTFT p99", "TPOT p50", "out tok/s", "wall s"]
    h2 = ["server", "turns", "prompt tok", "cached tok", "hit rate", "ideal tok", "ideal rate", "cached / ideal",
          "block ideal tok", "cached / block ideal"]
    r1, r2 = [], []
    for name, s in result["servers"].items():
        m = s["summary"]
        r1.append([name, str(m["requests"]), str(m["errors"]), _ms(m["ttft_s"]["p50"]), _ms(m["ttft_s"]["p99"]),
                   _ms(m["tpot_s"]["p50"]), _num(m["output_throughput"]), _num(m["duration_s"], 0)])
        for label, h in s["hits"].items():
            if isinstance(h, dict) and "hit_rate" in h:
                r2.append([name, label, str(h["prompt_tokens"]), str(h["cached_tokens"]), pct(h["hit_rate"]),
                           str(h["ideal_tokens"]), pct(h["ideal_rate"]), pct(h["of_ideal"]),
                           str(h["block_ideal_tokens"]), pct(h["of_block_ideal"])])
    title = (f"{result['users']} users x {result['turns']} turns, {result['system_prompts']} system prompts, "
             f"concurrency {result['concurrency']}, max_tokens {result['max_tokens']} (latencies in ms)")
    return [(title, h1, r1), ("prefix-cache hits (usage.prompt_tokens_details.cached_tokens)", h2, r2)]


def print_tables(tables) -> None:
    """Print (title, header, rows) tables to stdout."""
    from benchmarks.report import _print_table

    for title, header, rows in tables:
        _print_table(title, header, rows, sys.stdout)


def finish_run(result: dict, t_start: float, summarize, tables) -> dict:
    """End a benchmark's run: its wall time (from `t_start`, a perf_counter) and the machine's load average in
    `result`, then `summarize(result)` and print `tables(result)`; returns `result`."""
    import os
    import time

    result["wall_s"] = time.perf_counter() - t_start
    result["machine"]["loadavg_end"] = os.getloadavg()
    summarize(result)
    print_tables(tables(result))
    return result


def print_prefix(result: dict) -> None:
    print_tables(prefix_tables(result))
    for name, s in result["servers"].items():
        print(f"{name}: /metrics prefix-cache counters over the run: {s['metrics_delta']}")


def print_chat(result: dict) -> None:
    print_tables(chat_tables(result))
    for name, s in result["servers"].items():
        print(f"{name}: client prompt counts equal to usage.prompt_tokens: {s['hits']['prompt_count_matches']}/"
              f"{s['hits']['requests_ok']}; /metrics prefix-cache counters over the run: {s['metrics_delta']}")


def markdown(tables) -> str:
    from benchmarks.report import markdown_table

    return "\n\n".join(f"{title}:\n\n{markdown_table(h, r)}" for title, h, r in tables) + "\n"
