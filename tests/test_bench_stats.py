"""Statistics of the benchmark reports on synthetic data with known answers: percentiles, goodput, prefix hit
rate, the prefill fit, MFU/MBU/capacity; the workloads' uniqueness rules; the report and plot outputs.
No model is loaded."""

from __future__ import annotations

import asyncio
import json
import math
import random

import pytest

from benchmarks import compare, doc_blocks, plots, roofline
from benchmarks.loadgen import WorkloadConfig, prompt_key, run_benchmark
from benchmarks.report import markdown_compare, markdown_runs
from benchmarks.scenarios import WorkloadSpec, build_workload
from benchmarks.servers import one_p_one_d_topology
from benchmarks.stats import RequestRecord, goodput, parse_slos, percentile, prefix_hit_rate, summarize
from tests.test_bench import fake_server  # noqa: F401  (a fixture this module uses)


def rec(i, ttft, e2e, n=11, prompt=100, cached=0, error=None):
    return RequestRecord(index=i, ttft_s=ttft, e2e_s=None if error else e2e, output_tokens=n, prompt_tokens=prompt,
                         cached_tokens=cached, error=error)


# --- percentiles ----------------------------------------------------------------------------------------

def test_percentiles_of_a_uniform_grid():
    data = list(range(0, 1001))  # 0..1000: the q-th percentile is exactly 10*q
    random.Random(1).shuffle(data)
    for q in (0, 50, 90, 99, 100):
        assert percentile(data, q) == pytest.approx(10 * q)
    assert percentile([5, 1], 25) == pytest.approx(2.0)  # 1 + (5 - 1) * 0.25


# --- goodput ------------------------------------------------------------------------------------------

def test_goodput_counts_requests_meeting_every_slo():
    # TPOT = (e2e - ttft) / 10: 0.05, 0.1, 0.2, 0.05
    recs = [rec(0, 0.1, 0.6), rec(1, 0.2, 1.2), rec(2, 0.3, 2.3), rec(3, 0.9, 1.4), rec(4, 0.1, 0, error="boom")]
    slos = parse_slos(["ttft:500", "tpot:120"])
    assert slos == {"ttft_s": 0.5, "tpot_s": 0.12}
    g = goodput(recs, 10.0, slos)
    # good: #0 (0.1 s, 50 ms) and #1 (0.2 s, 100 ms); #2 misses TPOT, #3 misses TTFT, #4 failed
    assert g["good_requests"] == 2 and g["attainment"] == pytest.approx(2 / 5)
    assert g["request_goodput"] == pytest.approx(0.2) and g["output_goodput"] == pytest.approx(2.2)
    assert goodput(recs, 10.0, {"e2e_s": 1.3})["good_requests"] == 2  # #0 and #1
    one_token = RequestRecord(index=9, ttft_s=0.1, e2e_s=0.1, output_tokens=1)
    assert goodput([one_token], 1.0, {"tpot_s": 0.001})["good_requests"] == 1  # no TPOT: meets a TPOT SLO
    s = summarize(recs, 10.0, slos)
    assert s["goodput"]["good_requests"] == 2 and "goodput" not in summarize(recs, 10.0)


@pytest.mark.parametrize("bad", ["ttft", "ttft:abc", "latency:5", "tpot:0", "tpot:-1"])
def test_bad_slos_are_clear_errors(bad):
    with pytest.raises(ValueError, match="SLO"):
        parse_slos([bad])


def test_prefix_hit_rate_sums_tokens():
    recs = [rec(0, 0.1, 1, prompt=100, cached=64), rec(1, 0.1, 1, prompt=300, cached=0),
            RequestRecord(index=2, ttft_s=0.1, e2e_s=1, output_tokens=3, prompt_tokens=50)]  # no cached: ignored
    assert prefix_hit_rate(recs) == pytest.approx(64 / 400)
    assert summarize(recs, 1.0)["prefix_hit_rate"] == pytest.approx(0.16)
    assert math.isnan(prefix_hit_rate([RequestRecord(index=0, ttft_s=1, e2e_s=2)]))


# --- the prefill fit and the roofline numbers ----------------------------------------------------------------

def test_fit_recovers_known_coefficients_and_predicts_held_out():
    a, b = 5e-3, 2e-6
    lengths = [128, 256, 512, 1024, 2048]
    fit = roofline.fit_prefill(lengths, [a * t + b * t * t for t in lengths])
    assert fit.a == pytest.approx(a, rel=1e-9) and fit.b == pytest.approx(b, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0) and max(abs(r) for r in fit.residuals_s) < 1e-12
    (h,) = roofline.held_out_errors(fit, [1536], [a * 1536 + b * 1536**2])
    assert abs(h["rel_error"]) < 1e-9


def test_fit_with_noise_reports_residuals_and_r_squared():
    rng = random.Random(7)
    a, b = 1e-2, 1e-5
    lengths = [100 * k for k in range(1, 21)]
    noisy = [(a * t + b * t * t) * (1 + rng.uniform(-0.03, 0.03)) for t in lengths]
    fit = roofline.fit_prefill(lengths, noisy)
    assert fit.a == pytest.approx(a, rel=0.1) and fit.b == pytest.approx(b, rel=0.1)
    assert 0.99 < fit.r2 <= 1.0 and fit.max_rel_residual <= 0.07
    assert fit.residuals_s == pytest.approx([y - fit.predict(t) for t, y in zip(lengths, noisy)])
    assert fit.rms_residual_s == pytest.approx(math.sqrt(sum(r * r for r in fit.residuals_s) / 20))
    assert abs(roofline.held_out_errors(fit, [1050], [a * 1050 + b * 1050**2])[0]["rel_error"]) < 0.03


def test_fit_needs_two_lengths():
    with pytest.raises(ValueError, match="two distinct"):
        roofline.fit_prefill([512, 512], [1.0, 1.1])


def test_mfu_mbu_and_capacity_known_answers():
    # 1e9 matmul params at 1000 tokens/s = 2e12 FLOP/s; against 10 TFLOP/s: 20%
    assert roofline.mfu(1e9, 1000, 10e12) == pytest.approx(0.2)
    per_step = roofline.decode_bytes_per_step(2e9, 1e5, [1000, 3000])  # 2 GB weights + 4000 tokens x 100 kB
    assert per_step == pytest.approx(2.4e9)
    assert roofline.mbu(per_step, 50, 400e9) == pytest.approx(0.3)  # 120 GB/s of 400
    assert roofline.decode_roofline_tokens_per_s(4, 2e9, 400e9) == pytest.approx(800)
    assert roofline.capacity(704, 32, 2048) == 11 and roofline.capacity(704, 32, 2049) == 10  # 64 vs 65 blocks each
    assert roofline.kv_bytes_per_token(30, 3, 64, 4) == 46080
    assert roofline.kv_bytes_per_token(30, 3, 64, 4, kv_bits=8, kv_group_size=64) == 11520 + 2 * 180 * 4


# --- workloads: unique unless meant to hit the cache ------------------------------------------------------

def test_chat_and_long_prompts_are_unique_even_when_the_base_texts_repeat():
    chat = build_workload(WorkloadSpec("chat"), 200, seed=3)  # 200 requests over 50 base prompts
    assert len(set(chat)) == 200 and all(p.startswith("[req ") for p in chat)
    long = build_workload(WorkloadSpec("long-prompt", long_tokens=(300, 400)), 6, seed=3)
    assert len(set(long)) == 6 and all(p.startswith("[req ") for p in long)
    assert all(300 <= round(len(p.split()) * 1.3) <= 600 for p in long)
    assert build_workload(WorkloadSpec("chat"), 20, seed=3) == chat[:20]  # deterministic


def test_shared_prefix_shares_only_the_system_prompts():
    reqs = build_workload(WorkloadSpec("shared-prefix", tenants=3, system_tokens=200), 12, seed=1)
    systems = [r[0]["content"] for r in reqs]
    users = [r[1]["content"] for r in reqs]
    assert len(set(systems)) == 3 and systems[0] == systems[3]  # tenants round robin
    assert len(set(users)) == 12 and all(u.startswith("[req ") for u in users)
    assert WorkloadSpec("shared-prefix").hits_cache_by_design and not WorkloadSpec("chat").hits_cache_by_design


def test_shared_prefix_flag_turns_uniqueness_off_on_purpose():
    bare = build_workload(WorkloadSpec("chat"), 120, seed=2, shared_prefix=True)
    assert len(set(bare)) < 120 and not any(p.startswith("[req ") for p in bare)


def test_mixed_draws_every_kind():
    reqs = build_workload(WorkloadSpec("mixed", long_tokens=(100, 120), mix=(1, 1, 1)), 30, seed=4)
    kinds = {("shared" if isinstance(r, tuple) else "long" if "Passage 1" in r else "chat") for r in reqs}
    assert kinds == {"chat", "shared", "long"}
    assert len({prompt_key(r) for r in reqs}) == 30
    with pytest.raises(ValueError, match="unknown"):
        WorkloadSpec("rag")



@pytest.fixture(scope="module")
def fake_url(fake_server):
    """test_bench's fake OpenAI server (base URL, received bodies)."""
    return fake_server


def test_requests_sent_are_unique_and_shared_prefix_repeats_only_the_system(fake_url):
    url, received = fake_url
    received.clear()
    prompts = build_workload(WorkloadSpec("shared-prefix", tenants=2, system_tokens=50), 6, seed=9)
    result = asyncio.run(run_benchmark(WorkloadConfig(url=url, max_tokens=2), num_requests=6, concurrency=2,
                                       warmup_requests=0, seed=9, progress=False, prompts=prompts,
                                       workload="shared-prefix", slos={"ttft_s": 10.0}))
    sent = [json.dumps(b["messages"]) for b in received]
    assert len(set(sent)) == 6
    assert len({b["messages"][0]["content"] for b in received}) == 2
    assert result["config"]["workload"] == "shared-prefix" and result["summary"]["goodput"]["good_requests"] == 6
    assert result["summary"]["prefix_hit_rate"] == pytest.approx(4 / 9)  # the fake server's usage
    assert "shared-prefix" in markdown_runs([result])


# --- comparisons with several targets, the 1P1D topology, plots, doc blocks ------------------------------

def test_round_order_generalizes_abba():
    names = ("a", "b", "c")
    assert [compare.round_order(r, names) for r in range(4)] == [names, names[::-1], names[::-1], names]


def test_one_p_one_d_topology_parses(tmp_path):
    from cluster.topology import parse_topology

    topo = parse_topology(one_p_one_d_topology(str(tmp_path), "float32", 8123), "bench-1p1d")
    assert [w.role for w in topo.workers] == ["prefill", "decode"] and topo.router.port == 8123
    assert topo.routing.local_prefill_max_tokens == 0 and topo.engine.prefill_chunk_size == 512


def _summary(tp):
    d = {"p50": 0.1, "p90": 0.2, "p99": 0.3}
    return {"output_throughput": tp, "request_throughput": tp / 10, "ttft_s": d, "tpot_s": d, "itl_s": d,
            "e2e_s": d, "output_tokens_mean": 8.0, "prompt_tokens_mean": 50.0, "cached_tokens_mean": 0.0,
            "prefix_hit_rate": 0.0, "errors": 0, "goodput": {"request_goodput": 1.0, "attainment": 0.5}}


def test_report_rows_with_three_targets_and_goodput():
    names = ["mlx-pd", "mlx-pd-1p1d", "mlx_lm.server"]
    summ = {n: _summary(10.0 * (i + 1)) for i, n in enumerate(names)}
    level = {"concurrency": 4, "targets": names, "servers": summ,
             "ratios_vs": {o: compare.ratios(summ[names[0]], summ[o]) for o in names[1:]}}
    md = markdown_compare({"levels": [level], "max_tokens": 8})
    assert "ratio mlx-pd/mlx-pd-1p1d | 0.50x" in md and "ratio mlx-pd/mlx_lm.server | 0.33x" in md
    assert "100.0 / 200.0 / 300.0" in md and "1.000 (50%)" in md


def test_plots_are_small_pngs(tmp_path):
    records = [{"ttft_s": 0.1 * i, "tpot_s": 0.01 * i, "e2e_s": 1 + 0.1 * i, "error": None} for i in range(1, 30)]
    a = plots.plot_latency_cdfs({"x": records, "y": records[::2]}, tmp_path / "cdf.png", "t")
    b = plots.plot_throughput({"x": [(1, 10), (4, 30)]}, tmp_path / "tp.png")
    for p in (a, b):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size < 100_000
    assert plots.ecdf([3, 1, 2]) == ([1.0, 2.0, 3.0], [1 / 3, 2 / 3, 1.0])


def test_doc_blocks_replace_only_inside_markers():
    text = "keep\n<!-- BEGIN GENERATED: profile (x) -->\nold\n<!-- END GENERATED: profile -->\ntail\n"
    out = doc_blocks.replace_block(text, "profile", "new\nlines")
    assert out == "keep\n<!-- BEGIN GENERATED: profile (x) -->\nnew\nlines\n<!-- END GENERATED: profile -->\ntail\n"
    assert doc_blocks.replace_block(out, "profile", "new\nlines") == out
    with pytest.raises(ValueError, match="compare"):
        doc_blocks.replace_block(text, "compare", "x")
