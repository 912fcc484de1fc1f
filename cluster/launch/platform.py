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
