"""Shared pytest setup for mlx-pd.

The markers (`slow`: long tests over the real model, still run in CI; `ray`: tests that start a local
Ray cluster) and the default per-test timeout (600 s, pytest-timeout) are declared in pyproject.toml.

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
    """True when OpenBLAS is mapped into this process, or on a platform that does not use the reference BLAS.

    Reads /proc/self/maps on Linux (the truth, whatever LD_PRELOAD says); elsewhere (macOS: Accelerate and
    Metal) returns True.
    """
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return "openblas" in maps.read().lower()
    except OSError:
        return os.uname().sysname != "Linux"


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
