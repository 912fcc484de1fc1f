"""A real single-node server (router + the single-node worker, real SmolLM2, or any model folder as
`mlx-pd serve --model` loads it) on a free loopback port, for tests."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import httpx

from cluster.ports import free_port


@contextmanager
def live_server(api_key: str | None = None, **engine_config):
    """Yield (base_url, client) for a server over the shared real model with `engine_config`."""
    from cluster.launch.single_node import start_in_process_worker
    from cluster.model import DEFAULT_MODEL
    from router.app import create_app
    from router.tokenizer import RouterTokenizer
    from tests.engine_helpers import make_engine

    core = make_engine(**engine_config)
    client = start_in_process_worker(core, model_name=DEFAULT_MODEL)
    tokenizer = RouterTokenizer(core.tokenizer)
    app = create_app(client, tokenizer, served_model_names=[DEFAULT_MODEL], api_key=api_key)
    try:
        with serve_app(app) as base:
            yield base, client
    finally:
        client.stop()


@contextmanager
def live_model_server(model, api_key: str | None = None, **engine_config):
    """Yield (base_url, client) for `mlx-pd serve --model MODEL` with `engine_config` (EngineConfig fields, as
    the CLI's flags set them), started the way the CLI starts it: `start_single_node_engine` (the folder
    resolved, `load_model` at the config's dtype, the engine in the single-node worker's loop) and
    `create_app_for_model` (the folder's tokenizer, the folder's name as the served name), behind uvicorn."""
    import atexit

    from cluster.config import EngineConfig
    from cluster.launch.single_node import start_single_node_engine
    from router.app import create_app_for_model

    client, path = start_single_node_engine(str(model), EngineConfig(**engine_config))
    try:
        with serve_app(create_app_for_model(client, path, api_key)) as base:
            yield base, client
    finally:
        client.stop()
        atexit.unregister(client.stop)  # registered by start_single_node_engine; lets the model be freed


@contextmanager
def serve_app(app):
    """Run a FastAPI app with uvicorn on a thread and a free port; yields its base URL once /health answers."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    runner = threading.Thread(target=server.run, daemon=True)
    runner.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    try:
        yield base
    finally:
        server.should_exit = True
        runner.join(10)
