"""The SSD-tier benchmark (`mlx-pd bench ssd-tier`, benchmarks/ssd_tier_bench.py) without a model or a server: it
is registered with its documented defaults; its sessions have the asked size, differ from their first tokens on,
and go on as previous messages + answer + a short new message; the pool it sizes holds the asked number of
sessions; and its report's arithmetic (TTFT percentiles and ratios, cached tokens, restore GB/s from /metrics
deltas against the disk's read, oMLX's published rate) is what the numbers say."""

from __future__ import annotations

import argparse
import math

import pytest

from benchmarks import cli
from benchmarks import ssd_tier_bench as ssd
from benchmarks.workloads import approx_tokens


def test_ssd_tier_is_registered_with_its_documented_defaults():
    assert cli.MODULES["ssd-tier"] == "ssd_tier_bench" and "ssd-tier" in cli.SUBCOMMANDS
    a = cli.build_subcommand_parser("ssd-tier").parse_args([])
    assert (a.sessions, a.session_tokens, a.rounds, a.max_tokens, a.repeats) == (4, 6000, 3, 16, 1)
    assert (a.kv_bits, a.kv_cache_gb, a.pool_sessions, a.ssd_cache_gb, a.disk_probe_gb) == (8, None, 1.25, 2.0, 1.0)
    assert a.targets == "mlx-pd ssd,mlx-pd no-ssd,mlx_lm.server" and a.ports is None and not a.no_restart
    assert cli.build_subcommand_parser("ssd-tier").parse_args(["--ports", "8600-8699"]).ports == (8600, 8699)


def test_ports_parse_as_an_inclusive_range():
    assert ssd.parse_ports("8600-8699") == (8600, 8699) and ssd.parse_ports("8600") == (8600, 8600)
    assert ssd.parse_ports(None) is None
    for bad in ("x-y", "8699-8600", "0-10"):
        with pytest.raises(argparse.ArgumentTypeError):
            ssd.parse_ports(bad)


def test_sessions_have_the_asked_size_differ_from_the_start_and_follow_up_on_their_answers():
    sessions = ssd.build_sessions(3, 1500, 4, approx_tokens, tag="t", seed=1)
    assert [s.user for s in sessions] == [0, 1, 2] and all(len(s.questions) == 5 for s in sessions)
    for s in sessions:
        opening = approx_tokens(s.system) + approx_tokens(s.questions[0])
        assert abs(opening + ssd.TEMPLATE_TOKENS - 1500) <= 60
        assert all(approx_tokens(q) < 100 for q in s.questions[1:])  # follow-ups are short
    assert len({s.system[:4] for s in sessions}) == 3  # each session's own tag, in its first characters
    assert ssd.build_sessions(3, 1500, 4, approx_tokens, tag="t", seed=1) == sessions  # deterministic
    # turn 2 = turn 1's messages + the answer as it came back + the next short message
    s = sessions[0]
    one = s.messages(1, ["a0"])
    two = s.messages(2, ["a0", "a1"])
    assert two[:len(one)] == one and two[len(one):] == [{"role": "assistant", "content": "a1"},
                                                        {"role": "user", "content": s.questions[2]}]


def test_the_pool_holds_the_asked_sessions_and_the_prompt_bound_covers_every_turn():
    sessions = ssd.build_sessions(2, 800, 3, approx_tokens, tag="p")
    bound = ssd.longest_prompt_tokens(sessions, 3, 16, approx_tokens)
    text = max(sum(approx_tokens(m["content"]) for m in s.messages(3, ["w " * 12] * 3)) for s in sessions)
    assert bound >= text + 3 * 16 - 3 * approx_tokens("w " * 12)  # the answers' max_tokens counted in
    # 1000 tokens -> 32 blocks of 32 + one for the answer = 33 blocks; 1.25 sessions of 1000-byte blocks
    assert ssd.pool_gb(1000, 1000, 32, 1.25) == pytest.approx(1.25 * 33 * 1000 / 2**30)


def _row(ttft, cached=100, prompt=1000, error=None):
    return {"record": {"ttft_s": ttft, "cached_tokens": cached, "prompt_tokens": prompt, "error": error}}


def test_followup_summary_and_ratios():
    s = ssd.followup_summary([_row(1.0), _row(2.0), _row(3.0), _row(4.0), _row(None, error="HTTP 500")])
    assert (s["requests"], s["errors"]) == (5, 1)
    assert s["ttft_s"]["p50"] == 2.5 and s["ttft_s"]["p90"] == pytest.approx(3.7)  # linear interpolation
    assert s["cached_tokens"] == [100] * 4 and s["hit_rate"] == 0.1
    summaries = {"a": {"ttft_s": {"p50": 2.0, "p90": 4.0}}, "b": {"ttft_s": {"p50": 10.0, "p90": 8.0}}}
    r = ssd.ttft_ratios(summaries, "a")
    assert r["b"] == {"p50": 5.0, "p90": 2.0} and r["a"] == {"p50": 1.0, "p90": 1.0}
    assert math.isnan(ssd.ttft_ratios(summaries, "missing")["a"]["p50"])


def _metrics(blocks, nbytes, secs):
    m = {k: 0.0 for k in ssd.SSD_METRICS}
    m.update({"mlx_pd_kv_ssd_blocks_loaded": blocks, "mlx_pd_kv_ssd_bytes_loaded": nbytes,
              "mlx_pd_kv_ssd_load_seconds": secs})
    return m


def test_restore_rate_is_the_metrics_deltas_over_the_disks_read_and_omlx_is_its_published_figure():
    r = ssd.restore_rate(_metrics(10, 1e9, 1.0), _metrics(110, 3e9, 2.0), 32, disk_gbps=4.0)
    assert (r["blocks"], r["bytes"], r["seconds"]) == (100, 2e9, 1.0)
    assert r["gbps"] == 2.0 and r["tokens_per_s"] == 3200 and r["of_disk"] == 0.5
    assert math.isnan(ssd.restore_rate(_metrics(0, 0, 0), _metrics(0, 0, 0), 32)["gbps"])  # nothing loaded
    assert ssd.omlx_tokens_per_s() == pytest.approx(16384 / 3.66)


def test_the_summary_pools_rows_per_target_and_counts_the_restart_apart():
    def rows(ttfts, restart=False):
        out = []
        for i, t in enumerate(ttfts):
            row = _row(t)
            row.update(session=i, turn=9 if restart else 1, ssd_before=_metrics(0, 0, 0),
                       ssd_after=_metrics(4, 4e8, 0.5))
            if restart:  # dropped before every request after the restart (None: done)
                row["drop_page_cache"] = None
            out.append(row)
        return out

    result = {"block_size": 32, "disk": {"gbps": 1.6, "bytes": 2**30, "seconds": 0.67, "page_cache_dropped": True,
                                         "why_not": None},
              "sessions": 2, "session_tokens": 1500, "rounds": 1, "max_tokens": 8, "pool_tokens": 2000, "kv_bits": 8,
              "repeats": 1, "tmp_dir": "/tmp/x", "filesystem": {"type": "ext4", "device": "/dev/vda"},
              "omlx": {**ssd.OMLX, "tokens_per_s": ssd.omlx_tokens_per_s()},
              "runs": [{"repeat": 0, "order": list(ssd.TARGETS), "targets": {
                  ssd.TIER: {"opening": rows([5.0, 5.0]), "followups": rows([1.0, 1.0]),
                             "restart": rows([2.0, 2.0], restart=True)},
                  ssd.NO_TIER: {"opening": rows([5.0, 5.0]), "followups": rows([4.0, 6.0])},
                  ssd.THEIRS: {"opening": rows([6.0, 6.0]), "followups": rows([0.5, 0.5])}}}]}
    s = ssd.summarize(result)
    assert s["followups"][ssd.NO_TIER]["ttft_s"]["p50"] == 5.0 and s["ratio_to_tier"][ssd.NO_TIER]["p50"] == 5.0
    assert s["ratio_to_tier"][ssd.RESTART]["p50"] == 2.0 and s["ratio_to_no_tier"][ssd.RESTART]["p50"] == 0.4
    assert s["followups"][ssd.THEIRS]["opening"]["ttft_s"]["p50"] == 6.0
    after = s["restore"]["after restart (page cache dropped first)"]
    assert (after["blocks"], after["bytes"], after["seconds"]) == (8, 8e8, 1.0) and after["page_cache_dropped"]
    assert after["gbps"] == pytest.approx(0.8) and after["of_disk"] == pytest.approx(0.5)
    assert not s["restore"]["follow-up rounds (page cache as it was)"]["page_cache_dropped"]
    assert result["errors"] == 0
    titles = [t for t, _, _ in ssd.tables(result)]
    assert titles[0].startswith("Follow-up turns") and any("restore" in t for t in titles)
