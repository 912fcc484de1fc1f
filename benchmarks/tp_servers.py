"""A tensor-parallel group of mlx-lm's own server on loopback: `mlx_lm.server` on N ranks over MLX's ring backend.

    with MlxLmTensorParallel(model_dir, ranks=2, port=port) as group:
        group.wait_ready()            # /v1/models answers 200, then a 1-token chat completion does
        ... load against group.url ...
        group.cpu_seconds(), group.memory()

mlx_lm.server shards its model with `sharded_load` (each rank holds 1/N of every attention and MLP matrix, and
`all_sum`s the partial results) when `mx.distributed.init().size() > 1`; rank 0 serves HTTP and shares each
request with the other ranks. Each rank finds its peers through two environment variables: `MLX_HOSTFILE`, the
path of a JSON list with one `["IP:PORT"]` per rank (:func:`ring_hostfile`), and `MLX_RANK`. Two launchers
(`LAUNCHERS`) set them:

- ``direct`` (the default): this module starts the N rank processes itself, each with its own `MLX_RANK` and
  one shared hostfile written to a temporary folder, each in a session of its own with a log of its own.
- ``mlx.launch``: MLX's launcher, ``mlx.launch --backend ring --hosts 127.0.0.1 -n N --starting-port P --
  python -m mlx_lm server ...`` (:func:`mlx_launch_command`), one process over the group. For a host spelled
  exactly ``127.0.0.1`` it starts the ranks on this machine through bash, without ssh (any other name goes
  through ssh, and a name that is not an IP address is refused by the ring backend). It is not the default
  because its I/O threads spin: each selects on its rank's stdin pipe, which is always writable, so the
  launcher burns about one core for as long as the group runs (110% CPU on the 2-core dev machine with the
  group idle), taken from the ranks under test. It also leaves its per-rank pid and hostfile files in $TMPDIR.
  It is started with an empty pipe as its stdin (it sets its stdin non-blocking and would spin on /dev/null).

With `pin` (the direct launcher only) rank r runs under ``taskset -c`` on its own share of this process's CPUs
(:func:`rank_cpus`; OpenBLAS then sizes its threads to that share). On the 2-core dev machine that matters more
than anything else here: a random llama of SmolLM2-135M's size decoded 1.7 tokens/s on 2 unpinned ranks and
6.3-6.8 pinned one core each (one process: 8.0 on both cores, 4.3 on one), since a rank waiting for its peer
keeps a core busy that the peer needs.

Stopping sends SIGTERM to every rank's process group (then SIGKILL after a grace period); rank 0 first.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import httpx

from benchmarks.cluster_procs import pinned
from benchmarks.servers import ServerProcess, mlx_lm_command
from cluster.ports import free_ports

LOOPBACK = "127.0.0.1"
LAUNCHERS = ("direct", "mlx.launch")


def ring_hostfile(ports: Sequence[int], host: str = LOOPBACK) -> list[list[str]]:
    """The ring backend's hostfile for one rank per port, rank r at `host:ports[r]`: `[["IP:PORT"], ...]`
    (what `MLX_HOSTFILE` points at, as JSON). Raises ValueError for fewer than 2 ports or repeated ones."""
    if len(ports) < 2 or len(set(ports)) != len(ports):
        raise ValueError(f"a ring needs at least 2 distinct ports, got {list(ports)}")
    return [[f"{host}:{int(p)}"] for p in ports]


def rank_env(rank: int, hostfile_path: str) -> dict[str, str]:
    """The environment variables that make a process rank `rank` of the ring in `hostfile_path`."""
    return {"MLX_HOSTFILE": str(hostfile_path), "MLX_RANK": str(rank)}


def rank_cpus(ranks: int, cpus: Optional[Sequence[int]] = None) -> list[list[int]]:
    """`cpus` (default: those this process may run on) cut into `ranks` contiguous, nearly equal groups, the
    earlier ones one larger. Raises ValueError when there are fewer CPUs than ranks."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if ranks < 1 or len(cpus) < ranks:
        raise ValueError(f"cannot give {ranks} ranks a CPU each out of {len(cpus)} CPUs {cpus}")
    size, extra = divmod(len(cpus), ranks)
    out, start = [], 0
    for r in range(ranks):
        end = start + size + (1 if r < extra else 0)
        out.append(cpus[start:end])
        start = end
    return out


def consecutive_free_ports(n: int, host: str = LOOPBACK, tries: int = 100) -> int:
    """The first of `n` consecutive TCP ports on `host` that nothing listened on a moment ago (mlx.launch's
    ring ports are `--starting-port` plus 0, 1, ...). Raises OSError after `tries` attempts."""
    for _ in range(tries):
        base = free_ports(1, host)[0]
        if base + n - 1 > 65535:
            continue
        held = []
        try:
            for port in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise OSError(f"found no {n} consecutive free ports on {host} in {tries} tries")


def mlx_launch_path() -> str:
    """The `mlx.launch` script next to this Python, else on PATH. Raises FileNotFoundError when neither."""
    found = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or shutil.which("mlx.launch")
    if not found:
        raise FileNotFoundError("mlx.launch is not installed next to this Python nor on PATH (pip install mlx)")
    return found


def mlx_launch_command(argv: Sequence[str], ranks: int, starting_port: int, host: str = LOOPBACK,
                       launcher: Optional[str] = None) -> list[str]:
    """argv of ``mlx.launch`` running `argv` on `ranks` ranks of `host` over the ring backend, rank r listening
    on `starting_port + r` (`launcher`: the mlx.launch script, default :func:`mlx_launch_path`)."""
    return [launcher or mlx_launch_path(), "--backend", "ring", "--hosts", host, "-n", str(ranks),
            "--starting-port", str(starting_port), "--", *argv]


def wait_ready(url: str, procs: Sequence[ServerProcess], deadline_s: float = 600.0, interval_s: float = 0.5,
               probe_chat: bool = True) -> float:
    """Poll ``GET {url}/v1/models`` until it answers 200, then (`probe_chat`) send a greedy 1-token chat
    completion until it answers 200: mlx_lm.server answers /v1/models while its ranks still load the model.
    Returns the seconds waited. Raises RuntimeError when one of `procs` exits first (with the tail of its log)
    or at the deadline."""
    t0 = time.monotonic()
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0.0}
    stage = "/v1/models"
    while True:
        for p in procs:
            if p.proc is not None and p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited with code {p.proc.returncode} before {url} was ready "
                                   f"(log {p.log_path}):\n{p.log_tail()}")
        left = deadline_s - (time.monotonic() - t0)
        if left <= 0:
            raise RuntimeError(f"{url} did not answer {stage} within {deadline_s:.0f} s (log "
                               f"{procs[0].log_path if procs else '-'}):\n{procs[0].log_tail() if procs else ''}")
        try:
            if stage == "/v1/models":
                if httpx.get(url + "/v1/models", timeout=5.0).status_code == 200:
                    if not probe_chat:
                        return time.monotonic() - t0
                    stage = "/v1/chat/completions"
                    continue
            elif httpx.post(url + "/v1/chat/completions", json=body, timeout=max(1.0, left)).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)


def stop_tree(server: ServerProcess, grace_s: float = 10.0) -> None:
    """Stop `server` (its process group, as `ServerProcess.stop`), then every process that was under it and is
    still alive, even one in a session of its own (mlx-pd's tensor-parallel ranks start so, and would otherwise
    outlive their leader until their heartbeat gives up): SIGTERM, then SIGKILL after `grace_s`. Off Linux only
    the group is stopped."""
    import signal

    from benchmarks.host_cpu import process_tree

    alive = server.proc is not None and server.proc.poll() is None
    pids = process_tree(server.proc.pid)[1:] if alive and Path("/proc/self/task").exists() else []
    server.stop()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [p for p in pids if Path(f"/proc/{p}").exists()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.1)


class MlxLmTensorParallel:
    """mlx_lm.server on `ranks` tensor-parallel ranks on loopback, HTTP on `port` (rank 0); see the module doc.
    `pipeline`: its `--pipeline` (each rank a range of layers) instead.

    The interface of benchmarks/servers.py's servers: `url`, `argv`, `log_path`, `start`, `wait_ready`,
    `memory`, `cpu_seconds`, `stop`, and a context manager that starts and stops."""

    def __init__(self, model_dir: str, ranks: int = 2, port: Optional[int] = None, *, launcher: str = "direct",
                 ring_ports: Optional[Sequence[int]] = None, name: str = "mlx_lm.server-tp", pin: bool = False,
                 cpus: Optional[Sequence[int]] = None, env: Optional[dict] = None, log_dir: Optional[str] = None,
                 cwd: Optional[str] = None, pipeline: bool = False):
        if launcher not in LAUNCHERS:
            raise ValueError(f"unknown launcher {launcher!r}; choose from {', '.join(LAUNCHERS)}")
        if ranks < 2:
            raise ValueError(f"a tensor-parallel group needs at least 2 ranks, got {ranks}")
        if pin and launcher != "direct":
            raise ValueError("pinning ranks to CPUs needs the direct launcher (mlx.launch starts every rank alike)")
        self.name, self.ranks, self.launcher = name, ranks, launcher
        self.cpus = rank_cpus(ranks, cpus) if pin else None
        self.port = port if port is not None else free_ports(1)[0]
        self.dir = Path(tempfile.mkdtemp(prefix="mlx-pd-bench-tp-"))
        server = mlx_lm_command(self.port, model_dir) + (["--pipeline"] if pipeline else [])
        kw = {"env": env, "log_dir": log_dir, "cwd": cwd}
        if launcher == "direct":
            ports = list(ring_ports) if ring_ports is not None else free_ports(ranks)
            self.hostfile = ring_hostfile(ports)
            path = self.dir / "hostfile.json"
            path.write_text(json.dumps(self.hostfile) + "\n", encoding="utf-8")
            self.procs = [ServerProcess(f"{name}-rank{r}", pinned(server, self.cpus[r]) if pin else server,
                                        self.port, **{**kw, "env": {**(env or {}), **rank_env(r, str(path))}})
                          for r in range(ranks)]
        else:
            start = ring_ports[0] if ring_ports else consecutive_free_ports(ranks)
            self.hostfile = ring_hostfile([start + r for r in range(ranks)])
            self.procs = [ServerProcess(name, mlx_launch_command(server, ranks, start), self.port,
                                        stdin=subprocess.PIPE, **kw)]
        self.argv = self.procs[0].argv
        self.log_path = self.procs[0].log_path

    @property
    def url(self) -> str:
        """The root URL of rank 0's HTTP server."""
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def log_paths(self) -> list[str]:
        """Every process's log (one per rank with the direct launcher, else mlx.launch's, which has all)."""
        return [str(p.log_path) for p in self.procs]

    def start(self) -> "MlxLmTensorParallel":
        """Start every rank (or mlx.launch)."""
        for p in self.procs:
            p.start()
        return self

    def wait_ready(self, deadline_s: float = 600.0) -> float:
        """Wait until the group answers a chat completion (:func:`wait_ready`); returns seconds waited."""
        return wait_ready(self.url, self.procs, deadline_s)

    def memory(self) -> dict:
        """Resident memory of every process tree of the group, summed (benchmarks/servers.py: process_memory)."""
        parts = [p.memory() for p in self.procs]
        return {"rss_mib": sum(m["rss_mib"] for m in parts), "peak_rss_mib": sum(m["peak_rss_mib"] or 0 for m in parts),
                "processes": sum(m["processes"] for m in parts), "source": parts[0]["source"]}

    def cpu_seconds(self) -> float:
        """Host CPU seconds the group's process trees have used so far (mlx.launch's own threads included)."""
        return sum(p.cpu_seconds() for p in self.procs)

    def stop(self) -> None:
        """Stop rank 0 (or mlx.launch) first, then the other ranks; remove the hostfile's folder."""
        for p in self.procs:
            p.stop()
            if p.proc is not None and p.proc.stdin is not None:
                p.proc.stdin.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "MlxLmTensorParallel":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

