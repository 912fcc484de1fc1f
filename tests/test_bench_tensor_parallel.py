"""`mlx-pd bench tensor-parallel` (benchmarks/tp_compare.py) and its mlx_lm.server launcher
(benchmarks/tp_servers.py): the pure parts only, on known data: the ring hostfile and rank environment, the
mlx.launch and mlx-pd command lines, the options, the detection of a server that rejects --tensor-parallel, and
the tables. Nothing starts a server or loads a model; nothing is timed."""

from __future__ import annotations

import json
import math
import sys

import pytest

from benchmarks import cli, tp_compare, tp_servers
from benchmarks.random_models import SMOL_SHAPE_CONFIG


def test_the_ring_hostfile_has_one_loopback_address_per_rank():
    assert tp_servers.ring_hostfile([38111, 38112]) == [["127.0.0.1:38111"], ["127.0.0.1:38112"]]
    assert tp_servers.ring_hostfile([5, 6, 7], host="10.0.0.2")[2] == ["10.0.0.2:7"]
    for bad in ([38111], [38111, 38111], []):
        with pytest.raises(ValueError, match="ring"):
            tp_servers.ring_hostfile(bad)
    assert tp_servers.rank_env(1, "/tmp/h.json") == {"MLX_HOSTFILE": "/tmp/h.json", "MLX_RANK": "1"}


def test_the_direct_launcher_writes_the_hostfile_and_gives_each_rank_its_env(tmp_path):
    group = tp_servers.MlxLmTensorParallel("/models/m", 2, 8123, ring_ports=[40001, 40002], log_dir=str(tmp_path),
                                           env={"X": "1"})
    try:
        hostfile = group.dir / "hostfile.json"
        assert json.loads(hostfile.read_text()) == [["127.0.0.1:40001"], ["127.0.0.1:40002"]]
        assert [p.env for p in group.procs] == [{"X": "1", "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(r)}
                                                for r in (0, 1)]
        assert group.argv[1:] == ["-m", "mlx_lm", "server", "--model", "/models/m", "--port", "8123", "--log-level",
                                  "WARNING"]
        assert group.url == "http://127.0.0.1:8123" and len(group.log_paths) == 2
    finally:
        group.stop()  # never started: only removes the hostfile's folder
    assert not group.dir.exists()
    with pytest.raises(ValueError, match="launcher"):
        tp_servers.MlxLmTensorParallel("/m", 2, 1, launcher="ssh")
    with pytest.raises(ValueError, match="2 ranks"):
        tp_servers.MlxLmTensorParallel("/m", 1, 1)


def test_pinned_ranks_get_disjoint_cpu_shares(tmp_path):
    assert tp_servers.rank_cpus(2, [0, 1]) == [[0], [1]]
    assert tp_servers.rank_cpus(2, [3, 0, 2, 1, 4]) == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="a CPU each"):
        tp_servers.rank_cpus(3, [0, 1])
    group = tp_servers.MlxLmTensorParallel("/m", 2, 1, ring_ports=[2, 3], pin=True, cpus=[0, 1],
                                           log_dir=str(tmp_path))
    group.stop()
    if tp_servers.shutil.which("taskset"):
        assert [p.argv[:3] for p in group.procs] == [["taskset", "-c", "0"], ["taskset", "-c", "1"]]
    with pytest.raises(ValueError, match="direct launcher"):
        tp_servers.MlxLmTensorParallel("/m", 2, 1, launcher="mlx.launch", pin=True)


def test_mlx_launch_runs_the_server_on_loopback_ranks_with_consecutive_ring_ports():
    argv = tp_servers.mlx_launch_command(["python", "-m", "mlx_lm", "server"], 2, 38111, launcher="/bin/mlx.launch")
    assert argv == ["/bin/mlx.launch", "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2", "--starting-port",
                    "38111", "--", "python", "-m", "mlx_lm", "server"]
    base = tp_servers.consecutive_free_ports(2)
    assert 0 < base < 65535


def test_the_options_and_their_defaults():
    assert cli.MODULES["tensor-parallel"] == "tp_compare" and "tensor-parallel" in cli.SUBCOMMANDS
    p = cli.build_subcommand_parser("tensor-parallel")
    a = p.parse_args([])
    assert (a.ranks, a.concurrency, a.num_requests, a.launcher, a.targets, a.passes) == (
        2, [1, 8], [16, 32], "direct", "mlx_lm.server,mlx-pd", 1)
    assert tp_compare.mlx_pd_command_of(a) == tp_compare.MLX_PD_COMMAND and a.env == [] and not a.pin_ranks
    a = p.parse_args(["--parallel", "pipeline", "--random-model", "smol-qwen2"])
    assert "--pipeline-parallel {ranks}" in tp_compare.mlx_pd_command_of(a)
    assert tp_compare.mlx_pd_command_of(p.parse_args(["--parallel", "pipeline", "--mlx-pd-command", "x {port}"])) == "x {port}"
    a = p.parse_args(["--random-model", "smol-shape", "--concurrency", "1,4,8", "--num-requests", "8",
                      "--env", "OMP_NUM_THREADS=1", "--env", "A_B=x=y", "--launcher", "mlx.launch"])
    assert (a.random_model, a.concurrency, a.num_requests, a.env) == (
        "smol-shape", [1, 4, 8], [8], [("OMP_NUM_THREADS", "1"), ("A_B", "x=y")])
    for bad in (["--env", "NOEQUALS"], ["--env", "BAD-KEY=1"], ["--model-dir", "/m", "--random-model", "fast"],
                ["--concurrency", "0"], ["--launcher", "ssh"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)


def test_targets_request_counts_and_heads(tmp_path):
    assert tp_compare.parse_targets("mlx_lm.server") == ["mlx_lm.server"]
    assert tp_compare.parse_targets(" mlx-pd , mlx_lm.server ") == ["mlx-pd", "mlx_lm.server"]
    for bad in ("", "vllm", "mlx-pd,mlx-pd"):
        with pytest.raises(ValueError, match="--targets"):
            tp_compare.parse_targets(bad)
    assert tp_compare.level_counts([1, 8], [16]) == [16, 16]
    assert tp_compare.level_counts([1, 8], [4, 32]) == [4, 32]
    with pytest.raises(ValueError, match="one per level"):
        tp_compare.level_counts([1, 8], [1, 2, 3])
    (tmp_path / "config.json").write_text(json.dumps(SMOL_SHAPE_CONFIG))
    assert tp_compare.heads_divide(str(tmp_path), 2) is None
    assert "do not divide" in tp_compare.heads_divide(str(tmp_path), 3)
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9, "num_key_value_heads": 3}))
    assert "9 attention heads over 3 KV heads" in tp_compare.heads_divide(str(tmp_path), 2)


def test_the_mlx_pd_command_fills_its_placeholders_word_by_word():
    argv = tp_compare.mlx_pd_argv(tp_compare.MLX_PD_COMMAND, "/my models/m", 2, 9000, python="/py")
    assert argv == ["/py", "-m", "cluster.launch.cli", "serve", "--model", "/my models/m", "--tensor-parallel", "2",
                    "--port", "9000"]
    assert tp_compare.mlx_pd_argv("run --tp={ranks} '{model}'", "m", 4, 1)[1:] == ["--tp=4", "m"]
    assert tp_compare.mlx_pd_argv("x", "m", 2, 1) == ["x"]
    with pytest.raises(ValueError, match="placeholder"):
        tp_compare.mlx_pd_argv("{python} --gpus {gpus}", "m", 2, 1)
    assert tp_compare.mlx_pd_argv("{python}", "m", 2, 1) == [sys.executable]


def test_a_server_that_rejects_the_flag_is_told_apart_from_one_that_fails():
    log = ("usage: mlx-pd [-h]\n              {serve,generate}\n"
           "mlx-pd: error: unrecognized arguments: --tensor-parallel 2\n")
    assert tp_compare.flag_rejected(log) == "mlx-pd: error: unrecognized arguments: --tensor-parallel 2"
    assert tp_compare.flag_rejected("Traceback ...\nRuntimeError: out of memory\n") is None
    assert tp_compare.flag_rejected("serving with --tensor-parallel 2\n") is None


def numbers(tok_s: float, ttft_p50: float, errors: int = 0) -> dict:
    return {"output_throughput": tok_s, "ttft_s_p50": ttft_p50, "host_cpu_s_per_output_token": 0.02,
            "errors": errors, "loadavg_start": None, "loadavg_end": None}


def one_pass(by_level: dict, status: str = "ok", reason=None, identical: str = "yes", ready_s: float = 3.0) -> dict:
    ok = status == "ok"
    return {"status": status, "reason": reason, "ready_s": ready_s if ok else None,
            "check": {"identical": identical == "yes", "same_but_spaces": identical != "no", "common_prefix_chars": 5}
            if ok else None,
            "idle_cpu_s_per_s": 1.0 if ok else None, "memory_idle": {"rss_mib": 400.0} if ok else None,
            "memory": {"rss_mib": 500.0} if ok else None, "levels": [],
            "by_level": {str(c): n for c, n in by_level.items()}}


def result(servers: dict) -> dict:
    r = {"ranks": 2, "model_dir": "/m/fast-llama-2l-seed0", "max_tokens": 64, "launcher": "direct",
         "concurrency": [1, 8], "passes": 1, "servers": {n: tp_compare.combine(p) for n, p in servers.items()}}
    r["ratios"] = tp_compare.level_ratios(r)
    r["errors"] = tp_compare.errors(r)
    return r


def test_passes_alternate_abba_and_combine_as_medians():
    assert tp_compare.pass_order(3, ["mlx_lm.server", "mlx-pd"]) == [
        (0, "mlx_lm.server"), (0, "mlx-pd"), (1, "mlx-pd"), (1, "mlx_lm.server"), (2, "mlx-pd"),
        (2, "mlx_lm.server")]
    s = tp_compare.combine([one_pass({1: numbers(10.0, 0.3)}, ready_s=2.0),
                            one_pass({1: numbers(30.0, 0.1, errors=1)}, ready_s=4.0),
                            one_pass({1: numbers(20.0, float("nan"))}, identical="no", ready_s=9.0)])
    assert s["status"] == "ok" and s["passes_ok"] == 3 and s["ready_s"] == 4.0 and s["rss_mib_max"] == 500.0
    assert s["by_level"]["1"] == {"output_throughput": 20.0, "ttft_s_p50": 0.2, "host_cpu_s_per_output_token": 0.02,
                                  "errors": 1}
    assert s["check_identical"] is False and s["check_same_but_spaces"] is False
    assert s["check_common_prefix_chars"] == 5
    spaces = tp_compare.combine([one_pass({}, identical="spaces"), one_pass({})])
    assert (spaces["check_identical"], spaces["check_same_but_spaces"]) == (False, True)
    failed = tp_compare.combine([one_pass({1: numbers(10.0, 0.3)}), one_pass({}, status="failed", reason="died")])
    assert (failed["status"], failed["reason"], failed["passes_ok"]) == ("failed", "died", 1)
    assert tp_compare.combine([])["status"] == "not run"


def test_the_table_has_both_sides_and_the_ratios_mlx_pd_over_mlx_lm():
    r = result({"mlx_lm.server": [one_pass({1: numbers(20.0, 0.1), 8: numbers(80.0, 0.4)})],
                "mlx-pd": [one_pass({1: numbers(30.0, 0.05), 8: numbers(40.0, 0.8, errors=2)}, identical="no")]})
    assert r["ratios"]["1"] == {"output_throughput": 1.5, "ttft_s_p50": 0.5}
    assert r["ratios"]["8"] == {"output_throughput": 0.5, "ttft_s_p50": 2.0}
    assert r["errors"] == ["mlx-pd: 2 failed requests at concurrency 8",
                           "mlx-pd: its greedy answer differs from single-process mlx-lm's"]
    (_, head, rows), (_, head2, rows2) = tp_compare.tables(r)
    assert head[:3] == ["concurrency", "mlx_lm.server tok/s", "mlx-pd tok/s"]
    assert rows == [["1", "20.0", "30.0", "1.50x", "100.0", "50.0", "0.50x"],
                    ["8", "80.0", "40.0", "0.50x", "400.0", "800.0", "2.00x"]]
    assert [row[:5] for row in rows2] == [["mlx_lm.server", "ok", "1/1", "3.0", "yes"],
                                          ["mlx-pd", "ok", "1/1", "3.0", "no (5 chars agree)"]]
    assert rows2[1][5:9] == ["1.00", "500", "20.0 / 20.0", "2"]
    assert len(head2) == len(rows2[0])


def test_an_answer_that_differs_only_in_surrounding_whitespace_passes_the_check():
    r = result({"mlx_lm.server": [one_pass({1: numbers(20.0, 0.1)})],
                "mlx-pd": [one_pass({1: numbers(30.0, 0.05)}, identical="spaces")]})
    assert r["errors"] == []
    assert tp_compare.tables(r)[1][2][1][4] == "yes but for surrounding whitespace"


def test_the_answer_check_compares_text_and_stripped_text(monkeypatch):
    class Reply:
        def __init__(self, text):
            self.text = text

        def raise_for_status(self):
            pass

        def json(self):
            return {"choices": [{"message": {"content": self.text}}]}

    import httpx

    for text, verdict in (("abc def", (True, True, 7)), (" abc def", (False, True, 0)), ("abc xyz", (False, False, 4))):
        monkeypatch.setattr(httpx, "post", lambda *a, _t=text, **k: Reply(_t))
        c = tp_compare.check_answer("http://x", "abc def", "p", 4)
        assert (c["identical"], c["same_but_spaces"], c["common_prefix_chars"]) == verdict and c["error"] is None
    monkeypatch.setattr(httpx, "post", lambda *a, **k: (_ for _ in ()).throw(httpx.ConnectError("refused")))
    c = tp_compare.check_answer("http://x", "abc", "p", 4)
    assert not c["same_but_spaces"] and "ConnectError" in c["error"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="stop_tree finds descendants in /proc")
def test_stop_tree_ends_a_child_in_a_session_of_its_own(tmp_path):
    """mlx-pd's ranks start in sessions of their own: stopping the server's process group alone would leave them."""
    import os
    import time

    from benchmarks.servers import ServerProcess

    pidfile = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
              f"open({str(pidfile)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    server = ServerProcess("tree", [sys.executable, "-c", script], 1, log_dir=str(tmp_path)).start()
    try:
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pidfile.read_text())
        assert os.path.exists(f"/proc/{child}")
    finally:
        tp_servers.stop_tree(server, grace_s=5)
    assert server.proc.poll() is not None
    assert not os.path.exists(f"/proc/{child}") or "Z" in open(f"/proc/{child}/stat").read().split(")")[1][:3]


def test_a_skipped_mlx_pd_leaves_dashes_and_is_no_error():
    reason = "mlx-pd: error: unrecognized arguments: --tensor-parallel 2"
    r = result({"mlx_lm.server": [one_pass({1: numbers(20.0, 0.1), 8: numbers(80.0, 0.4)})],
                "mlx-pd": [one_pass({}, status="skipped", reason=reason)]})
    assert math.isnan(r["ratios"]["1"]["output_throughput"]) and r["errors"] == []
    (_, _, rows), (_, _, rows2) = tp_compare.tables(r)
    assert rows[0] == ["1", "20.0", "-", "-", "100.0", "-", "-"]
    assert rows2[1] == ["mlx-pd", "skipped", "0/1", "-", "-", "-", "-", "-", "0", reason]
    failed = result({"mlx_lm.server": [one_pass({}, status="failed", reason="exited with code 1")]})
    assert failed["errors"] == ["mlx_lm.server: exited with code 1"]
