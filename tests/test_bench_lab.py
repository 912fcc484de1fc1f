"""The lab benchmarks' parts that need no network namespaces: the TTFT client of `mlx-pd bench lab-ttft`
(benchmarks/lab_ttft.py) against a live single-node server of the fast model, and its table."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.lab_ttft import tables
from benchmarks.reliability_long import fast_model_dir
from tests.live_server import live_model_server


def test_lab_ttft_client_records_the_first_and_second_token_of_each_prompt(tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["Tell me about the sea. " * 20, "And the sky? " * 30]))
    with live_model_server(fast_model_dir(), api_key="k3y") as (base, _):
        served = fast_model_dir().name
        out = subprocess.run([sys.executable, "-m", "benchmarks.lab_ttft", "client", "--url", base + "/v1",
                              "--key", "k3y", "--prompts-file", str(prompts), "--model", served,
                              "--max-tokens", "4"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 2 and all(r["error"] is None for r in rows), rows
    assert all(0 < r["ttft_s"] <= r["second_s"] for r in rows) and all(r["tokens"] >= 2 for r in rows)


def test_lab_ttft_table_shows_each_format_in_milliseconds():
    result = {"rate": "1gbit", "prompts": 4, "prompt_tokens": 2048, "model": "default", "formats": {
        "float32": {"kv_mb_per_request": 95.8, "ttft_s": 22.9, "second_s": 24.0, "handoff_s": 1.1, "errors": 0},
        "8-bit g64": {"kv_mb_per_request": 27.0, "ttft_s": None, "second_s": None, "handoff_s": None,
                      "errors": 4}}}
    (title, header, rows), = tables(result)
    assert "1gbit" in title and header[0] == "KV on the wire"
    assert rows == [["float32", "95.8", "22900", "24000", "1100", "0"], ["8-bit g64", "27.0", "-", "-", "-", "4"]]
