"""The one table of Prometheus names for the stats (cluster/stats.py): each figure has exactly one name, one
help text and one type, declared here and nowhere else.

Two exporters read it: the router's `/metrics` (router/metrics.py: the sum over the workers, no labels
besides `group`) and each Ray worker actor (cluster/launch/actors.py: one worker's report, tagged `worker` and
`role`; Ray's exporter prefixes `ray_`). A counter's series carries Prometheus' `_total` suffix in both.

`METRICS` reads an `EngineStats` attribute (a field or a derived property) per metric; `GROUP_METRICS` reads a
`KVGroupStats` attribute per KV cache group, exported with a `group` label (the group's name) and skipped for a
group without that figure. The blocks of the pool every sequence allocates from (`EngineStats.kv_blocks_total`,
`_free`, `_used`) are its group's figures, so they have no name of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Literal

from cluster.stats import EngineStats

PREFIX = "mlx_pd_"


@dataclass(frozen=True)
class MetricSpec:
    """One metric: `field` (the stats attribute it reads), `name` (Prometheus, without a counter's `_total`),
    `help` and `kind` ("gauge": set to the value; "counter": the value is a count since the worker started)."""

    field: str
    name: str
    help: str
    kind: Literal["gauge", "counter"]


def _gauge(field: str, name: str, help: str) -> MetricSpec:
    return MetricSpec(field, PREFIX + name, help, "gauge")


def _counter(field: str, name: str, help: str) -> MetricSpec:
    return MetricSpec(field, PREFIX + name, help, "counter")


METRICS: tuple[MetricSpec, ...] = (
    _gauge("healthy", "healthy", "1 while the engine serves (a worker: its loop runs; the router: a decode worker "
                                 "is alive)"),
    _gauge("num_running", "running_sequences", "Sequences in the running batch"),
    _gauge("num_waiting", "waiting_sequences", "Sequences queued for admission"),
    _gauge("kv_block_size", "kv_block_size", "Tokens per KV block"),
    _counter("num_preemptions", "preemptions", "Sequences preempted (recomputed later)"),
    _counter("prefix_cache_queries", "prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache"),
    _counter("prefix_cache_hits", "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"),
    _gauge("prefix_cache_hit_rate", "prefix_cache_hit_rate", "Prompt tokens served from the prefix cache over "
                                                             "those looked up since start (0..1)"),
    _counter("num_draft_tokens", "draft_tokens", "Speculative decoding: draft tokens proposed and verified"),
    _counter("num_accepted_tokens", "draft_accepted_tokens", "Speculative decoding: draft tokens accepted"),
    _gauge("draft_acceptance_rate", "draft_acceptance_rate", "Speculative decoding: accepted / proposed draft "
                                                             "tokens since start (0 before any)"),
    _counter("constrained_requests", "constrained_requests", "Constrained decoding: requests with a grammar "
                                                             "(response_format, tool_choice)"),
    _counter("grammar_mask_seconds", "grammar_mask_seconds", "Constrained decoding: seconds spent computing "
                                                             "grammar masks"),
    _counter("tokens_out", "output_tokens", "Output tokens sent to the router"),
    _gauge("requests", "requests", "Requests the workers hold"),
    _gauge("transfers_inflight", "kv_transfers_inflight", "KV transfers under way"),
    _gauge("awaiting_kv", "awaiting_kv_requests", "Decode: requests waiting for their KV"),
    _gauge("orphans", "orphan_transfers", "Decode: KV transfers whose request is gone, still held"),
    _gauge("handed_off", "handed_off_requests", "Prefill: requests whose KV reached the decode worker"),
    _gauge("transfers_pending", "pending_transfers", "Prefill: requests whose KV is still being sent"),
    _counter("kv_bytes_sent", "kv_bytes_sent", "KV bytes shipped to decode workers"),
    _counter("kv_blocks_sent", "kv_blocks_sent", "KV blocks shipped to decode workers"),
    _counter("kv_bytes_received", "kv_bytes_received", "KV bytes received from prefill workers"),
    _counter("kv_blocks_received", "kv_blocks_received", "KV blocks received from prefill workers"),
    _counter("transfer_timeouts", "kv_transfer_timeouts", "KV transfers ended by a deadline"),
    _counter("reservations_busy", "kv_reservations_busy", "Decode: KV handshakes answered busy"),
    _gauge("ssd_blocks", "kv_ssd_blocks", "KV blocks the SSD tier holds"),
    _gauge("ssd_bytes", "kv_ssd_bytes", "Bytes of the SSD tier's block files"),
    _gauge("ssd_budget_bytes", "kv_ssd_budget_bytes", "The SSD tier's byte budget (0: no tier)"),
    _counter("ssd_blocks_written", "kv_ssd_blocks_written", "KV blocks written to the SSD tier"),
    _counter("ssd_blocks_dropped", "kv_ssd_blocks_dropped", "KV blocks the SSD tier's full write queue dropped"),
    _counter("ssd_blocks_loaded", "kv_ssd_blocks_loaded", "KV blocks loaded from the SSD tier by prefix hits"),
    _counter("ssd_bytes_loaded", "kv_ssd_bytes_loaded", "Bytes loaded from the SSD tier by prefix hits"),
    _counter("ssd_load_seconds", "kv_ssd_load_seconds", "Seconds spent loading blocks from the SSD tier"),
    _counter("ssd_blocks_evicted", "kv_ssd_blocks_evicted", "SSD tier files its LRU let go of to keep within its "
                                                            "budget"),
    _counter("ssd_bad_blocks", "kv_ssd_bad_blocks", "SSD tier block files found torn, corrupted or colliding "
                                                    "(recomputed instead)"),
    _gauge("ssd_block_worth", "kv_ssd_block_worth", "What a block only on the SSD tier is worth as a share of one in "
                                                    "RAM: 1 - its load time / its compute time (the router: the "
                                                    "smallest worker's)"),
    _gauge("ttft_p50_s", "ttft_p50_seconds", "Prefill: median time to first token of recent requests, seconds "
                                             "(the router: the largest worker median)"),
)

GROUP_METRICS: tuple[MetricSpec, ...] = (
    _gauge("blocks_total", "kv_group_blocks_total", "Usable blocks of a KV cache group's pool"),
    _gauge("blocks_free", "kv_group_blocks_free", "Free blocks of a KV cache group's pool"),
    _gauge("blocks_used", "kv_group_blocks_used", "Blocks of a KV cache group's pool in use (total - free)"),
    _gauge("entries", "kv_group_entries", "Entries a KV cache group keeps outside a block pool"),
    _gauge("bytes_used", "kv_group_bytes", "Bytes a KV cache group's entries hold"),
    _gauge("budget_bytes", "kv_group_budget_bytes", "A KV cache group's byte budget for its entries"),
    _counter("restores", "kv_group_restores", "Prefix-cache hits that restored an entry of a KV cache group"),
    _counter("bytes_sent", "kv_group_bytes_sent", "A KV cache group's payload bytes shipped beside the KV blocks"),
    _counter("bytes_received", "kv_group_bytes_received", "A KV cache group's payload bytes received beside the "
                                                          "KV blocks"),
)

GROUP_LABEL = "group"


def samples(stats: EngineStats) -> Iterator[tuple[MetricSpec, dict[str, str], float]]:
    """(metric, labels, value) for every figure `stats` has: each of `METRICS` once (a None value, e.g. no
    median yet, is skipped) and each of `GROUP_METRICS` once per KV cache group that has the figure, labelled
    {"group": its name}. Booleans become 1.0 / 0.0."""
    for spec in METRICS:
        value = getattr(stats, spec.field)
        if value is not None:
            yield spec, {}, float(value)
    for spec in GROUP_METRICS:
        for group in stats.kv_groups:
            value = getattr(group, spec.field)
            if value is not None:
                yield spec, {GROUP_LABEL: group.group}, float(value)


def exported_names() -> set[str]:
    """Every series name the exporters make from the table (a counter's with `_total`), without Ray's prefix."""
    return {s.name + ("_total" if s.kind == "counter" else "") for s in (*METRICS, *GROUP_METRICS)}
