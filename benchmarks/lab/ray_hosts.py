"""Ray on the lab's hosts: the head in the studio, the minis joined to it, each in its own namespace.

Each host runs `ray start --block` inside its namespace, in a session of its own, with its own `--temp-dir`
(`ROOT/HOST`: Ray's sockets, logs and its `ray_current_cluster` record stay there), its address as
`--node-ip-address`, its Mac's custom resource (`{"mac-studio-1": 1}`, `{"mac-mini-1": 1}`, ...) and no CPUs
to schedule (every mlx-pd actor asks for none; no idle Ray workers are prestarted on the 2-core machine).
Token authentication is on (`RAY_AUTH_MODE=token`); the token is one file of the lab (`RAY_AUTH_TOKEN_PATH`)
that every host and every command run in the lab reads, as the Macs of a real lab share `~/.ray/auth_token`.

Stopping a host is `cluster.launch.ray_head.stop_process_group` on its `ray start --block`: SIGTERM, which
stops the Ray processes it started, then SIGKILL to its process group if some remain. `ray stop` is never
used: it stops every Ray process on the machine, whoever started it, and resets Ray's record in /tmp/ray.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.lab.net import Host, LabError, in_namespace
from cluster.launch import ray_head

GCS_PORT = 6379
START_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0  # then SIGKILL: a lab host is disposable, and one cut off from its head waits 30 s for it


def host_env(root: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of everything the lab runs in a host: this one, without the caller's Ray address or
    token (the lab's token file instead), Ray's temp folder for calls that name no `--temp-dir` inside the
    lab's folder (`ROOT/tmp`), OpenBLAS preloaded, and `extra`."""
    from cluster.launch.platform import preload_env

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(preload_env(env))
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(root / "ray_auth_token"),
                "RAY_TMPDIR": str(root / "tmp"), "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"})  # stop at once: nothing here needs draining
    env.update(extra or {})
    return env


def ray_start_command(host: Host, head: Host, temp_dir: Path) -> list[str]:
    """`ray start --block` for `host`: the head (`host is head`: GCS on GCS_PORT, the dashboard on the
    studio's loopback) or a node joining it."""
    cmd = [ray_head.ray_cli(), "start", "--block", f"--node-ip-address={host.ip}", f"--temp-dir={temp_dir}",
           f"--resources={json.dumps({host.resource: 1})}", "--num-cpus=0",
           f"--object-store-memory={ray_head.OBJECT_STORE_BYTES}", "--disable-usage-stats"]
    if host is head:
        return cmd + ["--head", f"--port={GCS_PORT}", "--dashboard-host=127.0.0.1"]
    return cmd + [f"--address={head.ip}:{GCS_PORT}"]


def temp_dir(root: Path, host: Host) -> Path:
    """The host's Ray `--temp-dir`, short enough for Ray's socket paths (under 107 bytes)."""
    return root / host.name


def start_hosts(root: Path, head: Host, nodes: list[Host], env: dict[str, str],
                record=lambda host, pid: None) -> dict[str, int]:
    """Start Ray on `head`, then on every host of `nodes` at once; returns {host name: pid of its `ray start
    --block`}. `record(host, pid)` is called as each starts (before it is waited for), so a failure later on
    still knows what to stop. LabError with the log's tail when one does not come up."""
    pids = {}

    def start(host: Host) -> subprocess.Popen:
        directory = temp_dir(root, host)
        directory.mkdir(parents=True, exist_ok=True)
        log = root / f"{host.name}.ray.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(in_namespace(host.ns, ray_start_command(host, head, directory)), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        pids[host.name] = proc.pid
        record(host, proc.pid)
        return proc

    def wait(host: Host, proc: subprocess.Popen) -> None:
        try:
            ray_head.wait_blocking(proc, root / f"{host.name}.ray.log", START_TIMEOUT_S, f"Ray on {host.name}")
        except RuntimeError as exc:
            raise LabError(str(exc)) from None

    wait(head, start(head))
    procs = [(host, start(host)) for host in nodes]
    for host, proc in procs:
        wait(host, proc)
    return pids


def is_ours(pid: int, root: Path, name: str) -> bool:
    """True if `pid` still is the lab's `ray start` of host `name` (its command line names the host's temp
    folder), so a pid the system has reused for something else is never signalled."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"--temp-dir={root / name}".encode() in cmdline


def stop_hosts(root: Path, pids: dict[str, int], head: str) -> list[str]:
    """Stop the `ray start --block` of each host in `pids` ({name: pid}) that is still ours: the nodes at
    once, then the head (`head`, its name; a node whose GCS is already gone takes 30 s to give up on it);
    returns the names of those whose processes did not all end."""
    ours = {name: pid for name, pid in pids.items() if is_ours(pid, root, name)}
    nodes = {name: pid for name, pid in ours.items() if name != head}
    stop = functools.partial(ray_head.stop_process_group, grace_s=STOP_GRACE_S)
    stuck = []
    if nodes:
        with ThreadPoolExecutor(len(nodes)) as pool:
            stuck = [name for name, gone in zip(nodes, pool.map(stop, nodes.values())) if not gone]
    if head in ours and not stop(ours[head]):
        stuck.append(head)
    return stuck


def mlx_pd_cli() -> str:
    """The `mlx-pd` command of this interpreter's environment."""
    candidate = Path(sys.executable).parent / "mlx-pd"
    return str(candidate) if candidate.exists() else "mlx-pd"
