"""Printing benchmark results: terminal tables (rich when installed, else plain text) and Markdown.

Latencies are shown in milliseconds, throughput in output tokens/s and requests/s. Ratios are
ours / mlx_lm.server: above 1 is better for throughput, below 1 is better for latencies.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional, Sequence, TextIO

from benchmarks.compare import OURS, THEIRS


def _ms(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 1000:.1f}"


def _num(x: float, digits: int = 2) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def _print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]], out: Optional[TextIO]) -> None:
    out = out or sys.stdout  # resolved at call time: a default bound at import would pin a replaced stdout
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is not None:
        console = Console(file=out, width=max(120, len(header) * 12))
        console.print(title)
        table = Table()
        for i, h in enumerate(header):
            table.add_column(h, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    print(title, file=out)
    for row in (header, *rows):
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)), file=out)


def single_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows (one per latency metric) for one run's summary."""
    header = ["metric (ms)", "p50", "p90", "p99", "mean", "max"]
    rows = [[label] + [_ms(summary[name][k]) for k in ("p50", "p90", "p99", "mean", "max")]
            for label, name in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"))]
    return header, rows


def print_single(result: dict, out: Optional[TextIO] = None) -> None:
    """Print one load-generator run: the latency table and the throughput line."""
    s, c = result["summary"], result["config"]
    mode = f"rate {c['rate']}/s" if c.get("rate") else f"concurrency {c['concurrency']}"
    header, rows = single_rows(s)
    _print_table(f"{c['endpoint']} - {s['requests']} requests, {mode}, max_tokens {c['max_tokens']}",
                 header, rows, out)
    print(f"output throughput {s['output_throughput']:.2f} tok/s, {s['request_throughput']:.3f} req/s, "
          f"{s['output_tokens_mean']:.1f} output tokens/request, {s['errors']} errors, "
          f"{s['duration_s']:.1f} s", file=out)


COMPARE_HEADER = ["conc.", "server", "out tok/s", "req/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                  "E2E p99", "out tok/req", "prompt tok (cached)", "errors"]


def compare_rows(result: dict) -> list[list[str]]:
    """Rows of the comparison table: per level, one per server and one with the ratios ours/theirs."""
    rows = []
    for level in result["levels"]:
        for name in (OURS, THEIRS):
            s = level["servers"][name]
            rows.append([str(level["concurrency"]), name, _num(s["output_throughput"]),
                         _num(s["request_throughput"], 3), _ms(s["ttft_s"]["p50"]), _ms(s["ttft_s"]["p99"]),
                         _ms(s["tpot_s"]["p50"]), _ms(s["tpot_s"]["p99"]), _ms(s["e2e_s"]["p99"]),
                         _num(s["output_tokens_mean"], 1),
                         f"{_num(s.get('prompt_tokens_mean'), 1)} ({_num(s.get('cached_tokens_mean'), 1)})",
                         str(s["errors"])])
        r = level["ratios"]
        rows.append([str(level["concurrency"]), "ratio ours/theirs", _num(r["output_throughput"]) + "x",
                     _num(r["request_throughput"]) + "x", _num(r["ttft_s_p50"]) + "x", _num(r["ttft_s_p99"]) + "x",
                     _num(r["tpot_s_p50"]) + "x", _num(r["tpot_s_p99"]) + "x", _num(r["e2e_s_p99"]) + "x", "", "", ""])
    return rows


def memory_rows(result: dict) -> list[list[str]]:
    """Rows: server, RSS idle (after load), RSS after the run, peak RSS."""
    rows = []
    for name in (OURS, THEIRS):
        idle = result.get("memory_idle", {}).get(name, {})
        end = result.get("memory", {}).get(name, {})
        rows.append([name, _num(idle.get("rss_mib"), 0), _num(end.get("rss_mib"), 0),
                     _num(end.get("peak_rss_mib"), 0)])
    return rows


MEMORY_HEADER = ["server", "RSS before load (MiB)", "RSS after run (MiB)", "peak RSS (MiB)"]


def print_compare(result: dict, out: Optional[TextIO] = None) -> None:
    """Print the comparison and memory tables (latencies in ms)."""
    _print_table(f"mlx-pd vs mlx_lm.server - max_tokens {result['max_tokens']}, latencies in ms",
                 COMPARE_HEADER, compare_rows(result), out)
    _print_table("resident memory", MEMORY_HEADER, memory_rows(result), out)
    for level in result["levels"]:
        s = level["sanity"]
        print(f"c={level['concurrency']}: identical greedy text {s['identical_text']}/{s['pairs']}, "
              f"errors {s['errors']}, early EOS stops {s['early_stops']}", file=out)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_compare(result: dict) -> str:
    """The comparison and memory tables as Markdown (what docs/BENCHMARKS.md shows)."""
    return (markdown_table(COMPARE_HEADER, compare_rows(result)) + "\n\n"
            + markdown_table(MEMORY_HEADER, memory_rows(result)) + "\n")


def write_json(result: dict, path: Optional[str]) -> None:
    """Write `result` to `path` as indented JSON (NaN written as null); no-op for None."""
    if not path:
        return

    def clean(x):
        if isinstance(x, float) and math.isnan(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    Path(path).write_text(json.dumps(clean(result), indent=1) + "\n", encoding="utf-8")
