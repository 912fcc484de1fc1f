"""Host CPU time of a server's process tree, read from /proc (Linux), and the table `bench --compare` shows of it.

A process's CPU time is ``utime + stime`` of ``/proc/PID/stat`` (fields 14 and 15 of proc(5), in clock ticks of
``SC_CLK_TCK``): user and system time of all its threads together (OpenBLAS's, MLX's, the HTTP server's). A
server's CPU time is that sum over the server process and every descendant process, plus each one's ``cutime +
cstime`` (fields 16 and 17: children that exited and were reaped), so a helper process that ends during a round
still counts, once. Only differences of two readings mean anything: `bench --compare` reads each target before
and after each of its rounds and divides the summed differences by the output tokens of those rounds
(``host_cpu_s_per_output_token``, lower is better). The load generator runs in another process and is not counted.
Where there is no /proc (macOS) the same sums come from psutil when it is installed (`supported` says whether
either is there).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional, Sequence

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
CPU_HEADER = ["conc.", "target", "host CPU s", "output tokens", "host CPU ms / output token",
              "ratio first target / this"]


def stat_cpu_ticks(stat_line: str) -> tuple[int, int, int, int]:
    """(utime, stime, cutime, cstime) in clock ticks from one ``/proc/PID/stat`` line.

    Fields 14-17 of proc(5). The command name (field 2) is in parentheses and may itself hold spaces and
    parentheses, so fields are counted after its last ``)``. Raises ValueError on a line of another shape."""
    end = stat_line.rfind(")")
    if end < 0:
        raise ValueError(f"not a /proc/PID/stat line: {stat_line[:80]!r}")
    rest = stat_line[end + 1:].split()  # rest[0] is field 3 (state), so field n is rest[n - 3]
    if len(rest) < 15:
        raise ValueError(f"/proc/PID/stat line too short: {stat_line[:80]!r}")
    return int(rest[11]), int(rest[12]), int(rest[13]), int(rest[14])


def child_pids(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """The direct children of `pid`, from ``/proc/PID/task/*/children`` (every thread's); [] when it is gone."""
    out: list[int] = []
    for task in (proc / str(pid) / "task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def process_tree(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """`pid` and all its descendants (depth first, each once)."""
    seen: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        todo += child_pids(p, proc)
    return seen


def supported() -> bool:
    """True when this machine can read a process tree's CPU time: Linux's /proc, or psutil."""
    import importlib.util

    return Path("/proc/self/stat").exists() or importlib.util.find_spec("psutil") is not None


def _psutil_tree_cpu_seconds(pid: int) -> float:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        raise ProcessLookupError(f"process {pid} is gone") from None
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            if p is root:
                raise ProcessLookupError(f"process {pid} is gone") from None
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def tree_cpu_seconds(pid: int, proc: Path = Path("/proc"), clk_tck: int = CLK_TCK) -> float:
    """CPU seconds used so far by `pid`'s process tree (see the module doc); processes that vanish while it is read
    are skipped. Raises ProcessLookupError when `pid` itself is gone (ImportError off Linux without psutil)."""
    if proc == Path("/proc") and not Path("/proc/self/stat").exists():
        return _psutil_tree_cpu_seconds(pid)
    total = 0
    for i, p in enumerate(process_tree(pid, proc)):
        try:
            total += sum(stat_cpu_ticks((proc / str(p) / "stat").read_text()))
        except (OSError, ValueError):
            if i == 0:
                raise ProcessLookupError(f"process {pid} is gone") from None
    return total / clk_tck


def per_token(cpu_s: float, output_tokens: int) -> float:
    """CPU seconds per output token; NaN when no token came out."""
    return cpu_s / output_tokens if output_tokens > 0 else math.nan


def cpu_rows(result: dict, ours: str = "mlx-pd", theirs: str = "mlx_lm.server") -> list[list[str]]:
    """Rows of CPU_HEADER for a `bench --compare` result whose levels carry ``host_cpu_s``: one per level and
    target, the ratio (first target / each other one, lower is better) on each other target's row."""
    rows = []
    for level in result.get("levels", []):
        names: Sequence[str] = level.get("targets") or [ours, theirs]
        servers = level["servers"]
        if not all("host_cpu_s" in servers[n] for n in names):
            continue
        for i, name in enumerate(names):
            s = servers[name]
            ratio: Optional[float] = level.get("ratios_vs", {}).get(name, {}).get("host_cpu_s_per_output_token")
            rows.append([str(level.get("concurrency")), name, f"{s['host_cpu_s']:.1f}", str(s["output_tokens_total"]),
                         _ms(s["host_cpu_s_per_output_token"]), "" if i == 0 or ratio is None else _ratio(ratio)])
    return rows


def _ms(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{1000 * x:.2f}"


def _ratio(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.2f}x"
