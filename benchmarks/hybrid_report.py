"""The tables of `mlx-pd bench hybrid-turns` (benchmarks/hybrid_bench.py): per-turn TTFT cached vs cold next to
mlx_lm.server, the summary of the last turns, the state snapshots (from /metrics and the in-process replay) and
the RSS over many conversations, as (title, headers, rows) for the terminal and Markdown."""

from __future__ import annotations

from typing import Optional

from benchmarks.compare import OURS, THEIRS

OURS_COLD, THEIRS_COLD = f"{OURS} cold", f"{THEIRS} cold"
FAMILIES = {OURS: (OURS, OURS_COLD), THEIRS: (THEIRS, THEIRS_COLD)}  # cached server, cold server
MiB = 2**20


def _s(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def _mib(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / MiB:.1f}"


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) for the terminal and the Markdown report."""
    out = []
    turns = result.get("turns_phase")
    if turns:
        recs = turns["records"]
        head, names = ["turn", "user msg tok"], [n for n in (OURS, OURS_COLD, THEIRS, THEIRS_COLD) if n in recs]
        for family, (cached, cold) in FAMILIES.items():
            if cached in recs:
                head += [f"{family} prompt tok", "cached TTFT s", "cached tok", "cold TTFT s", "cold tok",
                         "cold / cached"]
        rows = []
        for t in range(max(len(recs[n]) for n in names)):
            row = [str(t + 1), str(turns["user_message_tokens"][t])]
            for family, (cached, cold) in FAMILIES.items():
                if cached not in recs:
                    continue
                a = recs[cached][t] if t < len(recs[cached]) else None
                b = recs[cold][t] if cold in recs and t < len(recs[cold]) else None
                ratio = b["ttft_s"] / a["ttft_s"] if a and b and a["ttft_s"] and b["ttft_s"] else None
                row += [str(a["prompt_tokens"]) if a else "-", _f(a and a["ttft_s"]),
                        str(a["cached_tokens"]) if a else "-", _f(b and b["ttft_s"]),
                        str(b["cached_tokens"]) if b else "-", _f(ratio, ".1f") + ("x" if ratio else "")]
            rows.append(row)
        out.append((f"One conversation, {result['turns']} turns, max_tokens {result['max_tokens']}: TTFT cached vs "
                    f"cold per turn (cached tok = usage.prompt_tokens_details.cached_tokens)", head, rows))
        srows = []
        for family, s in turns["summary"].items():
            srows.append([family, str(s["last_turns"]), _f(s["last_cached_ttft_s"]), _f(s["last_cold_ttft_s"]),
                          _f(s["last_ratio"], ".1f") + "x", _f(s["all_ratio"], ".1f") + "x",
                          f"{s['last_cached_tokens']} / {s['last_prompt_tokens']}",
                          f"{s['same_answer_cold_vs_cached']} / {s['ok_pairs']}", str(s["cold_cached_tokens"])])
        out.append(("Cached vs cold", ["server", "last turns", "cached TTFT mean s", "cold TTFT mean s",
                                       "cold / cached (last turns)", "cold / cached (all turns)",
                                       "cached / prompt tok (last turns)", "same answer cold and cached",
                                       "cold server's cached tok (all turns)"], srows))
        mrows = []
        for n in names:
            b, a = turns["memory_before"][n], turns["memory_after"][n]
            mrows.append([n, _f(turns["idle_cpu"].get(n), ".3f"), _f(b["rss_mib"], ".0f"), _f(a["rss_mib"], ".0f"),
                          _f(a["peak_rss_mib"], ".0f")])
        out.append((f"The servers of the turns phase ({turns['wall_s'] / 60:.1f} min)",
                    ["server", "idle CPU (cores)", "RSS before MiB", "RSS after MiB", "peak RSS MiB"], mrows))
        for n, ms in (turns.get("snapshot_metrics") or {}).items():
            base = (turns.get("snapshot_metrics_after_warmup") or {}).get(n) or {}
            rows = [["after warm-up", _f(base.get("snapshots"), ".0f"), _mib(base.get("bytes")),
                     _mib(base.get("budget_bytes")), _f(base.get("restored"), ".0f")]]
            rows += [[str(t + 1), _f(m["snapshots"], ".0f"), _mib(m["bytes"]), _mib(m["budget_bytes"]),
                      _f(m["restored"], ".0f")] for t, m in enumerate(ms)]
            out.append((f"{n}: state snapshots after each turn (/metrics)",
                        ["turn", "snapshots", "MiB held", "budget MiB", "restored (total)"], rows))
    snaps = result.get("snapshots_phase") or {}
    if "turns" in snaps:
        rows, bs = [], snaps["turns"]["config"].get("block_size", 32)
        served = ((turns or {}).get("snapshot_metrics") or {}).get(OURS, [])
        base = ((turns or {}).get("snapshot_metrics_after_warmup") or {}).get(OURS) or {}
        for r in snaps["turns"]["rows"]:
            # the server's, less what its warm-up requests left (nothing is evicted within the default budget)
            m = served[r["turn"] - 1] if r["turn"] <= len(served) else None
            same = "-" if m is None or m["bytes"] is None else (
                "yes" if (m["snapshots"] - (base.get("snapshots") or 0), m["bytes"] - (base.get("bytes") or 0))
                == (r["snapshots"], r["bytes"]) else "NO")
            shared = r.get("shared_with_previous")
            ideal = r.get("block_ideal", None if shared is None else min(shared, r["prompt_tokens"] - 1) // bs * bs)
            prev = r.get("previous_prompt_tokens")
            # where the restored state came from: inside the previous answer, or the previous prompt's last block
            source = "-" if prev is None or not r["cached_tokens"] else (
                "answer" if r["cached_tokens"] > (prev - 1) // bs * bs else "prompt")
            rows.append([str(r["turn"]), str(r["prompt_tokens"]), str(r["cached_tokens"]),
                         str(r.get("http_cached_tokens", "-")), "-" if prev is None else str(prev),
                         "-" if shared is None else str(shared), "-" if ideal is None else str(ideal), source,
                         str(r["snapshots"]), _f(r["bytes"] / MiB, ".1f"), _f(r["budget_bytes"] / MiB, ".0f"),
                         f"{r['saved']} / {r['evicted']} / {r['restored']}",
                         {True: "yes", False: "NO"}.get(r.get("same_answer_as_http"), "-"), same])
        c = snaps["turns"]["config"]
        one = _f((result.get("state_bytes_per_snapshot") or 0) / MiB)
        out.append((f"State snapshots of mlx-pd's conversation, replayed in process (state_cache_gb "
                    f"{_f(c['state_cache_gb'], '.4g')} of kv_cache_gb {_f(c['kv_cache_gb'], '.4g')}, one snapshot "
                    f"{one} MiB)", ["turn", "prompt tok", "cached tok", "server's cached tok", "previous prompt tok",
                              "shared with previous prompt + answer ids", "block ideal", "restored from",
                              "snapshots held", "MiB held", "budget MiB", "saved / evicted / restored",
                              "answer = server's", "snapshots = server's (/metrics, less warm-up)"], rows))
    if "rss" in snaps:
        c = snaps["rss"]["config"]
        rows = [[str(r["conversation"]), str(r["snapshots"]), _f(r["bytes"] / MiB, ".1f"),
                 _f(r["budget_bytes"] / MiB, ".0f"), str(r["saved"]), str(r["evicted"]), str(r["restored"]),
                 f"{r['kv_blocks_cached']} / {r['kv_blocks_total']}"]
                for r in snaps["rss"]["rows"]]
        out.append((f"State snapshots over the rss phase's first conversations, in process (state_cache_gb "
                    f"{_f(c['state_cache_gb'], '.4g')}, kv_cache_gb {_f(c['kv_cache_gb'], '.4g')})",
                    ["after conversation", "snapshots held", "MiB held", "budget MiB", "saved", "evicted",
                     "restored", "KV blocks cached / total"], rows))
    rss = result.get("rss_phase")
    if rss:
        rows = []
        for r in rss["rows"]:
            m = r.get("snapshot_metrics") or {}
            rows.append([str(r["conversation"]), _f(r["rss_mib"], ".1f"), _f(r["peak_rss_mib"], ".1f"),
                         _f(m.get("snapshots"), ".0f"), _mib(m.get("bytes")), _mib(m.get("budget_bytes")),
                         f"{r['cached_tokens']} / {r['prompt_tokens']}", _f(_mean(r["ttft_s"])), str(r["errors"])])
        out.append((f"mlx-pd RSS after each conversation ({len(rss['rows'])} conversations; first "
                    f"{rss['first_rss_mib']:.0f} MiB, last {rss['last_rss_mib']:.0f} MiB, "
                    f"growth {rss['growth_mib']:+.0f} MiB, "
                    f"{rss['growth_after_settle_mib']:+.0f} MiB after conversation {rss['settle_after']})",
                    ["conversation", "RSS MiB", "peak RSS MiB", "snapshots (/metrics)", "MiB held", "budget MiB",
                     "cached / prompt tok", "TTFT mean s", "errors"], rows))
    return out
