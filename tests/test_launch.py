"""Cluster mode on Ray (cluster/launch/, `mlx-pd up|status|down`).

The first half needs no Ray: actor names, placement and options, the head's command line, metrics, the
status table, the lab example, CLI errors. The `ray` half shares one local cluster (local-1p1d with free
ports, a private state folder) for the whole module: up, a chat answer through the router, status, an
idempotent second up, a worker that fails to start, a router restarted while a worker is gone, and down (last:
no actors, no Ray processes left). Beside it on the same head, a topology whose decode worker is a group of two
ranks on loopback: the following rank is an actor of its own, status shows both ranks, and the rank killed is
restarted by Ray with its leader, the group re-formed and answering as before.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.launch import ray_head, ray_up
from cluster.launch.actors import metric_values
from cluster.stats import KVGroupStats, WorkerStats
from cluster.topology import TOPOLOGY_DIR, load_topology
from tests.cluster_helpers import free_port_topology

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "cluster.launch.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


# -- without Ray ---------------------------------------------------------------------------------------------

def test_lab_example_parses_into_a_studio_and_two_minis():
    t = load_topology("lab-example")
    assert [(w.actor_name, w.role) for w in t.workers] == [
        ("prefill-0@mac-studio-1", "prefill"), ("decode-0@mac-mini-1", "decode"), ("decode-1@mac-mini-2", "decode")]
    assert t.security.curve_keys_dir and t.ray.address.endswith(":6379") and t.router.host == "192.168.1.10"
    assert {w.host for w in t.workers} == {"192.168.1.10", "192.168.1.11", "192.168.1.12"}
    text = (TOPOLOGY_DIR / "lab-example.toml").read_text()
    for machine in ("mac-studio-1", "mac-mini-1", "mac-mini-2"):  # each Mac's `ray start` is in the comments
        assert re.search(r"#.*ray start .*\\\n#.*--resources='\{\"" + machine, text), machine
    assert "RAY_AUTH_MODE=token" in text and "MLX_PD_API_KEY" in text


def test_placement_pins_actors_to_their_machine_or_host():
    assert ray_up.placement_resources("192.168.1.11", "mac-mini-1", "10.0.0.1") == {"mac-mini-1": 0.01}
    assert ray_up.placement_resources("192.168.1.11", None, "10.0.0.1") == {"node:192.168.1.11": 0.01}
    for host in ("127.0.0.1", "localhost", "0.0.0.0"):  # this machine: where `mlx-pd up` runs
        assert ray_up.placement_resources(host, None, "10.0.0.1") == {"node:10.0.0.1": 0.01}


def test_worker_options_name_place_and_restart_the_actor():
    t = load_topology("lab-example")
    opts = ray_up.worker_options(t, t.worker("decode-1"), "192.168.1.10", {"LD_PRELOAD": "/x/libblas.so.3"})
    assert opts == {"name": "decode-1@mac-mini-2", "namespace": "mlx-pd-lab-example", "lifetime": "detached",
                    "get_if_exists": True, "num_cpus": 0, "resources": {"mac-mini-2": 0.01}, "max_restarts": 3,
                    "max_task_retries": 0, "runtime_env": {"env_vars": {"LD_PRELOAD": "/x/libblas.so.3"}}}
    local = load_topology("local-1p1d")
    opts = ray_up.worker_options(local, local.worker("prefill-0"), "10.0.0.1", {})
    assert opts["resources"] == {"node:10.0.0.1": 0.01} and "runtime_env" not in opts
    router = ray_up.router_options(t, "192.168.1.10")
    assert router["name"] == "router@192.168.1.10" and router["resources"] == {"node:192.168.1.10": 0.01}


def test_missing_resources_name_what_no_node_advertises():
    needed = [{"mac-mini-1": 0.01}, {"mac-mini-2": 0.01}, {"node:10.0.0.1": 0.01}]
    assert ray_up.missing_resources(needed, {"CPU": 2.0, "mac-mini-1": 1.0, "node:10.0.0.1": 1.0}) == ["mac-mini-2"]


def test_head_command_keeps_the_dashboard_on_loopback():
    ports = ray_head.choose_ports(is_free=lambda p: p != 6379)  # 6379 taken: another port, not a clash
    assert ports["gcs"] != 6379 and ports["dashboard"] == 8265 and len(set(ports.values())) == 4
    assert not 10002 <= ports["gcs"] <= 19999  # never inside Ray's worker port range
    cmd = ray_head.head_command(ports)
    assert cmd[1:4] == ["start", "--head", "--block"]
    assert "--dashboard-host=127.0.0.1" in cmd and f"--port={ports['gcs']}" in cmd


def test_token_auth_is_on_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert ray_head.token_auth_env() == {"RAY_AUTH_MODE": "token"}
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert ray_head.token_auth_env() == {"RAY_AUTH_MODE": "token"}


def test_metric_values_turn_stats_into_gauges_and_counter_increments():
    """A worker report becomes gauges set to its values and counters grown by their increase since the last
    report (never negative, from zero at first), KV cache group figures labelled by group; a median not yet
    known is left out."""
    stats = WorkerStats(num_running=2, num_waiting=1, healthy=True, prefix_cache_queries=10, prefix_cache_hits=5,
                        tokens_out=50, kv_bytes_sent=4096.0, ttft_p50_s=None,
                        kv_groups=(KVGroupStats("full", blocks_total=100, blocks_free=60),))

    def by_name(rows):
        return {(s.name, tuple(labels.values())): v for s, labels, v in rows}

    gauges, inc, seen = metric_values(stats, None)
    g = by_name(gauges)
    assert g[("mlx_pd_running_sequences", ())] == 2 and g[("mlx_pd_waiting_sequences", ())] == 1
    assert g[("mlx_pd_kv_group_blocks_used", ("full",))] == 40 and g[("mlx_pd_kv_group_blocks_free", ("full",))] == 60
    assert g[("mlx_pd_prefix_cache_hit_rate", ())] == 0.5 and g[("mlx_pd_healthy", ())] == 1.0
    assert ("mlx_pd_ttft_p50_seconds", ()) not in g
    assert by_name(inc)[("mlx_pd_output_tokens", ())] == 50 and by_name(inc)[("mlx_pd_kv_bytes_sent", ())] == 4096
    later = dataclasses.replace(stats, tokens_out=90, healthy=False, kv_bytes_sent=1.0)
    gauges, inc, _ = metric_values(later, seen)
    assert by_name(gauges)[("mlx_pd_healthy", ())] == 0.0
    assert by_name(inc)[("mlx_pd_output_tokens", ())] == 40 and by_name(inc)[("mlx_pd_kv_bytes_sent", ())] == 0


def test_status_table_shows_each_worker_and_the_router():
    """One table line per worker, then one line per worker saying its load check (passed: in how long and which
    checks; skipped; not run; unknown for a worker that gave no report), then the router's endpoint."""
    passed = {"model_type": "llama", "seconds": 1.234, "skipped": False,
              "passed": ["output head equals the model's own call", "prefix hit reusing 64 tokens"]}
    rows = [{"actor": "router@127.0.0.1", "name": "router", "role": "router", "host": "127.0.0.1", "state": "alive",
             "endpoint": "http://127.0.0.1:8000/v1", "dashboard": "http://127.0.0.1:8265"},
            {"actor": "decode-0@127.0.0.1", "name": "decode-0", "role": "decode", "host": "127.0.0.1", "state": "alive",
             "running": 1, "waiting": 0, "kv_blocks_used": 3, "kv_blocks_free": 725, "prefix_cache_hit_rate": 0.25,
             "load_check": passed},
            {"actor": "prefill-0@127.0.0.1", "name": "prefill-0", "role": "prefill", "host": "127.0.0.1",
             "state": "restarting"},
            {"actor": "decode-1@127.0.0.1", "name": "decode-1", "role": "decode", "host": "127.0.0.1", "state": "alive",
             "load_check": {"model_type": "llama", "passed": [], "seconds": 0.0, "skipped": True}},
            {"actor": "decode-2@127.0.0.1", "name": "decode-2", "role": "decode", "host": "127.0.0.1", "state": "alive",
             "load_check": None}]
    text = ray_up.format_status(rows)
    lines = text.splitlines()
    assert lines[0].split() == ["ACTOR", "ROLE", "HOST", "STATE", "RUNNING", "WAITING", "KV", "USED/FREE",
                                "PREFIX", "HIT"]
    assert lines[1].split() == ["decode-0@127.0.0.1", "decode", "127.0.0.1", "alive", "1", "0", "3/725", "25.0%"]
    assert lines[2].split()[3:] == ["restarting", "-", "-", "-", "-"]
    assert lines[5:9] == [
        "decode-0@127.0.0.1: load check passed for llama in 1.2 s: output head equals the model's own call; "
        "prefix hit reusing 64 tokens",
        "prefill-0@127.0.0.1: load check unknown (no report)",
        "decode-1@127.0.0.1: load check skipped for llama (a family the tests cover)",
        "decode-2@127.0.0.1: load check not run"]
    assert "OpenAI API at http://127.0.0.1:8000/v1" in text and "Ray dashboard: http://127.0.0.1:8265" in text
    assert "layout cluster (router + 1 prefill, 3 decode worker processes)" in text


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="cpu_affinity is Linux-only")
def test_cpu_affinity_pins_every_thread_of_the_worker_process():
    code = ("import os, threading; from cluster.launch.platform import pin_cpus; "
            "t = threading.Thread(target=threading.Event().wait, daemon=True); t.start(); pin_cpus((0,)); "
            "print(sorted({tuple(os.sched_getaffinity(int(tid))) for tid in os.listdir('/proc/self/task')}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[(0,)]", r.stderr


def test_cli_errors_are_clear(tmp_path):
    env = {"MLX_PD_CACHE": str(tmp_path)}  # a state folder with no local head recorded
    r = _cli("up", "no-such-topology", env=env)
    assert r.returncode == 2 and "topology 'no-such-topology' not found" in r.stderr and "Traceback" not in r.stderr
    r = _cli("up", "single-node", env=env)
    assert r.returncode == 1 and "single-node topology" in r.stderr and "mlx-pd serve --topology" in r.stderr
    r = _cli("up", "local-1p1d", "--timeout", "0", env=env)
    assert r.returncode == 2 and "--timeout=0.0 is invalid" in r.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[ray]\naddres = "local"\n')
    r = _cli("status", str(bad), env=env)
    assert r.returncode == 2 and "unknown key(s) addres" in r.stderr
    r = _cli("status", "local-1p1d", env=env)
    assert r.returncode == 1 and "is not running" in r.stdout
    r = _cli("down", "local-1p1d", env=env)
    assert r.returncode == 0 and "not running" in r.stderr
    r = _cli("up", env=env)
    assert r.returncode == 2 and "topology" in r.stderr


def test_a_head_that_cannot_be_reached_is_one_line_naming_its_address(tmp_path):
    from cluster.ports import free_port

    gone = f"127.0.0.1:{free_port()}"  # nothing listens there
    path = free_port_topology("local-1p1d", tmp_path / "gone.toml", address=gone)
    for command in ("up", "status", "down"):
        r = _cli(command, str(path), env={"MLX_PD_CACHE": str(tmp_path)}, timeout=60)
        assert r.returncode == 1 and r.stdout == "", (command, r.stdout)
        assert r.stderr.startswith(f"mlx-pd: error: cannot reach the Ray head at {gone} (") and \
            len(r.stderr.strip().splitlines()) == 1, (command, r.stderr)


def test_auto_never_follows_a_stale_record_of_the_last_ray_start(monkeypatch):
    from ray._private import services, utils

    from cluster.launch import ray_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(utils, "read_ray_address", lambda temp_dir=None: "10.0.0.9:6379")  # a head long gone
    for live, chosen in (({"10.0.0.5:6379"}, "10.0.0.5:6379"), ({"10.0.0.5:6379", "10.0.0.9:6379"}, "10.0.0.9:6379")):
        monkeypatch.setattr(services, "find_gcs_addresses", lambda: frozenset(live))
        assert ray_address.resolve("auto") == chosen
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: frozenset())
    with pytest.raises(ConnectionError, match='"auto" finds no Ray running on this machine'):
        ray_address.resolve("auto")
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: frozenset({"10.0.0.5:6379", "10.0.0.6:6379"}))
    with pytest.raises(ConnectionError, match="10.0.0.5:6379, 10.0.0.6:6379"):
        ray_address.resolve("auto")
    assert ray_address.resolve("10.0.0.7:6379") == "10.0.0.7:6379"  # an explicit address is never looked up


# -- on a local Ray cluster ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """local-1p1d on a local Ray head, up once for the module; yields (topology path, state dir, up's info)."""
    root = tmp_path_factory.mktemp("cluster")
    path, state = free_port_topology("local-1p1d", root / "test-1p1d.toml"), root / "clusters"  # $MLX_PD_CACHE/clusters
    t0 = time.monotonic()
    info = ray_up.up(str(path), state_dir=state, timeout_s=600)
    info["up_s"] = time.monotonic() - t0
    try:
        yield path, state, info
    finally:
        ray_up.down(str(path), state_dir=state)  # a no-op when test_down already ran


def _chat(endpoint: str, content: str, max_tokens: int = 24) -> str:
    import httpx

    r = httpx.post(f"{endpoint}/chat/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _rows(path, state) -> dict:
    return {r["name"]: r for r in ray_up.status(str(path), state_dir=state)}


@pytest.mark.ray
def test_up_serves_chat_through_the_router(cluster):
    path, state, info = cluster
    assert info["endpoint"].startswith("http://127.0.0.1:") and info["endpoint"].endswith("/v1")
    assert info["dashboard"].startswith("http://127.0.0.1:") and set(info["workers"]) == {"prefill-0", "decode-0"}
    baseline = _rows(path, state)
    assert "Paris" in _chat(info["endpoint"], "What is the capital of France?")
    import httpx

    checks = httpx.get(f"{info['endpoint']}/models", timeout=30).json()["data"][0]["load_checks"]
    assert [c["worker"] for c in checks] == ["prefill-0", "decode-0"], checks  # each worker's, over its pongs
    assert all(c["model_type"] == "llama" and not c["skipped"] and
               "output head equals the model's own call" in c["passed"] for c in checks), checks
    long_prompt = ("Here are some facts. " + "The Seine flows through Paris. " * 12 +
                   "Question: which river flows through Paris? Answer in one word.")
    assert "Seine" in _chat(info["endpoint"], long_prompt, max_tokens=8)  # over local_prefill_max_tokens
    deadline = time.monotonic() + 10
    while True:  # stats refresh every 0.5 s in the worker
        rows = _rows(path, state)
        if all(rows[n]["kv_blocks_free"] == baseline[n]["kv_blocks_free"] for n in ("prefill-0", "decode-0")) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for name in ("prefill-0", "decode-0"):
        row = rows[name]
        assert row["state"] == "alive" and row["running"] == 0 and row["waiting"] == 0, row
        assert row["kv_blocks_free"] == baseline[name]["kv_blocks_free"] == row["kv_blocks_total"], row
    assert rows["decode-0"]["tokens_out"] > 0
    assert rows["prefill-0"]["kv_bytes_sent"] == rows["decode-0"]["kv_bytes_received"] > 0  # the long prompt moved
    assert rows["router"]["state"] == "alive" and rows["router"]["endpoint"] == info["endpoint"]


@pytest.mark.ray
def test_status_cli_prints_the_table(cluster):
    path, state, info = cluster
    r = _cli("status", str(path), env={"MLX_PD_CACHE": str(state.parent)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"prefill-0@127\.0\.0\.1\s+prefill\s+127\.0\.0\.1\s+alive", r.stdout), r.stdout
    assert re.search(r"decode-0@127\.0\.0\.1\s+decode\s+127\.0\.0\.1\s+alive", r.stdout), r.stdout
    for worker in ("prefill-0", "decode-0"):  # each worker's load check, as the worker ran it when it started
        assert re.search(rf"^{worker}@127\.0\.0\.1: load check passed for llama in [0-9.]+ s: output head equals",
                         r.stdout, flags=re.M), r.stdout
    assert info["endpoint"] in r.stdout
    # the Ray token that guards this cluster never shows in `mlx-pd status` or in what `up` returned
    token = os.environ.get("RAY_AUTH_TOKEN") or Path(os.environ.get(
        "RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token")).read_text().strip()
    assert len(token) >= 16
    assert token not in r.stdout + r.stderr and token not in repr(info)


@pytest.mark.ray
def test_workers_export_metrics_and_run_with_openblas(cluster):
    import httpx

    path, state, info = cluster
    _chat(info["endpoint"], "What is the capital of France?", max_tokens=4)  # the decode worker's process decodes
    ray_head.enable_token_auth()
    import ray

    ray.init(address=ray_head.read_head(state).address, log_to_driver=False, configure_logging=False)
    try:
        node = ray.nodes()[0]
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    finally:
        ray.shutdown()
    blocks_free = r'ray_mlx_pd_kv_group_blocks_free\{[^}]*group="full"[^}]*role="decode"[^}]*worker="decode-0"'
    decoded = r'ray_mlx_pd_output_tokens\S*\{[^}]*worker="decode-0"[^}]*\} [1-9]'
    deadline, text = time.monotonic() + 60, ""
    # each worker's figures reach Ray's exporter on their own schedule: wait for the decode worker's, not any one's
    while time.monotonic() < deadline and not (re.search(blocks_free, text) and re.search(decoded, text)):
        time.sleep(2)
        text = httpx.get(url, timeout=10).text
    assert re.search(blocks_free, text)
    assert re.search(decoded, text)
    if sys.platform.startswith("linux") and os.environ.get("LD_PRELOAD"):
        for w in info["workers"].values():
            assert "openblas" in Path(f"/proc/{w['pid']}/maps").read_text(), w


@pytest.mark.ray
def test_up_again_says_it_is_already_up(cluster):
    path, state, info = cluster
    again = ray_up.up(str(path), state_dir=state, timeout_s=60, echo=lambda line: None)
    assert again["already_running"] and again["endpoint"] == info["endpoint"]


@pytest.mark.ray
def test_ray_restarts_a_killed_worker_and_the_router_uses_it_again(cluster):
    path, state, info = cluster
    old_pid = _rows(path, state)["decode-0"]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    deadline, row = time.monotonic() + 120, {}
    while time.monotonic() < deadline:
        rows = _rows(path, state)
        row = rows["decode-0"]
        if row["state"] == "alive" and row.get("pid") not in (None, old_pid):
            break
        time.sleep(1)
    assert row["state"] == "alive" and row["pid"] != old_pid, row  # Ray re-ran the constructor: model, sockets
    assert "Paris" in _chat(info["endpoint"], "What is the capital of France?")


@pytest.mark.ray
def test_a_worker_that_cannot_start_shows_its_error(cluster, tmp_path):
    path, state, _ = cluster
    bad = free_port_topology("local-1p1d", tmp_path / "test-broken.toml", source=str(tmp_path / "no-such-model.gguf"))
    with pytest.raises(ray_up.LaunchError, match=r"(?s)failed to start.*no-such-model"):
        ray_up.up(str(bad), state_dir=state, timeout_s=300, echo=lambda line: None)
    assert all(r["state"] in ("absent", "dead") for r in ray_up.status(str(bad), state_dir=state))
    assert _rows(path, state)["decode-0"]["state"] == "alive"  # the other topology and the shared head are untouched


@pytest.mark.ray
def test_a_router_restarted_while_a_worker_is_gone_serves_and_uses_it_once_it_is_back(cluster):
    import httpx
    import ray

    path, state, info = cluster
    topology = ray_up.load_cluster_topology(str(path))
    health = info["endpoint"].removesuffix("/v1") + "/health"
    ray_head.enable_token_auth()
    ray.init(address=ray_head.read_head(state).address, namespace=topology.namespace, log_to_driver=False,
             configure_logging=False)
    try:
        router = ray.get_actor(ray_up.router_actor_name(topology))
        old_pid = ray.get(router.info.remote(), timeout=30)["pid"]
        ray.kill(ray.get_actor(topology.worker("decode-0").actor_name), no_restart=True)  # gone with its machine
        os.kill(old_pid, signal.SIGKILL)  # Ray restarts the router (max_restarts)
        deadline, pid, answer = time.monotonic() + 120, old_pid, None
        while time.monotonic() < deadline and answer is None:
            time.sleep(0.5)
            try:
                pid = ray.get(router.info.remote(), timeout=10)["pid"]
                answer = httpx.get(health, timeout=5).status_code if pid != old_pid else None
            except (ray.exceptions.RayError, httpx.HTTPError):
                continue
    finally:
        ray.shutdown()
    assert pid != old_pid and answer == 503, (pid, answer)  # it listens, and says no decode worker is alive
    # the router answers once its wait for a decode worker (dead_after_s, 60 s here) is over: a client waiting
    # exactly as long raced it, and lost to any work before the wait (a first request's tokenizer set-up)
    r = httpx.post(f"{info['endpoint']}/chat/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert r.status_code == 503 and r.headers.get("retry-after"), r.text
    ray_up.up(str(path), state_dir=state, timeout_s=300, echo=lambda line: None)  # decode-0 again, same ports
    assert "Paris" in _chat(info["endpoint"], "What is the capital of France?")


GROUP_TOPOLOGY = """[model]
source = "{source}"
[engine]
dtype = "float32"
num_blocks = 128
block_size = 8
[routing]
heartbeat_s = 0.5
dead_after_s = 3.0
[ray]
address = "local"
max_restarts = 2
[router]
host = "127.0.0.1"
port = {ports[0]}
[[workers]]
name = "decode-0"
role = "decode"
host = "127.0.0.1"
control_port = {ports[1]}
kv_port = {ports[2]}
[workers.group]
parallel = "tensor"
backend = "ring"
deadline_s = 5.0
ranks = [{{ host = "127.0.0.1", ring_port = {ports[3]}, step_port = {ports[4]}, heartbeat_port = {ports[5]} }},
         {{ host = "127.0.0.1", ring_port = {ports[6]}, step_port = {ports[7]}, heartbeat_port = {ports[8]} }}]
"""


@pytest.mark.ray
def test_a_worker_groups_following_rank_is_an_actor_that_ray_restarts_with_its_leader(cluster, tmp_path):
    import httpx

    from tests.group_helpers import model_folder

    path, state, _ = cluster
    folder = model_folder("llama", tmp_path / "models")
    group = tmp_path / "test-group.toml"
    group.write_text(GROUP_TOPOLOGY.format(source=folder, ports=ray_head.free_ports(9)))
    body = {"model": folder.name, "prompt": list(range(100, 160)), "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    try:
        info = ray_up.up(str(group), state_dir=state, timeout_s=300, echo=lambda line: None)
        assert set(info["workers"]) == {"decode-0", "decode-0-rank1"}
        r = httpx.post(f"{info['endpoint']}/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        before = r.json()["choices"][0]["text"]
        row = _rows(group, state)["decode-0"]
        assert row["state"] == "alive" and row["parallel"] == "tensor"
        assert [(k["rank"], k["actor"], k["state"], k["alive"]) for k in row["ranks"]] == [
            (0, "decode-0@127.0.0.1", "alive", True), (1, "decode-0-rank1@127.0.0.1", "alive", True)]
        assert "decode-0@127.0.0.1: a tensor-parallel group of 2 ranks" in ray_up.format_status(
            ray_up.status(str(group), state_dir=state))
        old = {k["rank"]: k["pid"] for k in row["ranks"]}
        os.kill(old[1], signal.SIGKILL)  # the following rank's process: Ray restarts it; its leader exits (75)
        deadline, pids, answer = time.monotonic() + 150, old, None
        while time.monotonic() < deadline and answer is None:
            time.sleep(1)
            row = _rows(group, state)["decode-0"]
            pids = {k["rank"]: k["pid"] for k in row["ranks"]}
            if row["state"] == "alive" and all(k["state"] == "alive" and k["alive"] for k in row["ranks"]):
                r = httpx.post(f"{info['endpoint']}/completions", json=body, timeout=60)
                answer = r.json()["choices"][0]["text"] if r.status_code == 200 else None
        assert answer == before and pids[0] != old[0] and pids[1] != old[1], (row, answer)
    finally:
        result = ray_up.down(str(group), state_dir=state, echo=lambda line: None)
    assert set(result["stopped"]) == {"router@127.0.0.1", "decode-0@127.0.0.1", "decode-0-rank1@127.0.0.1"}
    assert not result["head_stopped"] and _rows(path, state)["decode-0"]["state"] == "alive"


@pytest.mark.ray
def test_down_leaves_no_actors_and_no_ray_processes(cluster):
    path, state, _ = cluster
    head = ray_head.read_head(state)
    result = ray_up.down(str(path), state_dir=state, echo=lambda line: None)
    assert result["head_stopped"] and set(result["stopped"]) == {"router@127.0.0.1", "prefill-0@127.0.0.1",
                                                                  "decode-0@127.0.0.1"}
    assert ray_head.read_head(state) is None and not ray_head.pid_alive(head.pid)
    assert ray_head.group_members(head.pid) == []  # nothing of the head's session (gcs, raylet, workers)
    from ray._private.utils import read_ray_address

    assert read_ray_address() != head.address  # Ray's record of the last `ray start` went with the head
    assert all(r["state"] == "stopped" for r in ray_up.status(str(path), state_dir=state))
