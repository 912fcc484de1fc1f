"""Topology files (`topologies/*.toml`) -> a validated `TopologySpec`.

Single-node form (what `mlx-pd serve --topology FILE` reads; `topologies/single-node.toml` is the default):

    [model]
    source = "SmolLM2-135M-Instruct"   # a folder, a .gguf file or a repo id (cluster.model.resolve_model_path)
    served_name = "SmolLM2-135M-Instruct"
    aliases = ["claude-*", "gpt-5*"]     # more names clients may use (globs allowed; see ModelSection)

    [engine]                             # any field of cluster.config.EngineConfig
    kv_cache_gb = 1.0
    kv_bits = 8

    [router]
    host = "127.0.0.1"
    port = 8000

Cluster form (`mlx-pd up FILE`; see topologies/local-1p1d.toml and lab-example.toml): the same tables plus

    [transfer]                           # any field of cluster.config.TransferConfig
    timeout_s = 30
    [routing]                            # RoutingSection
    policy = "prefix_aware"
    [security]
    curve_keys_dir = "~/.config/mlx-pd/keys"   # from `mlx-pd keys DIR`; every cluster socket then needs them
    [ray]
    address = "local"                    # start a Ray head here; or "auto" / "HOST:6379" to join one
    [[workers]]
    name = "prefill-0"
    role = "prefill"                     # or "decode"
    machine = "mac-studio-1"             # a Ray custom resource that node advertises (ray start --resources)
    host = "127.0.0.1"                   # the address it binds and the others reach it at
    control_port = 5601
    [workers.engine]                     # overrides of [engine] for this worker (not the KV format)
    kv_cache_gb = 4
    [workers.group]                      # optional: the worker is a group of ranks (WorkerGroup)
    parallel = "tensor"                  # or "pipeline" (each rank a range of whole layers)
    backend = "ring"                     # or "jaccl" (RDMA over Thunderbolt 5, macOS 26.2+)
    ranks = [{ host = "127.0.0.1", ring_port = 5610, step_port = 5611, heartbeat_port = 5612 },
             { host = "10.0.0.3", ring_port = 5610, step_port = 5611, heartbeat_port = 5612,
               machine = "mac-studio-2" }]   # optional: the Ray resource of the rank's node (as a worker's)
    heartbeat_s = 0.5                    # a beat every 0.5 s; a rank silent for deadline_s ends the group
    deadline_s = 10.0

Every unknown table or key is an error that names it and the file, so a typo never silently falls back to
a default. The KV format (dtype, kv_bits, kv_group_size, block_size) must be the same on every worker: a
mismatch is an error at load time, before anything starts.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from cluster.config import EngineConfig, TransferConfig
from cluster.parallel.spec import GroupPlan, RankAddress

TOPOLOGY_DIR = Path(__file__).resolve().parent.parent / "topologies"


@dataclass(frozen=True)
class ModelSection:
    """`[model]`: what to load, the name clients use, and `aliases`: more names the model answers to (as vLLM's
    `--served-model-name` takes several), each a name or a shell-style glob (`claude-*`), so agent clients that
    send their own default model ids (Claude Code's `claude-...`, Codex's `gpt-5...`) work unconfigured."""

    source: Optional[str] = None
    served_name: Optional[str] = None
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        aliases = self.aliases
        if isinstance(aliases, list):
            aliases = tuple(aliases)
            object.__setattr__(self, "aliases", aliases)
        if not isinstance(aliases, tuple) or not all(isinstance(a, str) and a.strip() for a in aliases):
            raise ValueError(f"aliases={self.aliases!r} must be a list of non-empty names or globs")


@dataclass(frozen=True)
class RouterSection:
    """`[router]`: where the OpenAI API listens (127.0.0.1 unless the file says otherwise), and
    `max_body_bytes`, the largest request body it reads (a larger one is a 413; unset: sized to the model's
    context, see router/body.py)."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"router.port={self.port!r} is invalid: must be an integer in 1..65535")
        if self.max_body_bytes is not None and (isinstance(self.max_body_bytes, bool)
                                                or not isinstance(self.max_body_bytes, int) or self.max_body_bytes <= 0):
            raise ValueError(f"router.max_body_bytes={self.max_body_bytes!r} is invalid: must be an integer > 0 "
                             "(leave it unset to size it to the context)")


ROLES = ("prefill", "decode")
POLICIES = ("prefix_aware", "least_loaded", "round_robin")
KV_FORMAT_FIELDS = ("dtype", "kv_bits", "kv_group_size", "block_size")


@dataclass(frozen=True)
class RoutingSection:
    """`[routing]`: how the router places requests.

    - `policy`: "prefix_aware" (workers holding the prompt's leading blocks, weighed against load; see
      router/placement.py), "least_loaded" (fewest requests in flight, then most free KV blocks) or
      "round_robin" (for comparison).
    - `cache_weight`: how many requests in flight one cached prompt block is worth in prefix_aware scoring.
    - `disk_cache_weight`: the fraction of `cache_weight` a cached block is worth when only the worker's SSD
      tier holds it (it is loaded from disk before the prompt runs), until the worker reports its own measure
      (`ssd_block_worth`: 1 - load time / compute time): below 1, a worker with the prefix in RAM wins over one
      with it on disk, which wins over one without it.
    - `spill_margin`: a worker holding the prefix is passed over once it has this many more requests in
      flight than the least loaded live worker of its role (a hot prefix spreads instead of piling up).
    - `local_prefill_max_tokens`: a prompt with fewer uncached tokens than this is prefilled by its decode
      worker itself, with no prefill worker and no transfer (conditional disaggregation).
    - `heartbeat_s` / `dead_after_s`: the router pings every worker this often and marks one dead after this
      long without an answer (its requests fail or migrate; it is used again once it answers). A worker
      answers between engine steps, so `dead_after_s` must exceed the longest step (a prefill chunk); a
      worker whose connection drops (its process gone) is marked dead at once, and one whose connection goes
      silent at the transport level (ZeroMQ heartbeats unanswered) after `dead_after_s` too.
    """

    policy: str = "prefix_aware"
    cache_weight: float = 0.1
    disk_cache_weight: float = 0.5
    spill_margin: int = 4
    local_prefill_max_tokens: int = 256
    heartbeat_s: float = 1.0
    dead_after_s: float = 60.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing.policy={self.policy!r} is invalid: must be one of {', '.join(POLICIES)}")
        if not self.cache_weight >= 0 or self.spill_margin < 0:
            raise ValueError("routing.cache_weight and routing.spill_margin must be >= 0")
        if not 0 <= self.disk_cache_weight <= 1:
            raise ValueError(f"routing.disk_cache_weight={self.disk_cache_weight} is invalid: must be in [0, 1]")
        if self.local_prefill_max_tokens < 0:
            raise ValueError("routing.local_prefill_max_tokens must be >= 0")
        if not 0 < self.heartbeat_s < self.dead_after_s:
            raise ValueError("routing needs 0 < heartbeat_s < dead_after_s")


@dataclass(frozen=True)
class SecuritySection:
    """`[security]`: `curve_keys_dir` (from `mlx-pd keys DIR`) makes every cluster socket require CurveZMQ."""

    curve_keys_dir: Optional[str] = None


@dataclass(frozen=True)
class RaySection:
    """`[ray]`: `address` "local" starts a Ray head on this machine (the local-* topologies); "auto" or
    "HOST:PORT" joins a running cluster. `namespace` defaults to "mlx-pd-<topology name>". Actors restart at
    most `max_restarts` times."""

    address: str = "auto"
    namespace: Optional[str] = None
    max_restarts: int = 3

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError("ray.max_restarts must be >= 0")


@dataclass(frozen=True)
class WorkerGroup:
    """A `[workers.group]` table: the worker is a group of ranks (cluster/parallel/), rank 0 at the worker's
    own host. Fields as `cluster.parallel.spec.GroupPlan`'s; `ranks` one table per rank ({host, ring_port,
    step_port, heartbeat_port, machine}: `mlx-pd up` runs each following rank as a Ray actor of its own on its
    `machine`, else on the node whose IP is its `host`; rank 0 is the worker's own actor)."""

    parallel: str
    backend: str
    ranks: tuple[RankAddress, ...]
    heartbeat_s: float = 0.5
    deadline_s: float = 10.0
    memory_budget_gb: Optional[float] = None

    def plan(self, model_source: Optional[str], served_name: Optional[str], engine: EngineConfig) -> GroupPlan:
        """The `GroupPlan` every rank of this worker starts from (a prefill or decode worker: it moves KV)."""
        return GroupPlan(self.parallel, self.backend, self.ranks, model_source, served_name, engine,
                         self.heartbeat_s, self.deadline_s, self.memory_budget_gb, moves_kv=True)


@dataclass(frozen=True)
class WorkerSpec:
    """One `[[workers]]` entry. `engine` is the topology's `[engine]` with this worker's overrides applied.

    `kv_port` (decode workers only) receives KV blocks; `control_port` takes requests from the router (None:
    an in-process worker reached through `cluster.control.InProcessControl`, single-node mode's, which takes
    no KV either; a topology file cannot say None);
    `events_port` publishes the prefix cache's KV events (without it the router cannot see what this
    worker has cached, and routes to it by load alone). `metrics_port` serves the worker's Prometheus
    metrics (KV transfer bytes, blocks, latency histogram, refusals, aborts, timeouts) over HTTP.
    `cpu_affinity` pins the worker's process to those CPUs (Linux; used to stand in for separate machines).
    """

    name: str
    role: str
    control_port: Optional[int]
    engine: EngineConfig = field(default_factory=EngineConfig)
    machine: Optional[str] = None
    host: str = "127.0.0.1"
    kv_port: Optional[int] = None
    events_port: Optional[int] = None
    metrics_port: Optional[int] = None
    cpu_affinity: Optional[tuple[int, ...]] = None
    group: Optional[WorkerGroup] = None

    def __post_init__(self) -> None:
        if self.group is not None and self.group.ranks[0].host != self.host:
            raise ValueError(f"group.ranks[0].host={self.group.ranks[0].host!r} is invalid: rank 0 leads the group "
                             f"at the worker's own host {self.host!r}")
        if self.group is not None and self.group.ranks[0].machine not in (None, self.machine):
            raise ValueError(f"group.ranks[0].machine={self.group.ranks[0].machine!r} is invalid: rank 0 is the "
                             f"worker itself, on the worker's machine {self.machine!r} (leave it out)")
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise ValueError(f"name={self.name!r} is invalid: use letters, digits, '-', '_' or '.'")
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r} is invalid: must be one of {', '.join(ROLES)}")
        for key in ("control_port", "kv_port", "events_port", "metrics_port"):
            port = getattr(self, key)
            if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
                raise ValueError(f"{key}={port!r} is invalid: must be an integer in 1..65535")
        if self.role == "decode" and self.kv_port is None and self.control_port is not None:
            raise ValueError("a decode worker needs kv_port (where prefill workers send KV blocks)")
        if self.role == "prefill" and self.kv_port is not None:
            raise ValueError("kv_port is for decode workers only (prefill workers connect out)")

    @property
    def actor_name(self) -> str:
        """The readable name of its Ray actor, e.g. "prefill-0@mac-studio-1"."""
        return f"{self.name}@{self.machine or self.host}"

    def endpoint(self, port: int) -> str:
        return f"tcp://{self.host}:{port}"


@dataclass(frozen=True)
class TopologySpec:
    """A parsed topology file; `workers` is empty in single-node form."""

    name: str
    model: ModelSection = field(default_factory=ModelSection)
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: RouterSection = field(default_factory=RouterSection)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    routing: RoutingSection = field(default_factory=RoutingSection)
    security: SecuritySection = field(default_factory=SecuritySection)
    ray: RaySection = field(default_factory=RaySection)
    workers: tuple[WorkerSpec, ...] = ()
    source: Optional[str] = None  # the file's text, so a launcher can hand the same topology to every process

    def workers_of(self, role: str) -> list[WorkerSpec]:
        return [w for w in self.workers if w.role == role]

    def worker(self, name: str) -> WorkerSpec:
        for w in self.workers:
            if w.name == name:
                return w
        raise KeyError(f"no worker named {name!r} in topology {self.name!r}")

    @property
    def namespace(self) -> str:
        return self.ray.namespace or f"mlx-pd-{self.name}"


def _section(cls, table: Any, where: str):
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    try:
        return cls(**table)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def resolve_topology_path(name_or_path: str) -> Path:
    """A path as given, or a name looked up in the shipped `topologies/` folder (".toml" optional)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    for candidate in (TOPOLOGY_DIR / name_or_path, TOPOLOGY_DIR / f"{name_or_path}.toml"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"topology {name_or_path!r} not found (looked in . and {TOPOLOGY_DIR})")


def load_topology(name_or_path: str) -> TopologySpec:
    """Parse and validate a topology file. Raises FileNotFoundError or ValueError naming the bad key."""
    path = resolve_topology_path(name_or_path)
    return parse_topology(path.read_text(), name=path.stem, where=str(path))


_SECTIONS = {"model": ModelSection, "engine": EngineConfig, "router": RouterSection, "transfer": TransferConfig,
             "routing": RoutingSection, "security": SecuritySection, "ray": RaySection}


def parse_topology(text: str, name: str, where: str = "<topology>") -> TopologySpec:
    """Parse topology TOML `text` (see the module docstring). Raises ValueError naming the bad key."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{where}: not valid TOML: {exc}") from None
    known = set(_SECTIONS) | {"workers"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown table(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    parsed = {key: _section(cls, data.get(key, {}), f"{where} [{key}]") for key, cls in _SECTIONS.items()}
    tables = data.get("workers", [])
    if not isinstance(tables, list):
        raise ValueError(f"{where}: workers must be an array of tables ([[workers]])")
    workers = tuple(_worker(t, parsed["engine"], f"{where} [[workers]] #{i + 1}") for i, t in enumerate(tables))
    _check_workers(workers, where)
    return TopologySpec(name=name, workers=workers, source=text, **parsed)


def _worker(table: Any, engine: EngineConfig, where: str) -> WorkerSpec:
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table")
    table = dict(table)
    overrides = table.pop("engine", {})
    where = f"{where} ({table.get('name', '?')})"
    if not isinstance(overrides, dict):
        raise ValueError(f"{where}: engine must be a table")
    fixed = sorted(set(overrides) & set(KV_FORMAT_FIELDS))
    if fixed:
        raise ValueError(f"{where} [engine]: {', '.join(fixed)} is part of the KV format, which every worker "
                         "shares: set it in the top-level [engine] table")
    merged = _section(EngineConfig, {**_fields(engine), **overrides}, f"{where} [engine]")
    if "cpu_affinity" in table and isinstance(table["cpu_affinity"], list):
        table["cpu_affinity"] = tuple(table["cpu_affinity"])
    if "group" in table:
        table["group"] = _group(table["group"], f"{where} [group]")
    return _section(WorkerSpec, {**table, "engine": merged}, where)


def _group(table: Any, where: str) -> WorkerGroup:
    if not isinstance(table, dict) or not isinstance(table.get("ranks"), list):
        raise ValueError(f"{where}: must be a table with ranks = [{{host, ring_port, step_port, heartbeat_port}}, ...]")
    table = dict(table)
    table["ranks"] = tuple(_section(RankAddress, r, f"{where} ranks[{i}]") for i, r in enumerate(table["ranks"]))
    group = _section(WorkerGroup, table, where)
    group.plan(None, None, EngineConfig())  # the plan's own rules (kind, backend, at least 2 ranks, times)
    return group


def _fields(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _check_workers(workers: tuple[WorkerSpec, ...], where: str) -> None:
    names = [w.name for w in workers]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{where}: duplicate worker name(s) {', '.join(dup)}")
    ports = [(w.host, p) for w in workers for p in (w.control_port, w.kv_port, w.events_port, w.metrics_port)
             if p is not None]
    ports += [(r.host, p) for w in workers if w.group is not None for r in w.group.ranks
              for p in (r.ring_port, r.step_port, r.heartbeat_port)]
    clash = sorted({f"{h}:{p}" for h, p in ports if ports.count((h, p)) > 1})
    if clash:
        raise ValueError(f"{where}: port(s) {', '.join(clash)} used twice")
    if workers and not any(w.role == "decode" for w in workers):
        raise ValueError(f"{where}: a cluster needs at least one decode worker")
