"""An in-process cluster for tests: prefill and decode workers (cluster.worker) on threads of this process,
sharing one loaded model (the real SmolLM2 by default, or tests.engine_helpers.fast_model()), talking over tcp
loopback exactly as separate processes would, behind a router (ClusterEngineClient + the FastAPI app) served by
uvicorn on a free port."""

from __future__ import annotations

import re
import time
from contextlib import contextmanager

from cluster.topology import TOPOLOGY_DIR, parse_topology
from cluster.ports import free_ports
from tests.live_server import serve_app


def topology_text(prefill: int = 1, decode: int = 1, engine: str = "", routing: str = "", transfer: str = "",
                  security: str = "") -> str:
    """A cluster topology with free ports; `engine`/`routing`/`transfer`/`security` are extra TOML lines of
    those tables. The workers skip their load check (a family the tests cover; tests/test_load_check.py and
    tests/test_families_served.py run it) unless `engine` sets `skip_load_check`."""
    skip = '' if re.search(r'(?m)^skip_load_check', engine) else 'skip_load_check = true'
    lines = ['[model]', 'source = "SmolLM2-135M-Instruct"', 'served_name = "SmolLM2-135M-Instruct"',
             '[engine]', 'dtype = "float32"', 'kv_cache_gb = 0.25', skip, engine,
             '[routing]', 'heartbeat_s = 0.5', 'dead_after_s = 30.0', routing,
             '[transfer]', '' if re.search(r'(?m)^timeout_s', transfer) else 'timeout_s = 120', transfer,
             '[security]', security]
    ports = iter(free_ports(3 * prefill + 4 * decode))  # at once: distinct
    for i in range(prefill):
        lines += ['[[workers]]', f'name = "prefill-{i}"', 'role = "prefill"', f'control_port = {next(ports)}',
                  f'events_port = {next(ports)}', f'metrics_port = {next(ports)}']
    for i in range(decode):
        lines += ['[[workers]]', f'name = "decode-{i}"', 'role = "decode"', f'control_port = {next(ports)}',
                  f'kv_port = {next(ports)}', f'events_port = {next(ports)}', f'metrics_port = {next(ports)}']
    return "\n".join(lines) + "\n"


def free_port_topology(src: str, dst, **replace: str):
    """Write the shipped topology `src` to `dst` (a Path) with every port replaced by a free one and any
    `key = "value"` line named in `replace` given that value (e.g. `source=` another model); returns `dst`.
    The ports avoid Ray's worker range (cluster.launch.ray_head.free_ports), so a Ray test may use them."""
    from cluster.launch import ray_head

    text = (TOPOLOGY_DIR / f"{src}.toml").read_text()
    port_line = r"^(\s*(?:control_port|kv_port|events_port|metrics_port|port)\s*=\s*)\d+"
    spare = iter(ray_head.free_ports(len(re.findall(port_line, text, flags=re.M))))  # at once: distinct
    text = re.sub(port_line, lambda m: f"{m.group(1)}{next(spare)}", text, flags=re.M)
    for key, value in replace.items():
        text = re.sub(rf'^({key}\s*=\s*)"[^"]*"', rf'\g<1>"{value}"', text, flags=re.M)
    parse_topology(text, name=dst.stem)  # still valid
    dst.write_text(text)
    return dst


@contextmanager
def running_cluster(prefill: int = 1, decode: int = 1, loaded=None, **tables):
    """Yield (base_url, client, workers) of a started in-process cluster serving `loaded` = (model, tokenizer,
    spec) (default: the real model) under its spec's model id; everything stops afterwards."""
    from cluster.launch.workers import make_worker
    from router.app import create_app
    from router.cluster_client import ClusterEngineClient
    from router.tokenizer import RouterTokenizer
    from tests.engine_helpers import real_model

    topology = parse_topology(topology_text(prefill, decode, **tables), name="test-cluster")
    loaded = loaded if loaded is not None else real_model()
    workers = {w.name: make_worker(topology, w.name, loaded) for w in topology.workers}
    try:
        for w in workers.values():
            w.start()
        _, tokenizer, spec = loaded
        client = ClusterEngineClient(topology, spec.model_id, spec.max_model_len, revision=spec.revision)
        app = create_app(client, RouterTokenizer(tokenizer), served_model_names=[spec.model_id])
        with serve_app(app) as base:  # /health is 200 once a decode worker answered a ping
            deadline = time.monotonic() + 30
            while not all(w.alive for w in client.workers):
                assert time.monotonic() < deadline, "a worker never answered the router"
                time.sleep(0.05)
            yield base, client, workers
    finally:
        for w in workers.values():
            w.stop()


def slow_steps(worker, seconds: float) -> None:
    """From now on `worker`'s loop sleeps `seconds` before each engine step. The fast model prefills a prompt of
    a thousand tokens in a fraction of a second and decodes a token in milliseconds, where the real one takes
    seconds and ~0.1 s: a test that acts while a prefill or a stream is under way (a client leaving, a worker
    dying) or that needs requests to queue for seconds stretches that worker's steps so that the moment it acts
    in lasts, on a fast machine too. Installed on the worker's own thread (the engine belongs to it)."""
    def install(w) -> None:
        step = w.engine.step

        def slow_step():
            time.sleep(seconds)
            return step()

        w.engine.step = slow_step

    worker.call(install)
