"""The local Ray head of `[ray] address = "local"` topologies, and Ray's token authentication.

Ray 2.60 checks a shared secret token on every connection when `RAY_AUTH_MODE=token`. What we found in
Ray's code (`ray/_private/authentication/authentication_token_setup.py`, `ray/scripts/scripts.py`) and by
experiment:

- the token is read from `$RAY_AUTH_TOKEN`, else the file `$RAY_AUTH_TOKEN_PATH`, else `~/.ray/auth_token`;
  `ray get-auth-token --generate` writes that file if it does not exist;
- `ray.init()` *without* an address (a throwaway local cluster) enables token mode by default, but
  `ray start --head` enables it only if a token already exists, and a driver given an explicit
  address (`HOST:6379`) never turns it on by itself: with `RAY_AUTH_MODE` unset it sends no token and
  the GCS answers `Unauthenticated: InvalidAuthToken` until `ray.init` gives up ("Failed to connect");
- `RAY_AUTH_MODE` is read when Ray's config is first initialized, so it must be in the environment
  before `ray` is imported, or `ray._raylet.Config.initialize("")` must run again (what Ray itself does);
- the dashboard's HTTP API answers 401 without `Authorization: Bearer <token>`; `ray.util.state` sends it.

So mlx-pd makes sure a token exists (generating `~/.ray/auth_token` once, with Ray's own CLI), starts the
local head with `RAY_AUTH_MODE=token`, and sets `RAY_AUTH_MODE=token` in its own process before it
connects (unless the user set `RAY_AUTH_MODE` explicitly). In a lab, every Mac needs the same token
(copy `~/.ray/auth_token` to each, or export `RAY_AUTH_TOKEN`) and runs `ray start` with
`RAY_AUTH_MODE=token` (see topologies/lab-example.toml).

The local head runs as `ray start --head --block` in its own session, so it outlives `mlx-pd up`;
`mlx-pd down` sends SIGTERM to that process (which stops every Ray process it started) and, if it is
still there after a grace period, SIGKILL to its process group. A JSON record in the state folder
(`$MLX_PD_CACHE/clusters`, default `~/.cache/mlx-pd/clusters`) remembers the head's pid, address and
dashboard and which topologies use it; no other Ray on the machine is ever touched.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from cluster import ports

AUTH_MODE_ENV = "RAY_AUTH_MODE"
HEAD_RECORD = "local-head.json"
PREFERRED_PORTS = {"gcs": 6379, "dashboard": 8265, "client": 10001, "agent": 52365}
OBJECT_STORE_BYTES = 256 * 1024**2  # Ray's object store carries no requests, tokens or KV (ZeroMQ does)
_WORKER_PORT_RANGE = (10002, 19999)  # Ray's default worker ports: never hand one of these to the head


@dataclass(frozen=True)
class LocalHead:
    """The record of a Ray head that mlx-pd started: `pid` of `ray start --block`, GCS `address`
    ("ip:port"), `dashboard` URL, the `namespaces` of the topologies that use it, and its `log` file."""

    pid: int
    address: str
    dashboard: str
    log: str
    namespaces: tuple[str, ...] = field(default_factory=tuple)


def default_state_dir() -> Path:
    """`$MLX_PD_CACHE/clusters` (the documented cache folder), default `~/.cache/mlx-pd/clusters`."""
    root = os.environ.get("MLX_PD_CACHE") or Path.home() / ".cache" / "mlx-pd"
    return Path(root) / "clusters"


def token_auth_env() -> dict[str, str]:
    """`{"RAY_AUTH_MODE": "token"}` unless the user set RAY_AUTH_MODE (then their value is kept)."""
    return {AUTH_MODE_ENV: os.environ.get(AUTH_MODE_ENV, "token")}


def enable_token_auth() -> None:
    """Make this process's Ray client send the token (call before `ray.init`)."""
    if AUTH_MODE_ENV in os.environ:
        return
    os.environ[AUTH_MODE_ENV] = "token"
    if "ray" in sys.modules:  # Ray read its config at import: re-read it, as Ray's own token setup does
        from ray._raylet import Config

        Config.initialize("")


def ray_cli() -> str:
    """The `ray` command of this interpreter's environment."""
    candidate = Path(sys.executable).parent / "ray"
    return str(candidate) if candidate.exists() else "ray"


def ensure_token() -> None:
    """Create `~/.ray/auth_token` with `ray get-auth-token --generate` unless a token is already set up.

    The token goes to a pipe and is dropped (never printed). Raises RuntimeError if Ray cannot make one.
    """
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if os.environ.get("RAY_AUTH_TOKEN") or (path and Path(path).is_file()) or \
            (Path.home() / ".ray" / "auth_token").is_file():
        return
    r = subprocess.run([ray_cli(), "get-auth-token", "--generate"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"could not create a Ray auth token: {r.stderr.strip()[-500:]}")


def token_hint() -> str:
    """Where this machine's Ray token comes from, as a command or a variable to read it by (never the token):
    the Ray dashboard's login asks for it."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "the value of $RAY_AUTH_TOKEN"
    return f"`{ray_cli()} get-auth-token` prints it"


def port_free(port: int) -> bool:
    """True if nothing listens on `port` (TCP, any address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port nothing listens on now, on every interface, outside Ray's worker port range."""
    return ports.free_port("", exclude=_WORKER_PORT_RANGE)


def free_ports(n: int) -> list[int]:
    """`n` distinct such ports, for one configuration (`cluster.ports.free_ports`)."""
    return ports.free_ports(n, "", exclude=_WORKER_PORT_RANGE)


def choose_ports(preferred: Optional[dict[str, int]] = None, is_free=port_free) -> dict[str, int]:
    """Ray's usual ports (GCS 6379, dashboard 8265, client 10001, agent 52365) where free, else free ones.

    `preferred` overrides the wishes (tests); `is_free(port) -> bool` is injectable.
    """
    chosen: dict[str, int] = {}
    for name, port in {**PREFERRED_PORTS, **(preferred or {})}.items():
        while not is_free(port) or port in chosen.values():  # never the same port twice
            port = free_port()
        chosen[name] = port
    return chosen


def head_command(ports: dict[str, int], num_cpus: Optional[int] = None) -> list[str]:
    """The `ray start --head --block` command line; the dashboard listens on 127.0.0.1 only."""
    cmd = [ray_cli(), "start", "--head", "--block", f"--port={ports['gcs']}",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}",
           f"--ray-client-server-port={ports['client']}", f"--dashboard-agent-listen-port={ports['agent']}",
           f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats"]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    return cmd


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_head(state_dir: Path) -> Optional[LocalHead]:
    """The record of our local head if its process still runs; a stale record is removed."""
    path = state_dir / HEAD_RECORD
    try:
        data = json.loads(path.read_text())
        head = LocalHead(**{**data, "namespaces": tuple(data.get("namespaces", ()))})
    except (OSError, ValueError, TypeError):
        return None
    if not pid_alive(head.pid):
        path.unlink(missing_ok=True)
        return None
    return head


def write_head(state_dir: Path, head: LocalHead) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / HEAD_RECORD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**asdict(head), "namespaces": list(head.namespaces)}, indent=1))
    tmp.replace(path)


def start_head(state_dir: Path, env: dict[str, str], timeout_s: float = 120.0,
               ports: Optional[dict[str, int]] = None) -> LocalHead:
    """Start `ray start --head --block` in its own session with `env` added (OpenBLAS preload) and token
    auth on; returns once Ray says it runs. Raises RuntimeError with the log's tail if it fails."""
    ensure_token()
    ports = choose_ports(ports)
    state_dir.mkdir(parents=True, exist_ok=True)
    log = state_dir / "ray-head.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(head_command(ports), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **env, AUTH_MODE_ENV: "token"}, start_new_session=True)
    text = wait_blocking(proc, log, timeout_s, "`ray start --head`")
    head = LocalHead(pid=proc.pid, address=_address_from_log(text, ports["gcs"]), log=str(log),
                     dashboard=f"http://127.0.0.1:{ports['dashboard']}")
    write_head(state_dir, head)
    return head


def wait_blocking(proc: subprocess.Popen, log: Path, timeout_s: float, what: str) -> str:
    """Wait until `ray start --block` (`proc`, its output in `log`) says that its node runs; returns the log's
    text. RuntimeError with the log's tail if it exits first, or if it does not come up within `timeout_s`
    (its process group is stopped then); `what` names it in the message."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "block forever" in text:
            return text
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{_tail(text)}")
        time.sleep(0.2)
    stop_process_group(proc.pid)
    raise RuntimeError(f"{what} did not come up within {timeout_s:.0f} s:\n{_tail(log.read_text())}")


def _address_from_log(text: str, port: int) -> str:
    """Ray binds the GCS to this machine's network address (never loopback) and prints
    `ray start --address='IP:PORT'` for joining nodes; fall back to the local IP Ray would choose."""
    marker = "ray start --address='"
    at = text.find(marker)
    if at >= 0:
        return text[at + len(marker):].split("'", 1)[0]
    from ray._private.services import get_node_ip_address  # the launcher modules are the only ray users

    return f"{get_node_ip_address()}:{port}"


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def stop_process_group(pid: int, grace_s: float = 30.0) -> bool:
    """SIGTERM `pid` (our `ray start --block`, which then stops the Ray processes it started) and wait up to
    `grace_s` for every process of its process group (its session, started by us) to end; SIGKILL the group
    if some remain, and wait up to 10 s more for those to exit. Returns True once none is left (zombies aside:
    they are already dead)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reaped(pid)
        if not group_members(pid):
            return True
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + 10.0  # a killed process still takes a moment to exit on a loaded machine
    while True:
        _reaped(pid)
        if not group_members(pid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes in process group `pgid` (`ps`, on Linux and macOS)."""
    try:
        out = subprocess.run(["ps", "-A", "-o", "pid=,pgid=,stat="], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return [pgid] if pid_alive(pgid) else []
    members = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == str(pgid) and not parts[2].startswith("Z"):
            members.append(int(parts[0]))
    return members


def _reaped(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)  # our child when `up` and `down` run in one process (tests)
        if done == pid:
            return True
    except ChildProcessError:
        pass
    return not pid_alive(pid)


def stop_head(state_dir: Path, head: LocalHead) -> bool:
    """Stop our local head and forget it (our record, and Ray's `ray_current_cluster` when it names this
    head). Returns True if it is gone."""
    gone = stop_process_group(head.pid)
    if gone:
        (state_dir / HEAD_RECORD).unlink(missing_ok=True)
        forget_ray_address(head.address)
    return gone


def forget_ray_address(address: str) -> None:
    """Remove Ray's record of the last `ray start` on this machine (`ray_current_cluster` in Ray's temp folder,
    /tmp/ray unless RAY_TMPDIR says otherwise) if it names `address`, a head that is gone: left behind, it
    would send a later `ray.init()` or Ray CLI call that gives no address to nothing. A record naming another
    head is kept."""
    from ray._common.utils import get_ray_address_file

    path = Path(get_ray_address_file(None))
    try:
        if path.read_text().strip() == address:
            path.unlink()
    except OSError:
        pass
