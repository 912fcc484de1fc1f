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
    assert topo.router.max_body_bytes is None  # sized to the context by the router


def test_router_body_limit_from_the_topology_reaches_the_app(tmp_path):
    """`[router] max_body_bytes` is the limit the served app applies: a body one byte over it is a 413."""
    import httpx

    from cluster.gguf_import import ensure_default_model
    from router.app import create_app_for_model
    from tests.live_server import serve_app
    from tests.router_fakes import FakeEngine, load_tokenizer

    path = tmp_path / "t.toml"
    path.write_text("[router]\nmax_body_bytes = 2000\n")
    limit = load_topology(str(path)).router.max_body_bytes
    app = create_app_for_model(FakeEngine(load_tokenizer()), ensure_default_model(progress=False), max_body_bytes=limit)
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "x", "max_tokens": 1, "pad": "y" * 2000}
    with serve_app(app) as base:
        r = httpx.post(base + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 413 and "2000" in r.json()["error"]["message"]


@pytest.mark.parametrize("text,message", [
    ("[engine]\nkv_bitz = 8\n", "unknown key(s) kv_bitz"),
    ("[engine]\nkv_bits = 3\n", "kv_bits=3 is invalid"),
    ("[engine]\nblock_size = 16\nstate_snapshot_interval = 24\n", "positive multiple of block_size=16"),
    ("[engine]\nstate_cache_gb = -1.0\n", "state_cache_gb=-1.0 is invalid"),
    ("[engin]\n", "unknown table(s) engin"),
    ("[router]\nport = 0\n", "router.port=0"),
    ("[router]\nmax_body_bytes = 0\n", "router.max_body_bytes=0 is invalid"),
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
    r = subprocess.run([sys.executable, "-m", "cluster.launch.cli", "serve", "--topology", str(path)],
                       capture_output=True, text=True, env={"PYTHONPATH": ".", "MLX_PD_NO_OPENBLAS": "1"}, timeout=120)
    assert r.returncode == 2 and "kv_bits=3 is invalid" in r.stderr and "Traceback" not in r.stderr


def test_cluster_topologies_parse():
    one = load_topology("local-1p1d")
    assert [(w.name, w.role) for w in one.workers] == [("prefill-0", "prefill"), ("decode-0", "decode")]
    assert one.worker("decode-0").endpoint(one.worker("decode-0").kv_port) == "tcp://127.0.0.1:5612"
    assert one.ray.address == "local" and one.namespace == "mlx-pd-local-1p1d"
    two = load_topology("local-1p2d")
    assert [w.actor_name for w in two.workers_of("decode")] == ["decode-0@127.0.0.1", "decode-1@127.0.0.1"]


WORKERS = '[[workers]]\nname = "p"\nrole = "prefill"\ncontrol_port = 7001\n' \
          '[[workers]]\nname = "d"\nrole = "decode"\ncontrol_port = 7002\nkv_port = 7003\n'


@pytest.mark.parametrize("text,message", [
    (WORKERS.replace('role = "prefill"', 'role = "prefil"'), "role='prefil' is invalid"),
    (WORKERS.replace("kv_port = 7003\n", ""), "a decode worker needs kv_port"),
    (WORKERS.replace('name = "d"', 'name = "p"'), "duplicate worker name(s) p"),
    (WORKERS.replace("kv_port = 7003", "kv_port = 7001"), "port(s) 127.0.0.1:7001 used twice"),
    (WORKERS.replace('role = "decode"', 'role = "prefill"').replace("kv_port = 7003\n", ""),
     "at least one decode worker"),
    (WORKERS + '[workers.engine]\nkv_bits = 8\n', "kv_bits is part of the KV format"),  # a per-worker KV format
    (WORKERS + '[workers.engine]\nkv_cach_gb = 8\n', "unknown key(s) kv_cach_gb"),
    (WORKERS + 'colour = "red"\n', "unknown key(s) colour"),
    ("[routing]\npolicy = \"fastest\"\n", "routing.policy='fastest' is invalid"),
    ("[transfer]\ntimeout_s = 0\n", "timeout_s=0 is invalid"),
    ("workers = 3\n", "workers must be an array of tables"),
])
def test_bad_cluster_files_name_the_problem(tmp_path, text, message):
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_topology(str(path))


def test_worker_engine_overrides_apply_to_that_worker_only(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text("[engine]\nkv_cache_gb = 2.0\nkv_bits = 8\n" + WORKERS + "[workers.engine]\nkv_cache_gb = 6.0\n")
    topo = load_topology(str(path))
    assert topo.worker("p").engine.kv_cache_gb == 2.0 and topo.worker("d").engine.kv_cache_gb == 6.0
    assert topo.worker("d").engine.kv_bits == 8
