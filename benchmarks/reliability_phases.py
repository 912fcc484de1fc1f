"""Phases 1 and 7 of `mlx-pd bench reliability`: API fuzz (schemathesis) and the baseline at the end.

Each phase takes the running `ReliabilityCluster` (benchmarks/reliability_cluster.py) and returns a JSON-able
dict that benchmarks/reliability_report.py turns into table rows. Phase 2 is benchmarks/reliability_access.py,
phase 3 benchmarks/reliability_wire.py, phases 4-6 benchmarks/reliability_soak.py.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Optional

import httpx

from benchmarks.reliability_cluster import ReliabilityCluster

MODEL = "SmolLM2-135M-Instruct"


# -- 1. API fuzz ---------------------------------------------------------------------------------------------

def _cap_case(case) -> None:
    """Keep generated requests cheap on a CPU: max_tokens <= 8 (8 when absent, which would otherwise mean "up
    to the context limit"), n <= 2. Every other value, invalid ones included, is sent as generated."""
    body = getattr(case, "body", None)
    if isinstance(body, dict):
        for key, cap in (("max_tokens", 8), ("max_completion_tokens", 8), ("n", 2), ("best_of", 2)):
            v = body.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > cap:  # 85.0 is a valid n too
                body[key] = cap
        if ("messages" in body or "prompt" in body) and body.get("max_tokens") is None \
                and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 8


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _repair(case) -> None:
    """Make a positive case the router accepts: the served model, known roles, a non-empty message list. The
    published schema is looser than the router's validation (any role string, an empty message list), so most
    generated "valid" chats are answered 400 before they reach the engine; repaired, every sampling field
    schemathesis generated (temperature, logit_bias, stop, seed, penalties, ...) reaches the real engine."""
    body = getattr(case, "body", None)
    if not isinstance(body, dict):
        return
    if "model" in body:
        body["model"] = MODEL
    if "messages" in body:
        msgs = [m for m in body["messages"] if isinstance(m, dict)] if isinstance(body["messages"], list) else []
        for m in msgs:
            if m.get("role") not in _ROLES:
                m["role"] = "user"
            if not isinstance(m.get("content"), (str, list)) or not m.get("content"):
                m["content"] = "Hello"
        body["messages"] = msgs or [{"role": "user", "content": "Hello"}]
    if "prompt" in body and not body["prompt"]:
        body["prompt"] = "Hello"


def _first_field(message: str) -> str:
    return message.split(":", 1)[0][:60]


def api_fuzz(c: ReliabilityCluster, examples: int, log: Callable[[str], None], seed: int = 0) -> dict:
    """schemathesis over every operation of the router's published schema: positive data, negative data, and
    positive data repaired to pass the router's stricter validation (see `_repair`)."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                     status_code_conformance)

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    headers = c.headers()
    schema = schemathesis.openapi.from_url(c.router_url + "/openapi.json", headers=headers, timeout=30)
    ops: dict[str, dict] = {}
    modes: Counter = Counter()
    rejected_valid: Counter = Counter()
    bad: list[str] = []
    t0 = time.monotonic()
    for result in schema.get_all_operations():
        op = result.ok()
        stats = ops.setdefault(op.label, {"requests": 0, "server_errors": 0, "violations": 0, "statuses": Counter()})
        for label, mode in (("positive", GenerationMode.POSITIVE), ("negative", GenerationMode.NEGATIVE),
                            ("repaired", GenerationMode.POSITIVE)):
            def make(op=op, stats=stats, mode=mode, label=label):
                @settings(max_examples=examples, deadline=None, database=None, derandomize=label != "repaired",
                          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(generation_mode=mode))
                def one(case):
                    if label == "repaired":
                        _repair(case)
                    _cap_case(case)
                    stats["requests"] += 1
                    modes[label] += 1
                    try:
                        response = case.call(base_url=c.router_url, headers=headers, timeout=180)
                    except Exception as exc:  # a connection the server dropped counts as a server error
                        stats["server_errors"] += 1
                        bad.append(f"{op.label} ({label}): {type(exc).__name__}: {exc}"[:300])
                        return
                    stats["statuses"][str(response.status_code)] += 1
                    if label == "positive" and response.status_code == 400:  # valid by the schema, refused
                        try:
                            rejected_valid[_first_field(response.json()["error"]["message"])] += 1
                        except Exception:
                            rejected_valid["?"] += 1
                    if response.status_code >= 500:
                        stats["server_errors"] += 1
                    try:
                        case.validate_response(response, checks=checks, headers=headers)
                    except Exception as exc:
                        stats["violations"] += 1
                        if len(bad) < 20:
                            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                            bad.append(f"{op.label} ({label}) -> {response.status_code}: {first}"[:300])
                return one
            try:
                make()()
            except Unsatisfiable:  # e.g. no negative data exists for an operation without inputs
                stats.setdefault("not_applicable", []).append(label)
        log(f"  {op.label}: {stats['requests']} requests, statuses {dict(stats['statuses'])}, "
            f"violations {stats['violations']}")
    health = httpx.get(c.router_url + "/health", timeout=30).status_code
    for s in ops.values():
        s["statuses"] = dict(sorted(s["statuses"].items()))
    statuses: Counter = Counter()
    for s in ops.values():
        statuses.update(s["statuses"])
    return {"requests": sum(s["requests"] for s in ops.values()), "operations": ops, "modes": dict(modes),
            "server_errors": sum(s["server_errors"] for s in ops.values()),
            "violations": sum(s["violations"] for s in ops.values()), "statuses": dict(sorted(statuses.items())),
            "examples_per_operation_and_mode": examples, "violation_examples": bad, "healthy_after": health == 200,
            "positive_rejected_400": sum(rejected_valid.values()),
            "positive_rejected_fields": dict(rejected_valid.most_common(8)),
            "duration_s": time.monotonic() - t0}


# -- 7. baseline ---------------------------------------------------------------------------------------------

_BUSY_KEYS = ("num_running", "num_waiting", "transfers_inflight", "transfers_pending", "awaiting_kv", "orphans",
              "requests", "handed_off")


def at_baseline(stats: Optional[dict]) -> bool:
    return bool(stats) and stats["kv_blocks_free"] == stats["kv_blocks_total"] and \
        all(not stats.get(k) for k in _BUSY_KEYS)


def baseline(c: ReliabilityCluster, rss_warm: dict, wait_s: float, log: Callable[[str], None]) -> dict:
    """Every worker back at baseline (all KV blocks free, nothing running, waiting, in transfer or awaiting
    KV), waiting up to `wait_s` (a transfer abandoned by a peer is freed at its deadline); RSS end / warm."""
    deadline = time.monotonic() + wait_s
    stats: dict = {}
    while True:
        stats = {w["name"]: c.probe(w["name"]) for w in c.workers}
        if all(at_baseline(s) for s in stats.values()) or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    rss_end = c.rss()
    rss = {}
    for name, end in rss_end.items():
        warm = rss_warm.get(name)
        if warm:
            rss[name] = {"warm_mib": warm, "end_mib": end, "ratio": end / warm}
    keep = ("kv_blocks_free", "kv_blocks_total", *_BUSY_KEYS, "tokens_out", "num_preemptions", "transfer_timeouts")
    workers = {n: ({k: s.get(k) for k in keep if k in s} if s else {"error": "no answer to a ping"})
               for n, s in stats.items()}
    good = [n for n, s in stats.items() if at_baseline(s)]
    log(f"  at baseline: {good}; RSS ratios {({n: round(r['ratio'], 2) for n, r in rss.items()})}")
    return {"workers": workers, "at_baseline": good, "not_at_baseline": [n for n in stats if n not in good],
            "rss": rss, "max_rss_ratio": max((r["ratio"] for r in rss.values()), default=0.0),
            "rss_over_1_2x": [n for n, r in rss.items() if r["ratio"] > 1.2]}
