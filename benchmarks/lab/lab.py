"""`Lab`: a lab of Macs on one Linux machine, its life from `up` to `down`.

`up` = `start` (the network, then Ray on every host) + `deploy` (`mlx-pd up` in the studio). Everything the
lab starts is written to `ROOT/lab.json` before it is started (namespace names, the pid of each host's
`ray start`), so `down`, from this process or another (`lab down`), removes exactly that and nothing else:
it stops those processes (if their command line still names the lab's folder), then deletes those
namespaces, which deletes every link and the bridge with them. A failure or Ctrl-C during `up` runs `down`
before it propagates; so does leaving a `with Lab(...)` block.

The folder (`ROOT`, default /tmp/mlxpd-lab: Ray's socket paths must stay short) holds the Ray token, the API
key and the CurveZMQ keys (secrets: mode 0600 / 0700), the topology `lab.toml`, each host's Ray temp folder and
log, `up.log`, and `tmp/` (Ray's temp folder for every command run in the lab). `down` leaves it for a
look at the logs; the next `up` replaces it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from benchmarks.lab import net, ray_hosts, topology
from benchmarks.lab.net import Host, LabError

DEFAULT_ROOT = Path("/tmp/mlxpd-lab")
DEFAULT_PREFIX = "mlxpd-lab-"
SUBNET = "10.77.0"  # /24, inside the lab's own namespaces only
STUDIO_IP, FIRST_MINI_IP, CLIENT_IP = 10, 11, 100
STATE = "lab.json"
Echo = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def check_platform() -> None:
    """LabError (one line) unless this is Linux, as root, with iproute2: what network namespaces need."""
    if not sys.platform.startswith("linux"):
        raise LabError(f"the lab needs Linux network namespaces; this is {sys.platform} (on Macs, run a real lab: "
                       "topologies/lab-example.toml)")
    if os.geteuid() != 0:
        raise LabError("the lab needs root to create network namespaces: run it with sudo")
    net.require_tools()


def lab_hosts(prefix: str, minis: int) -> list[Host]:
    """The studio, `minis` minis and the client, with their namespaces, addresses and Ray resources."""
    if not 1 <= minis <= 8:
        raise ValueError(f"minis={minis} is invalid: must be 1..8")
    hosts = [Host("studio", f"{prefix}studio", f"{SUBNET}.{STUDIO_IP}", "mac-studio-1")]
    hosts += [Host(f"mini-{i}", f"{prefix}mini-{i}", f"{SUBNET}.{FIRST_MINI_IP + i - 1}", f"mac-mini-{i}")
              for i in range(1, minis + 1)]
    return hosts + [Host("client", f"{prefix}client", f"{SUBNET}.{CLIENT_IP}")]


@dataclass
class LabState:
    """What `ROOT/lab.json` holds: the lab's settings and everything it has started."""

    prefix: str
    minis: int
    rate_bps: int
    hosts: list[Host]
    namespaces: list[str] = field(default_factory=list)  # created, in order (the bridge's first)
    ray_pids: dict[str, int] = field(default_factory=dict)
    topology: str = ""
    endpoint: str = ""
    served_name: str = ""

    @property
    def net_ns(self) -> str:
        return f"{self.prefix}net"

    def host(self, name: str) -> Host:
        """The host called `name`; ValueError naming the lab's hosts otherwise."""
        for h in self.hosts:
            if h.name == name:
                return h
        raise ValueError(f"no host {name!r} in the lab: its hosts are {', '.join(h.name for h in self.hosts)}")


class Lab:
    """A lab in folder `root`: `minis` minis beside the studio and the client, links of `rate` (tc's
    spelling), `model` ("fast", "default" or a source), `routing` / `engine` keys added to the topology's
    [routing] / [engine], `max_restarts` its [ray] max_restarts (how often Ray restarts a dead actor),
    `decode_group` (more [workers.group] keys, e.g. {"deadline_s": 5}) makes the minis one tensor-parallel decode
    group (benchmarks/lab/topology.py)."""

    def __init__(self, root: Path = DEFAULT_ROOT, *, prefix: str = DEFAULT_PREFIX, minis: int = 2,
                 rate: str = "10gbit", model: str = "fast", routing: Optional[dict] = None,
                 engine: Optional[dict] = None, max_restarts: int = 1, decode_group: Optional[dict] = None,
                 echo: Echo = _stderr):
        self.root = Path(root).resolve()
        self.model, self.routing, self.engine, self.echo = model, dict(routing or {}), dict(engine or {}), echo
        self.max_restarts, self.decode_group = max_restarts, decode_group
        self._owner = False  # True once this object made the folder (or loaded its record): `down` may act
        self.state = LabState(prefix=prefix, minis=minis, rate_bps=net.parse_rate(rate),
                              hosts=lab_hosts(prefix, minis))

    # -- the state file ----------------------------------------------------------------------------------------

    @classmethod
    def load(cls, root: Path = DEFAULT_ROOT, echo: Echo = _stderr) -> "Lab":
        """The lab recorded in `root/lab.json`; LabError when there is none."""
        path = Path(root).resolve() / STATE
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            raise LabError(f"no lab is up in {path.parent} (no readable {STATE})") from None
        lab = cls.__new__(cls)
        lab.root, lab.model, lab.routing, lab.echo, lab._owner = path.parent, "", {}, echo, True
        lab.state = LabState(**{**data, "hosts": [Host(**h) for h in data["hosts"]]})
        return lab

    def require_up(self) -> None:
        """LabError unless the lab's namespaces exist (it is up, or was left half up)."""
        if not any(ns in net.namespaces() for ns in self.state.namespaces):
            raise LabError(f"no lab is up in {self.root} (`lab up` starts one)")

    def _save(self) -> None:
        tmp = self.root / f"{STATE}.tmp"
        tmp.write_text(json.dumps(asdict(self.state), indent=1))
        tmp.replace(self.root / STATE)

    @property
    def studio(self) -> Host:
        return self.state.host("studio")

    @property
    def minis(self) -> list[Host]:
        return [h for h in self.state.hosts if h.name.startswith("mini-")]

    @property
    def endpoint(self) -> str:
        return self.state.endpoint

    @property
    def api_key(self) -> str:
        return (self.root / "api_key").read_text().strip()

    # -- up --------------------------------------------------------------------------------------------------

    def up(self, timeout_s: float = 600.0) -> "Lab":
        """`start`, then `deploy`; on any failure or Ctrl-C, `down` first. Returns self."""
        try:
            self.start()
            self.deploy(timeout_s)
        except BaseException:
            self.down()
            raise
        return self

    def start(self, ray: bool = True) -> None:
        """The folder and its secrets, the network, then Ray on every host but the client (`down` on failure).
        `ray=False`: no Ray (for processes started by hand in the hosts, `command`; `write_topology` writes
        their topology, and `down` ends whatever still runs in the hosts)."""
        check_platform()
        self._fresh_root()
        try:
            t0 = time.monotonic()
            self._write_secrets()
            self._make_network()
            if not ray:
                self.echo(f"lab: network up ({len(self.state.hosts)} hosts, {_rate(self.state.rate_bps)} links) "
                          f"in {time.monotonic() - t0:.1f} s; no Ray")
                return
            studio, nodes = self.studio, self.minis
            self.echo(f"lab: network up ({len(self.state.hosts)} hosts, {_rate(self.state.rate_bps)} links); "
                      "starting Ray ...")
            ray_hosts.start_hosts(self.root, studio, nodes, ray_hosts.host_env(self.root), record=self._record_pid)
            self.echo(f"lab: Ray up on {', '.join(h.name for h in [studio, *nodes])} in "
                      f"{time.monotonic() - t0:.1f} s")
        except BaseException:
            self.down()
            raise

    def write_topology(self) -> Path:
        """Write the lab's topology (`ROOT/lab.toml`, benchmarks/lab/topology.py) and record it; returns its path."""
        source, served, kv_gb = topology.resolve_model(self.model)
        path = self.root / "lab.toml"
        path.write_text(topology.topology_text(self.studio, self.minis, source=source, served_name=served,
                                               kv_cache_gb=kv_gb, keys_dir=self.root / "keys", routing=self.routing,
                                               engine=self.engine, max_restarts=self.max_restarts,
                                               decode_group=self.decode_group))
        self.state.topology, self.state.served_name = str(path), served
        self.state.endpoint = topology.endpoint(self.studio)
        self._save()
        return path

    def deploy(self, timeout_s: float = 600.0) -> None:
        """Write the topology and run `mlx-pd up` on it in the studio; LabError with its last lines if it fails."""
        path = self.write_topology()
        self.state.endpoint = ""
        self._save()
        cmd = [ray_hosts.mlx_pd_cli(), "up", str(path), "--timeout", str(timeout_s)]
        lines = []
        with open(self.root / "up.log", "w") as log:
            proc = subprocess.Popen(self.command("studio", cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, text=True, env=self.env())
            watchdog = threading.Timer(timeout_s + 60.0, proc.kill)  # `up` keeps its own --timeout; this is a bound
            watchdog.start()
            try:
                for line in proc.stdout:
                    log.write(line)
                    if line.startswith(("mlx-pd:", "  ")):
                        self.echo(line.rstrip())
                    lines.append(line.rstrip())
                rc = proc.wait(timeout=30)
            finally:
                watchdog.cancel()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if rc != 0:
            raise LabError(f"`mlx-pd up` in the studio failed ({rc}):\n" + "\n".join(lines[-12:]))
        self.state.endpoint = topology.endpoint(self.studio)
        self._save()

    def _fresh_root(self) -> None:
        existing = self.root / STATE
        if existing.exists():
            old = Lab.load(self.root)
            live = [ns for ns in old.state.namespaces if ns in net.namespaces()]
            if live or any(ray_hosts.is_ours(pid, self.root, n) for n, pid in old.state.ray_pids.items()):
                raise LabError(f"a lab is up in {self.root} ({', '.join(live) or 'Ray running'}): "
                               "`lab down` it first")
        taken = sorted(n for n in net.namespaces() if n in {h.ns for h in self.state.hosts} | {self.state.net_ns})
        if taken:
            raise LabError(f"network namespaces {', '.join(taken)} exist but no lab in {self.root} made them: "
                           "use another --prefix, or delete them (`ip netns del NAME`)")
        if self.root.exists():
            if not existing.exists() and any(self.root.iterdir()):
                raise LabError(f"{self.root} holds files but no lab: give an empty or new folder")
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True)
        (self.root / "tmp").mkdir()
        self._owner = True
        self._save()

    def _write_secrets(self) -> None:
        from cluster.transport import generate_keys

        for name in ("ray_auth_token", "api_key"):  # Ray's own token format: 64 hex digits
            fd = os.open(self.root / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
        generate_keys(self.root / "keys")

    def _make_network(self) -> None:
        s = self.state
        s.namespaces.append(s.net_ns)
        self._save()
        net.create_bridge(s.net_ns)
        for host in s.hosts:
            s.namespaces.append(host.ns)
            self._save()
            net.add_host(s.net_ns, host, s.rate_bps)

    def _record_pid(self, host: Host, pid: int) -> None:
        self.state.ray_pids[host.name] = pid
        self._save()

    # -- use -------------------------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The environment of a command run in the lab: Ray's (token, temp folder), the API key and the OpenAI
        endpoint (`MLX_PD_API_KEY`, `OPENAI_API_KEY`, `OPENAI_BASE_URL`)."""
        key = self.api_key if (self.root / "api_key").exists() else ""
        return ray_hosts.host_env(self.root, {"MLX_PD_API_KEY": key, "OPENAI_API_KEY": key,
                                              "OPENAI_BASE_URL": topology.endpoint(self.studio)})

    def command(self, host: str, cmd: list[str]) -> list[str]:
        """`cmd` as run inside host `host`'s namespace (pass `env()` as its environment)."""
        return net.in_namespace(self.state.host(host).ns, cmd)

    def run(self, host: str, cmd: list[str], timeout_s: float = 120.0, **kw) -> subprocess.CompletedProcess:
        """Run `cmd` in host `host` with the lab's environment and wait (at most `timeout_s`)."""
        return subprocess.run(self.command(host, cmd), env=self.env(), timeout=timeout_s, **kw)

    def link(self, host: str, up: bool) -> None:
        """Pull host `host`'s cable (`up=False`) or plug it back."""
        net.set_link(self.state.net_ns, self.state.host(host), up)

    def status(self) -> list[dict]:
        """One row per host: name, namespace, address, link (up/down, the rate), Ray (running/stopped/-)."""
        rows, existing = [], net.namespaces()
        for h in self.state.hosts:
            alive = h.ns in existing
            pid = self.state.ray_pids.get(h.name)
            ray = "-" if h.resource is None else ("running" if pid and ray_hosts.is_ours(pid, self.root, h.name)
                                                  else "stopped")
            rows.append({"host": h.name, "ns": h.ns, "ip": h.ip, "ray": ray, "resource": h.resource or "-",
                         "link": net.link_state(self.state.net_ns, h) if alive else "gone",
                         "rate": net.shaped_rate(h.ns, net.IFACE) if alive else "-"})
        return rows

    # -- down ------------------------------------------------------------------------------------------------

    def down(self) -> list[str]:
        """Stop what the lab started (Ray on each host, then its namespaces) and record that nothing runs;
        returns problems, one line each (empty when all is gone). Does nothing for a lab that never made its
        folder (another lab's, say)."""
        if not self._owner:
            return []
        s = self.state
        existing = net.namespaces()
        for host in s.hosts:  # plug every cable back, so each host's Ray can say goodbye to the head
            if s.net_ns in existing and host.ns in existing:
                try:
                    net.set_link(s.net_ns, host, True)
                except LabError:
                    pass
        problems = [f"Ray on {name} did not stop" for name in ray_hosts.stop_hosts(self.root, s.ray_pids, "studio")]
        problems += [f"process {pid} in a lab host did not end" for pid in net.end_processes_in(s.namespaces)]
        problems += net.delete_namespaces([*s.namespaces[1:][::-1], *s.namespaces[:1]])
        if not problems:
            s.namespaces, s.ray_pids, s.endpoint = [], {}, ""
            self._save()
        return problems

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc) -> None:
        for problem in self.down():
            self.echo(f"lab: {problem}")


def _rate(bps: int) -> str:
    return f"{bps / 1e9:g} Gbit/s" if bps >= 10**9 else f"{bps / 1e6:g} Mbit/s"
