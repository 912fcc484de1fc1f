"""Process-level platform quirks: preload Debian's OpenBLAS under MLX's CPU backend on Linux, pin CPUs.

The ``mlx-cpu`` wheel for Linux links a bundled *reference* BLAS (``mlx_cpu.libs/libblas-*.so``),
which is slow. Preloading the ``libblas.so.3`` of Debian's ``libopenblas0-pthread`` package
(``LD_PRELOAD``) makes the dynamic linker resolve MLX's ``cblas_*`` calls to OpenBLAS instead.
Measured on the 2-core x86_64 dev machine: a 1024x1024 float32 matmul went from about 360 ms to
about 12 ms (15-30x), and decode of the default model got about 2x faster.

``LD_PRELOAD`` only takes effect when a process starts, so:

- ``scripts/env.sh`` exports it for the shell scripts (serve, test);
- the CLI calls :func:`reexec_with_openblas` first thing, so ``mlx-pd serve`` started directly
  re-executes itself once with the preload;
- launchers pass :func:`preload_env` into the environment of subprocesses and Ray workers.

Setting the documented environment variable ``MLX_PD_NO_OPENBLAS=1`` turns all of this off.
On macOS (Metal, Accelerate) and on Linux without the package, every OpenBLAS function here is a no-op.

:func:`pin_cpus` pins a worker process to its topology's ``cpu_affinity`` (Linux only; macOS has no
affinity API, so it is ignored there). The engine's own tuning for the CPU backend is in
``cluster/kv/cpu_backend.py``.
"""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

logger = logging.getLogger(__name__)
ENV_DISABLE = "MLX_PD_NO_OPENBLAS"
DPKG_PACKAGE = "libopenblas0-pthread"
KNOWN_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)


def _dpkg_listing() -> list[str]:
    """Files of the Debian package, or [] when dpkg or the package is missing."""
    try:
        out = subprocess.run(
            ["dpkg", "-L", DPKG_PACKAGE], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.splitlines() if out.returncode == 0 else []


def openblas_preload_path(
    *,
    system: str | None = None,
    candidates: Sequence[str] | None = None,
    listing: Callable[[], list[str]] | None = None,
) -> str | None:
    """Path of OpenBLAS's ``libblas.so.3`` to preload, or None (not Linux, or not installed).

    Looks at the known Debian paths first (the one for this machine's architecture first), then
    asks ``dpkg -L libopenblas0-pthread``. The keyword arguments exist for tests: ``system``
    replaces ``platform.system()``, ``candidates`` the known paths, ``listing`` the dpkg query.
    """
    if (system or platform.system()) != "Linux":
        return None
    if candidates is None:
        machine = platform.machine()
        candidates = sorted(KNOWN_PATHS, key=lambda p: f"/{machine}-" not in p)
    for path in candidates:
        if os.path.isfile(path):
            return path
    for path in (listing or _dpkg_listing)():
        if path.endswith("/libblas.so.3") and "openblas" in path and os.path.isfile(path):
            return path
    return None


def _disabled(env: Mapping[str, str]) -> bool:
    return env.get(ENV_DISABLE, "").strip().lower() in ("1", "true", "yes")


def _preloaded(path: str, env: Mapping[str, str]) -> bool:
    entries = env.get("LD_PRELOAD", "").replace(" ", ":").split(":")
    return path in entries


def preload_env(env: Mapping[str, str] | None = None, path: str | None = None) -> dict[str, str]:
    """The ``LD_PRELOAD`` entry to give a subprocess or Ray worker, as a dict to merge.

    Returns ``{"LD_PRELOAD": "<openblas>:<existing entries>"}`` (the existing value of ``env``,
    default ``os.environ``, kept after it; unchanged if it already holds the library), or ``{}``
    when there is nothing to preload or ``MLX_PD_NO_OPENBLAS=1``. Use it as
    ``{**os.environ, **preload_env()}`` or in Ray's ``runtime_env={"env_vars": preload_env()}``.
    """
    env = os.environ if env is None else env
    path = path or openblas_preload_path()
    if path is None or _disabled(env):
        return {}
    current = env.get("LD_PRELOAD", "")
    if _preloaded(path, env):
        return {"LD_PRELOAD": current}
    return {"LD_PRELOAD": f"{path}:{current}" if current else path}


def reexec_with_openblas(argv: Sequence[str] | None = None) -> None:
    """Re-execute this interpreter with OpenBLAS preloaded; return only if nothing needs doing.

    Does nothing unless on Linux, the library exists, it is not already in ``LD_PRELOAD`` and
    ``MLX_PD_NO_OPENBLAS`` is not set to 1. Otherwise replaces the process (``os.execve``) with
    ``sys.executable`` and the same command line; the new process sees the library in
    ``LD_PRELOAD`` and so does not re-exec again. Call it before importing mlx.

    ``argv`` is the script's argument list (``sys.argv``-style, argv[0] the script). When it is
    omitted or equal to ``sys.argv``, the original interpreter command line ``sys.orig_argv`` is
    re-run instead, so interpreter flags and ``python -m cluster.launch.cli`` survive the re-exec.
    """
    path = openblas_preload_path()
    if path is None or _disabled(os.environ) or _preloaded(path, os.environ):
        return
    if argv is None or list(argv) == sys.argv:
        args = list(sys.orig_argv[1:])
    else:
        args = list(argv)
    env = {**os.environ, **preload_env(path=path)}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args], env)


def pin_cpus(cpus: tuple[int, ...]) -> bool:
    """Pin every thread of this process to `cpus` (Linux). Returns False where the OS cannot (macOS)."""
    if not hasattr(os, "sched_setaffinity"):
        logger.warning("cpu_affinity is ignored on this OS")
        return False
    for tid in os.listdir("/proc/self/task"):  # threads started earlier (BLAS pools) too, not only this one
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, OSError):
            pass
    return True


# -- serve's process layout ---------------------------------------------------------------------------------

LAYOUTS = ("auto", "one-process", "split")
SPLIT_MIN_CORES = 4  # host cores (performance cores on Apple Silicon) from which `auto` splits a GPU machine


def host_cores(*, system: str | None = None, sysctl: Callable[[], str | None] | None = None) -> int:
    """Cores the host's Python threads can count on: on macOS the performance cores (`sysctl -n
    hw.perflevel0.physicalcpu`; Apple Silicon's efficiency cores run background work at a fraction of the
    speed), elsewhere the CPUs this process may run on (its affinity, so `taskset` counts); `os.cpu_count()`
    where neither answers. `system` and `sysctl` replace `platform.system()` and the sysctl query in tests."""
    if (system or platform.system()) == "Darwin":
        out = (sysctl or _perf_cores_sysctl)()
        if out and out.strip().isdigit() and int(out) > 0:
            return int(out)
    elif hasattr(os, "sched_getaffinity") and system is None:
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _perf_cores_sysctl() -> str | None:
    try:
        out = subprocess.run(["sysctl", "-n", "hw.perflevel0.physicalcpu"], capture_output=True, text=True,
                             timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def mlx_computes_on_gpu() -> bool:
    """Whether MLX's default device is a GPU (Metal on a Mac, CUDA where built with it); False on the CPU backend."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu


def choose_layout(requested: str = "auto", *, gpu: bool | None = None, cores: int | None = None) -> tuple[str, str]:
    """The process layout of `mlx-pd serve` and why: ("one-process" | "split", reason).

    `requested` "one-process" or "split" is taken as given; "auto" decides by this rule:

        split  when the model computes on a GPU and the host has at least SPLIT_MIN_CORES (4) cores
               (performance cores on Apple Silicon, `host_cores`);
        one-process otherwise (MLX's CPU backend, or a GPU machine with fewer cores).

    Why. In one process the router (HTTP, tokenization, detokenization, SSE) and the engine's loop thread
    (scheduling, building each step, reading its tokens back) share one interpreter lock, so their Python
    work runs one after the other; split, each has its own interpreter and they overlap, at the price of a
    ZeroMQ message per output on both sides (m). That only pays where the two interpreters get a core each
    that the model's compute does not need.

    - MLX on the CPU (this Linux dev machine, 2 cores): the model's matmuls run on the same cores (OpenBLAS
      threads), so the second busy interpreter takes cores from the compute. Measured with `mlx-pd bench --url
      ONE --url SPLIT --concurrency 8,32 --num-requests 32,64 --rounds 2 --max-tokens 64` on the fast stand-in
      model (split / one-process output tokens/s): 0.83x (c=8), 0.96x (c=32) with both servers on the 2 cores (a
      second run, while other work loaded the shared cores to a load average of 3.8, gave 1.22x and 1.20x:
      two processes win a larger share of contended CPUs from the scheduler, not a faster step), and
      1.00x (c=8), 0.92x (c=32) with both pinned to 1 core (`taskset -c 0`); earlier, 0.91x at 32 streams.
      No win where the server has the cores to itself, so one process.
    - MLX on a GPU (Metal): the compute (G per step) runs on the GPU and the host cores only run Python: the
      engine loop's work E and the router's R. One process needs about max(G, E + R) per step, the split
      max(G, E + m, R + m): equal when the GPU bounds the step, up to (E + R) / max(E, R) faster (2x for
      E = R) when the host does, and never slower by more than m, which the 1-core run above bounds at about
      8% (there the two processes could not overlap at all). The split needs a core for each interpreter and
      room for the ZeroMQ I/O threads, Metal's completion threads and the OS: 2 + 2 = SPLIT_MIN_CORES = 4.
      Every M-series chip has at least 4 performance cores (M1-M4: 4; Pro: 6-10; Max: 8-12; Ultra:
      16-24), so `auto` splits on every Apple Silicon Mac: an M2 Pro's 8 performance cores give the router
      and the engine loop one each and leave 6 for the rest. A GPU machine with fewer host cores (a small VM)
      keeps one process, where the two interpreters would contend for cores as they do here.

    `gpu` and `cores` replace `mlx_computes_on_gpu()` and `host_cores()` (tests). Raises ValueError naming
    --layout for any other `requested`.
    """
    if requested not in LAYOUTS:
        raise ValueError(f"--layout={requested!r} is invalid: must be one of {', '.join(LAYOUTS)}")
    if requested != "auto":
        return requested, f"--layout {requested} was given"
    gpu = mlx_computes_on_gpu() if gpu is None else gpu
    cores = host_cores() if cores is None else cores
    if not gpu:
        return "one-process", ("MLX computes on the CPU, so a separate router process would take cores from the "
                               "model's matmuls (auto: split only when the model runs on a GPU)")
    if cores < SPLIT_MIN_CORES:
        return "one-process", (f"the model runs on the GPU but the host has {cores} core(s), fewer than the "
                               f"{SPLIT_MIN_CORES} a split needs (router, engine loop, I/O and OS)")
    return "split", (f"the model runs on the GPU and the host has {cores} cores (>= {SPLIT_MIN_CORES}): the "
                     "router and the engine loop each get one")
