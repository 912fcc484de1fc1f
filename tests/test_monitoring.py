"""Monitoring: `mlx-pd monitor` (cluster/launch/monitor.py), the Grafana dashboard it ships
(cluster/launch/grafana_dashboard.json) and the router's prefix-cache counter.

Without Ray: the Prometheus config (parsed back, and `promtool check config` when installed), the dashboard's
shape and metric names (each one a series some exporter of this project makes), CLI errors, and the router's
`mlxpd_router_prefix_cache_hit_tokens_total` for streamed requests that ask for no usage. On a local Ray
cluster (local-1p1d over the random-weight stand-in model): `mlx-pd monitor` runs a real Prometheus, which
then holds every worker's `ray_mlx_pd_*` series and the router's histograms, and every panel's query of the
dashboard returns data. Prometheus is Debian's `prometheus` package (scripts/setup installs it when CI=true);
without it these tests skip outside CI and fail in CI.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from cluster.launch import monitor
from cluster.stats_metrics import exported_names
from cluster.ports import free_port
from cluster.topology import load_topology

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = json.loads(monitor.DASHBOARD_FILE.read_text())
PANELS = [p for p in DASHBOARD["panels"] if p["type"] != "row"]
EXPRS = [(p["title"], t["expr"]) for p in PANELS for t in p["targets"]]
RATE_WINDOW = "1m"  # what Grafana's $__rate_interval becomes in the live check


def _need(tool: str) -> str:
    """The path of `tool`; skip without it, except in CI (CI=true), where it is a failure."""
    path = shutil.which(tool)
    if path is None:
        why = f"{tool} is not installed (Debian's `prometheus` package; scripts/setup installs it when CI=true)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return path


def _cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "cluster.launch.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


# -- the Prometheus config ------------------------------------------------------------------------------------

def test_config_scrapes_ray_through_its_sd_file_the_router_and_the_workers(tmp_path):
    topology = load_topology("local-1p1d")
    sd = tmp_path / "session" / monitor.SD_FILE_NAME
    files = monitor.write_files(topology, tmp_path / "out", sd, scrape_interval_s=1.0, api_key="sk-test")
    config = yaml.safe_load(files.config.read_text())
    assert config["global"]["scrape_interval"] == "1s"
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["ray"]["file_sd_configs"] == [{"files": [str(sd)], "refresh_interval": "1s"}]
    router = jobs["mlx-pd-router"]
    assert router["static_configs"][0]["targets"] == ["127.0.0.1:8000"] and router["metrics_path"] == "/metrics"
    assert router["authorization"] == {"type": "Bearer", "credentials_file": str(files.credentials)}
    assert files.credentials.read_text() == "sk-test" and files.credentials.stat().st_mode & 0o777 == 0o600
    assert "sk-test" not in files.config.read_text()  # the key stays in its 0600 file
    workers = {c["labels"]["worker"]: c for c in jobs["mlx-pd-workers"]["static_configs"]}
    assert workers["prefill-0"]["targets"] == ["127.0.0.1:5604"] and workers["prefill-0"]["labels"]["role"] == "prefill"
    assert workers["decode-0"]["targets"] == ["127.0.0.1:5614"]
    assert json.loads(files.dashboard.read_text()) == DASHBOARD
    open_files = monitor.write_files(topology, tmp_path / "open", sd)  # no key: no credentials
    assert open_files.credentials is None and "authorization" not in open_files.config.read_text()
    assert monitor.write_files(topology, tmp_path / "out", sd).credentials is None  # a rerun without the key
    assert not files.credentials.exists()
    assert yaml.safe_load(open_files.config.read_text())["global"]["scrape_interval"] == "5s"
    sd.parent.mkdir()
    sd.write_text('[{"labels": {"job": "ray"}, "targets": ["127.0.0.1:1"]}]')
    r = subprocess.run([_need("promtool"), "check", "config", str(files.config)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_config_values_are_checked():
    topology = load_topology("local-1p1d")
    with pytest.raises(ValueError, match="scrape-interval"):
        monitor.prometheus_config(topology, Path("/x"), scrape_interval_s=0.01)
    assert monitor.prometheus_config(topology, Path("/x"), scrape_interval_s=0.5)["global"]["scrape_interval"] == "500ms"
    assert monitor.scrape_host("0.0.0.0") == "127.0.0.1" and monitor.scrape_host("192.168.1.10") == "192.168.1.10"
    assert monitor.scrape_host("fd00::1") == "[fd00::1]"


def test_sd_file_is_rays_link_to_this_session_else_the_sessions_own(tmp_path):
    session, other = tmp_path / "session_b", tmp_path / "session_a"
    for folder in (session, other):
        folder.mkdir()
        (folder / monitor.SD_FILE_NAME).write_text("[]")
    assert monitor.find_sd_file(session, 1) == session / monitor.SD_FILE_NAME  # no link
    link = tmp_path / monitor.SD_FILE_NAME
    link.symlink_to(other / monitor.SD_FILE_NAME)
    assert monitor.find_sd_file(session, 1) == session / monitor.SD_FILE_NAME  # a link to another session
    link.unlink()
    link.symlink_to(session / monitor.SD_FILE_NAME)
    assert monitor.find_sd_file(session, 1) == link  # follows the head through a restart
    with pytest.raises(monitor.MonitorError, match="head's machine"):
        monitor.find_sd_file(tmp_path / "session_c", 0.5)


def test_monitor_cli_errors_are_one_line(tmp_path):
    env = {"MLX_PD_CACHE": str(tmp_path)}
    r = _cli("monitor", "local-1p1d", "--no-start", env=env)
    assert r.returncode == 1 and "is not running" in r.stderr and "mlx-pd up local-1p1d" in r.stderr, r.stderr
    r = _cli("monitor", "no-such-topology", env=env)
    assert r.returncode == 2 and "not found" in r.stderr, r.stderr
    r = _cli("monitor", "single-node", env=env)
    assert r.returncode == 1 and "no [[workers]]" in r.stderr, r.stderr
    r = _cli("monitor", "local-1p1d", "--port", "0", env=env)
    assert r.returncode == 2 and "--port" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# -- the dashboard -------------------------------------------------------------------------------------------

def _exported_names() -> set[str]:
    """Every series name this project's exporters make: Ray's (ray_ prefix, counters _total), the router's and
    the KV transfer's (from their registries)."""
    from prometheus_client import CollectorRegistry

    from kv_transfer.metrics import TransferMetrics
    from router.metrics import RouterMetrics
    from tests.router_fakes import FakeEngine, load_tokenizer

    names = {f"ray_{n}" for n in exported_names()}
    registry = CollectorRegistry()
    transfer = TransferMetrics("send", registry)
    transfer.moved(1, 1)
    router = RouterMetrics(FakeEngine(load_tokenizer()))
    router.count_request("/health", 200)  # a labelled counter shows once it has a label set
    for m in [*router.registry.collect(), *registry.collect()]:
        names |= {s.name for s in m.samples}
    return names


def test_dashboard_uses_a_datasource_variable_and_real_series():
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert len(PANELS) >= 15 and len({p["id"] for p in DASHBOARD["panels"]}) == len(DASHBOARD["panels"])
    for panel in PANELS:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
    exported = _exported_names()
    used = {name for _, expr in EXPRS for name in re.findall(r"\b((?:ray_mlx_pd|mlx_pd|mlxpd)_\w+)", expr)}
    assert used - exported == set()
    for metric in ("kv_group_blocks_used", "kv_group_blocks_free", "running_sequences", "waiting_sequences",
                   "output_tokens_total", "prefix_cache_hit_tokens_total", "kv_bytes_sent_total"):
        assert f"ray_mlx_pd_{metric}" in used, metric
    for metric in ("time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
                   "inter_token_latency_seconds_bucket", "requests_total", "generation_tokens_total"):
        assert f"mlxpd_router_{metric}" in used, metric
    quantiles = [e for _, e in EXPRS if "time_to_first_token" in e]
    assert [re.match(r"histogram_quantile\((0\.\d+),", e).group(1) for e in quantiles] == ["0.5", "0.9", "0.99"]


# -- the router's prefix-cache counter -----------------------------------------------------------------------

def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, flags=re.M)
    return float(found.group(1)) if found else 0.0


def test_router_counts_cached_tokens_of_streams_without_usage():
    """A streamed request that asks for no usage still counts the engine's cached-token figure, once; so does a
    client that leaves mid-stream (real engine: the random-weight model, single-node, a repeated prompt)."""
    from benchmarks.reliability_long import fast_model_dir
    from tests.live_server import live_model_server

    prompt = "Tell me everything about the Seine. " + "The Seine flows through Paris. " * 30
    with live_model_server(fast_model_dir()) as (base, _):
        body = {"model": httpx.get(f"{base}/v1/models").json()["data"][0]["id"], "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}], "stream": True}
        httpx.post(f"{base}/v1/chat/completions", json={**body, "stream": False}, timeout=60).raise_for_status()
        before = httpx.get(f"{base}/metrics").text
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200 and "usage" not in r.read().decode()
        after = httpx.get(f"{base}/metrics").text
        router = _metric(after, "mlxpd_router_prefix_cache_hit_tokens_total") - \
            _metric(before, "mlxpd_router_prefix_cache_hit_tokens_total")
        engine = _metric(after, "mlx_pd_prefix_cache_hit_tokens_total") - \
            _metric(before, "mlx_pd_prefix_cache_hit_tokens_total")
        assert router == engine >= 32 * 5  # the repeated prompt came from the cache, counted once
        with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "max_tokens": 200},
                          timeout=60) as r:  # leaves after the first chunk
            next(r.iter_lines())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            left = httpx.get(f"{base}/metrics").text
            if _metric(left, "mlxpd_router_active_sequences") == 0:
                break
            time.sleep(0.1)
        assert _metric(left, "mlxpd_router_prefix_cache_hit_tokens_total") - \
            _metric(after, "mlxpd_router_prefix_cache_hit_tokens_total") == router


# -- live: Ray, the router and Prometheus --------------------------------------------------------------------

def _query(url: str, expr: str) -> list[dict]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["data"]["result"]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """local-1p1d over the random-weight model on a local Ray head whose metrics agent exports every second;
    yields (topology path, MLX_PD_CACHE folder, up's info, what up printed)."""
    from benchmarks.reliability_long import fast_model_dir
    from cluster.launch import ray_up
    from tests.cluster_helpers import free_port_topology

    root = tmp_path_factory.mktemp("monitor")
    path = free_port_topology("local-1p1d", root / "mon-1p1d.toml", source=str(fast_model_dir()))
    state = root / "clusters"  # $MLX_PD_CACHE/clusters
    saved = os.environ.get("RAY_metrics_report_interval_ms")
    os.environ["RAY_metrics_report_interval_ms"] = "1000"  # the head (started with this environment) exports every 1 s
    try:
        lines: list[str] = []
        info = ray_up.up(str(path), state_dir=state, timeout_s=300, echo=lines.append)
        yield path, root, info, "\n".join(lines)
    finally:
        if saved is None:
            os.environ.pop("RAY_metrics_report_interval_ms", None)
        else:
            os.environ["RAY_metrics_report_interval_ms"] = saved
        ray_up.down(str(path), state_dir=state, echo=lambda line: None)


def _chat(endpoint: str, content: str, stream: bool = False) -> None:
    r = httpx.post(f"{endpoint}/chat/completions", timeout=60, json={
        "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": content}], "max_tokens": 8,
        "temperature": 0, "stream": stream})
    assert r.status_code == 200, r.text


@pytest.mark.ray
def test_up_prints_the_dashboards_and_where_the_ray_token_is(ray_cluster):
    path, _, info, printed = ray_cluster
    base = info["endpoint"].removesuffix("/v1")
    assert f"Live dashboard: {base}/dashboard" in printed and f"Ray dashboard:  {info['dashboard']}" in printed
    assert "get-auth-token` prints it" in printed and f"mlx-pd monitor {path}" in printed
    token = os.environ.get("RAY_AUTH_TOKEN") or Path(os.environ.get(
        "RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token")).read_text().strip()
    assert token not in printed


@pytest.mark.ray
def test_monitor_scrapes_the_cluster_and_every_panel_has_data(ray_cluster, tmp_path):
    _need("prometheus")
    path, cache, info, _ = ray_cluster
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "cluster.launch.cli", "monitor", str(path), "--port", str(port),
                             "--scrape-interval", "1", "--out", str(tmp_path / "mon")],
                            env={**os.environ, "PYTHONPATH": str(ROOT), "MLX_PD_CACHE": str(cache)}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        long_prompt = "Here are some facts. " + "The Seine flows through Paris. " * 20  # past local prefill: KV moves
        for i in range(2):  # the second time from the prefix cache
            _chat(info["endpoint"], long_prompt, stream=bool(i))
            _chat(info["endpoint"], f"Say hello {i}.")
        deadline, missing = time.monotonic() + 60, ["(not asked yet)"]
        while time.monotonic() < deadline and missing:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(1)
            try:
                workers = {s["metric"].get("worker") for s in _query(url, "ray_mlx_pd_kv_group_blocks_free")}
                ttft = _query(url, "mlxpd_router_time_to_first_token_seconds_bucket")
                missing = [f"ray_mlx_pd_kv_group_blocks_free of {w}" for w in ("prefill-0", "decode-0") if w not in workers]
                missing += [] if ttft else ["the router's TTFT"]
                missing += [f"{title}: {expr}" for title, expr in EXPRS
                            if not _query(url, expr.replace("$__rate_interval", RATE_WINDOW))]
                down = [s["metric"] for s in _query(url, "up") if s["value"][1] != "1"]
                missing += [f"a target Prometheus cannot scrape: {m}" for m in down]
            except httpx.HTTPError as exc:
                missing = [f"Prometheus at {url}: {exc}"]
        assert not missing, "\n".join(missing)
        # Ray's metrics export ports answered Prometheus without Ray's token (the config sends none)
        jobs = {s["metric"]["job"] for s in _query(url, "up")}
        assert jobs == {"ray", "mlx-pd-router", "mlx-pd-workers"}
        assert "authorization" not in (tmp_path / "mon" / "prometheus.yml").read_text()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # Ctrl-C did not stop it: fail, and leave no Prometheus behind
            proc.kill()
            out, _ = proc.communicate(timeout=30)
            subprocess.run(["pkill", "-f", str(tmp_path / "mon" / "prometheus.yml")], check=False)
            raise AssertionError(f"mlx-pd monitor did not stop on SIGINT within 60 s:\n{out}") from None
    assert proc.returncode == 0, out
    assert "RAY_PROMETHEUS_HOST" in out and "grafana_dashboard.json" in out, out
    with pytest.raises(httpx.HTTPError):  # Prometheus stopped with it
        httpx.get(f"{url}/-/ready", timeout=2)
