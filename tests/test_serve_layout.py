"""`mlx-pd serve --layout`: the rule that picks one process or a split, and the split layout served end to end.

The rule (`cluster.launch.platform.choose_layout`) is checked on stubbed backends and core counts, and on this
machine, where MLX computes on the CPU, `auto` must keep one process. The split layout runs as the CLI runs it
(a subprocess of `python -m cluster.launch.cli serve --layout split` on the fast stand-in model): its greedy
chat answer must equal one-process mode's (the same model served in this process), streaming must work, the
OpenAI and operator endpoints must answer, and its engine process must be gone once the serve stops, whether
it was asked to (SIGTERM) or killed outright (SIGKILL).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cluster.config import EngineConfig
from cluster.launch import platform as mpd_platform
from cluster.launch.platform import SPLIT_MIN_CORES, choose_layout, host_cores
from cluster.launch.split_serve import LOCAL_PREFILL_ALL, split_topology_text
from cluster.ports import free_port
from cluster.topology import parse_topology

REPO = Path(__file__).resolve().parent.parent
CHAT = {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 12, "temperature": 0}


# -- the rule -------------------------------------------------------------------------------------------------

def test_auto_keeps_one_process_when_mlx_computes_on_the_cpu_whatever_the_cores():
    for cores in (1, 2, 16, 64):
        assert choose_layout("auto", gpu=False, cores=cores)[0] == "one-process"


def test_auto_splits_a_gpu_machine_with_enough_cores_and_not_one_with_too_few():
    assert choose_layout("auto", gpu=True, cores=SPLIT_MIN_CORES)[0] == "split"
    assert choose_layout("auto", gpu=True, cores=8)[0] == "split"  # e.g. an M2 Pro's 8 performance cores
    name, reason = choose_layout("auto", gpu=True, cores=SPLIT_MIN_CORES - 1)
    assert name == "one-process" and str(SPLIT_MIN_CORES - 1) in reason


def test_an_explicit_layout_is_taken_as_given_and_a_bad_one_names_the_option():
    assert choose_layout("split", gpu=False, cores=1)[0] == "split"
    assert choose_layout("one-process", gpu=True, cores=32)[0] == "one-process"
    with pytest.raises(ValueError, match="--layout='two'"):
        choose_layout("two")


def test_a_mac_counts_its_performance_cores_and_falls_back_to_all_cores():
    assert host_cores(system="Darwin", sysctl=lambda: "8\n") == 8
    assert host_cores(system="Darwin", sysctl=lambda: None) == (os.cpu_count() or 1)
    assert host_cores(system="Darwin", sysctl=lambda: "garbage") == (os.cpu_count() or 1)


def test_auto_picks_one_process_on_this_cpu_machine():
    if mpd_platform.mlx_computes_on_gpu():
        pytest.skip("MLX computes on a GPU here")
    name, reason = choose_layout("auto")
    assert name == "one-process" and "CPU" in reason


def test_the_cli_refuses_an_unknown_layout_by_name(capsys):
    from cluster.launch import cli

    assert cli.main(["serve", "--layout", "sideways"]) == 2
    assert "--layout='sideways'" in capsys.readouterr().err


def test_the_split_topology_has_one_decode_worker_that_prefills_every_prompt_with_the_serve_settings():
    engine = EngineConfig(kv_cache_gb=0.5, max_num_seqs=8, kv_bits=8, dtype="float32")
    text = split_topology_text(source="/m/x", served_name="x", aliases=("claude-*",), engine=engine, ports=(5001, 5002))
    topology = parse_topology(text, name="split")
    (worker,) = topology.workers
    assert (worker.name, worker.role, worker.host, worker.control_port, worker.kv_port) == (
        "engine", "decode", "127.0.0.1", 5001, 5002)
    assert worker.engine == engine and topology.engine == engine
    assert topology.model.served_name == "x" and topology.model.aliases == ("claude-*",)
    assert topology.routing.local_prefill_max_tokens == LOCAL_PREFILL_ALL > 10**9


# -- the split served end to end --------------------------------------------------------------------------------

def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie left to a container's init that does not reap counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:4]
    except OSError:
        return True


def _start_split(model_dir: str) -> tuple[subprocess.Popen, str]:
    from cluster.launch.platform import preload_env

    port = free_port()
    env = {**os.environ, **preload_env(), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "cluster.launch.cli", "serve", "--model", model_dir, "--layout",
                             "split", "--port", str(port), "--log-level", "warning"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the split serve did not come up:\n{proc.communicate()[0].decode(errors='replace')}")


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


@pytest.mark.timeout(240)
def test_split_serve_answers_as_one_process_streams_and_leaves_no_engine_behind():
    from benchmarks.reliability_long import fast_model_dir
    from tests.live_server import live_model_server

    model_dir = str(fast_model_dir())
    with live_model_server(model_dir) as (base, _):
        expected = httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=60).json()["choices"][0]["message"]
    proc, base = _start_split(model_dir)
    try:
        models = httpx.get(base + "/v1/models", timeout=10).json()
        layout = models["layout"]
        assert layout["name"] == "split" and layout["router_pid"] == proc.pid != layout["engine_pid"]
        engine_pid = layout["engine_pid"]
        assert models["data"][0]["id"] == Path(model_dir).name and _alive(engine_pid)
        answer = httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=60).json()
        assert answer["choices"][0]["message"]["content"] == expected["content"]
        with httpx.stream("POST", base + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=60) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, events[:-1])
                           if c["choices"])
        assert streamed == expected["content"]
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        assert "mlxpd_router_requests_total" in httpx.get(base + "/metrics", timeout=10).text
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0].decode(errors="replace")
    assert f"mlx-pd: layout split (router pid {proc.pid}, engine pid {engine_pid}): --layout split was given" in out
    assert proc.returncode == 0, out
    assert _wait_gone(engine_pid, 5), "the engine process outlived the serve"


@pytest.mark.timeout(240)
def test_a_killed_split_serve_takes_its_engine_process_with_it():
    from benchmarks.reliability_long import fast_model_dir

    proc, base = _start_split(str(fast_model_dir()))
    engine_pid = httpx.get(base + "/v1/models", timeout=10).json()["layout"]["engine_pid"]
    proc.kill()  # no finally, no atexit: the engine notices its parent is gone
    proc.communicate(timeout=30)
    assert _wait_gone(engine_pid, 15), "the engine process outlived a killed serve"
