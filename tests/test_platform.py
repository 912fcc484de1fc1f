"""cluster.launch.platform: where OpenBLAS is found, when the process re-executes itself with it preloaded,
and that MLX still imports and multiplies correctly under the preload."""

import json
import os
import subprocess
import sys

import pytest

from cluster.launch import platform as mpd_platform
from cluster.launch.platform import ENV_DISABLE, openblas_preload_path, preload_env

LIB = openblas_preload_path()
needs_openblas = pytest.mark.skipif(LIB is None, reason="libopenblas0-pthread is not installed")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clean_env(**extra):
    """os.environ without the preload or the switch (scripts/env.sh may have set them for pytest)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", ENV_DISABLE)}
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def run_python(args, env):
    out = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


# ---- path logic ----

def test_not_linux_means_no_preload(tmp_path):
    lib = tmp_path / "libblas.so.3"
    lib.write_bytes(b"")
    for system in ("Darwin", "Windows"):
        assert openblas_preload_path(system=system, candidates=[str(lib)]) is None


def test_first_existing_known_path_wins(tmp_path):
    missing, present = tmp_path / "missing" / "libblas.so.3", tmp_path / "libblas.so.3"
    present.write_bytes(b"")
    never = lambda: pytest.fail("dpkg asked although a known path exists")  # noqa: E731
    got = openblas_preload_path(system="Linux", candidates=[str(missing), str(present)], listing=never)
    assert got == str(present)


def test_dpkg_listing_is_the_fallback(tmp_path):
    lib = tmp_path / "openblas-pthread" / "libblas.so.3"
    lib.parent.mkdir()
    lib.write_bytes(b"")
    other = tmp_path / "libblas.so.3"  # a libblas.so.3 that is not OpenBLAS's
    other.write_bytes(b"")
    listing = lambda: ["/usr/share/doc/libopenblas0-pthread", str(other), str(lib)]  # noqa: E731
    assert openblas_preload_path(system="Linux", candidates=[], listing=listing) == str(lib)
    # listed but absent on disk, or nothing listed: None
    gone = lambda: [str(tmp_path / "openblas-pthread" / "gone" / "libblas.so.3")]  # noqa: E731
    assert openblas_preload_path(system="Linux", candidates=[], listing=gone) is None
    assert openblas_preload_path(system="Linux", candidates=[], listing=lambda: []) is None


def test_preload_env_prepends_once_and_respects_the_switch(monkeypatch):
    lib = "/opt/openblas/libblas.so.3"
    assert preload_env({}, path=lib) == {"LD_PRELOAD": lib}
    assert preload_env({"LD_PRELOAD": "/x/libfoo.so"}, path=lib) == {"LD_PRELOAD": f"{lib}:/x/libfoo.so"}
    already = {"LD_PRELOAD": f"/x/libfoo.so:{lib}"}
    assert preload_env(already, path=lib) == already
    for value in ("1", "true", "YES"):
        assert preload_env({ENV_DISABLE: value}, path=lib) == {}
    assert preload_env({ENV_DISABLE: "0"}, path=lib) == {"LD_PRELOAD": lib}
    monkeypatch.setattr(mpd_platform, "openblas_preload_path", lambda: None)
    assert preload_env({}) == {}


def test_reexec_does_nothing_without_a_library(monkeypatch):
    monkeypatch.setattr(mpd_platform, "openblas_preload_path", lambda: None)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("re-exec without a library"))
    mpd_platform.reexec_with_openblas(["prog"])


def test_reexec_builds_the_command_line(monkeypatch):
    calls = []
    monkeypatch.setattr(mpd_platform, "openblas_preload_path", lambda: "/opt/libblas.so.3")
    monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv(ENV_DISABLE, raising=False)
    mpd_platform.reexec_with_openblas(["/venv/bin/mlx-pd", "serve", "--port", "9"])
    (exe, argv, env), = calls
    assert exe == sys.executable and argv == [sys.executable, "/venv/bin/mlx-pd", "serve", "--port", "9"]
    assert env["LD_PRELOAD"] == "/opt/libblas.so.3"
    # with the process's own sys.argv, the original interpreter command line is re-run
    mpd_platform.reexec_with_openblas(sys.argv)
    assert calls[-1][1] == [sys.executable, *sys.orig_argv[1:]]
    # already preloaded, or switched off: no re-exec
    monkeypatch.setenv("LD_PRELOAD", "/opt/libblas.so.3")
    mpd_platform.reexec_with_openblas(["prog"])
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setenv(ENV_DISABLE, "1")
    mpd_platform.reexec_with_openblas(["prog"])
    assert len(calls) == 2


# ---- real processes ----

REEXEC = (
    "import os, sys, json\n"
    "from cluster.launch.platform import reexec_with_openblas\n"
    "reexec_with_openblas(sys.argv)\n"
    "print(json.dumps({'preload': os.environ.get('LD_PRELOAD', ''), 'argv': sys.argv[1:]}))\n"
)


@needs_openblas
def test_reexec_sets_ld_preload_in_a_subprocess():
    out = json.loads(run_python(["-c", REEXEC, "a", "b c"], clean_env(LD_PRELOAD="/nonexistent/libx.so")))
    assert out["preload"].split(":") == [LIB, "/nonexistent/libx.so"]
    assert out["argv"] == ["a", "b c"]  # arguments survive the re-exec, printed once


@needs_openblas
def test_switch_keeps_the_process_as_it_is():
    out = json.loads(run_python(["-c", REEXEC], clean_env(**{ENV_DISABLE: "1"})))
    assert out["preload"] == ""


MATMUL = (
    "import json, numpy as np, mlx.core as mx\n"
    "rng = np.random.default_rng(0)\n"
    "a = rng.standard_normal((257, 300), dtype=np.float32)\n"
    "b = rng.standard_normal((300, 129), dtype=np.float32)\n"
    "c = np.array(mx.array(a) @ mx.array(b))\n"
    "maps = open('/proc/self/maps').read()\n"
    "print(json.dumps({'ok': bool(np.allclose(c, a @ b, rtol=1e-4, atol=1e-3)),\n"
    "                  'openblas': '/openblas-pthread/' in maps}))\n"
)


@needs_openblas
def test_mlx_matmul_is_correct_under_the_preload():
    out = json.loads(run_python(["-c", MATMUL], clean_env(**preload_env({}))))
    assert out == {"ok": True, "openblas": True}
    # the control: without the preload MLX uses its bundled BLAS, and is still correct
    out = json.loads(run_python(["-c", MATMUL], clean_env()))
    assert out == {"ok": True, "openblas": False}


DETECT = (
    "import json, numpy, mlx.core\n"
    "from tests.conftest import openblas_loaded\n"
    "print(json.dumps(openblas_loaded()))\n"
)


@needs_openblas
def test_the_suite_knows_which_blas_mlx_uses():
    """The suite lengthens its per-test timeout when MLX runs on the reference BLAS. Its check must not take
    NumPy's own bundled OpenBLAS (mapped in every process that imports NumPy) for the preloaded one."""
    assert json.loads(run_python(["-c", DETECT], clean_env(**preload_env({})))) is True
    assert json.loads(run_python(["-c", DETECT], clean_env())) is False
