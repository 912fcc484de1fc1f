"""`mlx-pd profile`: the chip table, the measured peaks, the analysis of a profile on synthetic data with known
answers, and one short real run over the default model with the real engine (unique prompts: no cache hit)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fastapi import FastAPI, Request  # module level: FastAPI resolves the string annotations here

from benchmarks import chips, profile
from benchmarks.profile_report import markdown_profile, print_profile


def test_chip_table_lookup():
    m3 = chips.table_peak("Apple M3 Max", 30)
    assert m3.bandwidth_bytes_per_s == 300e9 and m3.gpu_cores == 30 and m3.approximate_flops
    full = chips.table_peak("M3 Max")  # default: the largest bin
    assert full.gpu_cores == 40 and full.bandwidth_bytes_per_s == 400e9
    assert chips.table_peak("M4 Max").bandwidth_bytes_per_s == 546e9
    assert chips.table_peak("M2 Ultra").flops == pytest.approx(2 * chips.table_peak("M2 Max").flops)
    assert chips.table_peak("M1").flops == pytest.approx(2.6e12)
    assert chips.table_peak("Intel Xeon") is None
    with pytest.raises(ValueError, match="not in the table"):
        chips.machine_peak("M9 Hyper")
    names = {r["chip"] for r in chips.table_rows()}
    assert {f"Apple M{g}{v}" for g in "1234" for v in ("", " Pro", " Max")} <= names
    assert {"Apple M1 Ultra", "Apple M2 Ultra", "Apple M3 Ultra"} <= names


def test_measured_peaks_are_positive():
    peak = chips.measure_peaks(matmul_n=256, copy_mib=8, repeats=2)
    assert peak.flops > 1e8 and peak.bandwidth_bytes_per_s > 1e8
    assert peak.source.startswith("measured") and not peak.approximate_flops


def test_default_lengths():
    assert profile.default_lengths(2048) == ((128, 256, 512, 1024, 2048), (1536,))
    assert profile.default_lengths(4096) == ((128, 256, 512, 1024, 2048, 4096), (3072,))
    assert profile.default_lengths(3000)[0][-1] == 3000
    with pytest.raises(ValueError):
        profile.ProfileConfig(lengths=(128, 256), held_out=(256,))


def synthetic_raw(a=4e-3, b=3e-6) -> dict:
    """A raw in-process result whose prefill follows a*T + b*T^2 exactly and whose decode is known."""
    samples = [{"tokens": t, "ttft_s": a * t + b * t * t + 0.01, "prefill_s": a * t + b * t * t, "cached_tokens": 0,
                "held_out": held} for t, held in [(128, False), (256, False), (512, False), (1024, False),
                                                  (2048, False), (1536, True)] for _ in range(2)]
    return {"mode": "engine", "config": {"repeats": 2, "contexts": [2048, 8192]},
            "model": {"name": "toy", "dtype": "float32", "layers": 30, "kv_heads": 3, "head_dim": 64, "kv_bits": None,
                      "kv_group_size": 64, "max_model_len": 8192, "kv_bytes_per_token": 46080,
                      "params_total": 134_515_008, "params_matmul": 100_000_000, "param_bytes": 500_000_000},
            "kv_pool": {"usable_blocks": 704, "block_size": 32, "bytes": 704 * 32 * 46080},
            "prefill_samples": samples,
            "decode": [{"batch": 4, "tokens_per_s": 40.0, "step_s": [0.1] * 8, "context_tokens_mean": 1000}]}


def test_analyze_synthetic_profile_known_answers(tmp_path):
    peak = chips.Peak(flops=100e9, bandwidth_bytes_per_s=20e9, source="test")
    p = profile.analyze(synthetic_raw(), peak)
    assert p["fit"]["a"] == pytest.approx(4e-3) and p["fit"]["b"] == pytest.approx(3e-6)
    assert p["fit"]["r2"] == pytest.approx(1.0)
    (h,) = p["held_out"]
    assert h["tokens"] == 1536 and abs(h["rel_error"]) < 1e-9
    pt = next(x for x in p["prefill"] if x["tokens"] == 1024)
    tps = 1024 / (4e-3 * 1024 + 3e-6 * 1024**2)
    assert pt["tokens_per_s"] == pytest.approx(tps) and pt["mfu"] == pytest.approx(2 * 1e8 * tps / 100e9)
    (d,) = p["decode"]  # 10 steps/s, each reading 500 MB + 1000 x 46080 B
    assert d["bytes_per_step"] == pytest.approx(500e6 + 46.08e6)
    assert d["mbu"] == pytest.approx(10 * 546.08e6 / 20e9) and d["step_s_p50"] == pytest.approx(0.1)
    assert p["capacity"] == [{"context": 2048, "sequences": 11}, {"context": 8192, "sequences": 2}]
    assert profile.predicted_prefill_s(p, 1000) == pytest.approx(4 + 3)
    md = markdown_profile(p)
    assert "R^2 = 1.0000" in md and "1,536 (held out)" in md and "11 at 2,048" in md
    from benchmarks.plots import plot_profiles

    png = plot_profiles({"this": p, "other": profile.analyze(synthetic_raw(b=5e-6), peak)}, tmp_path / "two.png")
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size < 100_000


def test_profile_cli_help():
    from benchmarks.profile_cli import build_parser

    from pathlib import Path

    from benchmarks.profile_cli import plot_path

    args = build_parser().parse_args(["--max-len", "4096", "--batches", "1,2", "--json", "x.json"])
    assert args.max_len == 4096 and args.batches == (1, 2) and args.out == "x.json"
    assert plot_path(args) == Path("x.png")  # the plot goes next to the JSON by default
    for argv, plot in ((["--json", "x.json", "--no-plot"], None), (["--json", "x.json", "--plot", "y.png"], Path("y.png")),
                       ([], None), (["--json", "x.png"], Path("x.png.png"))):
        assert plot_path(build_parser().parse_args(argv)) == plot, argv
    r = subprocess.run([sys.executable, "-m", "cluster.launch.cli", "profile", "--help"], capture_output=True,
                       text=True, timeout=120, env={"PYTHONPATH": ".", "MLX_PD_NO_OPENBLAS": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "--max-len" in r.stdout and "--url" in r.stdout


@pytest.mark.slow
def test_short_real_profile(tmp_path, capsys):
    """The default model in-process, tiny lengths: every prompt misses the cache, the tables print, JSON + PNG."""
    from benchmarks.profile_cli import main

    out, png = tmp_path / "p.json", tmp_path / "p.png"
    rc = main(["--lengths", "32,64,128", "--held-out", "96", "--repeats", "1", "--batches", "1,2",
               "--decode-steps", "3", "--kv-cache-gb", "0.1", "--chip", "M2 Max", "--json", str(out),
               "--plot", str(png), "--no-progress"])
    assert rc == 0
    p = json.loads(out.read_text())
    assert [s["cached_tokens"] for s in p["prefill_samples"]] == [0, 0, 0, 0]
    assert {s["tokens"] for s in p["prefill_samples"]} == {32, 64, 96, 128}
    assert p["model"]["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 4  # SmolLM2-135M in float32
    assert p["peak"]["chip"] == "Apple M2 Max" and 0 < p["decode"][0]["mbu"] < 1
    assert [d["batch"] for d in p["decode"]] == [1, 2] and all(d["tokens_per_s"] > 0 for d in p["decode"])
    assert png.stat().st_size < 100_000
    text = capsys.readouterr().out
    assert "fit: prefill_s = a*T + b*T^2" in text and "held out: 96 tokens" in text and "MBU" in text
    print_profile(p)


def fake_prefill_app(a: float, b: float, gap_s: float):
    """An OpenAI stream whose TTFT is a*T + b*T^2 for a prompt of T = characters / 4 "tokens" and whose tokens
    come every `gap_s`; usage reports T as prompt_tokens."""
    import asyncio

    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        t = sum(len(m["content"]) for m in body["messages"]) // 4
        n = body["max_tokens"]

        async def events():
            await asyncio.sleep(a * t + b * t * t)
            for i in range(n):
                if i:
                    await asyncio.sleep(gap_s)
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": f"w{i} "}}]}) + "\n\n"
            usage = {"prompt_tokens": t, "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_url_mode_against_a_fake_server_with_known_prefill_curve():
    import threading
    import time

    import uvicorn

    from benchmarks.profile_http import run_url_profile
    from benchmarks.servers import free_port
    from cluster.model import resolve_model_path

    a, b, gap = 4e-4, 2e-7, 0.01
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake_prefill_app(a, b, gap), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        cfg = profile.ProfileConfig(lengths=(128, 256, 512, 768), held_out=(640,), repeats=1, batches=(1, 4),
                                    decode_steps=5, decode_prompt_tokens=64, contexts=(2048,))
        raw = run_url_profile(f"http://127.0.0.1:{port}", cfg, resolve_model_path(None), progress=False)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    p = profile.analyze(raw, chips.Peak(flops=1e12, bandwidth_bytes_per_s=1e11, source="test"))
    assert len({s["tokens"] for s in p["prefill_samples"]}) == 5  # the server's counts, one per length
    assert p["fit"]["r2"] > 0.98 and abs(p["held_out"][0]["rel_error"]) < 0.1
    assert p["model"]["params_total"] == 134_515_008 and p["kv_pool"]["assumed"]
    d1, d4 = p["decode"]
    assert 0.5 / gap < d1["tokens_per_s"] < 1.1 / gap and 2.0 / gap < d4["tokens_per_s"] < 4.4 / gap


def test_url_mode_reads_an_mlx_pd_servers_own_pool_and_each_ranks_memory():
    import httpx

    from benchmarks.profile_http import served_workers
    from benchmarks.profile_report import rank_lines

    mib = 2**20
    ranks = [{"rank": 0, "host": "10.0.0.2", "alive": True, "parameter_bytes": 50 * mib, "kv_bytes": 512 * mib,
              "peak_bytes": 600 * mib, "step_bytes": 10},
             {"rank": 1, "host": "10.0.0.3", "alive": False, "parameter_bytes": 48 * mib, "kv_bytes": 512 * mib,
              "peak_bytes": 590 * mib, "step_bytes": 10}]
    state = {"workers": [
        {"name": "prefill-0", "role": "prefill", "kv_blocks_total": 100, "kv_block_size": 32, "parallel": "",
         "ranks": []},
        {"name": "decode-0", "role": "decode", "kv_blocks_total": 500, "kv_block_size": 32, "parallel": "pipeline",
         "ranks": ranks, "running": 3}]}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/dashboard/api/state":
            return httpx.Response(404)
        if request.headers.get("authorization") != "Bearer key-1":
            return httpx.Response(401, json={"error": {"message": "log in"}})
        return httpx.Response(200, json=state)

    def client():
        return httpx.Client(transport=httpx.MockTransport(handler))

    workers = served_workers("http://router:8000/", "key-1", client())
    assert [w["name"] for w in workers] == ["prefill-0", "decode-0"] and "running" not in workers[1]
    lines = rank_lines(workers)  # the one-process prefill worker has no ranks to list
    assert lines == [
        "decode-0 (decode): a pipeline-parallel group of 2 ranks, each holding its share of the weights and of the KV",
        "  rank 0 @ 10.0.0.2: weights 50.0 MiB, KV 512.0 MiB, peak 600.0 MiB",
        "  rank 1 @ 10.0.0.3 (not heard): weights 48.0 MiB, KV 512.0 MiB, peak 590.0 MiB"]
    # without the key, or from a server that is not mlx-pd (no dashboard), the pool stays assumed
    assert served_workers("http://router:8000", None, client()) is None
    assert served_workers("http://x", None, httpx.Client(transport=httpx.MockTransport(
        lambda r: httpx.Response(404)))) is None
