"""The Ray side of `ray_up.py`, run while connected: create the actors and wait for them
(`create_cluster`), read their state (`collect_status`) and remove them (`kill_namespace`)."""

from __future__ import annotations

import time
from typing import Optional

from cluster.launch.ray_up import (Connection, Echo, LaunchError, error_summary, group_placement_problems,
                                   missing_resources, namespace_actors, rank_actor_name, rank_actor_names,
                                   rank_options, router_actor_name, router_options, worker_options)
from cluster.topology import TopologySpec

_PROGRESS_EVERY_S = 15.0
_PASSED_ON = ("prefix_cache_hit_rate", "tokens_out", "kv_bytes_sent", "kv_bytes_received", "ttft_p50_s", "load_check",
              "pid")
_STATE_NAMES = {"ALIVE": "alive", "RESTARTING": "restarting", "DEAD": "dead", "PENDING_CREATION": "starting",
                "DEPENDENCIES_UNREADY": "starting"}


def create_cluster(topology: TopologySpec, conn: Connection, *, timeout_s: float, api_key: Optional[str],
                   echo: Echo, label: str = "") -> dict:
    """Create (or find) every worker actor, wait for all to be ready, then the router; see `ray_up.up`."""
    import ray

    from cluster.launch.actors import RankActor, RouterActor, WorkerActor
    from cluster.launch.platform import preload_env

    t0 = time.monotonic()
    deadline = t0 + timeout_s
    names = [w.actor_name for w in topology.workers] + rank_actor_names(topology) + [router_actor_name(topology)]
    before = namespace_actors(topology.namespace)
    if all(before.get(n, {}).get("state") == "ALIVE" for n in names):
        router = ray.get_actor(router_actor_name(topology))
        info = ray.get(router.info.remote(), timeout=30)
        echo(f"mlx-pd: {topology.name} is already up")
        for line in endpoint_lines(info["endpoint"], conn.dashboard, label or topology.name):
            echo(line)
        return {"namespace": topology.namespace, "endpoint": info["endpoint"], "dashboard": conn.dashboard,
                "address": conn.address, "workers": {}, "already_running": True}
    created = [n for n in names if before.get(n, {}).get("state") != "ALIVE"]
    local_ip = ray.util.get_node_ip_address()
    env = preload_env()
    options = {w.name: worker_options(topology, w, local_ip, env) for w in topology.workers}
    ranks = {(w.name, r): rank_options(topology, w, r, local_ip, env) for w in topology.workers
             if w.group is not None for r in range(1, len(w.group.ranks))}
    needed = [o["resources"] for o in [*options.values(), *ranks.values()]] + [
        router_options(topology, local_ip)["resources"]]
    missing = missing_resources(needed, ray.cluster_resources())
    if missing:
        raise LaunchError(f"no Ray node advertises {', '.join(missing)}: each machine must join with "
                          "`ray start --address=HEAD:6379 --resources='{\"NAME\": 1}'` (a `machine` of the "
                          "topology), and a worker without `machine` must use its node's IP as `host`")
    shared = group_placement_problems(topology, local_ip, _resource_nodes())
    if shared:
        raise LaunchError("a worker group's ranks must run on distinct machines:\n    " + "\n    ".join(shared))
    try:
        pending = {}
        for w in topology.workers:
            actor = ray.remote(WorkerActor).options(**options[w.name]).remote(topology.source, topology.name, w.name)
            pending[actor.ready.remote()] = (actor, w)
            for r in range(1, len(w.group.ranks) if w.group is not None else 1):
                follower = ray.remote(RankActor).options(**ranks[(w.name, r)]).remote(
                    topology.source, topology.name, w.name, r)
                pending[follower.ready.remote()] = (follower, _Rank(w, r))
        echo(f"mlx-pd: placing {len(pending)} worker(s) and rank(s): "
             f"{', '.join(w.actor_name for _, w in pending.values())}")
        ready = _wait_workers(pending, deadline, t0, echo)
        router = ray.remote(RouterActor).options(**router_options(topology, local_ip)).remote(
            topology.source, topology.name, api_key)
        info = _wait_ref(router.start.remote(timeout_s=max(1.0, deadline - time.monotonic())), deadline, "the router")
        _wait_health(info["endpoint"], deadline)
    except BaseException:
        kill_namespace(topology, 30.0, lambda line: None, only=created)
        raise
    echo(f"mlx-pd: {topology.name} is up in {time.monotonic() - t0:.1f} s")
    label = label or topology.name
    for line in endpoint_lines(info["endpoint"], conn.dashboard, label):
        echo(line)
    return {"namespace": topology.namespace, "endpoint": info["endpoint"], "dashboard": conn.dashboard,
            "address": conn.address, "workers": ready, "already_running": False}


class _Rank:
    """A following rank as `_wait_workers` names it (a worker's `actor_name`, `name`, `role`)."""

    def __init__(self, spec, rank: int):
        self.spec, self.rank = spec, rank
        self.actor_name = rank_actor_name(spec, rank)
        self.name = f"{spec.name}-rank{rank}"
        self.role = f"rank {rank} of {spec.name}"


def _resource_nodes() -> dict[str, set[str]]:
    """{resource name: ids of the live nodes that advertise it} of the connected cluster."""
    import ray

    out: dict[str, set[str]] = {}
    for node in ray.nodes():
        if node.get("Alive"):
            for name in node.get("Resources", {}):
                out.setdefault(name, set()).add(node["NodeID"])
    return out


def endpoint_lines(endpoint: str, dashboard: str, label: str) -> list[str]:
    """What `up` prints once the cluster serves: the OpenAI API, the router's live dashboard page, the Ray
    dashboard and how to get the token its login asks for, then the next commands."""
    from cluster.launch.ray_head import token_hint

    return [f"  OpenAI API:     {endpoint}",
            f"  Live dashboard: {endpoint.removesuffix('/v1')}/dashboard",
            f"  Ray dashboard:  {dashboard or '(not running)'}  (metrics: ray_mlx_pd_*; its login asks for Ray's "
            f"token: {token_hint()})",
            f"  then: mlx-pd status {label}  |  mlx-pd monitor {label} (Prometheus, Grafana)  |  mlx-pd down {label}"]


def _wait_workers(pending: dict, deadline: float, t0: float, echo: Echo) -> dict:
    """Wait for every `ready()` in `pending` ({ref: (actor, WorkerSpec)}); returns {name: ready info}."""
    import ray

    ready, last = {}, time.monotonic()
    while pending:
        left = deadline - time.monotonic()
        waiting = ", ".join(w.actor_name for _, w in pending.values())
        if left <= 0:
            raise LaunchError(f"timed out after {time.monotonic() - t0:.0f} s waiting for {waiting} (raise "
                              "--timeout, or see the actors' logs in the Ray dashboard)")
        done, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, 2.0))
        for ref in done:
            actor, w = pending.pop(ref)
            try:
                ready[w.name] = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:  # restarting: ask again
                time.sleep(1.0)
                pending[actor.ready.remote()] = (actor, w)
                continue
            except Exception as exc:
                raise LaunchError(f"worker {w.actor_name} failed to start:\n    {error_summary(exc)}") from None
            where = (f"at {ready[w.name]['host']}" if isinstance(w, _Rank) else
                     f"control {ready[w.name]['control']}")
            echo(f"mlx-pd: {w.actor_name} ready ({w.role}, {where}) after {time.monotonic() - t0:.1f} s")
        if pending and time.monotonic() - last > _PROGRESS_EVERY_S:
            last = time.monotonic()
            echo(f"mlx-pd: waiting for {waiting} ({time.monotonic() - t0:.0f} s)")
    return ready


def _wait_ref(ref, deadline: float, what: str):
    import ray

    try:
        return ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
    except ray.exceptions.GetTimeoutError:
        raise LaunchError(f"{what} did not start in time (raise --timeout)") from None
    except Exception as exc:
        raise LaunchError(f"{what} failed to start:\n    {error_summary(exc)}") from None


def _wait_health(endpoint: str, deadline: float) -> None:
    import urllib.error
    import urllib.request

    url = endpoint.removesuffix("/v1") + "/health"
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5.0) as r:
                if r.status == 200:
                    return
                last = f"HTTP {r.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}: {exc.read()[:200].decode(errors='replace')}"
        except OSError as exc:
            last = str(exc) or type(exc).__name__
        time.sleep(0.5)
    raise LaunchError(f"the router at {url} did not become healthy in time ({last})")


def collect_status(topology: TopologySpec, actors: dict[str, dict], timeout_s: float, dashboard: str) -> list[dict]:
    """Rows for `ray_up.status`: Ray's actor state combined with each actor's own report."""
    import ray

    rows, refs = [], {}
    router_name = router_actor_name(topology)
    specs = [(router_name, "router", "router", topology.router.host)] + [
        (w.actor_name, w.name, w.role, w.host) for w in topology.workers]
    for actor_name, name, role, host in specs:
        record = actors.get(actor_name)
        state = _STATE_NAMES.get(record["state"], record["state"].lower()) if record else "absent"
        row = {"actor": actor_name, "name": name, "role": role, "host": host, "state": state}
        if role == "router":
            row["dashboard"] = dashboard
        if state == "alive":
            handle = ray.get_actor(actor_name)
            refs[actor_name] = (handle.info if role == "router" else handle.stats).remote()
        rows.append(row)
    for row in rows:
        ref = refs.get(row["actor"])
        if ref is None:
            continue
        try:
            report = ray.get(ref, timeout=timeout_s)
        except Exception as exc:
            row.update(state="unhealthy", error=error_summary(exc, 2))
            continue
        if not report.get("healthy", True):
            row["state"] = "unhealthy"
        if row["role"] == "router":
            row["endpoint"] = report.get("endpoint")
            seen = report.get("workers_alive") or {}
            for other in rows:  # alive for Ray but silent to the router: network, host or keys
                if other["role"] != "router" and seen.get(other["name"]) is False and other["state"] == "alive":
                    other["state"] = "unreachable"
            continue
        total, free = report.get("kv_blocks_total"), report.get("kv_blocks_free")
        row.update(running=report.get("num_running"), waiting=report.get("num_waiting"), kv_blocks_total=total,
                   kv_blocks_free=free, kv_blocks_used=(total - free) if None not in (total, free) else None,
                   **{k: report.get(k) for k in _PASSED_ON if k in report})
        row["_ranks"] = report.get("ranks")
    by_name = {row["name"]: row for row in rows}
    own = {}  # each live rank actor's own report (`RankActor.stats`), None when it did not answer
    names = [n for n in rank_actor_names(topology) if actors.get(n, {}).get("state") == "ALIVE"]
    rank_refs = {n: ray.get_actor(n).stats.remote() for n in names}
    for name, ref in rank_refs.items():
        try:
            own[name] = ray.get(ref, timeout=timeout_s)
        except Exception:
            own[name] = None
    for w in topology.workers:
        if w.group is not None:
            row = by_name[w.name]
            row.update(parallel=w.group.parallel, ranks=group_ranks(w, row, actors, row.pop("_ranks", None), own))
    for row in rows:
        row.pop("_ranks", None)
    return rows


def group_ranks(spec, row: dict, actors: dict[str, dict], reported: Optional[list],
                own: Optional[dict] = None) -> list[dict]:
    """A group worker's `ranks` in its status row (see `ray_up.status`): the topology's ranks, each with its
    actor's state ("unhealthy" when a live rank actor did not answer or no longer follows), its "pid" and,
    when the leader answered, what it reported of the rank (`WorkerStats.ranks`). `own`: {rank actor name: its
    `RankActor.stats()`, None when it did not answer}."""
    reported = {k["rank"]: k for k in reported or []}
    out = []
    for r, address in enumerate(spec.group.ranks):
        if r == 0:
            actor, state, pid = spec.actor_name, row["state"], row.get("pid")
        else:
            actor = rank_actor_name(spec, r)
            record = actors.get(actor)
            state = _STATE_NAMES.get(record["state"], record["state"].lower()) if record else "absent"
            report = (own or {}).get(actor, {})
            pid = (report or {}).get("pid")
            if state == "alive" and (report is None or not report.get("healthy", True)):
                state = "unhealthy"
        k = reported.get(r, {})
        out.append({"rank": r, "host": address.host, "actor": actor, "state": state, "pid": pid,
                    "alive": k.get("alive"),
                    **{f: k.get(f) for f in ("parameter_bytes", "kv_bytes", "peak_bytes", "step_bytes")}})
    return out


def kill_namespace(topology: TopologySpec, timeout_s: float, echo: Echo, only: Optional[list[str]] = None) -> list[str]:
    """Stop (gracefully, then `ray.kill` without restart) the router, then every worker, then any other live
    actor of the namespace; wait until none is left. `only` limits it to those actor names."""
    import ray

    actors = namespace_actors(topology.namespace)
    order = [router_actor_name(topology)] + [name for w in topology.workers for name in (
        w.actor_name, *(rank_actor_name(w, r) for r in range(1, len(w.group.ranks) if w.group else 1)))]
    order += sorted(n for n in actors if n not in order)
    names = [n for n in order if actors.get(n, {}).get("state", "DEAD") != "DEAD" and (only is None or n in only)]
    handles = {}
    for name in names:
        try:
            handles[name] = ray.get_actor(name)
        except ValueError:
            continue
    for name, handle in handles.items():  # the router first, so it never sees its workers vanish mid-request
        try:
            ray.get(handle.stop.remote(), timeout=15)
        except Exception:  # dead, restarting or stuck: ray.kill below ends it anyway
            pass
        ray.kill(handle, no_restart=True)
        echo(f"mlx-pd: stopped {name}")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        live = [n for n, a in namespace_actors(topology.namespace).items() if a["state"] != "DEAD" and n in handles]
        if not live:
            break
        time.sleep(0.5)
    else:
        raise LaunchError(f"actors still alive after {timeout_s:.0f} s: {', '.join(live)}")
    return list(handles)
