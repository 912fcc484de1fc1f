"""`mlx-pd bench load-check` is registered and measures the load check and a 512-token prefill of a model; its
table gives seconds per billion parameters and the ratio to the prefill."""

from __future__ import annotations

import json


def test_bench_load_check_times_the_check_and_a_prefill_on_the_fast_model(tmp_path):
    """One run on the fast stand-in writes the check's seconds, the prefill's, the checks passed, and a table row
    whose figures follow from them."""
    from benchmarks import cli
    from benchmarks.load_check_bench import tables

    assert cli.MODULES["load-check"] == "load_check_bench" and "load-check" in cli.SUBCOMMANDS
    out = tmp_path / "lc.json"
    assert cli.main(["load-check", "--models", "fast", "--runs", "1", "--out", str(out),
                     "--markdown", str(tmp_path / "lc.md")]) == 0
    result = json.loads(out.read_text())
    fast = result["models"]["fast"]
    assert len(fast["check_s"]) == 1 and fast["check_s"][0] > 0 and fast["prefill_512_s"][0] > 0
    assert "output head equals the model's own call" in fast["checks"]
    (_, headers, rows), = tables(result)
    row = dict(zip(headers, rows[0]))
    assert row["model"] == "fast"
    assert row["s per billion parameters"] == f"{fast['check_s'][0] / fast['parameters'] * 1e9:.0f}"
    assert "The load check's cost" in (tmp_path / "lc.md").read_text()
