"""The SSD tier's soak (`mlx-pd bench ssd-soak`, benchmarks/ssd_tier_soak.py) without a model or a server: it is
registered with its documented defaults; follow-ups come `lag` sessions after their openings; the folder walk
counts every file (block, temporary, lock) in nested folders; the RSS slope is a least-squares fit after the
warm-up, in MiB per 100 sessions; a folder over its budget shows in the summary and the table; the server log's
warnings, errors and tracebacks are counted."""

from __future__ import annotations

import math

import pytest

from benchmarks import cli
from benchmarks import ssd_tier_soak as soak
from benchmarks.prefix_report import markdown


def test_ssd_soak_is_registered_with_its_documented_defaults():
    assert cli.MODULES["ssd-soak"] == "ssd_tier_soak" and "ssd-soak" in cli.SUBCOMMANDS
    a = cli.build_subcommand_parser("ssd-soak").parse_args([])
    assert (a.sessions, a.session_tokens, a.max_tokens, a.followup_every, a.followup_lag) == (240, 300, 8, 2, None)
    assert (a.concurrency, a.kv_cache_gb, a.pool_sessions, a.ssd_budget_mb, a.sample_every) == (1, None, 4.0, 32.0, 10)
    assert a.warmup_fraction == 0.1 and a.ports is None and a.model_dir is None and a.tmp_dir is None
    assert cli.build_subcommand_parser("ssd-soak").parse_args(["--ports", "8600-8699"]).ports == (8600, 8699)


def test_followups_come_lag_sessions_after_their_openings():
    plan = soak.followup_plan(20, 3, 5)
    assert plan == {5: 0, 8: 3, 11: 6, 14: 9, 17: 12}  # every 3rd session, 5 later; none past the last session
    assert soak.followup_plan(20, 0, 5) == {} and soak.followup_plan(4, 1, 5) == {}
    assert soak.default_lag(4.0, 1) == 9 and soak.default_lag(1.25, 2) == 5


def test_the_folder_walk_counts_every_file_in_nested_folders(tmp_path):
    fp = tmp_path / "0123456789abcdef0123456789abcdef"
    fp.mkdir()
    (fp / "00000000000000aa.kv").write_bytes(b"k" * 1000)
    (fp / "00000000000000aa.st").write_bytes(b"s" * 200)
    (fp / ".00000000000000bb.kv.tmp").write_bytes(b"t" * 50)
    (fp / "lock").write_text("1234")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "00000000000000cc.kv").write_bytes(b"k" * 7)
    u = soak.folder_usage(tmp_path)
    assert u == {"bytes": 1000 + 200 + 50 + 4 + 7, "files": 5, "block_files": 3, "block_bytes": 1207, "tmp_files": 1,
                 "dirs": 2}
    assert soak.folder_usage(tmp_path / "absent")["files"] == 0


def _samples(rss, folder_bytes, every=10):
    return [{"n": i * every, "requests": i * every, "t": float(i), "rss_mib": r,
             "folder": {"bytes": b, "files": b // 100, "block_files": b // 100, "block_bytes": b, "tmp_files": 0,
                        "dirs": 1},
             "metrics": {"mlx_pd_kv_ssd_blocks_written": 10.0 * i, "mlx_pd_kv_ssd_blocks_loaded": float(i),
                         "mlx_pd_kv_ssd_blocks_dropped": 0.0, "mlx_pd_kv_ssd_bytes": float(b),
                         "mlx_pd_kv_ssd_budget_bytes": 1000.0}}
            for i, (r, b) in enumerate(zip(rss, folder_bytes))]


def test_the_rss_slope_is_fitted_after_the_warm_up_in_mib_per_100_sessions():
    # a warm-up jump, then 0.05 MiB a session: 5 MiB per 100 sessions, whatever came before session 20
    rss = [300.0, 340.0] + [350.0 + 0.05 * n for n in range(20, 110, 10)]
    fit = soak.rss_fit(_samples(rss, [0] * len(rss)), from_n=20)
    assert fit["slope_mib_per_100"] == pytest.approx(5.0)
    assert (fit["first_mib"], fit["steady_start_mib"], fit["end_mib"]) == (300.0, pytest.approx(351.0),
                                                                          pytest.approx(355.0))
    assert fit["samples"] == 9 and fit["fitted_growth_mib"] == pytest.approx(4.0)
    flat = soak.rss_fit(_samples([300.0, 320, 320, 320, 320], [0] * 5), from_n=10)
    assert flat["slope_mib_per_100"] == pytest.approx(0.0) and flat["max_mib"] == 320
    one = soak.rss_fit(_samples([300.0, 320.0], [0, 0]), from_n=10)  # one sample after the warm-up: no slope
    assert math.isnan(one["slope_mib_per_100"]) and one["end_mib"] == 320.0


def test_a_folder_over_its_budget_shows_in_the_summary_and_the_table():
    samples = _samples([300.0] * 5, [0, 600, 990, 1100, 1000])
    samples[-1]["quiet"] = True
    rows = [{"session": 0, "turn": 0, "error": None, "prompt_tokens": 300, "cached_tokens": 0, "ttft_s": 0.1},
            {"session": 0, "turn": 1, "error": None, "prompt_tokens": 320, "cached_tokens": 288, "ttft_s": 0.05},
            {"session": 1, "turn": 1, "error": "HTTP 500", "prompt_tokens": None, "cached_tokens": None,
             "ttft_s": None}]
    result = {"samples": samples, "requests": rows, "warmup_sessions": 10, "ssd_budget_bytes": 1000,
              "sessions": 40, "session_tokens": 300, "followups": 2, "followup_lag": 9, "concurrency": 1,
              "pool_tokens": 1792, "wall_s": 12.0, "server_log": soak.log_findings("")}
    sm = soak.summarize(result)
    f = sm["folder"]
    assert f["max_bytes"] == 1100 and f["max_at_n"] == 30 and f["over_budget"] == [[30, 1100]]
    assert f["first_full_n"] == 20 and f["end_bytes"] == 1000 and f["max_of_budget"] == pytest.approx(1.1)
    assert sm["rss"]["samples"] == 3  # the quiet sample is not in the fit
    assert sm["requests"]["followups"]["errors"] == 1 and sm["requests"]["followups"]["hit_rate"] == 0.9
    assert result["errors"] == 1 and sm["counters"]["mlx_pd_kv_ssd_blocks_written"] == 40.0
    text = markdown(soak.tables(result))
    assert "| samples over the budget | 1: session 30 (0.00 MiB) |" in text
    assert "| 40 (quiet) |" in text and text.count("(quiet)") == 1
    assert "+0.00 MiB per 100 sessions" in text and "SSD tier soak: 40 sessions" in text
    assert text.count("\n| ") >= 16 + 5  # the figures and every sample


def test_the_server_log_s_warnings_errors_and_tracebacks_are_counted():
    text = ("INFO fine\nWARNING cluster.kv: slow\nERROR cluster.kv.disk_tier: SSD tier: writing off\n"
            "Traceback (most recent call last):\n  File x\nWARNING cluster.kv: slow\n")
    got = soak.log_findings(text, examples=2)
    assert (got["warnings"], got["errors"], got["tracebacks"]) == (2, 1, 1)
    assert got["examples"] == ["WARNING cluster.kv: slow", "ERROR cluster.kv.disk_tier: SSD tier: writing off"]
