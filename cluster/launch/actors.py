"""What runs inside the Ray actors of cluster mode: one `WorkerActor` per `[[workers]]` entry, one `RankActor` per
following rank of a worker that is a group (`[workers.group]`; the worker's own actor is its rank 0) and one
`RouterActor` (the OpenAI API). `ray_driver.py` wraps these plain classes with `ray.remote`.

Both take the topology as TOML text (`TopologySpec.source`), so every process parses the same file.
A worker actor does all its work in its constructor (pin CPUs, load the model, bind the sockets, start the
loop thread), so when Ray restarts a dead actor (`max_restarts`) the new process comes up the same way.
It exports its `Worker.stats()` as Ray metrics every `METRICS_INTERVAL_S` (see `metric_values`), under the
names of the stats' metric table (cluster/stats_metrics.py, the names the router's `/metrics` uses), which the
Ray dashboard and its Prometheus endpoint show as `ray_mlx_pd_*`, tagged `worker` and `role`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Optional

from cluster.stats import EngineStats
from cluster.stats_metrics import GROUP_LABEL, GROUP_METRICS, METRICS, samples
from cluster.topology import TopologySpec, parse_topology

logger = logging.getLogger(__name__)
METRICS_INTERVAL_S = 2.0


def metric_values(stats: EngineStats, prev: Optional[dict]) -> tuple[list, list, dict]:
    """(gauges, counter increments, counter values) from a `Worker.stats()` report, through the metric table
    (cluster/stats_metrics.py): gauges and increments are lists of (MetricSpec, labels, value).

    `prev` is the counter values of the previous call (None at first: counters then count from zero), keyed
    by (metric name, labels as a sorted tuple); pass the third item back next time. Increments are never
    negative.

    >>> from cluster.stats import KVGroupStats, WorkerStats
    >>> g, c, seen = metric_values(WorkerStats(tokens_out=30, kv_groups=(KVGroupStats("full", 10, 7),)), None)
    >>> [(labels, v) for s, labels, v in g if s.name == "mlx_pd_kv_group_blocks_used"]
    [({'group': 'full'}, 3.0)]
    >>> {s.name: v for s, _, v in c}["mlx_pd_output_tokens"]
    30.0
    >>> _, c, _ = metric_values(WorkerStats(tokens_out=50), seen)
    >>> {s.name: v for s, _, v in c}["mlx_pd_output_tokens"]
    20.0
    """
    gauges, increments, values = [], [], {}
    for spec, labels, value in samples(stats):
        if spec.kind == "gauge":
            gauges.append((spec, labels, value))
            continue
        key = (spec.name, tuple(sorted(labels.items())))
        values[key] = value
        increments.append((spec, labels, max(0.0, value - (prev or {}).get(key, 0.0))))
    return gauges, increments, values


class MetricsExporter:
    """A daemon thread that turns `stats_fn()` (a `WorkerStats`) into Ray metrics every `interval_s`, one per
    entry of the metric table, tagged worker/role (and `group` for the KV cache group figures)."""

    def __init__(self, stats_fn, worker: str, role: str, interval_s: float = METRICS_INTERVAL_S):
        from ray.util.metrics import Counter, Gauge

        keys = ("worker", "role")
        self._tags = {"worker": worker, "role": role}
        self._metrics = {}
        for spec in (*METRICS, *GROUP_METRICS):
            tag_keys = keys + ((GROUP_LABEL,) if spec in GROUP_METRICS else ())
            kind = Counter if spec.kind == "counter" else Gauge
            self._metrics[spec.name] = kind(spec.name, description=spec.help, tag_keys=tag_keys)
        self._stats_fn, self._interval_s = stats_fn, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"metrics-{worker}", daemon=True)

    def start(self) -> "MetricsExporter":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def export(self, prev: Optional[dict]) -> dict:
        """Export one report of `stats_fn()`; `prev` and the return value are `metric_values`' counter values."""
        gauges, increments, values = metric_values(self._stats_fn(), prev)
        for spec, labels, value in gauges:
            self._metrics[spec.name].set(value, tags={**self._tags, **labels})
        for spec, labels, value in increments:
            if value > 0:
                self._metrics[spec.name].inc(value, tags={**self._tags, **labels})
        return values

    def _run(self) -> None:
        prev = None
        while not self._stop.wait(self._interval_s if prev is not None else 0.0):
            try:
                prev = self.export(prev)
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
        """The worker's report as JSON (`WorkerStats.report`) plus the actor's "pid"."""
        return {**self.worker.stats().report(), "pid": os.getpid()}

    def stop(self) -> None:
        self.exporter.stop()
        self.worker.stop()


class RankActor:
    """Following rank `rank` (1..N-1) of worker `worker_name`'s group, in a Ray actor of its own on the node of
    that rank (ray_up.py places it by the rank's `machine`, else its `host`): `cluster.parallel.rank.follow` on a
    thread of this actor's process, so its methods answer while it follows. The rank binds its collective, step
    and heartbeat sockets on its `host` from the topology (the ring's hostfile lists each rank's host), never
    on whatever interface comes first.

    The process is the rank: when its group breaks (the leader silent past the deadline, or restarted) the
    heartbeat ends the process with exit status 75, and a failure while following ends it too, so Ray restarts
    the actor (`[ray] max_restarts`) and its constructor follows again on the same ports while the leader's
    worker actor, ended the same way, comes back beside it. A failure before the rank ever started (a model its
    heads cannot split, say) stays in the actor for `ready()` to raise, unless Ray restarted it (then it ends
    the process, for another try). A normal `Stop` from the leader leaves the actor idle until it is killed."""

    def __init__(self, topology_text: str, topology_name: str, worker_name: str, rank: int):
        from cluster.launch.platform import pin_cpus

        topology = parse_topology(topology_text, name=topology_name)
        self.spec = topology.worker(worker_name)
        group = self.spec.group
        if group is None or not 0 < rank < len(group.ranks):
            raise ValueError(f"{worker_name} has no following rank {rank}")
        if self.spec.cpu_affinity:
            pin_cpus(self.spec.cpu_affinity)
        self.rank, self.address = rank, group.ranks[rank]
        self.plan = group.plan(topology.model.source, topology.model.served_name, self.spec.engine)
        self.state = "starting"  # then "following", "stopped" (the leader ended the group) or "failed"
        self.error: Optional[BaseException] = None
        self.started_at = time.time()
        self._restarted = _restarted_by_ray()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._follow, name=f"rank{rank}-{worker_name}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"RankActor({self.spec.name} rank {self.rank})"

    def _follow(self) -> None:
        from cluster.parallel.heartbeat import LOST_EXIT_CODE
        from cluster.parallel.rank import follow

        try:
            follow(self.plan, self.rank, on_started=self._on_started)
            self.state = "stopped"
        except BaseException as exc:  # noqa: BLE001 - reported by ready(), or the process ends
            logger.exception("%s: rank %d failed", self.spec.name, self.rank)
            if self._started.is_set() or self._restarted:
                logging.shutdown()
                os._exit(LOST_EXIT_CODE)
            self.state, self.error = "failed", exc
            self._started.set()

    def _on_started(self, started) -> None:
        self.state = "following"
        self._started.set()

    def ready(self, timeout_s: float = 600.0) -> dict:
        """{"name", "rank", "host", "pid", "started_at"} once the rank has joined its group and built its engine
        (the leader's worker actor is ready at the same time). Raises the rank's own failure, or TimeoutError."""
        if not self._started.wait(timeout_s):
            raise TimeoutError(f"rank {self.rank} of {self.spec.name} did not join its group within {timeout_s:.0f} s")
        if self.error is not None:
            raise RuntimeError(f"rank {self.rank} of {self.spec.name} failed to start: {self.error}")
        return {"name": self.spec.name, "rank": self.rank, "host": self.address.host, "pid": os.getpid(),
                "started_at": self.started_at}

    def stats(self) -> dict:
        """{"rank", "host", "state", "healthy", "pid"}: what the actor knows of itself (its memory and liveness in
        the group are in the leader's report, `WorkerStats.ranks`)."""
        return {"rank": self.rank, "host": self.address.host, "state": self.state,
                "healthy": self.state in ("starting", "following"), "pid": os.getpid()}

    def stop(self) -> None:
        """Nothing to do: the leader's `Stop` ends the rank's loop, Ray's kill its process."""


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
