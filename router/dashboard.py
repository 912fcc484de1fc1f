"""The dashboard's state (`GET /dashboard/api/state`): one JSON object from the engine client's worker reports
and the router's own history (router/dashboard_history.py). The page polls it every second; scripts may too.

    version      1 (bumped when a field changes meaning)
    time         the server's clock, seconds since the epoch
    mode         "cluster" (ClusterEngineClient) or "single-node" (one in-process worker)
    model        the served model's name
    router       {"healthy": the engine serves (`/health`), "uptime_s", "requests_total" sequences begun and
                 "tokens_total" tokens delivered since the router started}
    workers      one row per worker, in topology order (single-node: one row, name "engine", role
                 "single-node"):
                   name, role, address ("host:control_port"; "in-process" for single-node), alive (the router's
                   liveness: heartbeats and connection), inflight (sequences the router has placed there);
                   from its last report (None while it has not reported, e.g. dead): running, waiting
                   (sequences), kv_blocks_total / kv_blocks_used / kv_blocks_free, kv_block_size (tokens),
                   prefix_cache_hit_rate (0..1, prompt tokens served from its prefix cache), tokens_out,
                   kv_bytes_sent / kv_bytes_received (counters since it started), transfers_inflight (KV transfers
                   under way), kv_groups (its KV cache groups: {"group", and the figures the group has of
                   blocks_total, blocks_free, entries, bytes_used, budget_bytes, restores, bytes_sent,
                   bytes_received}, cluster/stats.py); parallel ("tensor" or "pipeline" for a worker that is a group of ranks,
                   "" otherwise) and ranks (a group's ranks, rank 0 first: {"rank", "host", "alive" (its heartbeat,
                   as the leader last heard it), "parameter_bytes", "kv_bytes", "peak_bytes", "step_bytes"}; [] for
                   one process); its SSD KV tier (cluster/kv/disk_tier.py, the report's figures): ssd_blocks and
                   ssd_bytes held, ssd_budget_bytes, and the counters ssd_blocks_written, ssd_blocks_dropped (the
                   writer's queue was full), ssd_blocks_loaded (blocks of prefix hits read from disk),
                   ssd_bytes_loaded, ssd_load_seconds, ssd_bad_blocks (files found torn, corrupted or colliding);
                   ssd_tier ("on", "off" for a budget of 0, None while it has not reported) and
                   ssd_load_bytes_per_s (ssd_bytes_loaded / ssd_load_seconds, None before anything was loaded);
                   from the history: tokens_per_s, kv_bytes_per_s, ssd_blocks_written_per_s and
                   ssd_blocks_loaded_per_s (counter deltas over the last interval)
    summary      the last `window_s` seconds (60): requests_per_s, tokens_per_s, and ttft / tpot / itl / e2e as
                 {"p50", "p90", "p99", "count"} (seconds; None without observations)
    history      {"interval_s", "span_s", "samples": [...]}: the samples (fields in router/dashboard_history.py)
                 oldest first; with `?since=T` only those with t > T
    requests     the sequences in flight, oldest first (at most MAX_REQUEST_ROWS): request_id, workers (names,
                 prefill worker first), phase ("prefill" before the first token, "decode" after), age_s, tokens
                 (delivered so far), ttft_s
    requests_inflight   how many are in flight (the list may be cut)
"""

from __future__ import annotations

import time
from typing import Any, Optional

from router.dashboard_history import WORKER_RATES, DashboardHistory

STATE_VERSION = 1
MAX_REQUEST_ROWS = 200
_REPORTED = (("running", "num_running"), ("waiting", "num_waiting"), ("kv_blocks_total", "kv_blocks_total"),
             ("kv_blocks_free", "kv_blocks_free"), ("kv_block_size", "kv_block_size"),
             ("prefix_cache_hit_rate", "prefix_cache_hit_rate"), ("tokens_out", "tokens_out"),
             ("kv_bytes_sent", "kv_bytes_sent"), ("kv_bytes_received", "kv_bytes_received"),
             ("transfers_inflight", "transfers_inflight"), ("kv_groups", "kv_groups"), ("parallel", "parallel"),
             ("ranks", "ranks"),
             *((f, f) for f in ("ssd_blocks", "ssd_bytes", "ssd_budget_bytes", "ssd_blocks_written",
                                "ssd_blocks_dropped", "ssd_blocks_loaded", "ssd_bytes_loaded", "ssd_load_seconds",
                                "ssd_bad_blocks")))


def is_cluster(engine: Any) -> bool:
    """True for a client over a topology's workers (router.cluster_client.ClusterEngineClient)."""
    return hasattr(engine, "workers") and hasattr(engine, "worker_stats")


def worker_reports(engine: Any) -> list[dict]:
    """Each worker's last report plus the router's view ("name", "role", "alive", "inflight"), from the engine
    client's `worker_stats()`; an engine client without it gives one row "engine" from `stats().report()`."""
    reports = getattr(engine, "worker_stats", None)
    if reports is not None:
        return [dict(r) for r in reports()]
    return [dict(engine.stats().report(), name="engine", role="single-node", alive=bool(engine.is_healthy()),
                 inflight=None)]


def ssd_load_rate(bytes_loaded: Optional[float], load_seconds: Optional[float]) -> Optional[float]:
    """The SSD tier's load rate since the worker started: bytes loaded per second spent loading them; None when
    nothing was loaded (or nothing reported)."""
    if not bytes_loaded or not load_seconds or load_seconds <= 0:
        return None
    return bytes_loaded / load_seconds


def worker_rows(engine: Any, history: DashboardHistory) -> list[dict]:
    """The `workers` rows of the state (see the module docstring)."""
    cluster = is_cluster(engine)
    specs = {w.spec.name: w.spec for w in engine.workers} if cluster else {}
    rows = []
    for report in worker_reports(engine):
        name = report.get("name", "?")
        spec = specs.get(name)
        row = {"name": name, "role": report.get("role") if cluster else "single-node",
               "address": f"{spec.host}:{spec.control_port}" if spec is not None else "in-process",
               "alive": bool(report.get("alive")), "inflight": report.get("inflight")}
        for key, field in _REPORTED:
            row[key] = report.get(field)
        row["parallel"], row["ranks"] = row["parallel"] or "", row["ranks"] or []
        total, free = row["kv_blocks_total"], row["kv_blocks_free"]
        row["kv_blocks_used"] = total - free if total is not None and free is not None else None
        budget = row["ssd_budget_bytes"]
        row["ssd_tier"] = None if budget is None else "on" if budget > 0 else "off"
        row["ssd_load_bytes_per_s"] = ssd_load_rate(row["ssd_bytes_loaded"], row["ssd_load_seconds"])
        rates = history.worker_rates.get(name, {})
        for rate, _ in WORKER_RATES:
            row[rate] = rates.get(rate, 0.0)
        rows.append(row)
    return rows


def request_rows(engine: Any, history: DashboardHistory) -> list[dict]:
    """The `requests` rows of the state (see the module docstring), all of them."""
    streams = getattr(engine, "streams", None) if is_cluster(engine) else None
    rows = []
    for row in history.inflight():
        if streams is None:
            workers = ["engine"]
        else:
            stream = streams.get(row["request_id"])
            workers = [w.spec.name for w in stream.workers] if stream is not None else []
        rows.append({"request_id": row["request_id"], "workers": workers,
                     "phase": "prefill" if row["ttft_s"] is None else "decode", "age_s": row["age_s"],
                     "tokens": row["tokens"], "ttft_s": row["ttft_s"]})
    return rows


def build_state(engine: Any, history: DashboardHistory, *, started: float, since: Optional[float] = None) -> dict:
    """The state object (see the module docstring). `started` is the router's time.time() at start; `since`
    keeps only the samples after that time (seconds since the epoch)."""
    history.roll()
    try:
        healthy = bool(engine.is_healthy())
    except Exception:
        healthy = False
    now = time.time()
    requests = request_rows(engine, history)
    samples = [s for s in history.samples if since is None or s["t"] > since]
    return {
        "version": STATE_VERSION, "time": now, "mode": "cluster" if is_cluster(engine) else "single-node",
        "model": getattr(engine, "model_name", None),
        "router": {"healthy": healthy, "uptime_s": max(0.0, now - started), "requests_total": history.requests_total,
                   "tokens_total": history.tokens_total},
        "workers": worker_rows(engine, history),
        "summary": history.summary(),
        "history": {"interval_s": history.interval_s, "span_s": history.span_s, "samples": samples},
        "requests": requests[:MAX_REQUEST_ROWS], "requests_inflight": len(requests),
    }
