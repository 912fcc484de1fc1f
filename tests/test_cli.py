"""The `mlx-pd` command from a shell, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys


def test_generate_streams_the_answer_to_stdout():
    env = {**os.environ, "PYTHONPATH": "."}
    r = subprocess.run([sys.executable, "-m", "cluster.launch.cli", "generate", "What is the capital of France?",
                        "--max-tokens", "20", "--kv-cache-gb", "0.1"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_bad_option_value_is_a_clear_error():
    env = {**os.environ, "PYTHONPATH": "."}
    r = subprocess.run([sys.executable, "-m", "cluster.launch.cli", "generate", "hi", "--block-size", "0"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "block_size=0 is invalid" in r.stderr and "Traceback" not in r.stderr


def test_bench_and_profile_without_the_bench_extra_say_how_to_install_it(monkeypatch, capsys):
    """`mlx-pd bench|profile` where the benchmarks' dependencies are missing: one line naming the extra, exit 2."""
    import importlib.util

    import cluster.launch.platform
    from cluster.launch import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(cluster.launch.platform, "reexec_with_openblas", lambda *a, **k: None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    for command in ("bench", "profile"):
        assert cli.main([command, "--help"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "pip install -e '.[bench]'" in err[0] and "matplotlib missing" in err[0], err


def test_the_bench_extra_is_what_the_benchmarks_tool_checks_for():
    """The CLI's install hint is only right if `benchmarks.REQUIRES` names exactly the `[bench]` extra, and
    the server's own dependencies carry none of them (it serves without the tool)."""
    import re
    import tomllib
    from pathlib import Path

    import benchmarks

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    name = lambda requirement: re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()
    assert sorted(map(name, project["optional-dependencies"]["bench"])) == sorted(benchmarks.REQUIRES)
    assert not {name(r) for r in project["dependencies"]} & set(benchmarks.REQUIRES)
