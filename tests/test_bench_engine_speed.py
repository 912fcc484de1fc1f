"""The engine-speed benchmarks against mlx_lm.server: host CPU time per output token in `bench --compare`
(benchmarks/host_cpu.py), `bench interference`, `bench mixed-prefill` and `bench aiperf`. Their pure parts on
known data (the /proc stat parsing, the token-arrival windows, the prompt lengths, aiperf's export), their request
loops against the fake OpenAI server of tests/test_bench.py, aiperf's runner against a fake aiperf program, and
one short run of both real servers over the random-weight 2-layer model."""

from __future__ import annotations

import asyncio
import json
import math
import os
import stat
import sys

import pytest

from benchmarks import aiperf_compare, cli, compare, engine_pair, host_cpu, interference_bench, mixed_prefill_bench
from benchmarks.stats import RequestRecord
from benchmarks.workloads import approx_tokens
from tests.test_bench import fake_server  # noqa: F401  (a fixture this module uses)

# --- host CPU time --------------------------------------------------------------------------------------------


def stat_line(pid: int, comm: str, utime: int, stime: int, cutime: int = 0, cstime: int = 0) -> str:
    """A /proc/PID/stat line with the given CPU fields (14-17) and zeros elsewhere."""
    fields = ["S", "1", "1", "1", "0", "-1", "0", "0", "0", "0", "0", str(utime), str(stime), str(cutime),
              str(cstime)] + ["0"] * 37
    return f"{pid} ({comm}) " + " ".join(fields) + "\n"


def fake_proc(root, tree: dict[int, list[int]], ticks: dict[int, tuple]) -> None:
    """A /proc of `tree` (pid -> children, listed under thread 1's children file) with `ticks` per pid."""
    for pid, children in tree.items():
        task = root / str(pid) / "task" / str(pid)
        task.mkdir(parents=True)
        (task / "children").write_text(" ".join(map(str, children)))
        if pid in ticks:
            (root / str(pid) / "stat").write_text(stat_line(pid, "python3", *ticks[pid]))


def test_stat_fields_are_counted_after_the_last_parenthesis_of_the_command_name():
    line = stat_line(42, "evil) (name 1 2", 7, 5, 3, 1)
    assert host_cpu.stat_cpu_ticks(line) == (7, 5, 3, 1)
    with pytest.raises(ValueError):
        host_cpu.stat_cpu_ticks("42 no parenthesis here")
    with pytest.raises(ValueError):
        host_cpu.stat_cpu_ticks("42 (short) S 1 2")


def test_tree_cpu_sums_every_descendant_and_skips_one_that_vanished(tmp_path):
    # 10 -> 11 -> 13, 10 -> 12; 12 has exited (no stat file) between listing and reading
    fake_proc(tmp_path, {10: [11, 12], 11: [13], 12: [], 13: []},
              {10: (100, 50, 20, 10), 11: (30, 20), 13: (5, 5)})
    assert sorted(host_cpu.process_tree(10, tmp_path)) == [10, 11, 12, 13]
    assert host_cpu.tree_cpu_seconds(10, tmp_path, clk_tck=100) == pytest.approx((180 + 50 + 10) / 100)
    assert host_cpu.tree_cpu_seconds(11, tmp_path, clk_tck=100) == pytest.approx(0.6)
    with pytest.raises(ProcessLookupError):
        host_cpu.tree_cpu_seconds(12, tmp_path)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads Linux's /proc")
def test_tree_cpu_of_this_process_matches_its_own_accounting():
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    got = host_cpu.tree_cpu_seconds(os.getpid())
    assert got >= own - 2 / host_cpu.CLK_TCK
    assert got < own + 1.0  # the same clock, read a moment later (plus any live child's time)


def test_without_proc_the_tree_cpu_comes_from_psutil(monkeypatch):
    """Off Linux: psutil's cpu_times over the process and its descendants, a child that vanished skipped."""
    import types

    class NoSuchProcess(Exception):
        pass

    times = {1: (1.0, 0.5, 0.25, 0.25), 2: (0.5, 0.5, 0.0, 0.0), 3: None}  # 3 ends before it is read

    class Process:
        def __init__(self, pid):
            if pid not in times:
                raise NoSuchProcess(pid)
            self.pid = pid

        def children(self, recursive=False):
            return [Process(2), Process(3)] if self.pid == 1 else []

        def cpu_times(self):
            if times[self.pid] is None:
                raise NoSuchProcess(self.pid)
            return types.SimpleNamespace(**dict(zip(("user", "system", "children_user", "children_system"),
                                                    times[self.pid])))

    monkeypatch.setitem(sys.modules, "psutil", types.SimpleNamespace(Process=Process, NoSuchProcess=NoSuchProcess))
    assert host_cpu._psutil_tree_cpu_seconds(1) == pytest.approx(3.0)
    with pytest.raises(ProcessLookupError):
        host_cpu._psutil_tree_cpu_seconds(9)


def test_the_cpu_table_shows_ms_per_output_token_and_the_ratio_on_the_other_targets_row():
    s = lambda cpu, tokens: {"host_cpu_s": cpu, "output_tokens_total": tokens,  # noqa: E731
                             "host_cpu_s_per_output_token": host_cpu.per_token(cpu, tokens)}
    level = {"concurrency": 4, "targets": ["mlx-pd", "mlx_lm.server"],
             "servers": {"mlx-pd": s(3.0, 1000), "mlx_lm.server": s(6.0, 1000)},
             "ratios_vs": {"mlx_lm.server": compare.ratios(
                 {**s(3.0, 1000), **{k: 1.0 for k in ("output_throughput", "request_throughput")},
                  **{k: {"p50": 1.0, "p99": 1.0} for k in ("ttft_s", "tpot_s", "e2e_s")}},
                 {**s(6.0, 1000), **{k: 1.0 for k in ("output_throughput", "request_throughput")},
                  **{k: {"p50": 1.0, "p99": 1.0} for k in ("ttft_s", "tpot_s", "e2e_s")}})}}
    rows = host_cpu.cpu_rows({"levels": [level]})
    assert rows == [["4", "mlx-pd", "3.0", "1000", "3.00", ""], ["4", "mlx_lm.server", "6.0", "1000", "6.00", "0.50x"]]
    assert host_cpu.cpu_rows({"levels": [{"concurrency": 1, "servers": {"mlx-pd": {}, "mlx_lm.server": {}}}]}) == []
    assert math.isnan(host_cpu.per_token(1.0, 0))


def test_compare_reads_each_targets_cpu_around_its_own_rounds_only(fake_server):  # noqa: F811
    url, _ = fake_server
    calls = {"a": 0, "b": 0}

    def reader(name: str, step: float):
        def read() -> float:
            calls[name] += 1
            return calls[name] * step
        return read

    levels = compare.run_levels({"a": url, "b": url}, [2], [8], max_tokens=3, rounds=2, progress=False,
                                cpu={"a": reader("a", 1.0), "b": reader("b", 0.25)})
    level = levels[0]
    assert calls == {"a": 4, "b": 4}  # before and after each of 2 rounds, never during the other's rounds
    a, b = level["servers"]["a"], level["servers"]["b"]
    assert a["host_cpu_s"] == pytest.approx(2.0) and b["host_cpu_s"] == pytest.approx(0.5)
    assert a["output_tokens_total"] == 24 and a["host_cpu_s_per_output_token"] == pytest.approx(2.0 / 24)
    assert level["ratios"]["host_cpu_s_per_output_token"] == pytest.approx(4.0)
    plain = compare.run_levels({"a": url, "b": url}, [1], [2], max_tokens=2, rounds=1, progress=False)[0]
    assert "host_cpu_s" not in plain["servers"]["a"] and "host_cpu_s_per_output_token" not in plain["ratios"]


# --- shared parts --------------------------------------------------------------------------------------------

def test_rounds_alternate_abba_and_medians_skip_missing_values():
    assert engine_pair.abba(4) == [(0, "mlx-pd"), (0, "mlx_lm.server"), (1, "mlx_lm.server"), (1, "mlx-pd"),
                                   (2, "mlx_lm.server"), (2, "mlx-pd"), (3, "mlx-pd"), (3, "mlx_lm.server")]
    assert engine_pair.median([3.0, None, float("nan"), 1.0, 2.0]) == 2.0
    assert math.isnan(engine_pair.median([None]))
    assert engine_pair.medians([{"x": 1.0, "y": 5.0}, {"x": 3.0}], ["x", "y"]) == {"x": 2.0, "y": 5.0}
    assert engine_pair.ratio(1.0, 4.0) == 0.25 and math.isnan(engine_pair.ratio(1.0, 0.0))
    assert math.isnan(engine_pair.ratio(None, 1.0))


def test_long_prompts_reach_their_length_and_differ_from_the_first_characters():
    a = engine_pair.long_prompt(300, "r0 p1", approx_tokens)
    b = engine_pair.long_prompt(300, "r1 p1", approx_tokens)
    body = a.rstrip("\n")
    assert approx_tokens(a) >= 300 and approx_tokens(body[:body.rfind("\n") + 1]) < 300  # stops at the first past it
    assert a.startswith("[r0 p1] ") and b.startswith("[r1 p1] ") and a[:3] != b[:3]
    assert engine_pair.long_prompt(300, "r0 p1", approx_tokens) == a


def test_fast_model_and_model_dir_together_are_refused():
    args = cli.build_subcommand_parser("interference").parse_args(["--fast-model", "--model-dir", "/x"])
    with pytest.raises(ValueError, match="not both"):
        engine_pair.model_dir_of(args)
    assert cli.main(["--compare", "--fast-model", "--model-dir", "/x"]) == 2


def test_the_scenarios_are_registered_with_their_defaults():
    for name, module in (("interference", "interference_bench"), ("mixed-prefill", "mixed_prefill_bench"),
                         ("aiperf", "aiperf_compare")):
        assert cli.MODULES[name] == module and name in cli.SUBCOMMANDS
    i = cli.build_subcommand_parser("interference").parse_args([])
    assert (i.streams, i.stream_tokens, i.after_tokens, i.long_tokens, i.rounds) == (4, 256, 32, 1500, 4)
    m = cli.build_subcommand_parser("mixed-prefill").parse_args([])
    assert (m.prompts, m.min_prompt_tokens, m.max_prompt_tokens, m.output_tokens) == (8, 100, 2000, 1)
    a = cli.build_subcommand_parser("aiperf").parse_args([])
    assert (a.concurrency, a.num_requests, a.isl, a.osl, a.rounds) == ("1,4,8", 16, 128, 64, 2)
    assert cli.build_parser().parse_args(["--compare", "--fast-model"]).fast_model


# --- interference windows --------------------------------------------------------------------------------------

def test_windows_split_gaps_into_idle_and_prefill_and_a_stall_counts_whole():
    # times in ms: two streams at 10 ms steps; the long prompt arrives at 1000 and its first token comes at 1100;
    # stream 1 stalls from 1000 to 1120 (one gap across the whole window), stream 2 keeps going
    s1 = [900 + 10 * i for i in range(11)] + [1120, 1130]  # 900 .. 1000, 1120, 1130
    s2 = [905 + 10 * i for i in range(30)]  # 905 .. 1195
    steady = interference_bench.steady_from([s1, s2], 5)
    assert steady == 945  # stream 2's fifth token
    w = interference_bench.window_stats([s1, s2], 1000, 1100, steady)
    assert w["idle_gaps"] == 5 + 5 and w["idle_itl_p50_s"] == 10  # s1: 950 -> 1000; s2: 945 -> 995
    assert w["prefill_gaps"] == 1 + 11  # s1: 1000 -> 1120; s2: 995 -> 1005 ... 1095 -> 1105
    assert w["prefill_itl_p50_s"] == 10 and w["prefill_itl_max_s"] == 120
    assert w["streams_outlived_prefill"]
    assert not interference_bench.window_stats([s1[:11], s2], 1000, 1100, steady)["streams_outlived_prefill"]


def test_windows_without_a_first_token_or_a_steady_start_are_empty():
    assert interference_bench.steady_from([[1.0, 2.0], [1.0]], 2) is None
    w = interference_bench.window_stats([[1.0, 2.0, 3.0]], 2.5, None, None)
    assert (w["idle_gaps"], w["prefill_gaps"], w["streams_outlived_prefill"]) == (0, 0, False)
    assert math.isnan(w["idle_itl_p50_s"]) and math.isnan(w["prefill_itl_max_s"])
    assert interference_bench.gaps([1.0, 1.5, 3.0]) == [(1.0, 1.5), (1.5, 3.0)]


def test_an_interference_round_streams_then_sends_the_long_prompt_with_eos_blocked(fake_server):  # noqa: F811
    url, received = fake_server
    received.clear()
    got = asyncio.run(interference_bench.one_round(url, ["s one", "s two"], "the long one", stream_tokens=40,
                                                   after_tokens=4, long_max_tokens=2, suppress=(2, 7)))
    assert got["error"] is None and got["stream_tokens"] == [40, 40] and got["long_prompt_tokens"] == 9
    assert got["prefill_gaps"] > 0 and got["idle_gaps"] > 0 and got["long_ttft_s"] > 0
    long = [b for b in received if b["messages"][-1]["content"] == "the long one"]
    assert len(long) == 1 and long[0]["max_tokens"] == 2 and long[0]["logit_bias"] == {"2": -100.0, "7": -100.0}
    assert received.index(long[0]) == 2  # sent after both streams
    bad = asyncio.run(interference_bench.one_round(url, ["s one"], "FAIL", stream_tokens=6, after_tokens=2,
                                                   long_max_tokens=1, suppress=()))
    assert bad["error"].startswith("HTTP 400") and math.isnan(bad["long_ttft_s"])


# --- mixed prefill ----------------------------------------------------------------------------------------------

def test_prompt_lengths_spread_evenly_and_are_sent_short_long_alternating():
    lengths = mixed_prefill_bench.prompt_lengths(8, 100, 2000)
    assert lengths == [100, 371, 643, 914, 1186, 1457, 1729, 2000]
    assert mixed_prefill_bench.send_order(lengths) == [100, 2000, 371, 1729, 643, 1457, 914, 1186]
    assert mixed_prefill_bench.send_order([1, 2, 3]) == [1, 3, 2]
    assert mixed_prefill_bench.prompt_lengths(1, 50, 60) == [50]
    with pytest.raises(ValueError):
        mixed_prefill_bench.prompt_lengths(4, 300, 200)


def test_prefill_throughput_is_prompt_tokens_over_send_to_last_first_token():
    recs = [RequestRecord(index=0, start_s=0.0, ttft_s=0.5, e2e_s=0.5, prompt_tokens=100),
            RequestRecord(index=1, start_s=0.01, ttft_s=1.99, e2e_s=2.0, prompt_tokens=None),  # no usage: client's
            RequestRecord(index=2, start_s=0.0, ttft_s=1.0, e2e_s=1.0, prompt_tokens=300)]
    s = mixed_prefill_bench.round_stats(recs, [99, 500, 301])
    assert s["window_s"] == pytest.approx(2.0) and s["prefill_tok_s"] == pytest.approx(900 / 2.0)
    assert s["ttft_p50_s"] == pytest.approx(1.0) and s["ttft_max_s"] == pytest.approx(1.99)
    assert s["prompt_tokens"] == [100, 500, 300] and s["server_counted"] == 2 and s["error"] is None
    failed = mixed_prefill_bench.round_stats(recs[:2] + [RequestRecord(index=2, error="HTTP 500: x")], [1, 2, 3])
    assert failed["error"] == "HTTP 500: x" and math.isnan(failed["prefill_tok_s"])


# --- aiperf -----------------------------------------------------------------------------------------------------

EXPORT = {"output_token_throughput": {"unit": "tokens/sec", "avg": 43.8},
          "inter_token_latency": {"unit": "ms", "avg": 13.3, "p50": 14.5, "p99": 14.7},
          "time_to_first_token": {"unit": "ms", "avg": 455.6, "p50": 493.9},
          "request_count": {"unit": "requests", "avg": 4.0},
          "output_sequence_length": {"unit": "tokens", "avg": 16.0, "p50": 16.0},
          "input_sequence_length": {"unit": "tokens", "avg": 94.0}, "error_summary": []}


def test_the_aiperf_export_is_read_in_seconds_with_its_errors():
    got = aiperf_compare.parse_export(EXPORT)
    assert got["output_token_throughput"] == 43.8 and got["itl_p50_s"] == pytest.approx(0.0145)
    assert got["ttft_p50_s"] == pytest.approx(0.4939) and (got["requests"], got["errors"]) == (4, 0)
    assert (got["output_tokens_mean"], got["input_tokens_mean"]) == (16.0, 94.0)
    failing = {**EXPORT, "error_summary": [{"error_details": {"code": 500}, "count": 3}]}
    assert aiperf_compare.parse_export(failing)["errors"] == 3
    assert aiperf_compare.parse_export({**EXPORT, "error_request_count": {"avg": 2.0}})["errors"] == 2
    with pytest.raises(ValueError, match="output_token_throughput"):
        aiperf_compare.parse_export({"request_count": {"avg": 0}})


def test_aiperf_argv_blocks_eos_in_the_body_and_a_missing_aiperf_names_the_install(tmp_path):
    argv = aiperf_compare.aiperf_argv("/bin/aiperf", model="m", url="http://h:1", tokenizer="/t", concurrency=4,
                                      requests=16, isl=128, osl=64, seed=3, artifact_dir="/a", suppress=(2,))
    extra = json.loads(argv[argv.index("--extra-inputs") + 1])
    assert extra == {"temperature": 0, "ignore_eos": True, "logit_bias": {"2": -100}}
    assert argv[argv.index("--concurrency") + 1] == "4" and argv[argv.index("--osl") + 1] == "64"
    assert "--streaming" in argv and argv[argv.index("--endpoint-type") + 1] == "chat"
    # aiperf would otherwise scrape only the server that serves /metrics, three times a second
    assert "--no-server-metrics" in argv and "--no-gpu-telemetry" in argv
    with pytest.raises(FileNotFoundError, match="pip install aiperf"):
        aiperf_compare.find_aiperf(str(tmp_path / "missing" / "aiperf"))
    assert cli.main(["aiperf", "--aiperf", str(tmp_path / "missing")]) == 2


def test_the_runner_reads_what_the_aiperf_program_exported(tmp_path):
    fake = tmp_path / "aiperf"
    fake.write_text(f"#!{sys.executable}\nimport json, pathlib, sys\nargs = sys.argv[1:]\n"
                    "if 'FAIL' in args: print('boom'); sys.exit(3)\n"
                    "out = pathlib.Path(args[args.index('--artifact-dir') + 1])\n"
                    f"(out / 'profile_export_aiperf.json').write_text(json.dumps({EXPORT!r}))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    assert aiperf_compare.find_aiperf(str(fake)) == str(fake)
    got = aiperf_compare.run_aiperf([str(fake), "profile", "--artifact-dir", str(tmp_path / "run")], tmp_path / "run",
                                    60)
    assert got["output_token_throughput"] == 43.8
    with pytest.raises(RuntimeError, match="boom"):
        aiperf_compare.run_aiperf([str(fake), "FAIL"], tmp_path / "bad", 60)


# --- both real servers, briefly --------------------------------------------------------------------------------

def test_both_real_servers_answer_a_round_of_each_scenario_on_the_fast_model():
    """mlx-pd and mlx_lm.server on the random 2-layer model: an interference round and a mixed-prefill round each,
    with the servers' prompt counts equal to the client's rendered counts, and host CPU read around them."""
    from benchmarks.loadgen import WorkloadConfig, run_load
    from benchmarks.reliability_long import fast_model_dir

    model_dir = str(fast_model_dir())
    count = engine_pair.chat_token_counter(model_dir)
    suppress = compare.eos_token_ids(model_dir)
    long_text = engine_pair.long_prompt(200, "test long", count)
    texts = [engine_pair.long_prompt(n, f"test p{i}", count) for i, n in enumerate((40, 160, 90))]
    with engine_pair.pair(model_dir, "float32", lambda msg: None) as servers:
        for name, server in servers.items():
            before = server.cpu_seconds()
            # 96 tokens a stream: mlx_lm.server sends a chunk only for a token with text, and the random model's
            # tokens often have none, so 24 tokens could end a stream before it showed 6 chunks
            got = asyncio.run(interference_bench.one_round(server.url, ["a b", "c d"], long_text, stream_tokens=96,
                                                           after_tokens=6, long_max_tokens=2, suppress=suppress))
            assert got["error"] is None, name
            assert got["long_prompt_tokens"] == count(long_text), name
            assert min(got["stream_tokens"]) >= 6 and got["prefill_gaps"] > 0, name
            cfg = WorkloadConfig(url=server.url, max_tokens=1, suppress_token_ids=suppress)
            records, _ = asyncio.run(run_load(cfg, texts, concurrency=len(texts), progress=False))
            s = mixed_prefill_bench.round_stats(records, [count(t) for t in texts])
            assert s["error"] is None and s["server_counted"] == 3, name
            assert s["prompt_tokens"] == s["client_prompt_tokens"], name
            assert server.cpu_seconds() > before, name
