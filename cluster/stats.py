"""The stats a worker reports and the router adds up: one typed object, made by the worker from its engine
(`cluster.worker.Worker.stats`), carried as it is in `Pong.stats` (packed by `cluster.protocol.to_wire`),
summed over workers by `EngineStats.from_reports`, and read by every stat logger (the router's `/metrics`, the
Ray exporter, the dashboard) through one table of metric names (cluster/stats_metrics.py).

`EngineStats` holds the figures (field names are the same everywhere: the report, the sum, the metric table);
`WorkerStats` adds the worker's identity and what its load check proved (`LoadCheckReport`, never added up).
The KV figures are per KV cache group (`KVGroupStats`, made by
`cluster.kv.manager.KVManager.group_stats`, each group's `stats`): a group is named by a string and carries only the figures it has
(None: not a figure of that group), so nothing here names a kind of layer.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass(frozen=True)
class KVGroupStats:
    """One KV cache group's figures. `group` names it ("full", "sliding_window", "recurrent", ...); a figure
    the group does not have is None.

    blocks_total / blocks_free   blocks of its pool (usable, free)
    entries                      entries it keeps outside a block pool (e.g. saved states)
    bytes_used / budget_bytes    bytes those entries hold, and their byte budget
    restores                     prefix-cache hits that restored one of its entries (a counter)
    bytes_sent / bytes_received  its payload bytes moved by KV transfers beside the blocks (counters)
    """

    group: str
    blocks_total: Optional[int] = None
    blocks_free: Optional[int] = None
    entries: Optional[int] = None
    bytes_used: Optional[int] = None
    budget_bytes: Optional[int] = None
    restores: Optional[int] = None
    bytes_sent: Optional[float] = None
    bytes_received: Optional[float] = None

    @property
    def blocks_used(self) -> Optional[int]:
        """Blocks of its pool in use (total - free; None without a pool)."""
        return None if self.blocks_total is None or self.blocks_free is None else self.blocks_total - self.blocks_free


def _add(a, b):
    return b if a is None else a if b is None else a + b


def _add_groups(records: Iterable[KVGroupStats], block_records: Iterable[KVGroupStats]) -> tuple[KVGroupStats, ...]:
    """Every group's figures added up by group name, in order of first appearance: the block counts from
    `block_records` only, the other figures from `records`."""
    sums: dict[str, dict] = {}
    blocks = {"blocks_total", "blocks_free"}
    for source, wanted in ((block_records, blocks), (records, None)):
        for g in source:
            row = sums.setdefault(g.group, {})
            for f in dataclasses.fields(KVGroupStats):
                if f.name != "group" and (f.name in blocks) == (wanted is not None):
                    row[f.name] = _add(row.get(f.name), getattr(g, f.name))
    return tuple(KVGroupStats(name, **row) for name, row in sums.items())


@dataclass(frozen=True)
class EngineStats:
    """An engine's load and counters: one worker's (`WorkerStats`) or the sum over a topology's workers
    (`from_reports`), for `/metrics`, `/health`, the dashboard and placement.

    Sequences, requests, tokens and blocks are counts; `kv_block_size` is tokens per block; byte figures are
    bytes and `grammar_mask_seconds`, `ttft_p50_s` seconds. Counters (preemptions, prefix-cache tokens, draft
    tokens, constrained requests, mask seconds, tokens out, KV moved, timeouts, busy answers) count since the
    worker started; the rest are gauges. The transfer figures are Prometheus counter values (floats).
    `kv_groups[0]` is the pool every sequence allocates from (the figures `kv_blocks_total`/`_free` read)."""

    num_running: int = 0  # sequences in the running batch
    num_waiting: int = 0  # sequences queued
    kv_block_size: int = 0  # tokens per KV block
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens served from it
    num_draft_tokens: int = 0  # speculative decoding: draft tokens proposed and verified
    num_accepted_tokens: int = 0  # of those, accepted by verification
    constrained_requests: int = 0  # constrained decoding: requests with a grammar
    grammar_mask_seconds: float = 0.0  # seconds computing their grammar masks
    tokens_out: int = 0  # output tokens sent to the router
    requests: int = 0  # requests the worker holds (routes to the router)
    transfers_inflight: int = 0  # KV transfers under way
    awaiting_kv: int = 0  # decode: requests waiting for their KV
    orphans: int = 0  # decode: KV transfers whose request is gone, still held
    handed_off: int = 0  # prefill: requests whose KV reached the decode worker
    transfers_pending: int = 0  # prefill: requests whose KV is still being sent
    kv_bytes_sent: float = 0.0
    kv_blocks_sent: float = 0.0
    kv_bytes_received: float = 0.0
    kv_blocks_received: float = 0.0
    transfer_timeouts: float = 0.0  # KV transfers ended by a deadline
    reservations_busy: float = 0.0  # decode: handshakes answered "busy"
    ttft_p50_s: Optional[float] = None  # prefill: median time to first token of recent requests (seconds)
    healthy: bool = True  # the worker loop runs (the sum: the engine client serves)
    # the SSD tier under the pool (cluster/kv/disk_tier.py; zeros without one): held now, and since start
    ssd_blocks: int = 0
    ssd_bytes: float = 0.0
    ssd_budget_bytes: float = 0.0
    ssd_blocks_written: float = 0.0
    ssd_blocks_dropped: float = 0.0  # the writer's queue was full
    ssd_blocks_loaded: float = 0.0
    ssd_bytes_loaded: float = 0.0
    ssd_load_seconds: float = 0.0
    ssd_bad_blocks: float = 0.0  # torn, corrupted or colliding files found (recomputed)
    ssd_blocks_evicted: float = 0.0  # files the tier's LRU let go of to keep within its budget
    # what a block only on the SSD tier is worth, as a share of one in RAM: 1 - its load time / its compute time,
    # from the tier's measured load rate and the engine's fitted prefill cost (None until both are measured)
    ssd_block_worth: Optional[float] = None
    kv_groups: tuple[KVGroupStats, ...] = ()

    @property
    def kv_blocks_total(self) -> int:
        """Usable blocks of the pool every sequence allocates from (`kv_groups[0]`; 0 without one)."""
        return (self.kv_groups[0].blocks_total or 0) if self.kv_groups else 0

    @property
    def kv_blocks_free(self) -> int:
        """Free blocks of that pool."""
        return (self.kv_groups[0].blocks_free or 0) if self.kv_groups else 0

    @property
    def kv_blocks_used(self) -> int:
        """Blocks of that pool in use (total - free)."""
        return self.kv_blocks_total - self.kv_blocks_free

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache over those looked up (0..1; 0 before any lookup)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def report(self) -> dict:
        """A JSON-able map of every field (`kv_groups` as a list of maps, their None figures left out) plus the
        derived figures `kv_blocks_total`, `kv_blocks_free`, `kv_blocks_used` (blocks) and
        `prefix_cache_hit_rate` (0..1): what `mlx-pd status`, the dashboard and scripts read."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "kv_groups"}
        out["kv_groups"] = [{k: v for k, v in dataclasses.asdict(g).items() if v is not None} for g in self.kv_groups]
        out.update(kv_blocks_total=self.kv_blocks_total, kv_blocks_free=self.kv_blocks_free,
                   kv_blocks_used=self.kv_blocks_used, prefix_cache_hit_rate=self.prefix_cache_hit_rate)
        return out

    @classmethod
    def from_reports(cls, reports: Iterable["WorkerStats"]) -> "EngineStats":
        """The stats of the workers whose latest reports are `reports`, added up field by field: the sequences
        running, the KV blocks, the speculative and constrained-request counters are the decode workers' (a
        prefill worker's sequences and blocks are transient, and a request it hands on starts its grammar again
        on the decode worker); everything else is everyone's. `ttft_p50_s` is the largest worker median (None
        without one), `ssd_block_worth` the smallest worker's. Single-node mode reports one decode worker."""
        live = list(reports)
        decode = [s for s in live if s.role == "decode"]
        everyone = {f.name for f in dataclasses.fields(cls)} - {"num_running", "kv_block_size", "num_draft_tokens",
                                                               "num_accepted_tokens", "constrained_requests",
                                                               "ttft_p50_s", "healthy", "kv_groups",
                                                               "ssd_block_worth"}
        medians = [s.ttft_p50_s for s in live if s.ttft_p50_s is not None]
        worths = [s.ssd_block_worth for s in live if s.ssd_block_worth is not None]
        return cls(**{k: sum(getattr(s, k) for s in live) for k in everyone},
                   num_running=sum(s.num_running for s in decode),
                   kv_block_size=decode[0].kv_block_size if decode else 0,
                   num_draft_tokens=sum(s.num_draft_tokens for s in decode),
                   num_accepted_tokens=sum(s.num_accepted_tokens for s in decode),
                   constrained_requests=sum(s.constrained_requests for s in decode),
                   ttft_p50_s=max(medians) if medians else None,
                   ssd_block_worth=min(worths) if worths else None,
                   healthy=any(s.healthy for s in decode),
                   kv_groups=_add_groups((g for s in live for g in s.kv_groups),
                                         (g for s in decode for g in s.kv_groups)))


@dataclass(frozen=True)
class LoadCheckReport:
    """What a worker's load check proved (`cluster.load_check.LoadCheck.report`), as a worker reports it: the
    `model_type` checked, each check `passed` (in words), the check's cost in `seconds`, and whether it was
    `skipped` (a family the tests cover, `EngineConfig.skip_load_check`; then nothing is listed as passed)."""

    model_type: str = ""
    passed: tuple[str, ...] = ()
    seconds: float = 0.0
    skipped: bool = False

    def __post_init__(self) -> None:
        if not math.isfinite(self.seconds) or self.seconds < 0:
            raise ValueError(f"seconds={self.seconds!r} must be a finite number >= 0")

    def summary(self) -> str:
        """One line: the worker's log line of its load check, and `mlx-pd status`'s."""
        if self.skipped:
            return f"load check skipped for {self.model_type} (a family the tests cover)"
        return f"load check passed for {self.model_type} in {self.seconds:.1f} s: " + "; ".join(self.passed)

    def report(self) -> dict:
        """A JSON-able map of the fields (`passed` a list)."""
        return {"model_type": self.model_type, "passed": list(self.passed), "seconds": self.seconds,
                "skipped": self.skipped}


@dataclass(frozen=True)
class RankStats:
    """One rank of a worker group as its leader knows it: `alive` (its heartbeat within the deadline; the leader
    itself always), the bytes of its weights, KV pool and MLX peak (from its heartbeat; 0 before it reports),
    and `step_bytes`, the step messages the leader sent it (for rank 0: to every follower)."""

    rank: int
    host: str
    alive: bool
    parameter_bytes: int = 0
    kv_bytes: int = 0
    peak_bytes: int = 0
    step_bytes: int = 0


@dataclass(frozen=True)
class WorkerStats(EngineStats):
    """One worker's report (`cluster.worker.Worker.stats`, `Pong.stats`): its identity (`name`, Ray `actor`
    name, `role` "prefill" or "decode", `host`), what its load check proved (`load_check`; None when its engine
    was built without one, as tests build it) and its engine's figures (`EngineStats`). A worker that is a group
    of ranks (cluster/parallel/) names its `parallel` kind and reports each rank (`ranks`, rank 0 first)."""

    name: str = ""
    actor: str = ""
    role: str = ""
    host: str = ""
    load_check: Optional[LoadCheckReport] = None
    parallel: str = ""
    ranks: tuple[RankStats, ...] = ()

    def report(self) -> dict:
        """`EngineStats.report` with the identity, `load_check` as a map (`LoadCheckReport.report`) or None, and
        `ranks` as a list of maps."""
        out = super().report()
        out["load_check"] = None if self.load_check is None else self.load_check.report()
        out["ranks"] = [dataclasses.asdict(r) for r in self.ranks]
        return out
