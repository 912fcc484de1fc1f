"""Shared pytest setup for mlx-pd.

The markers (`slow`: long tests over the real model, still run in CI; `ray`: tests that start a local
Ray cluster) and the default per-test timeout (600 s, pytest-timeout) are declared in pyproject.toml.

After each module the process hands MLX's cached buffers back (`_memory_back_after_each_module`).

The timeout is sized for MLX's CPU backend with OpenBLAS preloaded (scripts/env.sh). Without it
(`MLX_PD_NO_OPENBLAS=1`, or a machine without Debian's OpenBLAS) the wheel's reference BLAS does the same
matmuls about ten times slower (the 3,000-token recall test in tests/test_quantized_kv.py: 45 s with
OpenBLAS, 467 s without, on a quiet machine of CI's kind), so every test without its own `timeout` mark
gets REFERENCE_BLAS_FACTOR times the configured limit. The limit still catches a hang; it only stops
mistaking the slower BLAS for one.
"""

from __future__ import annotations

import os

import pytest

REFERENCE_BLAS_FACTOR = 4


def openblas_loaded() -> bool:
    """True when the OpenBLAS that MLX's matmuls use is mapped into this process, or off Linux.

    Looks in /proc/self/maps for the library scripts/env.sh preloads (Debian's OpenBLAS, by its resolved path):
    NumPy's own bundled OpenBLAS (`libscipy_openblas64_`, with renamed symbols that MLX never calls) is mapped in
    every process that imported NumPy and does not count. Off Linux (macOS: Accelerate and Metal) returns True.
    """
    from cluster.launch.platform import openblas_preload_path

    if os.uname().sysname != "Linux":
        return True
    path = openblas_preload_path()
    if path is None:
        return False
    wanted = {path, os.path.realpath(path)}
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any(line.split()[-1] in wanted for line in maps if "/" in line)
    except OSError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Scale the default per-test timeout when the reference BLAS does the matmuls (see the module docstring)."""
    if openblas_loaded():
        return
    try:
        base = float(config.getini("timeout") or 0)
    except ValueError:
        return
    if base <= 0:
        return
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(base * REFERENCE_BLAS_FACTOR))


@pytest.fixture(scope="module", autouse=True)
def _memory_back_after_each_module():
    """After each test module, collect its garbage and hand MLX's cached buffers back to the system: the suite runs
    in one process on a 24 GiB machine, and buffers a module freed would otherwise stay in MLX's cache, sized for
    that module's models, under the next module's."""
    yield
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
