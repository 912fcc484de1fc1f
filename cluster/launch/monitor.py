"""`mlx-pd monitor TOPOLOGY`: Prometheus (and a Grafana dashboard) for a running cluster.

It writes into one folder (default `$MLX_PD_CACHE/monitor/<topology>/`, `--out DIR` to choose):

    prometheus.yml          three scrape jobs: `ray` (every Ray node's metrics export port: the workers'
                            `ray_mlx_pd_*` series), `mlx-pd-router` (the router's `/metrics`: `mlxpd_router_*`
                            and the workers' stats added up, `mlx_pd_*`)
                            and `mlx-pd-workers` (each worker's `metrics_port`: `mlxpd_kv_transfer_*`, labelled
                            worker and role)
    router_api_key          the router's API key (mode 0600), sent as a bearer credential; only with --api-key
                            or $MLX_PD_API_KEY (the router serves /metrics without one, see router/app.py)
    grafana_dashboard.json  the dashboard to import into Grafana (a `datasource` variable picks the Prometheus)
    data/                   Prometheus's storage

The `ray` job reads its targets from the service-discovery file that the head's dashboard rewrites every few
seconds in the session folder, so nodes that join later are scraped too. Ray also links it from its temp folder
(`/tmp/ray/prom_metrics_service_discovery.json` by default) to the latest session; the config names that link when
it points at this cluster's session, so a Prometheus left running follows the head through `mlx-pd down` and `up`.

`monitor` then runs `prometheus` on that config in the foreground until Ctrl-C when it is on PATH (Debian's or
Homebrew's package), listening on 127.0.0.1:`--port` (9090). With `--no-start`, or without `prometheus`, it
only writes the files and prints the command that starts it.

Ray's metrics export port needs no token even with Ray's token authentication on (checked against Ray 2.60:
tests/test_monitoring.py scrapes it with none), so the `ray` job sends none. The Ray dashboard's Metrics page
graphs from this Prometheus once the head runs with `RAY_PROMETHEUS_HOST` (and `RAY_GRAFANA_HOST` for its
embedded Grafana panels) in its environment; `mlx-pd up` passes its own environment to the head it starts.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from cluster.launch import ray_up
from cluster.topology import TopologySpec

DEFAULT_PORT = 9090
DEFAULT_SCRAPE_INTERVAL_S = 5.0
SD_FILE_NAME = "prom_metrics_service_discovery.json"  # Ray's name (ray._private.ray_constants)
DASHBOARD_FILE = Path(__file__).resolve().with_name("grafana_dashboard.json")
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
Echo = Callable[[str], None]


class MonitorError(ray_up.LaunchError):
    """`mlx-pd monitor` cannot do what was asked; the message says why and what to do."""


@dataclass(frozen=True)
class MonitorFiles:
    """What `write_files` wrote: the folder, the Prometheus config, its storage folder, the dashboard JSON and
    the credentials file (None without an API key)."""

    out_dir: Path
    config: Path
    storage: Path
    dashboard: Path
    credentials: Optional[Path]


def default_out_dir(topology_name: str) -> Path:
    """`$MLX_PD_CACHE/monitor/<topology_name>`, default `~/.cache/mlx-pd/monitor/<topology_name>`."""
    root = os.environ.get("MLX_PD_CACHE") or Path.home() / ".cache" / "mlx-pd"
    return Path(root) / "monitor" / topology_name


def scrape_host(host: str) -> str:
    """The address to scrape a server bound to `host` at, for a `host:port` target: a wildcard bind is reached
    on loopback, an IPv6 address goes in brackets."""
    if host in ("", "0.0.0.0", "::", "localhost"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _duration(seconds: float) -> str:
    """Prometheus's duration syntax for `seconds` (whole milliseconds): 5.0 -> "5s", 0.5 -> "500ms"."""
    ms = round(seconds * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def prometheus_config(topology: TopologySpec, sd_file: Path, *, scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S,
                      credentials: Optional[Path] = None) -> dict:
    """The Prometheus configuration (as a dict, for YAML) that scrapes `topology`'s cluster.

    `sd_file` is Ray's service-discovery file (`find_sd_file`);
    `credentials` a file holding the router's API key (sent as `Authorization: Bearer`), or None.
    Raises ValueError for a scrape interval under 0.1 s.
    """
    if not scrape_interval_s >= 0.1:
        raise ValueError(f"--scrape-interval={scrape_interval_s!r} is invalid: must be >= 0.1 seconds")
    interval = _duration(scrape_interval_s)
    router: dict = {"job_name": "mlx-pd-router", "metrics_path": "/metrics", "static_configs": [{
        "targets": [f"{scrape_host(topology.router.host)}:{topology.router.port}"],
        "labels": {"topology": topology.name}}]}
    if credentials is not None:
        router["authorization"] = {"type": "Bearer", "credentials_file": str(credentials)}
    jobs = [{"job_name": "ray", "file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": interval}]},
            router]
    workers = [{"targets": [f"{scrape_host(w.host)}:{w.metrics_port}"],
                "labels": {"topology": topology.name, "worker": w.name, "role": w.role}}
               for w in topology.workers if w.metrics_port is not None]
    if workers:
        jobs.append({"job_name": "mlx-pd-workers", "metrics_path": "/metrics", "static_configs": workers})
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval,
                       "scrape_timeout": _duration(min(10.0, scrape_interval_s))},
            "scrape_configs": jobs}


def write_files(topology: TopologySpec, out_dir: Path, sd_file: Path, *,
                scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S, api_key: Optional[str] = None) -> MonitorFiles:
    """Write prometheus.yml, the dashboard JSON and (with `api_key`) router_api_key (mode 0600) into `out_dir`."""
    import yaml

    out_dir = Path(out_dir).expanduser().resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    key_file = out_dir / "router_api_key"
    key_file.unlink(missing_ok=True)  # an earlier run's key goes too; a new file is created 0600
    credentials = None
    if api_key:
        with os.fdopen(os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(api_key)
        credentials = key_file
    config = out_dir / "prometheus.yml"
    body = prometheus_config(topology, sd_file, scrape_interval_s=scrape_interval_s, credentials=credentials)
    config.write_text(f"# written by `mlx-pd monitor {topology.name}`; rewritten on every run\n"
                      + yaml.safe_dump(body, sort_keys=False))
    dashboard = out_dir / DASHBOARD_FILE.name
    shutil.copyfile(DASHBOARD_FILE, dashboard)
    storage = out_dir / "data"
    storage.mkdir(exist_ok=True)
    return MonitorFiles(out_dir, config, storage, dashboard, credentials)


def prometheus_command(binary: str, files: MonitorFiles, port: int) -> list[str]:
    """The `prometheus` command line over `files`, listening on 127.0.0.1:`port`."""
    return [binary, f"--config.file={files.config}", f"--storage.tsdb.path={files.storage}",
            f"--web.listen-address=127.0.0.1:{port}"]


def find_sd_file(session_dir: Path, timeout_s: float) -> Path:
    """Ray's service-discovery file for the session in `session_dir`: the link in Ray's temp folder (its parent)
    when Ray made one to this session's file, else the session's own file. Waits for it (the dashboard writes it
    a few seconds after the head starts); MonitorError after `timeout_s`."""
    own, link = session_dir / SD_FILE_NAME, session_dir.parent / SD_FILE_NAME
    deadline = time.monotonic() + timeout_s
    while not own.is_file():
        if time.monotonic() > deadline:
            raise MonitorError(f"Ray's service-discovery file {own} did not appear within {timeout_s:.0f} s: "
                               "run `mlx-pd monitor` on the Ray head's machine (its dashboard writes the file)")
        time.sleep(0.5)
    return link if link.is_file() and link.resolve() == own.resolve() else own


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait until Prometheus at `url` answers `/-/ready`; MonitorError if it exits or takes over `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise MonitorError(f"prometheus exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2.0) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise MonitorError(f"prometheus did not answer at {url} within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM `proc` (Prometheus flushes its head block), SIGKILL it after `timeout_s`."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10.0)


def _log_tail(path: Path, lines: int = 3) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.is_file() else []
    return "\n    ".join(text[-lines:])


def run_prometheus(command: list[str], url: str, log: Path, echo: Echo) -> int:
    """Run `command` until Ctrl-C (or SIGTERM), its output in `log`; 0 once stopped, MonitorError (with the log's
    last lines) if it fails to start or exits by itself."""
    # SIGINT too: a process started in the background of a non-interactive shell inherits SIGINT ignored, and
    # Python then leaves it ignored, so Ctrl-C (or a supervisor's SIGINT) would never stop Prometheus
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        try:
            wait_ready(url, proc)
        except MonitorError as exc:
            raise MonitorError(f"{exc}; its log ({log}) ends:\n    {_log_tail(log)}") from None
        echo(f"mlx-pd: Prometheus serves {url} (log {log}); Ctrl-C stops it")
        code = proc.wait()
        raise MonitorError(f"prometheus exited with {code}; its log ({log}) ends:\n    {_log_tail(log)}")
    except KeyboardInterrupt:
        echo("mlx-pd: stopping Prometheus")
        return 0
    finally:
        stop(proc)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def router_answers(topology: TopologySpec, timeout_s: float = 2.0) -> bool:
    """True when the topology's router answers `/health` (any HTTP status: it listens)."""
    url = f"http://{scrape_host(topology.router.host)}:{topology.router.port}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def hints(topology_label: str, files: MonitorFiles, port: int) -> list[str]:
    """How to point the Ray dashboard and Grafana at this Prometheus (printed by `monitor`)."""
    url = f"http://127.0.0.1:{port}"
    return [
        f"mlx-pd: Grafana: import {files.dashboard} (Dashboards > New > Import), choosing this Prometheus "
        f"({url}) as its data source",
        "mlx-pd: Ray dashboard Metrics page: start the head with RAY_PROMETHEUS_HOST in its environment, e.g.",
        f"    mlx-pd down {topology_label} && RAY_PROMETHEUS_HOST={url} "
        f"RAY_GRAFANA_HOST=http://127.0.0.1:3000 mlx-pd up {topology_label}",
        "  (RAY_GRAFANA_HOST only with a Grafana there; Ray writes its own Grafana dashboards into "
        "<session dir>/metrics/grafana)",
    ]


def monitor(topology_path: str, *, out_dir: Optional[str] = None, port: int = DEFAULT_PORT, start: bool = True,
            scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S, api_key: Optional[str] = None,
            state_dir: Optional[Path] = None, sd_timeout_s: float = 30.0, echo: Echo = print) -> int:
    """`mlx-pd monitor`: write the files for the running topology and (with `start`, when `prometheus` is on
    PATH) run Prometheus until Ctrl-C. Returns the exit code; raises MonitorError / ray_up.LaunchError (Ray not
    running or unreachable, Prometheus failing), ValueError / FileNotFoundError (bad topology or option)."""
    if not 0 < port < 65536:
        raise ValueError(f"--port={port} is invalid: must be in 1..65535")
    topology = ray_up.load_cluster_topology(topology_path)
    prometheus_config(topology, Path(), scrape_interval_s=scrape_interval_s)  # bad options fail before Ray
    session = ray_up.ray_session_dir(topology, state_dir)
    if session is None:
        raise MonitorError(f"{topology.name} is not running (no local Ray head of mlx-pd): start it with "
                           f"`mlx-pd up {topology_path}` first")
    sd_file = find_sd_file(Path(session), sd_timeout_s)
    files = write_files(topology, Path(out_dir) if out_dir else default_out_dir(topology.name), sd_file,
                        scrape_interval_s=scrape_interval_s, api_key=api_key)
    echo(f"mlx-pd: wrote {files.config} (scrapes Ray through {sd_file} and the router) and {files.dashboard}")
    if not router_answers(topology):
        echo(f"mlx-pd: warning: the router at {scrape_host(topology.router.host)}:{topology.router.port} does not "
             "answer yet; Prometheus scrapes it once it does")
    for line in hints(topology_path, files, port):
        echo(line)
    binary = shutil.which("prometheus")
    command = prometheus_command(binary or "prometheus", files, port)
    if not start or binary is None:
        why = "" if binary else " (prometheus is not installed: `apt-get install prometheus` or `brew install " \
                                "prometheus`)"
        echo(f"mlx-pd: start Prometheus with{why}:\n    {shlex.join(command)}")
        return 0
    return run_prometheus(command, f"http://127.0.0.1:{port}", files.out_dir / "prometheus.log", echo)
