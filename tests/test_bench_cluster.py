"""Tests of the cluster and routing benchmarks (benchmarks/cluster_bench.py, cluster_procs.py, cluster_projection.py,
routing_bench.py, routing_sim.py) with no model: topology files, argument parsing, the mixed workload against the
fake OpenAI server of tests/test_bench.py, SLO and goodput arithmetic, the paper projection, and the placement
simulation on a small scale."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from benchmarks import cli, cluster_bench, cluster_procs, cluster_projection, routing_bench, routing_sim
from benchmarks.cluster_projection import LLAMA_8B, SMOLLM2, Measured, Targets, project
from benchmarks.stats import RequestRecord
from tests.test_bench import fake_server  # noqa: F401  (the fixture)

# --- topology files and processes ------------------------------------------------------------------------


def test_generated_topology_parses_with_pinned_workers_and_settings():
    from cluster.topology import parse_topology

    workers = cluster_procs.make_workers([("prefill-0", "prefill", [0]), ("decode-0", "decode", [1]),
                                          ("decode-1", "decode", [1])])
    ports = [w[k] for w in workers for k in ("control_port", "events_port", "kv_port") if w[k] is not None]
    assert len(ports) == len(set(ports)) == 8
    assert workers[0]["kv_port"] is None and workers[1]["kv_port"] is not None
    text = cluster_procs.topology_toml(workers, 8123, engine={"prefill_chunk_size": 512, "kv_cache_gb": 0.5,
                                                              "dtype": "float32"},
                                       routing={"policy": "round_robin", "local_prefill_max_tokens": 512},
                                       transfer={"timeout_s": 600.0}, model_source="/models/a \"b\"")
    topo = parse_topology(text, name="t")
    assert topo.router.port == 8123 and topo.routing.policy == "round_robin"
    assert topo.routing.local_prefill_max_tokens == 512 and topo.transfer.timeout_s == 600.0
    assert topo.model.source == '/models/a "b"'
    assert [(w.name, w.role, w.cpu_affinity) for w in topo.workers] == [
        ("prefill-0", "prefill", (0,)), ("decode-0", "decode", (1,)), ("decode-1", "decode", (1,))]
    assert all(w.engine.prefill_chunk_size == 512 and w.engine.kv_cache_gb == 0.5 for w in topo.workers)
    assert topo.workers[1].kv_port == workers[1]["kv_port"]


def test_pinned_uses_taskset_when_there_is_one(monkeypatch):
    monkeypatch.setattr(cluster_procs.shutil, "which", lambda name: "/usr/bin/taskset")
    assert cluster_procs.pinned(["python", "x"], [0, 1]) == ["taskset", "-c", "0,1", "python", "x"]
    assert cluster_procs.pinned(["python"], []) == ["python"]
    monkeypatch.setattr(cluster_procs.shutil, "which", lambda name: None)
    assert cluster_procs.pinned(["python"], [0]) == ["python"]


def test_probe_of_a_port_nobody_serves_gives_none():
    from benchmarks.servers import free_port

    assert cluster_procs.probe_worker(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.2) is None


def test_single_node_gets_the_cluster_engine_settings():
    args = cli.build_subcommand_parser("cluster").parse_args(["--prefill-chunk-size", "256", "--kv-cache-gb", "2"])
    engine = cluster_bench.engine_settings(args)
    assert engine == {"block_size": 32, "kv_cache_gb": 2.0, "max_num_seqs": 16, "prefill_chunk_size": 256,
                      "dtype": "float32"}
    assert cluster_bench.serve_flags(engine) == ["--block-size", "32", "--kv-cache-gb", "2.0", "--max-num-seqs", "16",
                                                 "--prefill-chunk-size", "256"]


# --- argument parsing ----------------------------------------------------------------------------------------


def test_subcommands_parse_with_their_defaults():
    a = cli.build_subcommand_parser("cluster").parse_args([])
    assert (a.rounds, a.short_concurrency, a.long_tokens, a.long_per_round, a.slo_ttft_s, a.slo_tpot_ms) == (
        4, 4, 2048, 3, 2.0, 150.0)
    assert (a.prefill_cpus, a.decode_cpus, a.cpus, a.local_prefill_max_tokens) == ("0", "1", "0,1", 512)
    r = cli.build_subcommand_parser("routing").parse_args(["--users", "8", "--policies", "prefix_aware,round_robin"])
    assert (r.users, r.system_prompts, r.system_tokens, r.turns, r.policies) == (
        8, 8, 1000, 2, "prefix_aware,round_robin")
    s = cli.build_subcommand_parser("routing-sim").parse_args([])
    assert (s.workers, s.blocks, s.prompt_tokens) == (64, 1_000_000, 2048)
    assert {"cluster", "routing", "routing-sim"} <= set(cli.SUBCOMMANDS)


def test_orders_alternate():
    assert [cluster_bench.abba(["a", "b"], r) for r in range(4)] == [["a", "b"], ["b", "a"], ["b", "a"], ["a", "b"]]
    assert routing_bench.policy_order(["p", "q", "r"], 0) == ["p", "q", "r"]
    assert routing_bench.policy_order(["p", "q", "r"], 1) == ["r", "q", "p"]


# --- the mixed workload ----------------------------------------------------------------------------------


def test_long_messages_reach_their_length_and_differ_by_tag():
    from benchmarks.workloads import approx_tokens

    tokens = type("T", (), {"count": staticmethod(approx_tokens)})()
    a = cluster_bench.long_messages(tokens, 600, "long a")
    b = cluster_bench.long_messages(tokens, 600, "long b")
    assert a[0]["role"] == "system" and approx_tokens(a[0]["content"]) >= 560
    assert a[0]["content"].startswith("[long a]") and a[0]["content"] != b[0]["content"]


def rec(start, ttft, e2e, tokens=10, itl=0.1):
    return RequestRecord(index=0, start_s=start, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens,
                         itls_s=[itl] * (tokens - 1), prompt_tokens=50)


def test_overlap_with_a_long_prefill():
    long = rec(10.0, 5.0, 6.0)  # prefilling from 10 to 15
    assert cluster_bench.overlaps_prefill(rec(9.0, 0.1, 1.5), [long])  # ends at 10.5
    assert cluster_bench.overlaps_prefill(rec(14.0, 0.1, 3.0), [long])
    assert not cluster_bench.overlaps_prefill(rec(15.5, 0.1, 1.0), [long])
    assert not cluster_bench.overlaps_prefill(rec(5.0, 0.1, 4.0), [long])
    assert not cluster_bench.overlaps_prefill(rec(5.0, 0.1, 4.0), [])


def test_slo_and_goodput_arithmetic():
    from benchmarks.stats import meets_slos

    ok = rec(0, 1.0, 1.9, tokens=10)  # TPOT 0.1
    slow_first = rec(0, 2.5, 3.4, tokens=10)  # TTFT over 2 s
    slow_tokens = rec(0, 1.0, 3.7, tokens=10)  # TPOT 0.3
    failed = RequestRecord(index=0, error="boom")
    short, long = cluster_bench.slos("short", 2.0, 0.15), cluster_bench.slos("long", 2.0, 0.15)
    assert short == {"ttft_s": 2.0, "tpot_s": 0.15} and long == {"tpot_s": 0.15}  # long prompts: no TTFT SLO
    assert meets_slos(ok, short) and not meets_slos(slow_first, short) and meets_slos(slow_first, long)
    assert not meets_slos(slow_tokens, long) and not meets_slos(failed, short)
    s = cluster_bench.kind_summary([ok, slow_first, slow_tokens, failed], "short", 10.0, 2.0, 0.15)
    assert (s["n"], s["errors"], s["slo_met"]) == (4, 1, 1)
    assert s["slo_attainment"] == 0.25 and s["goodput_rps"] == pytest.approx(0.1)
    assert s["throughput_rps"] == pytest.approx(0.3)
    assert s["ttft_s"]["p50"] == pytest.approx(1.0)


def test_system_summary_splits_short_chats_and_ratios():
    slot = [("long", rec(2.0, 4.0, 5.0, tokens=4)), ("short", rec(0.0, 0.2, 1.1)), ("short", rec(3.0, 0.2, 1.1)),
            ("short", rec(8.0, 0.2, 1.1))]
    s = cluster_bench.summarize_system([(slot, 10.0), (slot, 10.0)], 2.0, 0.15)
    k = s["kinds"]
    counts = [k[name]["n"] for name in ("short", "long", "short, during a long prefill", "short, no long prefill")]
    assert counts == [6, 2, 2, 4]
    assert s["wall_s"] == 20.0 and s["goodput_rps"] == pytest.approx(6 / 20)  # the long ones: TPOT 1/3 s
    r = cluster_bench.ratios(s, s)
    assert r["short TPOT p99"] == 1.0 and r["long TTFT p50"] == 1.0 and r["all goodput"] == 1.0


def test_mixed_slot_streams_short_chats_until_the_long_prompts_finish(fake_server):
    from benchmarks.loadgen import WorkloadConfig
    from benchmarks.prefix_bench import ChatWorkloadConfig

    url, received = fake_server
    short = WorkloadConfig(url=url, max_tokens=3)
    long = ChatWorkloadConfig(url=url, max_tokens=5, messages={"L0": [{"role": "user", "content": "long 0"}],
                                                                "L1": [{"role": "user", "content": "long 1"}]})
    prompts = [f"short {i}" for i in range(200)]
    recs, wall = asyncio.run(cluster_bench.mixed_slot(short, long, prompts, ["L0", "L1"], concurrency=2,
                                                      first_s=0.1, interval_s=0.3))
    kinds = [k for k, _ in recs]
    assert kinds.count("long") == 2 and kinds.count("short") >= 4
    assert all(r.ok for _, r in recs)
    longs = [r for k, r in recs if k == "long"]
    assert longs[1].start_s == pytest.approx(0.4, abs=0.1)
    last_long_end = max(r.start_s + r.e2e_s for r in longs)
    assert all(r.start_s <= last_long_end for k, r in recs if k == "short")  # none started after the last long
    assert wall >= last_long_end


# --- the projection ------------------------------------------------------------------------------------------


def test_model_shapes_match_the_transfer_projection_and_the_kv_formula():
    from benchmarks.transfer_projection import Projection

    p = Projection()
    assert LLAMA_8B.matmul_params == p.matmul_params
    assert LLAMA_8B.prefill_flops(0, 2048) == p.prefill_flops(0, 2048)
    assert LLAMA_8B.kv_bytes_per_token("bfloat16") == p.kv_bytes_per_token(None) == 131072
    assert SMOLLM2.kv_bytes_per_token("float32") == 46080  # docs/BENCHMARKS.md, bench kv
    assert SMOLLM2.matmul_params == 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)
    assert SMOLLM2.decode_bytes(0, 0, "float32", 4) == (SMOLLM2.matmul_params + 49152 * 576) * 4


def test_projection_applies_the_measured_efficiencies():
    flops, bw = 1e11, 2e10
    prefill_s = SMOLLM2.prefill_flops(0, 4096) / (flops * 0.25)  # prefill at 25% of this core's peak
    step_s = SMOLLM2.decode_bytes(4, 100, "float32", 4) / (bw * 0.5)  # decode at 50% of its bandwidth
    m = Measured(4096, prefill_s, 4, 100, step_s, flops, bw)
    t = Targets(link_bytes_per_s=1e12)  # a link so fast that nothing is exposed
    p = project(m, t)
    assert p["prefill_efficiency_here"] == pytest.approx(0.25) and p["decode_efficiency_here"] == pytest.approx(0.5)
    same = p["models"]["Llama-3.1-8B"]["same efficiency as here"]
    assumed = p["models"]["Llama-3.1-8B"]["assumed efficiency"]
    assert same["prefill_s"] == pytest.approx(LLAMA_8B.prefill_flops(0, 4096) / (t.m3_ultra_flops * 0.25))
    assert assumed["prefill_s"] == pytest.approx(LLAMA_8B.prefill_flops(0, 4096) / (t.m3_ultra_flops * t.mfu))
    step = LLAMA_8B.decode_bytes(4, 100, "bfloat16", 2) / (t.m4_pro_bandwidth * 0.5)
    assert same["tpot_1p1d_s"] == pytest.approx(step)
    assert same["exposed_transfer_s"] == pytest.approx(2048 * 131072 / 1e12)  # only the last chunk
    assert same["ttft_long_1p1d_s"] == pytest.approx(same["prefill_s"] + same["exposed_transfer_s"])
    gap = LLAMA_8B.prefill_flops(4096 - 512, 4096) / (t.m3_ultra_flops * 0.25) + same["tpot_single_no_prefill_s"]
    assert same["gap_single_chunk512_s"] == pytest.approx(gap)


def test_slow_link_exposes_more_than_the_last_chunk():
    t = Targets(link_bytes_per_s=1e6)
    exposed = cluster_projection.exposed_transfer_s(LLAMA_8B, 4096, t, lambda a, b: 0.001 * (b - a))
    assert exposed == pytest.approx(4096 * 131072 / 1e6 - 0.001 * 2048)


def test_projection_from_a_result_and_its_tables():
    def kind(p50):
        return {"prompt_tokens_mean": 56.0, "itl_s": {"p50": p50}}

    result = {"args": {"short_concurrency": 4, "short_max_tokens": 64, "dtype": "float32"},
              "host_peaks": {"matmul_flops": 6e10, "copy_bytes_per_s": 2e10},
              "calibration": {"prompt_tokens": 4100, "ttft_s": 60.0},
              "systems": {"1p1d": {"summary": {"kinds": {"short, no long prefill": kind(0.1)}}, "records": []}}}
    p = cluster_projection.projection_from(result)
    assert p["measured"]["prefill_tokens"] == 4100 and p["measured"]["decode_context"] == 56 + 32
    (title, header, rows), = cluster_projection.projection_tables(p)
    assert len(rows) == 18 and "Llama-3.1-8B" in {r[1] for r in rows}
    assert cluster_projection.projection_from({**result, "host_peaks": None}) is None


# --- routing --------------------------------------------------------------------------------------------


def test_counter_delta_per_worker():
    before = {"a": {"prefix_cache_queries": 10, "prefix_cache_hits": 5, "kv_blocks_received": 0, "tokens_out": 1},
              "b": None}
    after = {"a": {"prefix_cache_queries": 30, "prefix_cache_hits": 20, "kv_blocks_received": 4, "tokens_out": 9},
             "b": {"prefix_cache_queries": 1}}
    d = routing_bench.counter_delta(before, after)
    assert d["a"] == {"prefix_cache_queries": 20, "prefix_cache_hits": 15, "kv_blocks_received": 4, "tokens_out": 8}
    assert d["b"] is None


def sim_args(**kw):
    args = cli.build_subcommand_parser("routing-sim").parse_args(
        ["--workers", "6", "--prefill-workers", "2", "--blocks", "3000", "--tenants", "20", "--tenant-blocks", "8",
         "--placements", "60", "--prompt-tokens", "512"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_simulated_index_holds_the_blocks_and_matches_prompts():
    syn = routing_sim.Synthetic(sim_args())
    index, build = routing_sim.build_index(syn, batch=16)
    assert build["distinct_blocks"] == len(index) == 3000
    assert build["events"] == sum(index.num_blocks(name) for name in index.workers) > 3000  # tenants on 2 workers
    from cluster.kv.hashing import block_hashes

    toks, hashes, holders = syn.tenants[0]
    match = index.match(block_hashes(syn.prompt("cold")[:256], syn.bs, syn.key), syn.bs)
    assert match == {}
    got = index.match(hashes + [12345], syn.bs)
    assert {syn.names[w] for w in holders} <= set(got) and all(got[syn.names[w]] == 8 for w in holders)
    conv = syn.sample[0]
    deep = index.match(block_hashes(conv, syn.bs, syn.key), syn.bs)
    assert max(deep.values()) == len(conv) // syn.bs
    assert routing_sim.index_bytes(index) > 0


def test_simulated_placements_and_wire_throughput():
    syn = routing_sim.Synthetic(sim_args())
    index, _ = routing_sim.build_index(syn, batch=4)
    before = len(index)
    wire = routing_sim.wire_throughput(syn, index, batch=8, blocks=200)
    assert len(index) == before and wire["blocks_per_s_decode_and_apply"] > 0  # stored, then removed again
    p = routing_sim.place_many(syn, index, 30)
    assert p["placements"] == 30 and p["total_s"]["p50"] > 0
    assert p["total_s"]["max"] >= p["total_s"]["p99"] >= p["total_s"]["p50"]
    assert set(p["by_kind_total_s"]) == {"tenant", "conversation", "cold"}


def test_routing_sim_command_end_to_end(tmp_path, capsys):
    out = tmp_path / "sim.json"
    md = tmp_path / "sim.md"
    code = cli.main(["routing-sim", "--workers", "4", "--prefill-workers", "1", "--blocks", "500", "--tenants", "5",
                     "--tenant-blocks", "4", "--placements", "30", "--prompt-tokens", "256", "--out", str(out),
                     "--markdown", str(md)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "routing-sim" and result["build"]["distinct_blocks"] == 500
    assert not math.isnan(result["placement"]["total_s"]["p99"])
    assert "Placement of 256-token prompts" in md.read_text()
