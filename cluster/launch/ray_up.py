"""Cluster mode on Ray: `up`, `status` and `down` of a topology (`mlx-pd up|status|down TOPOLOGY`).

`up` connects to Ray (for `[ray] address = "local"` it first starts a local head, see
`ray_head.py`, token authentication on; every Ray call goes to that address, never to Ray's record of the last
`ray start`, see `ray_address.py`), places one detached actor per `[[workers]]` entry
(`actors.WorkerActor`, named `spec.actor_name`, in the namespace `topology.namespace`),
waits until every worker has loaded its model and bound its sockets, then starts the router actor (the
OpenAI API over ZeroMQ) and waits for its `/health`. It returns while everything keeps running.

Placement: a worker with `machine = "NAME"` asks for a sliver (`RESOURCE_UNIT`) of the custom resource
NAME, which exactly one Mac advertises (`ray start ... --resources='{"NAME": 1}'`); without `machine`, a
worker (and the router) is placed on the node whose IP is its `host`, and a loopback host means the machine
running `mlx-pd up`. Actors ask for no CPUs (`num_cpus=0`), so a 2-core machine fits three of them; Ray
restarts a dead one up to `[ray] max_restarts` times, and its constructor loads and binds again.

Worker groups (`[workers.group]`): the worker's actor is rank 0, and each following rank is an actor of its own
(`actors.RankActor`, named `rank_actor_name`), placed the same way by the rank's own `machine`, else its `host`:
each rank must run on the node that owns its `host` address, since its collective binds there. (A placement
group with STRICT_SPREAD would put the ranks on distinct nodes, but of Ray's choosing, not on the ones that
own the ranks' addresses.) So the ranks of one group land on distinct nodes when they name distinct machines
(or hosts): `group_placement_problems` refuses, before anything starts, ranks of one group that would share a
node, except a group whose ranks are all on loopback (one machine, for trying a group out). When a rank dies,
the group's heartbeats end the others (exit status 75), Ray restarts each actor, and they re-form the group on
the same ports (cluster/parallel/rank.py); the router uses the worker again once it answers.

Only the modules of `cluster/launch/` import `ray` (DESIGN §3); the Ray calls made while connected are in
`ray_driver.py`.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from cluster.launch import ray_address, ray_head
from cluster.stats import LoadCheckReport
from cluster.topology import TopologySpec, WorkerSpec, load_topology
from cluster.transport import is_loopback

RESOURCE_UNIT = 0.01  # of a machine resource per actor: up to 100 actors on one Mac
DEFAULT_TIMEOUT_S = 600.0
_ALIVE, _GONE = "ALIVE", "DEAD"
Echo = Callable[[str], None]


class LaunchError(RuntimeError):
    """`up`, `status` or `down` cannot do what was asked; the message says why and what to do."""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def router_actor_name(topology: TopologySpec) -> str:
    return f"router@{topology.router.host}"


def placement_resources(host: str, machine: Optional[str], local_ip: str) -> dict[str, float]:
    """The Ray resources that pin an actor: its machine's custom resource, else the node of its host IP
    (a loopback or wildcard host means this machine, `local_ip`)."""
    if machine:
        return {machine: RESOURCE_UNIT}
    if host in ("", "0.0.0.0", "::", "localhost") or is_loopback(host):
        host = local_ip
    return {f"node:{host}": RESOURCE_UNIT}


def worker_options(topology: TopologySpec, spec: WorkerSpec, local_ip: str, env: dict[str, str]) -> dict:
    """The `.options(...)` of the worker's actor (pure; see the module docstring for the choices)."""
    options = {"name": spec.actor_name, "namespace": topology.namespace, "lifetime": "detached",
               "get_if_exists": True, "num_cpus": 0,
               "resources": placement_resources(spec.host, spec.machine, local_ip),
               "max_restarts": topology.ray.max_restarts,
               "max_task_retries": 0}  # a call during a restart fails at once (callers retry) rather than
    # blocking `status`, and Ray prints no retry tracebacks to the terminal
    if env:
        options["runtime_env"] = {"env_vars": dict(env)}
    return options


def rank_actor_name(spec: WorkerSpec, rank: int) -> str:
    """The readable name of following rank `rank`'s actor, e.g. "decode-0-rank1@mac-mini-2"."""
    address = spec.group.ranks[rank]
    return f"{spec.name}-rank{rank}@{address.machine or address.host}"


def rank_actor_names(topology: TopologySpec) -> list[str]:
    """Every following rank's actor name, worker by worker."""
    return [rank_actor_name(w, r) for w in topology.workers if w.group is not None
            for r in range(1, len(w.group.ranks))]


def rank_options(topology: TopologySpec, spec: WorkerSpec, rank: int, local_ip: str, env: dict[str, str]) -> dict:
    """The `.options(...)` of following rank `rank`'s actor: placed by the rank's machine or host, restarted as
    a worker's; a few methods at once (`ready` waits while `stats` answers)."""
    address = spec.group.ranks[rank]
    options = {"name": rank_actor_name(spec, rank), "namespace": topology.namespace, "lifetime": "detached",
               "get_if_exists": True, "num_cpus": 0, "max_concurrency": 4,
               "resources": placement_resources(address.host, address.machine, local_ip),
               "max_restarts": topology.ray.max_restarts, "max_task_retries": 0}
    if env:
        options["runtime_env"] = {"env_vars": dict(env)}
    return options


def group_placement_problems(topology: TopologySpec, local_ip: str,
                             nodes: Optional[dict[str, set[str]]] = None) -> list[str]:
    """One line per pair of ranks of a group that would share a node, so that a group's ranks each get a machine
    of their own: the same placement resource, or (given `nodes`, {resource name: ids of the nodes that advertise
    it}, from the connected cluster) two resources that one and the same node alone advertises. A group whose
    ranks are all on loopback hosts is one machine's by design, and passes."""
    def node_of(name: str) -> str:
        owners = (nodes or {}).get(name, set())
        return f"node {next(iter(owners))}" if len(owners) == 1 else name

    problems = []
    for w in topology.workers:
        if w.group is None or all(is_loopback(r.host) for r in w.group.ranks):
            continue
        where = [placement_resources(w.host, w.machine, local_ip)] + [
            placement_resources(r.host, r.machine, local_ip) for r in w.group.ranks[1:]]
        seen: dict[str, int] = {}
        for rank, resources in enumerate(where):
            (name,) = resources
            name = node_of(name)
            if name in seen:
                problems.append(f"{w.name}: ranks {seen[name]} and {rank} would share a node ({name}): give each "
                                "rank of a group a machine of its own (its `machine`, or a `host` on another node)")
            seen.setdefault(name, rank)
    return problems


def router_options(topology: TopologySpec, local_ip: str) -> dict:
    return {"name": router_actor_name(topology), "namespace": topology.namespace, "lifetime": "detached",
            "get_if_exists": True, "num_cpus": 0, "max_restarts": topology.ray.max_restarts,
            "resources": placement_resources(topology.router.host, None, local_ip)}


def missing_resources(needed: list[dict[str, float]], available: dict[str, float]) -> list[str]:
    """Resource names some actor needs that no node of the cluster advertises."""
    return sorted({name for res in needed for name in res if name not in available})


@dataclass(frozen=True)
class Connection:
    """A driver connection: GCS `address`, `dashboard` URL, `head` if it is our local head, and the Ray
    session folder on this machine (where the head's dashboard writes Prometheus's service-discovery file)."""

    address: str
    dashboard: str
    head: Optional[ray_head.LocalHead] = None
    started_head: bool = False
    session_dir: str = ""


def load_cluster_topology(topology_path: str) -> TopologySpec:
    """The topology at `topology_path` (a file or a shipped name); LaunchError for a single-node one."""
    topology = load_topology(topology_path)
    if not topology.workers:
        raise LaunchError(f"topology {topology.name!r} has no [[workers]]: it is a single-node topology, "
                          f"run it with `mlx-pd serve --topology {topology_path}`")
    return topology


def _connect(topology: TopologySpec, state_dir: Path, start: bool, echo: Echo) -> Optional[Connection]:
    """ray.init into the topology's namespace; None when a local head is not running and `start` is False."""
    from cluster.launch.platform import preload_env

    head, started = None, False
    address = topology.ray.address
    if address == "local":
        head = ray_head.read_head(state_dir)
        if head is None:
            if not start:
                return None
            t0 = time.monotonic()
            echo("mlx-pd: starting a local Ray head (token authentication on) ...")
            try:
                head = ray_head.start_head(state_dir, preload_env())
            except (RuntimeError, OSError, ValueError) as exc:
                raise LaunchError(str(exc)) from None
            started = True
            echo(f"mlx-pd: Ray head at {head.address} up in {time.monotonic() - t0:.1f} s")
        address = head.address
    try:  # never Ray's record of the last `ray start` (ray_address.py), and one line if nothing answers
        address = ray_address.resolve(address)
        ray_address.check_reachable(address)
    except ConnectionError as exc:
        raise LaunchError(str(exc)) from None
    ray_head.enable_token_auth()
    import ray

    try:
        ctx = ray.init(address=address, namespace=topology.namespace, log_to_driver=False,
                       logging_level=logging.WARNING, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise LaunchError(f"cannot connect to Ray at {address}: {first} (is RAY_AUTH_MODE=token set there, "
                          "with the cluster's token in ~/.ray/auth_token or RAY_AUTH_TOKEN?)") from None
    url = getattr(ctx, "dashboard_url", "") or (head.dashboard if head else "")
    dashboard = url if not url or url.startswith("http") else f"http://{url}"
    return Connection(address=address, dashboard=dashboard, head=head, started_head=started,
                      session_dir=str(ctx.address_info.get("session_dir") or ""))


def namespace_actors(namespace: str) -> dict[str, dict]:
    """The namespace's actors by name (the most alive record of each), from Ray's state API on the cluster this
    process is connected to."""
    from ray.util.state import list_actors

    rank = {"ALIVE": 0, "RESTARTING": 1, "PENDING_CREATION": 2, "DEPENDENCIES_UNREADY": 3, "DEAD": 9}
    best: dict[str, dict] = {}
    with ray_address.connected_state_api() as address:
        records = list_actors(address=address, filters=[("ray_namespace", "=", namespace)], limit=10_000,
                              raise_on_missing_output=False)
    for a in records:
        a = a if isinstance(a, dict) else a.__dict__
        name = a.get("name") or ""
        if name and (name not in best or rank.get(a["state"], 5) < rank.get(best[name]["state"], 5)):
            best[name] = a
    return best


def error_summary(exc: BaseException, lines: int = 3) -> str:
    """The message lines of a Ray error (its traceback's frames dropped): what a user needs to see."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # Ray colours actor names
    text = [ln for ln in plain.splitlines() if ln.strip() and not ln[:1].isspace() and
            not ln.startswith("Traceback")]
    return "\n    ".join(text[-lines:]) or type(exc).__name__


def up(topology_path: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, api_key: Optional[str] = None,
       state_dir: Optional[Path] = None, echo: Echo = _stderr) -> dict:
    """Start the topology's workers and router on Ray and wait until it serves (see the module docstring).

    Returns {"namespace", "endpoint" (http://host:port/v1), "dashboard", "address", "workers": {name: info},
    "already_running"}. Raises LaunchError (Ray unreachable, a resource nobody advertises, a worker that
    failed to start: its error) after removing what this call started; ValueError/FileNotFoundError for a
    bad topology.
    """
    from cluster.launch.ray_driver import create_cluster

    topology = load_cluster_topology(topology_path)
    if not api_key and not is_loopback(topology.router.host):
        echo(f"mlx-pd: warning: the router listens on {topology.router.host} without an API key, so anyone on "
             "that network can use it: pass --api-key or set MLX_PD_API_KEY")
    state_dir = Path(state_dir or ray_head.default_state_dir())
    conn = _connect(topology, state_dir, start=True, echo=echo)
    try:
        info = create_cluster(topology, conn, timeout_s=timeout_s, api_key=api_key, echo=echo, label=topology_path)
    except BaseException:
        if conn.started_head:
            _shutdown()
            ray_head.stop_head(state_dir, conn.head)
        raise
    finally:
        _shutdown()
    if conn.head is not None and topology.namespace not in conn.head.namespaces:
        ray_head.write_head(state_dir, ray_head.LocalHead(
            **{**conn.head.__dict__, "namespaces": (*conn.head.namespaces, topology.namespace)}))
    return info


def _shutdown() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def status(topology_path: str, *, state_dir: Optional[Path] = None, timeout_s: float = 10.0) -> list[dict]:
    """One row per worker plus one for the router: {"actor", "name", "role", "host", "state", ...}.

    `state` is "alive", "unhealthy" (the actor lives but its loop or engine does not), "starting",
    "restarting", "dead", "absent" (no such actor) or "stopped" (the local Ray head is not running).
    Worker rows add running, waiting, kv_blocks_used/free/total, prefix_cache_hit_rate and load_check (the
    worker's `LoadCheckReport.report()` map, None when its engine ran none; absent when the worker did not
    answer); a worker that is a group adds `parallel` and `ranks`, one map per rank: rank, host, actor (rank 0:
    the worker's own), state (its actor's, as above), pid, alive (its heartbeat as the leader last heard it;
    None when the leader did not answer) and parameter_bytes, kv_bytes, peak_bytes, step_bytes (`RankStats`); the
    router row adds its endpoint. Nothing secret is included.
    """
    from cluster.launch.ray_driver import collect_status

    topology = load_cluster_topology(topology_path)
    state_dir = Path(state_dir or ray_head.default_state_dir())
    conn = _connect(topology, state_dir, start=False, echo=_stderr)
    if conn is None:
        return [{"actor": router_actor_name(topology), "name": "router", "role": "router",
                 "host": topology.router.host, "state": "stopped"}] + [
            {"actor": w.actor_name, "name": w.name, "role": w.role, "host": w.host, "state": "stopped"}
            for w in topology.workers]
    try:
        return collect_status(topology, namespace_actors(topology.namespace), timeout_s, conn.dashboard)
    finally:
        _shutdown()


def down(topology_path: str, *, state_dir: Optional[Path] = None, echo: Echo = _stderr,
         timeout_s: float = 60.0) -> dict:
    """Stop the router and the workers of the topology's namespace; for `address = "local"` also stop the
    local Ray head once no topology uses it. Returns {"stopped": [actor names], "head_stopped": bool}."""
    from cluster.launch.ray_driver import kill_namespace

    topology = load_cluster_topology(topology_path)
    state_dir = Path(state_dir or ray_head.default_state_dir())
    conn = _connect(topology, state_dir, start=False, echo=echo)
    if conn is None:
        echo(f"mlx-pd: {topology.name} is not running (no local Ray head of mlx-pd)")
        return {"stopped": [], "head_stopped": False}
    try:
        stopped = kill_namespace(topology, timeout_s, echo)
    finally:
        _shutdown()
    head_stopped = False
    if conn.head is not None:
        left = tuple(ns for ns in conn.head.namespaces if ns != topology.namespace)
        if left:
            ray_head.write_head(state_dir, ray_head.LocalHead(**{**conn.head.__dict__, "namespaces": left}))
            echo(f"mlx-pd: the local Ray head stays up for {', '.join(left)}")
        else:
            head_stopped = ray_head.stop_head(state_dir, conn.head)
            echo("mlx-pd: stopped the local Ray head" if head_stopped else
                 f"mlx-pd: the local Ray head (pid {conn.head.pid}) did not stop; see {conn.head.log}")
    return {"stopped": stopped, "head_stopped": head_stopped}


def ray_session_dir(topology: TopologySpec, state_dir: Optional[Path] = None) -> Optional[str]:
    """The Ray session folder of the topology's cluster on this machine; None when its local head (`address =
    "local"`) is not running. Raises LaunchError when Ray cannot be reached."""
    conn = _connect(topology, Path(state_dir or ray_head.default_state_dir()), start=False, echo=_stderr)
    _shutdown()
    return None if conn is None else conn.session_dir


def format_status(rows: list[dict]) -> str:
    """The `mlx-pd status` table (pure): a line per worker, then a line per worker saying its load check
    (`load_check_line`), then the router's endpoint and process layout (`cluster_layout`) and the Ray dashboard."""
    head = ("ACTOR", "ROLE", "HOST", "STATE", "RUNNING", "WAITING", "KV USED/FREE", "PREFIX HIT")
    lines = [head]
    for r in rows:
        if r["role"] == "router":
            continue
        kv = f"{r['kv_blocks_used']}/{r['kv_blocks_free']}" if r.get("kv_blocks_free") is not None else "-"
        hit = f"{r['prefix_cache_hit_rate']:.1%}" if r.get("prefix_cache_hit_rate") is not None else "-"
        lines.append((r["actor"], r["role"], r["host"], r["state"], _cell(r.get("running")),
                      _cell(r.get("waiting")), kv, hit))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    text = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    text += [f"{r['actor']}: {load_check_line(r)}" for r in rows if r["role"] != "router"]
    for r in rows:
        if r.get("ranks"):
            text.append(f"{r['actor']}: a {r.get('parallel') or 'tensor'}-parallel group of {len(r['ranks'])} ranks")
            text += [f"  {line}" for line in rank_lines(r["ranks"])]
    for r in rows:
        if r["role"] == "router":
            where = r.get("endpoint") or f"http://{r['host']}:?/v1"
            text.append(f"router {r['actor']}: {r['state']}, OpenAI API at {where}, layout {cluster_layout(rows)}")
            if r.get("dashboard"):
                text.append(f"Ray dashboard: {r['dashboard']}")
    return "\n".join(text)


def cluster_layout(rows: list[dict]) -> str:
    """The process layout a status table shows for a topology's router, e.g. "cluster (router + 1 prefill, 2
    decode worker processes)" (`mlx-pd serve`'s layouts, one-process and split, are in its `GET /v1/models`)."""
    roles = [r["role"] for r in rows if r["role"] != "router"]
    counts = ", ".join(f"{roles.count(role)} {role}" for role in ("prefill", "decode") if role in roles)
    return f"cluster (router + {counts or 'no'} worker process{'es' if len(roles) != 1 else ''})"


def rank_lines(ranks: list[dict]) -> list[str]:
    """A group worker's ranks in `mlx-pd status` (pure), one line each: where it runs, its actor's Ray state, its
    liveness in the group (its heartbeat, as the leader last heard it) and its memory, e.g.
    "rank 1  10.77.0.12  decode-0-rank1@mac-mini-2 alive  in group: alive  weights 1.2 MiB, KV 4.0 MiB, peak
    9.0 MiB, steps 12.3 KiB"."""
    def mib(n) -> str:
        return "-" if n is None else f"{n / 2**20:.1f} MiB"

    lines = []
    for k in ranks:
        alive = {True: "alive", False: "silent", None: "unknown"}[k.get("alive")]
        memory = (f"weights {mib(k.get('parameter_bytes'))}, KV {mib(k.get('kv_bytes'))}, peak "
                  f"{mib(k.get('peak_bytes'))}, steps {(k.get('step_bytes') or 0) / 2**10:.1f} KiB")
        lines.append(f"rank {k['rank']}  {k['host']}  {k.get('actor') or '-'} {k.get('state') or '-'}  "
                     f"in group: {alive}  {memory}")
    return lines


def load_check_line(row: dict) -> str:
    """What a worker's status row says of its load check: the worker's log line of it (`LoadCheckReport.summary`:
    "load check passed for llama in 1.2 s: CHECK; CHECK; ..." or "load check skipped for llama (...)"),
    "load check not run" (its engine was built without one) or "load check unknown" (the worker did not answer)."""
    if "load_check" not in row:
        return "load check unknown (no report)"
    if row["load_check"] is None:
        return "load check not run"
    check = row["load_check"]
    return LoadCheckReport(check["model_type"], tuple(check["passed"]), check["seconds"], check["skipped"]).summary()


def _cell(value) -> str:
    return "-" if value is None else str(value)
