"""The lab's network: a namespace per host on one bridge, each host's link shaped with tbf.

    namespace <prefix>net     br0: ports studio, mini-1, mini-2, client           (no address, no route)
                                        │        │       │       │               (veth pairs)
    namespace <prefix>studio  eth0 10.77.0.10/24, <prefix>mini-1 eth0 10.77.0.11/24, ..., <prefix>client
                              eth0 10.77.0.100/24                                 (and loopback, up)

Nothing is created in the namespace the lab is started from: every veth pair is made with its two ends
already in lab namespaces (`ip link add ... netns A type veth peer ... netns B`), the bridge lives in a
namespace of its own with no address and no route, and a host namespace has only its loopback and its link.
So the lab's traffic can reach nothing but the lab: no address outside the namespaces it creates is ever
routed. Deleting the namespaces (the bridge's last) deletes every link with them.

Shaping: `tc qdisc ... tbf` on both ends of a host's link (the host's eth0 sends at the rate, its bridge port
sends to it at the rate), so the link is a full-duplex one of that rate. The bucket (burst) holds 1 ms of the
rate, as a switch port's buffer would; rates below 100 Mbit/s are refused (1 ms of them is under a few
full-size frames, and tbf would drop frames larger than its bucket).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

IFACE = "eth0"  # a host's side of its link
BRIDGE = "br0"
MIN_RATE_BPS = 100_000_000
MAX_RATE_BPS = 400_000_000_000
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


class LabError(RuntimeError):
    """The lab cannot do what was asked; the message says why (one line)."""


@dataclass(frozen=True)
class Host:
    """One lab host: `name` ("studio", "mini-1", "client"), its namespace `ns`, its address `ip` (/24), and
    the Ray custom resource it advertises (`resource`; None for the client, which runs no Ray)."""

    name: str
    ns: str
    ip: str
    resource: str | None = None


def parse_rate(text: str) -> int:
    """`"10gbit"`, `"1gbit"`, `"500mbit"` (tc's spelling; `bit` optional) -> bits per second. ValueError names
    a rate outside 100 Mbit/s .. 400 Gbit/s or one that does not parse."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:bit)?\s*", text.lower())
    if not m:
        raise ValueError(f"rate {text!r} is invalid: write it as tc does, e.g. 10gbit or 500mbit")
    bps = int(float(m.group(1)) * _UNITS[m.group(2)])
    if not MIN_RATE_BPS <= bps <= MAX_RATE_BPS:
        raise ValueError(f"rate {text!r} is invalid: must be between 100mbit and 400gbit")
    return bps


def tbf_args(rate_bps: int) -> list[str]:
    """The `tc qdisc add ... root` arguments of a link of `rate_bps`: burst = 1 ms of the rate (bytes), a
    queue that holds 20 ms more before it drops."""
    burst = rate_bps // 8 // 1000
    return ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "latency", "20ms"]


def require_tools() -> None:
    """LabError unless `ip` and `tc` (iproute2) are on PATH."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LabError(f"the lab needs iproute2 ({', '.join(missing)} not found): apt-get install iproute2")


def run(*args: str, timeout_s: float = 30.0) -> str:
    """Run one iproute2 command (`ip ...` / `tc ...`); LabError with its stderr when it fails."""
    try:
        r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise LabError(f"`{' '.join(args)}` did not finish within {timeout_s:.0f} s") from None
    if r.returncode != 0:
        raise LabError(f"`{' '.join(args)}` failed: {r.stderr.strip() or r.returncode}")
    return r.stdout


def namespaces() -> set[str]:
    """The names of the network namespaces that exist (`ip netns list`)."""
    return {line.split()[0] for line in run("ip", "netns", "list").splitlines() if line.strip()}


def in_namespace(ns: str, cmd: list[str]) -> list[str]:
    """`cmd` run inside namespace `ns`."""
    return ["ip", "netns", "exec", ns, *cmd]


def create_bridge(net_ns: str) -> None:
    """The bridge's namespace and its bridge, up; no address, no route."""
    run("ip", "netns", "add", net_ns)
    run("ip", "-n", net_ns, "link", "set", "lo", "up")
    run("ip", "-n", net_ns, "link", "add", BRIDGE, "type", "bridge")
    run("ip", "-n", net_ns, "link", "set", BRIDGE, "up")


def add_host(net_ns: str, host: Host, rate_bps: int) -> None:
    """Namespace `host.ns` with loopback up and `eth0` at `host.ip/24`, linked to the bridge through the port
    named `host.name`, both ends shaped to `rate_bps`."""
    run("ip", "netns", "add", host.ns)
    run("ip", "-n", host.ns, "link", "set", "lo", "up")
    run("ip", "-n", net_ns, "link", "add", host.name, "type", "veth", "peer", "name", IFACE, "netns", host.ns)
    run("ip", "-n", net_ns, "link", "set", host.name, "master", BRIDGE)
    run("ip", "-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", IFACE)
    for ns, dev in ((host.ns, IFACE), (net_ns, host.name)):
        run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf_args(rate_bps))
        run("ip", "-n", ns, "link", "set", dev, "up")


def set_link(net_ns: str, host: Host, up: bool) -> None:
    """Bring the host's bridge port down (the cable pulled: the host and the rest stop hearing each other,
    nothing is reset) or up again."""
    run("ip", "-n", net_ns, "link", "set", host.name, "up" if up else "down")


def link_state(net_ns: str, host: Host) -> str:
    """"up" or "down": the administrative state of the host's bridge port."""
    flags = re.search(r"<([^>]*)>", run("ip", "-n", net_ns, "-o", "link", "show", host.name))
    return "up" if flags and "UP" in flags.group(1).split(",") else "down"


def shaped_rate(ns: str, dev: str) -> str:
    """The tbf rate on `dev` in `ns` as tc prints it (e.g. "10Gbit"), or "unshaped"."""
    m = re.search(r"tbf \S+ root .*?rate (\S+)", run("tc", "-n", ns, "qdisc", "show", "dev", dev))
    return m.group(1) if m else "unshaped"


def pids_in(ns: str) -> list[int]:
    """The processes whose network namespace is `ns` (`ip netns pids`); [] when it does not exist."""
    try:
        return [int(pid) for pid in run("ip", "netns", "pids", ns).split()]
    except LabError:
        return []


def end_processes_in(names: list[str], grace_s: float = 10.0) -> list[int]:
    """SIGTERM every process left in the namespaces `names` (the lab made them, so what runs there is the
    lab's: an actor Ray failed to reap, a command of `lab exec`), SIGKILL those still there after `grace_s`;
    returns the pids that outlived even that."""
    def left() -> list[int]:
        return [pid for ns in names for pid in pids_in(ns)]

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = left()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = left()
        if not pids:
            return []
    return left()


def delete_namespaces(names: list[str]) -> list[str]:
    """Delete those of `names` that exist, in order (the bridge's last); returns the errors, one line each."""
    errors = []
    existing = namespaces()
    for name in names:
        if name in existing:
            try:
                run("ip", "netns", "del", name)
            except LabError as exc:
                errors.append(str(exc))
    return errors
