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
        cols = [max([len(str(h))] + [len(str(r[i])) for r in rows]) + 3 for i, h in enumerate(header)]
        console = Console(file=out, width=max(120, sum(cols) + 1))
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
    hit = s.get("prefix_hit_rate")
    if hit is not None and not math.isnan(hit):
        print(f"prefix hit rate {100 * hit:.1f}% of prompt tokens (server's usage.cached_tokens)", file=out)
    if s.get("goodput"):
        g = s["goodput"]
        slo = ", ".join(f"{k[:-2].upper()} <= {1000 * v:g} ms" for k, v in g["slo_s"].items())
        print(f"goodput {g['request_goodput']:.3f} req/s ({g['good_requests']}/{s['requests']} met {slo}), "
              f"{g['output_goodput']:.2f} tok/s", file=out)


def _dist(d: dict) -> str:
    """'p50 / p90 / p99' of a latency distribution, in ms."""
    return " / ".join(_ms(d.get(k)) for k in ("p50", "p90", "p99"))


def level_header(with_goodput: bool) -> list[str]:
    """Columns of the runs table (latency cells are p50 / p90 / p99 in ms)."""
    return (["conc.", "target", "out tok/s", "req/s", "TTFT ms p50 / p90 / p99", "TPOT ms p50 / p90 / p99",
             "ITL ms p50 / p90 / p99", "E2E ms p50 / p90 / p99", "out tok/req", "prompt tok (cached)",
             "prefix hit"] + (["goodput req/s (SLO met)"] if with_goodput else []) + ["errors"])


def run_row(conc: str, name: str, s: dict, with_goodput: bool) -> list[str]:
    """One table row for one target's summary at one level."""
    hit = s.get("prefix_hit_rate")
    row = [conc, name, _num(s["output_throughput"]), _num(s["request_throughput"], 3), _dist(s["ttft_s"]),
           _dist(s["tpot_s"]), _dist(s["itl_s"]), _dist(s["e2e_s"]), _num(s["output_tokens_mean"], 1),
           f"{_num(s.get('prompt_tokens_mean'), 1)} ({_num(s.get('cached_tokens_mean'), 1)})",
           "-" if hit is None or math.isnan(hit) else f"{100 * hit:.1f}%"]
    if with_goodput:
        g = s.get("goodput")
        row.append(f"{_num(g['request_goodput'], 3)} ({100 * g['attainment']:.0f}%)" if g else "-")
    return row + [str(s["errors"])]


def _conc(level: dict) -> str:
    return str(level["concurrency"]) if level.get("concurrency") else f"rate {level.get('rate')}/s"


def compare_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows of a comparison: per level one row per target, then one ratio row per other target
    (first / other; with mlx-pd and mlx_lm.server labelled "ratio ours/theirs")."""
    levels = result["levels"]
    with_goodput = any("goodput" in s for lv in levels for s in lv["servers"].values())
    header = level_header(with_goodput)
    rows = []
    for level in levels:
        names = level.get("targets") or [OURS, THEIRS]
        conc = _conc(level)
        rows += [run_row(conc, name, level["servers"][name], with_goodput) for name in names]
        for other in names[1:]:
            r = level.get("ratios_vs", {}).get(other) or level["ratios"]
            label = "ratio ours/theirs" if list(names) == [OURS, THEIRS] else f"ratio {names[0]}/{other}"
            rows.append([conc, label, _num(r["output_throughput"]) + "x", _num(r["request_throughput"]) + "x",
                         f"{_num(r['ttft_s_p50'])}x / - / {_num(r['ttft_s_p99'])}x",
                         f"{_num(r['tpot_s_p50'])}x / - / {_num(r['tpot_s_p99'])}x", "",
                         f"{_num(r['e2e_s_p50'])}x / - / {_num(r['e2e_s_p99'])}x"] + [""] * (len(header) - 8))
    return header, rows


def runs_rows(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of `mlx-pd bench --url` runs (one row per level)."""
    with_goodput = any("goodput" in r["summary"] for r in results)
    rows = []
    for r in results:
        c = r["config"]
        conc = str(c["concurrency"]) if not c.get("rate") else f"rate {c['rate']}/s"
        rows.append(run_row(conc, c.get("workload", "chat"), r["summary"], with_goodput))
    header = level_header(with_goodput)
    header[1] = "workload"
    return header, rows


def memory_rows(result: dict) -> list[list[str]]:
    """Rows: server, RSS idle (after load), RSS after the run, peak RSS."""
    rows = []
    for name in result.get("targets") or (OURS, THEIRS):
        idle = result.get("memory_idle", {}).get(name, {})
        end = result.get("memory", {}).get(name, {})
        rows.append([name, _num(idle.get("rss_mib"), 0), _num(end.get("rss_mib"), 0),
                     _num(end.get("peak_rss_mib"), 0)])
    return rows


MEMORY_HEADER = ["server", "RSS before load (MiB)", "RSS after run (MiB)", "peak RSS (MiB)"]


def print_compare(result: dict, out: Optional[TextIO] = None) -> None:
    """Print the comparison and memory tables (latencies in ms)."""
    names = result.get("targets") or [OURS, THEIRS]
    header, rows = compare_rows(result)
    _print_table(f"{' vs '.join(names)} - {result.get('workload', 'chat')}, max_tokens {result['max_tokens']}, "
                 "latencies in ms", header, rows, out)
    if result.get("memory"):
        _print_table("resident memory", MEMORY_HEADER, memory_rows(result), out)
    from benchmarks.host_cpu import CPU_HEADER, cpu_rows

    if cpu_rows(result):
        _print_table("host CPU time of each server's process tree over its rounds (lower is better)", CPU_HEADER,
                     cpu_rows(result), out)
    for level in result["levels"]:
        for other, s in level.get("sanity_vs", {"": level.get("sanity")}).items():
            if s:
                print(f"{_conc(level)} {names[0]} vs {other or names[1]}: identical greedy text "
                      f"{s['identical_text']}/{s['pairs']}, errors {s['errors']}, early EOS stops {s['early_stops']}",
                      file=out)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_compare(result: dict) -> str:
    """The comparison (and, when measured, memory and host CPU time) tables as Markdown (what docs/BENCHMARKS.md
    shows)."""
    from benchmarks.host_cpu import CPU_HEADER, cpu_rows

    text = markdown_table(*compare_rows(result)) + "\n"
    if result.get("memory"):
        text += "\n" + markdown_table(MEMORY_HEADER, memory_rows(result)) + "\n"
    if cpu_rows(result):
        text += "\n" + markdown_table(CPU_HEADER, cpu_rows(result)) + "\n"
    return text


def markdown_runs(results: list[dict]) -> str:
    """`mlx-pd bench --url` runs as a Markdown table."""
    return markdown_table(*runs_rows(results)) + "\n"


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
