"""Cluster mode without Ray: one worker or the router in the foreground of this process.

    mlx-pd worker TOPOLOGY NAME     # one worker (pinned to its cpu_affinity on Linux) until Ctrl-C / SIGTERM
    mlx-pd router TOPOLOGY          # the OpenAI API over the topology's workers

Useful for debugging a worker in a terminal, for machines without Ray, and for benchmarks that pin each
process to its own cores (a stand-in for separate Macs). `mlx-pd up` (ray_up.py) runs the same
worker and router code as Ray actors, with placement, restarts and the dashboard.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Optional

from cluster.topology import TopologySpec, load_topology


def cluster_router_client(topology: TopologySpec):
    """(ClusterEngineClient, model folder) for the router of `topology`: same model name and revision as the
    workers (so prompts hash alike), context limit = the smallest of the model's and the workers'."""
    from cluster.model import served_model
    from router.cluster_client import ClusterEngineClient

    path, spec = served_model(topology.model.source, topology.model.served_name, topology.engine.dtype)
    limits = [w.engine.max_model_len for w in topology.workers if w.engine.max_model_len]
    client = ClusterEngineClient(topology, spec.model_id, min([spec.max_model_len, *limits]), revision=spec.revision)
    return client, path


def run_worker(topology_path: str, name: str, exit_with_parent: Optional[int] = None, rank: int = 0) -> int:
    """Start worker `name` of the topology and serve until SIGINT/SIGTERM. Returns the exit status.
    `rank` > 0: run that following rank of the worker's group instead (`[workers.group]`), until its leader
    stops the group (or is lost: exit status 75).

    `exit_with_parent`: the pid of the process that started this one (`serve --layout split`); the worker
    stops once its parent is no longer that process (it exited, even by SIGKILL), so no engine is orphaned."""
    import os

    from cluster.launch.platform import pin_cpus
    from cluster.launch.workers import make_worker

    topology = load_topology(topology_path)
    spec = topology.worker(name)
    if spec.cpu_affinity:
        pin_cpus(spec.cpu_affinity)
    if rank:
        from cluster.parallel.rank import follow

        if spec.group is None or not 0 < rank < len(spec.group.ranks):
            print(f"mlx-pd: {spec.name} has no following rank {rank} (its [workers.group] lists "
                  f"{len(spec.group.ranks) if spec.group else 1} rank(s))", file=sys.stderr)
            return 2
        return follow(spec.group.plan(topology.model.source, topology.model.served_name, spec.engine), rank)
    worker = make_worker(topology, name)
    endpoints = worker.start()
    print(f"mlx-pd: {spec.actor_name} ({spec.role}) serving: {endpoints}", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        if exit_with_parent is not None and os.getppid() != exit_with_parent:
            print(f"mlx-pd: {spec.actor_name}: the process that started it ({exit_with_parent}) is gone; stopping",
                  file=sys.stderr, flush=True)
            break
        if not worker.healthy:
            print(f"mlx-pd: {spec.actor_name}: the worker loop stopped", file=sys.stderr)
            return 1
    worker.stop()
    return 0


def run_router(topology_path: str, api_key: Optional[str] = None, log_level: str = "warning") -> int:
    """Serve the OpenAI API over the topology's workers (host and port from `[router]`) until stopped."""
    import uvicorn

    from router.app import create_app_for_model

    topology = load_topology(topology_path)
    client, path = cluster_router_client(topology)
    app = create_app_for_model(client, path, api_key, max_body_bytes=topology.router.max_body_bytes,
                               aliases=topology.model.aliases)
    host, port = topology.router.host, topology.router.port
    print(f"mlx-pd: router for {topology.name} at http://{host}:{port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    return 0
