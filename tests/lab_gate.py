"""The lab tests' gate: the lab needs root and network namespaces. Where it cannot run, a test is skipped, except
under CI (`CI=true`), where the lab must run and its absence fails the test."""

from __future__ import annotations

import os

import pytest

from benchmarks.lab import LabError
from benchmarks.lab.lab import check_platform

IN_CI = os.environ.get("CI", "").lower() == "true"


def require_lab() -> None:
    """Skip the calling test where the lab cannot run (fail it under CI), naming why."""
    try:
        check_platform()
    except LabError as exc:
        if IN_CI:
            pytest.fail(f"the lab cannot run under CI: {exc}")
        pytest.skip(f"the lab cannot run here: {exc}")
