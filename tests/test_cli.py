"""The `mlx-pd` command from a shell, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys


def test_generate_streams_the_answer_to_stdout():
    env = {**os.environ, "PYTHONPATH": "."}
    r = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "What is the capital of France?",
                        "--max-tokens", "20", "--kv-cache-gb", "0.1"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_bad_option_value_is_a_clear_error():
    env = {**os.environ, "PYTHONPATH": "."}
    r = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "hi", "--block-size", "0"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "block_size=0 is invalid" in r.stderr and "Traceback" not in r.stderr
