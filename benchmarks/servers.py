"""Starting, health-checking, measuring and stopping the servers a comparison runs against.

    with ServerProcess("mlx-pd", mlx_pd_command(port, model_dir), port) as srv:
        srv.wait_healthy(deadline_s=300)
        ... load ...
        srv.memory()   # {"rss_mib": ..., "peak_rss_mib": ...}

Each server runs in its own session (process group), with OpenBLAS preloaded on Linux
(:func:`cluster.launch.platform.preload_env`), its output going to a log file. Leaving the ``with`` block,
normally, on an error or on Ctrl-C, sends SIGTERM to the group, then SIGKILL after a grace period.

:class:`ClusterProcess` does the same for a local 1P1D cluster (``mlx-pd worker`` x 2 + ``mlx-pd router``
from a temporary topology on free ports), with the same interface, so a comparison treats it as one server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import httpx

from cluster.ports import free_port, free_ports  # noqa: F401 (free_port: for the benchmarks that import it here)


def mlx_pd_command(port: int, model_dir: str, dtype: str = "float32") -> list[str]:
    """argv for our server (single-node mode) on `port`."""
    return [sys.executable, "-m", "cluster.launch.cli", "serve", "--port", str(port), "--model", str(model_dir),
            "--dtype", dtype, "--log-level", "warning"]


def mlx_lm_command(port: int, model_dir: str) -> list[str]:
    """argv for mlx-lm's own server (``python -m mlx_lm server``) on `port`."""
    return [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir), "--port", str(port),
            "--log-level", "WARNING"]


def _proc_status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def process_memory(pid: int) -> dict:
    """Resident memory of `pid` and its descendants in MiB: ``{rss_mib, peak_rss_mib, processes, source}``.

    Uses psutil when installed (peak RSS is then unknown off Linux), else ``/proc/PID/status``
    (VmRSS, VmHWM). The peak is summed over processes, an upper bound of the tree's true peak.
    """
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
        rss = sum(p.memory_info().rss for p in procs) / 2**20
        peak = None
        if Path(f"/proc/{pid}/status").exists():
            peak = sum(_proc_status_kib(p.pid, "VmHWM") for p in procs) / 1024
        return {"rss_mib": rss, "peak_rss_mib": peak, "processes": len(procs), "source": "psutil"}
    from benchmarks.host_cpu import process_tree

    pids = process_tree(pid)
    rss = sum(_proc_status_kib(p, "VmRSS") for p in pids) / 1024
    peak = sum(_proc_status_kib(p, "VmHWM") for p in pids) / 1024
    return {"rss_mib": rss, "peak_rss_mib": peak, "processes": len(pids), "source": "/proc/PID/status"}


class ServerProcess:
    """One server subprocess: start, wait until `/health` answers 200, measure memory, stop.

    `stdin` is handed to Popen as it is (default: inherited); ``subprocess.PIPE`` gives the server a pipe that
    stays open and empty while it runs."""

    def __init__(self, name: str, argv: Sequence[str], port: int, *, env: Optional[dict] = None,
                 log_dir: Optional[str] = None, cwd: Optional[str] = None, stdin=None):
        self.name, self.argv, self.port = name, list(argv), port
        self.env, self.cwd, self.stdin = env, cwd, stdin
        self.log_path = Path(log_dir or tempfile.gettempdir()) / f"bench-{name}-{port}.log"
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        """The server's root URL."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerProcess":
        """Start the process (its own session, OpenBLAS preloaded, output to `log_path`)."""
        from cluster.launch.platform import preload_env

        env = {**os.environ, **(self.env or {})}
        env.update(preload_env(env))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdin=self.stdin, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=self.cwd, start_new_session=True)
        return self

    def log_tail(self, n: int = 20) -> str:
        """The last `n` lines of the server's output."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, deadline_s: float = 300.0, interval_s: float = 0.5) -> float:
        """Poll ``GET /health`` until 200; return seconds waited. Raises RuntimeError if the process
        exits or the deadline passes (with the tail of its log)."""
        assert self.proc is not None, "start() first"
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before it was healthy:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > deadline_s:
                raise RuntimeError(f"{self.name} was not healthy after {deadline_s:.0f} s (log {self.log_path}):\n"
                                   f"{self.log_tail()}")
            time.sleep(interval_s)

    def memory(self) -> dict:
        """Resident memory of the server's process tree (see :func:`process_memory`)."""
        assert self.proc is not None, "start() first"
        return process_memory(self.proc.pid)

    def cpu_seconds(self) -> float:
        """Host CPU seconds the server's process tree has used so far (benchmarks/host_cpu.py); raises
        ProcessLookupError when the server is gone."""
        from benchmarks.host_cpu import tree_cpu_seconds

        assert self.proc is not None, "start() first"
        return tree_cpu_seconds(self.proc.pid)

    def stop(self, grace_s: float = 15.0) -> Optional[int]:
        """SIGTERM the server's process group, SIGKILL after `grace_s`; return the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                return self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.poll()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


ONE_P_ONE_D = """# written by benchmarks/servers.py for a comparison run
[model]
source = {model}

[engine]
dtype = "{dtype}"
prefill_chunk_size = {chunk}

[transfer]
timeout_s = 120

[routing]
local_prefill_max_tokens = {local_prefill}

[router]
host = "127.0.0.1"
port = {router}

[[workers]]
name = "prefill-0"
role = "prefill"
control_port = {p_ctl}
events_port = {p_ev}

[[workers]]
name = "decode-0"
role = "decode"
control_port = {d_ctl}
kv_port = {d_kv}
events_port = {d_ev}
"""


def one_p_one_d_topology(model_dir: str, dtype: str, router_port: int, prefill_chunk_size: int = 512,
                         local_prefill_max_tokens: int = 0, prefill_worker: bool = True) -> str:
    """TOML of a 1P1D cluster on loopback (like topologies/local-1p1d.toml) with free ports. By default every
    prompt goes through the prefill worker (`local_prefill_max_tokens` 0), so the run measures disaggregation.
    `prefill_worker` False: the decode worker alone (it prefills its own prompts), the single-node engine in
    a process of its own behind the router."""
    import json

    ports = free_ports(5)
    text = ONE_P_ONE_D.format(model=json.dumps(str(model_dir)), dtype=dtype, chunk=prefill_chunk_size,
                              local_prefill=local_prefill_max_tokens, router=router_port, p_ctl=ports[0],
                              p_ev=ports[1], d_ctl=ports[2], d_kv=ports[3], d_ev=ports[4])
    if prefill_worker:
        return text
    head, _, rest = text.partition("[[workers]]\nname = \"prefill-0\"")
    return head + rest[rest.index("[[workers]]"):]


class ClusterProcess:
    """A local 1P1D cluster as one "server": both workers and the router in their own processes.

    Healthy when each worker has logged that it serves and the router's ``/health`` answers 200 (a decode
    worker is alive). Memory sums the three process trees; stopping stops the router first."""

    def __init__(self, name: str, model_dir: str, dtype: str, port: int, *, env: Optional[dict] = None,
                 log_dir: Optional[str] = None, cwd: Optional[str] = None, prefill_chunk_size: int = 512,
                 prefill_worker: bool = True):
        self.name, self.port = name, port
        self.dir = Path(tempfile.mkdtemp(prefix="mlx-pd-bench-1p1d-"))
        self.topology = self.dir / "1p1d.toml"
        self.topology.write_text(one_p_one_d_topology(model_dir, dtype, port, prefill_chunk_size,
                                                      prefill_worker=prefill_worker), encoding="utf-8")
        cli = [sys.executable, "-m", "cluster.launch.cli"]
        kw = {"env": env, "log_dir": log_dir, "cwd": cwd}
        self.workers = [ServerProcess(f"{name}-{w}", cli + ["worker", str(self.topology), w], port, **kw)
                        for w in (("prefill-0",) if prefill_worker else ()) + ("decode-0",)]
        self.router = ServerProcess(f"{name}-router", cli + ["router", str(self.topology)], port, **kw)
        self.argv = {"topology": str(self.topology), **{p.name: p.argv for p in (*self.workers, self.router)}}
        self.log_path = self.router.log_path

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def proc(self):
        return self.router.proc

    def start(self) -> "ClusterProcess":
        for p in (*self.workers, self.router):
            p.start()
        return self

    def wait_healthy(self, deadline_s: float = 300.0, interval_s: float = 0.5) -> float:
        """Wait until both workers serve and the router answers /health; returns seconds waited."""
        t0 = time.monotonic()
        for w in self.workers:
            while "serving" not in w.log_tail(50):
                if w.proc.poll() is not None:
                    raise RuntimeError(f"{w.name} exited with code {w.proc.returncode}:\n{w.log_tail()}")
                if time.monotonic() - t0 > deadline_s:
                    raise RuntimeError(f"{w.name} did not serve within {deadline_s:.0f} s:\n{w.log_tail()}")
                time.sleep(interval_s)
        self.router.wait_healthy(max(1.0, deadline_s - (time.monotonic() - t0)), interval_s)
        return time.monotonic() - t0

    def memory(self) -> dict:
        parts = [p.memory() for p in (*self.workers, self.router)]
        return {"rss_mib": sum(m["rss_mib"] for m in parts),
                "peak_rss_mib": sum(m["peak_rss_mib"] or 0 for m in parts),
                "processes": sum(m["processes"] for m in parts), "source": parts[0]["source"]}

    def cpu_seconds(self) -> float:
        """Host CPU seconds used so far by the workers' and the router's process trees together."""
        return sum(p.cpu_seconds() for p in (*self.workers, self.router))

    def stop(self) -> None:
        for p in (self.router, *self.workers):
            p.stop()

    def __enter__(self) -> "ClusterProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
