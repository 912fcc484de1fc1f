"""What runs inside the Ray actors of cluster mode: one `WorkerActor` per `[[workers]]` entry and one
`RouterActor` (the OpenAI API). `ray_driver.py` wraps these plain classes with `ray.remote`.

Both take the topology as TOML text (`TopologySpec.source`), so every process parses the same file.
A worker actor does all its work in its constructor (pin CPUs, load the model, bind the sockets, start the
loop thread), so when Ray restarts a dead actor (`max_restarts`) the new process comes up the same way.
It exports its `Worker.stats()` as Ray metrics every `METRICS_INTERVAL_S` (see `metric_values`), which the
Ray dashboard and its Prometheus endpoint show as `ray_mlx_pd_*`, tagged `worker` and `role`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Optional

from cluster.topology import TopologySpec, parse_topology

logger = logging.getLogger(__name__)
METRICS_INTERVAL_S = 2.0

# stats key -> (metric name, description). Gauges are set to the value; counters grow by its increase.
GAUGES = {
    "num_running": ("mlx_pd_running_sequences", "sequences in the running batch"),
    "num_waiting": ("mlx_pd_waiting_sequences", "sequences waiting for admission"),
    "kv_blocks_used": ("mlx_pd_kv_blocks_used", "KV blocks in use (total - free)"),
    "kv_blocks_free": ("mlx_pd_kv_blocks_free", "free KV blocks"),
    "prefix_cache_hit_rate": ("mlx_pd_prefix_cache_hit_rate", "prompt tokens served from the prefix cache, "
                                                               "over those looked up (0..1)"),
    "tokens_per_s": ("mlx_pd_tokens_per_second", "output tokens per second over the last interval"),
    "transfers_inflight": ("mlx_pd_kv_transfers_inflight", "KV transfers under way"),
    "ttft_p50_s": ("mlx_pd_ttft_p50_seconds", "median time to first token of recent prefills (s)"),
    "state_snapshot_bytes": ("mlx_pd_state_snapshot_bytes", "bytes of recurrent-state snapshots kept (hybrid "
                                                             "models' prefix cache)"),
    "state_snapshot_budget_bytes": ("mlx_pd_state_snapshot_budget_bytes", "the snapshots' byte budget"),
    "healthy": ("mlx_pd_worker_healthy", "1 while the worker loop runs"),
}
COUNTERS = {
    "tokens_out": ("mlx_pd_output_tokens", "output tokens sent to the router"),
    "prefix_cache_queries": ("mlx_pd_prefix_cache_query_tokens", "prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("mlx_pd_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache"),
    "num_preemptions": ("mlx_pd_preemptions", "sequences preempted (recomputed later)"),
    "kv_bytes_sent": ("mlx_pd_kv_bytes_sent", "KV bytes shipped to decode workers"),
    "kv_bytes_received": ("mlx_pd_kv_bytes_received", "KV bytes received from prefill workers"),
    "kv_blocks_sent": ("mlx_pd_kv_blocks_sent", "KV blocks shipped"),
    "kv_blocks_received": ("mlx_pd_kv_blocks_received", "KV blocks received"),
    "state_bytes_sent": ("mlx_pd_state_bytes_sent", "recurrent-state bytes shipped with KV (hybrid models)"),
    "state_bytes_received": ("mlx_pd_state_bytes_received", "recurrent-state bytes received with KV"),
    "transfer_timeouts": ("mlx_pd_kv_transfer_timeouts", "KV transfers that timed out"),
}


def metric_values(stats: dict, prev: Optional[dict], dt_s: float) -> tuple[dict[str, float], dict[str, float]]:
    """(gauges, counter increments) keyed by stats key, from a `Worker.stats()` snapshot.

    `prev` is the snapshot `dt_s` seconds earlier (None at first: counters then count from zero).
    Missing or None values are skipped; increments are never negative.

    >>> g, c = metric_values({"kv_blocks_total": 10, "kv_blocks_free": 7, "tokens_out": 30, "healthy": True},
    ...                      {"tokens_out": 10}, 2.0)
    >>> g["kv_blocks_used"], g["tokens_per_s"], g["healthy"], c["tokens_out"]
    (3, 10.0, 1.0, 20)
    """
    stats = dict(stats)
    if isinstance(stats.get("kv_blocks_total"), (int, float)) and isinstance(stats.get("kv_blocks_free"), (int, float)):
        stats["kv_blocks_used"] = stats["kv_blocks_total"] - stats["kv_blocks_free"]
    if "healthy" in stats:
        stats["healthy"] = 1.0 if stats["healthy"] else 0.0
    increments = {}
    for key in COUNTERS:
        value = stats.get(key)
        if isinstance(value, (int, float)):
            increments[key] = max(0, value - ((prev or {}).get(key) or 0))
    if prev is not None and dt_s > 0 and "tokens_out" in increments:
        stats["tokens_per_s"] = increments["tokens_out"] / dt_s
    gauges = {k: stats[k] for k in GAUGES if isinstance(stats.get(k), (int, float))}
    return gauges, increments


class MetricsExporter:
    """A daemon thread that turns `stats_fn()` into Ray metrics every `interval_s`, tagged worker/role."""

    def __init__(self, stats_fn, worker: str, role: str, interval_s: float = METRICS_INTERVAL_S):
        from ray.util.metrics import Counter, Gauge

        keys = ("worker", "role")
        self._tags = {"worker": worker, "role": role}
        self._gauges = {k: Gauge(n, description=d, tag_keys=keys) for k, (n, d) in GAUGES.items()}
        self._counters = {k: Counter(n, description=d, tag_keys=keys) for k, (n, d) in COUNTERS.items()}
        self._stats_fn, self._interval_s = stats_fn, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"metrics-{worker}", daemon=True)

    def start(self) -> "MetricsExporter":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        prev, prev_t = None, time.monotonic()
        while not self._stop.wait(self._interval_s if prev is not None else 0.0):
            try:
                stats, now = self._stats_fn(), time.monotonic()
                gauges, increments = metric_values(stats, prev, now - prev_t)
                for key, value in gauges.items():
                    self._gauges[key].set(value, tags=self._tags)
                for key, value in increments.items():
                    if value > 0:
                        self._counters[key].inc(value, tags=self._tags)
                prev, prev_t = stats, now
            except Exception:  # metrics must never take a worker down
                logger.exception("exporting metrics failed")


class WorkerActor:
    """One prefill or decode worker (cluster.launch.workers.make_worker) living in a Ray actor."""

    def __init__(self, topology_text: str, topology_name: str, worker_name: str,
                 metrics_interval_s: float = METRICS_INTERVAL_S):
        from cluster.launch.platform import pin_cpus
        from cluster.launch.workers import make_worker

        topology = parse_topology(topology_text, name=topology_name)
        self.spec = topology.worker(worker_name)
        if self.spec.cpu_affinity:
            pin_cpus(self.spec.cpu_affinity)
        self.worker = make_worker(topology, worker_name)
        self.endpoints = self.worker.start()
        self.started_at = time.time()
        self.exporter = MetricsExporter(self.worker.stats, self.spec.name, self.spec.role, metrics_interval_s).start()

    def __repr__(self) -> str:
        return f"WorkerActor({self.spec.actor_name})"

    def ready(self) -> dict:
        """{"name", "role", "control", "kv", "pid", "started_at"} once the worker serves."""
        return {**self.endpoints, "pid": os.getpid(), "started_at": self.started_at}

    def stats(self) -> dict:
        return {**self.worker.stats(), "pid": os.getpid()}

    def stop(self) -> None:
        self.exporter.stop()
        self.worker.stop()


def _restarted_by_ray() -> bool:
    """True in an actor that Ray restarted (its constructor runs again after its process died)."""
    import warnings

    import ray

    with warnings.catch_warnings():  # Ray's property reads its own deprecated `actor_id` (a warning, every time)
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed)


class RouterActor:
    """The OpenAI HTTP API over `ClusterEngineClient`, served by uvicorn on a thread of this actor."""

    def __init__(self, topology_text: str, topology_name: str, api_key: Optional[str] = None,
                 request_timeout_s: float = 600.0):
        topology = parse_topology(topology_text, name=topology_name)
        self.host, self.port = topology.router.host, topology.router.port
        self._error: Optional[BaseException] = None
        self._server = None
        self._client = None
        self._ready = False
        self._restarted = _restarted_by_ray()
        self._served = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(topology, api_key, request_timeout_s),
                                        name="mlx-pd-router", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"RouterActor({self.host}:{self.port})"

    def _run(self, topology: TopologySpec, api_key: Optional[str], request_timeout_s: float) -> None:
        try:
            asyncio.run(self._serve(topology, api_key, request_timeout_s))
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
            logger.exception("the router stopped")
        finally:
            self._served.set()

    async def _serve(self, topology: TopologySpec, api_key: Optional[str], request_timeout_s: float) -> None:
        import uvicorn

        from cluster.launch.processes import cluster_router_client
        from router.app import create_app_for_model

        self._client, path = cluster_router_client(topology)
        try:
            # the first start waits for every worker (a silent one is a wrong host address, a firewall or a key:
            # `up` fails saying which); a restart by Ray waits one heartbeat, then serves with the workers that
            # answered and uses the others once they answer (a worker may be gone with its machine for good)
            wait_s = topology.routing.heartbeat_s if self._restarted else max(10.0, 3 * topology.routing.dead_after_s)
            if not await self._client.wait_ready(wait_s) and not self._restarted:  # starts sockets and heartbeats
                silent = [w.spec.actor_name for w in self._client.workers if not w.alive]
                raise RuntimeError(f"no answer within {wait_s:.0f} s from {', '.join(silent)} (check the "
                                   "workers' host addresses, firewalls and CurveZMQ keys)")
            self._ready = True
            app = create_app_for_model(self._client, path, api_key, request_timeout_s, topology.router.max_body_bytes,
                                       aliases=topology.model.aliases)
            config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning",
                                    timeout_graceful_shutdown=5)
            self._server = uvicorn.Server(config)
            await self._server.serve()
        finally:
            self._served.set()  # the port is free again; what follows only releases sockets
            await self._client.close()

    def start(self, timeout_s: float = 300.0) -> dict:
        """Wait until uvicorn listens; returns {"endpoint": "http://host:port/v1", "pid"}.
        Raises RuntimeError with the cause if the router failed (port taken, bad model, ...)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._server is not None and self._server.started:
                return self.info()
            if not self._thread.is_alive():
                raise RuntimeError(f"the router failed to start: {self._error!r}")
            time.sleep(0.05)
        raise RuntimeError(f"the router did not listen within {timeout_s:.0f} s")

    def info(self) -> dict:
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            import ray

            host = ray.util.get_node_ip_address()
        healthy = bool(self._thread.is_alive() and self._ready and self._client.is_healthy())
        workers = {w["name"]: w["alive"] for w in self._client.worker_stats()} if self._ready else {}
        return {"endpoint": f"http://{host}:{self.port}/v1", "pid": os.getpid(), "healthy": healthy,
                "workers_alive": workers}

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving (uvicorn finishes open responses for up to 5 s) and wait until the port is free."""
        if self._server is not None:
            self._server.should_exit = True
        self._served.wait(timeout_s)
        self._thread.join(1.0)
