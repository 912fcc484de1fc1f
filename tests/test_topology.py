"""Topology files: the shipped default parses; typos and bad values are errors naming the key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster.topology import load_topology


def test_single_node_default_parses():
    topo = load_topology("single-node")
    assert topo.router.host == "127.0.0.1" and topo.router.port == 8000
    assert topo.engine.block_size == 32 and topo.engine.prefill_chunk_size == 2048
    assert topo.model.served_name == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize("text,message", [
    ("[engine]\nkv_bitz = 8\n", "unknown key(s) kv_bitz"),
    ("[engine]\nkv_bits = 3\n", "kv_bits=3 is invalid"),
    ("[engin]\n", "unknown table(s) engin"),
    ("[router]\nport = 0\n", "router.port=0"),
    ("[engine\n", "not valid TOML"),
])
def test_bad_files_name_the_problem(tmp_path, text, message):
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_topology(str(path))


def test_cli_reports_a_bad_topology_without_a_traceback(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text("[engine]\nkv_bits = 3\n")
    r = subprocess.run([sys.executable, "-m", "cluster.cli", "serve", "--topology", str(path)],
                       capture_output=True, text=True, env={"PYTHONPATH": ".", "MLX_PD_NO_OPENBLAS": "1"}, timeout=120)
    assert r.returncode == 2 and "kv_bits=3 is invalid" in r.stderr and "Traceback" not in r.stderr
