"""`mlx-pd serve --layout split`: the engine as a decode worker in a child process, the router in this one.

In one process (single_node.py) the router's Python work (HTTP, tokenization, detokenization, SSE) and the
engine loop's share one interpreter lock; here each has its own (the rule for choosing is
`cluster.launch.platform.choose_layout`). The pieces are cluster mode's without Ray:

- `split_topology_text` writes a topology with one decode worker, `engine`, on free loopback ports, with the
  serve's model, served name, aliases and engine settings; with no prefill worker the router has the decode
  worker prefill every prompt itself (`router.placement.place`), and `local_prefill_max_tokens` is set past
  any context so that holds for prompts of any length;
- `EngineProcess` runs `mlx-pd worker TOPOLOGY engine` in its own process group, copies its output to this
  process's stderr (keeping a tail for errors), waits until it answers a ping (deadline: the child's log tail
  on failure), forwards a signal, and stops it (SIGTERM to the group, then SIGKILL). The child also stops on
  its own once this process is gone (`--exit-with-parent`), so a killed serve leaves no engine behind;
- `serve_split` runs the router (`cluster_router_client` + the OpenAI app) on uvicorn in this process.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from cluster.config import EngineConfig
from cluster.ports import free_ports

ENGINE_NAME = "engine"
START_TIMEOUT_S = 600.0  # model load and load check in the child
STOP_TIMEOUT_S = 15.0  # SIGTERM, then SIGKILL
LOCAL_PREFILL_ALL = 2**31 - 1  # every prompt is prefilled by the decode worker itself


def toml_value(value) -> str:
    """`value` (a bool, str, int, float, a list of them, or a dict of them as an inline table) written as a
    TOML value. Raises ValueError for any other type."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise ValueError(f"cannot write {value!r} to a topology file")


def split_topology_text(*, source: Optional[str], served_name: str, aliases: Sequence[str], engine: EngineConfig,
                        ports: tuple[int, int], curve_keys_dir: Optional[str] = None) -> str:
    """The topology file of a split serve: one decode worker named `engine` on 127.0.0.1 with control and KV
    ports `ports`, the model `source` served as `served_name` (+ `aliases`), every EngineConfig field that is
    set, and routing that prefills every prompt on that worker."""
    lines = ["# written by `mlx-pd serve --layout split` (cluster/launch/split_serve.py)", "[model]"]
    if source is not None:
        lines.append(f"source = {toml_value(source)}")
    lines += [f"served_name = {toml_value(served_name)}", f"aliases = {toml_value(list(aliases))}", "[engine]"]
    lines += [f"{f.name} = {toml_value(getattr(engine, f.name))}" for f in dataclasses.fields(engine)
              if getattr(engine, f.name) is not None]
    lines += ["[routing]", f"local_prefill_max_tokens = {LOCAL_PREFILL_ALL}"]
    if curve_keys_dir:
        lines += ["[security]", f"curve_keys_dir = {toml_value(curve_keys_dir)}"]
    lines += ["[[workers]]", f'name = "{ENGINE_NAME}"', 'role = "decode"', 'host = "127.0.0.1"',
              f"control_port = {ports[0]}", f"kv_port = {ports[1]}"]
    return "\n".join(lines) + "\n"


class EngineProcess:
    """The engine's child process: `mlx-pd worker TOPOLOGY engine`, in its own process group, stopped with this
    process. Its output goes to this process's stderr; the last lines are kept for error messages."""

    def __init__(self, topology_path: str, control_endpoint: str, keys=None, tail_lines: int = 40):
        from cluster.launch.platform import preload_env

        self.control_endpoint, self.keys = control_endpoint, keys
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        env = {**os.environ, **preload_env()}
        repo = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
        argv = [sys.executable, "-m", "cluster.launch.cli", "worker", topology_path, ENGINE_NAME,
                "--exit-with-parent", str(os.getpid())]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        self.pid = self.proc.pid
        atexit.register(self.stop)
        self._pump = threading.Thread(target=self._copy_output, name="engine-log", daemon=True)
        self._pump.start()

    def _copy_output(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            try:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass

    def log_tail(self) -> str:
        """The child's last lines of output."""
        return "\n".join(self.tail)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Wait until the engine answers a ping on its control socket; returns the seconds waited. Raises
        RuntimeError (with the child's log tail) when it exits first or `timeout_s` passes."""
        from cluster.launch.workers import probe_worker

        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                self._pump.join(2.0)
                raise RuntimeError(f"the engine process exited with status {self.proc.returncode} before it was "
                                   f"ready; its last output:\n{self.log_tail()}")
            if probe_worker(self.control_endpoint, self.keys, timeout_s=0.5) is not None:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"the engine process was not ready after {timeout_s:.0f} s; its last "
                                   f"output:\n{self.log_tail()}")
            time.sleep(0.2)

    def signal(self, sig: int) -> None:
        """Send `sig` to the engine's process group (nothing if it is gone)."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to the engine's group, SIGKILL after `timeout_s`; returns once the child is reaped. Idempotent."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait()
        self.signal(signal.SIGKILL)  # anything the worker left in its group
        atexit.unregister(self.stop)


def serve_split(*, source: Optional[str], served_name: Optional[str], aliases: Sequence[str], engine: EngineConfig,
                host: str, port: int, api_key: Optional[str], max_body_bytes: Optional[int], log_level: str,
                reason: str, curve_keys_dir: Optional[str] = None, start_timeout_s: float = START_TIMEOUT_S) -> int:
    """Serve the OpenAI API at host:port with the engine in a child process (see the module docstring); returns
    the exit status once the server stops (Ctrl-C / SIGTERM, forwarded to the engine)."""
    import uvicorn

    from cluster.launch.processes import cluster_router_client
    from cluster.model import served_model
    from cluster.topology import load_topology
    from cluster.transport import CurveKeys
    from router.app import create_app_for_model

    _, spec = served_model(source, served_name, engine.dtype)  # resolves (downloads, imports) once, here
    with tempfile.TemporaryDirectory(prefix="mlx-pd-split-") as tmp:
        ports = tuple(free_ports(2))
        path = Path(tmp) / "split.toml"
        path.write_text(split_topology_text(source=source, served_name=spec.model_id, aliases=aliases, engine=engine,
                                            ports=ports, curve_keys_dir=curve_keys_dir))
        topology = load_topology(str(path))
        keys = CurveKeys.load(curve_keys_dir) if curve_keys_dir else None
        child = EngineProcess(str(path), topology.workers[0].endpoint(ports[0]), keys)

        def forward(sig, _frame) -> None:  # uvicorn re-raises the signal it stopped on once it has shut down
            child.signal(sig)
            raise SystemExit(0)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            print(f"mlx-pd: layout split (router pid {os.getpid()}, engine pid {child.pid}): {reason}",
                  file=sys.stderr, flush=True)
            try:
                waited = child.wait_ready(start_timeout_s)
            except RuntimeError as exc:
                print(f"mlx-pd: error: {exc}", file=sys.stderr, flush=True)
                return 1
            client, model_path = cluster_router_client(topology)
            layout = {"name": "split", "reason": reason, "router_pid": os.getpid(), "engine_pid": child.pid}
            app = create_app_for_model(client, model_path, api_key, max_body_bytes=max_body_bytes, aliases=aliases,
                                       layout=layout)
            print(f"mlx-pd: serving {client.model_name} at http://{host}:{port}/v1 (context {client.max_model_len} "
                  f"tokens; engine ready after {waited:.1f} s)", file=sys.stderr, flush=True)
            server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                   timeout_graceful_shutdown=5))

            async def run() -> None:
                await client.wait_ready(10.0)  # sockets and heartbeats on the server's loop: /health is 200 at once
                await server.serve()

            asyncio.run(run())
            return 0
        finally:
            child.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
