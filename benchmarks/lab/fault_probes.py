"""What the lab's fault table (benchmarks/lab/faults.py) reads from the lab's hosts besides HTTP: `mlx-pd status`
as run in the studio, the process listening on a port of a host (`ss`: the one to kill), and the router's log
(Ray keeps each actor's stderr in the studio's session folder)."""

from __future__ import annotations

import glob
import json
import re
import sys
from pathlib import Path

from benchmarks.lab.lab import Lab
from benchmarks.lab.net import LabError

STATUS = ("import json, sys; from cluster.launch.ray_up import status; "
          "print(json.dumps({r['name']: r['state'] for r in status(sys.argv[1], timeout_s=10.0)}))")


def states(lab: Lab) -> dict:
    """`mlx-pd status` of the lab as {worker or "router": state}, or {"error": ...}."""
    try:
        r = lab.run("studio", [sys.executable, "-c", STATUS, lab.state.topology], capture_output=True, text=True,
                    timeout_s=120)
        return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-300:]}
    except Exception as exc:  # noqa: BLE001 - recorded as the row's observation
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def listener_pid(lab: Lab, host: str, port: int) -> int:
    """The pid of the process listening on TCP `port` in `host` (`ss`); LabError when there is none."""
    r = lab.run(host, ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, timeout_s=15)
    m = re.search(r"pid=(\d+)", r.stdout)
    if not m:
        raise LabError(f"nothing listens on port {port} in {host}: {r.stdout.strip() or r.stderr.strip()}")
    return int(m.group(1))


def router_log_count(lab: Lab, needle: str) -> int:
    """How often `needle` occurs in the studio's Ray worker logs (where the router actor logs)."""
    total = 0
    for path in glob.glob(str(lab.root / "studio" / "session_latest" / "logs" / "*.err")):
        try:
            total += Path(path).read_text(errors="replace").count(needle)
        except OSError:
            pass
    return total
