"""`mlx-pd bench reliability`: fuzzing, a soak, faults and overload on a live 1P2D cluster of processes (see
docs/RELIABILITY.md).

    mlx-pd bench reliability --json reliability.json --markdown docs/RELIABILITY.md
    mlx-pd bench reliability --requests 200 --concurrency 8 --skip faults,overload    # a shorter run
    mlx-pd bench reliability --soak-only --fast-model --requests 10000 --rss-plot soak.png   # the leak question

Starts `mlx-pd worker` x3 (prefill-0, decode-0, decode-1) and `mlx-pd router` on free loopback ports with
CurveZMQ keys (`mlx-pd keys`) and an API key, plus a single-node `mlx-pd serve` with the same engine settings
as the reference, then runs the phases in order:

    1 api       schemathesis over every operation of the router's OpenAPI schema (positive + negative data)
    2 access    401 without the key; no answer to ZeroMQ peers without the keys; loopback only; no secrets
    3 wire      hostile frames on every control and KV socket (with the keys); the workers keep serving
    4 soak      --requests mixed requests at --concurrency; greedy outputs equal the reference's
    5 faults    kill -9 a decode worker mid-stream and restart it; SIGSTOP the prefill worker (--stall-s)
    6 overload  --burst requests at once: each completes or gets 503 with Retry-After
    7 baseline  every worker's KV blocks free and nothing running; RSS at the end vs after warm-up

`--soak-only` runs the soak and the baseline alone, with RSS sampled over time and fitted per process
(benchmarks/reliability_long.py; `--fast-model`: a random-weight 2-layer llama, about 3 requests/s on 2 cores).

Exit code 0 when every rule held, 1 when one broke (the report names it), 2 when the cluster did not start.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import secrets
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

PHASES = ("api", "access", "wire", "soak", "faults", "overload", "baseline")


def add_reliability_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=1000,
                   help="soak requests (default 1000: the whole run took 17.5 minutes on a 2-core "
                        "CPU machine)")
    p.add_argument("--concurrency", type=int, default=8, help="soak requests in flight (default 8)")
    p.add_argument("--fuzz-examples", type=int, default=25,
                   help="schemathesis examples per operation and mode (positive, negative; default 25)")
    p.add_argument("--wire-per-kind", type=int, default=20, help="hostile frames per kind and socket (default 20)")
    p.add_argument("--burst", type=int, default=150, help="overload: requests sent at once (default 150)")
    p.add_argument("--stall-s", default="4,12",
                   help="slow-peer trials: seconds the prefill worker is stopped, comma-separated (default 4,12: "
                        "below and above the router's 5 s ZeroMQ heartbeat timeout)")
    p.add_argument("--skip", default="", help=f"comma-separated phases to skip ({', '.join(PHASES)})")
    p.add_argument("--no-curve", action="store_true", help="no CurveZMQ keys on the cluster sockets")
    p.add_argument("--no-api-key", action="store_true", help="no API key on the router")
    p.add_argument("--no-speculative", action="store_true", help="no speculative requests in the soak")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="keep topology, keys and process logs here (default: a temp dir)")
    p.add_argument("--json", dest="out", default=None, help="write the full result as JSON here")
    p.add_argument("--soak-only", action="store_true",
                   help="only the soak and the baseline, RSS of every process sampled every --rss-every s and "
                        "fitted against answers (benchmarks/reliability_long.py); its own generated section")
    p.add_argument("--fast-model", action="store_true",
                   help="with --soak-only: serve a random-weight 2-layer llama built in the mlx-pd cache (garbage "
                        "text, but deterministic; 10,000 requests in about an hour on a 2-core CPU machine)")
    p.add_argument("--rss-every", type=float, default=2.0, help="with --soak-only: seconds between RSS samples")
    p.add_argument("--rss-warmup", type=float, default=0.1,
                   help="with --soak-only: fraction of the answers left out of the RSS fit (default 0.1)")
    p.add_argument("--rss-plot", default=None, help="with --soak-only: write the RSS plot (PNG) here")
    p.add_argument("--markdown", default=None,
                   help="write the tables into this Markdown file between its generated-section markers "
                        "(docs/RELIABILITY.md)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx-pd bench reliability", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_reliability_args(p)
    return p


def _abandoned_deadline_s() -> float:
    """Seconds until a worker lets go of what a fuzzing peer abandoned: the longest is a decode worker told to
    expect KV that never comes (`TransferConfig.kv_start_deadline_s`); a prefill worker's offer to a receiver
    that never answers ends sooner (its reserve deadline)."""
    from benchmarks.reliability_cluster import ENGINE, TRANSFER
    from cluster.config import EngineConfig, TransferConfig

    return TransferConfig(**TRANSFER).kv_start_deadline_s(ENGINE.get("queue_timeout_s", EngineConfig.queue_timeout_s))


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def warm_up(c, items) -> None:
    """A few soak-like requests (one of each kind) before memory is measured; not counted."""
    from benchmarks.reliability_client import send

    async def go():
        import httpx

        async with httpx.AsyncClient(timeout=600.0) as client:
            seen, picked = set(), []
            for it in items:
                if it.kind not in seen:
                    seen.add(it.kind)
                    picked.append(it)
            await asyncio.gather(*(send(client, c.router_url, it.path, {**it.body, "model": c.served_name},
                                        c.headers(), disconnect_after=it.disconnect_after) for it in picked))

    asyncio.run(go())


def run_reliability(args: argparse.Namespace) -> dict:
    from benchmarks import reliability_access as acc
    from benchmarks import reliability_phases as ph
    from benchmarks import reliability_wire as wi
    from benchmarks import reliability_soak as so
    from benchmarks.reliability_cluster import ENGINE, ROUTING, TRANSFER, ReliabilityCluster
    from benchmarks.reliability_inputs import soak_workload

    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - set(PHASES)
    if unknown:
        raise ValueError(f"--skip: unknown phase(s) {', '.join(sorted(unknown))}; known: {', '.join(PHASES)}")
    stalls = [float(s) for s in args.stall_s.split(",") if s.strip()]
    api_key = None if args.no_api_key else "mlxpd-" + secrets.token_urlsafe(24)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="mlx-pd-reliability-"))
    result: dict = {"started": datetime.datetime.now().isoformat(timespec="seconds"),
                    "machine": f"{platform.system()} {platform.machine()}, {_cpus()} CPUs",
                    "config": {"engine": ENGINE, "routing": ROUTING, "transfer": TRANSFER, "curve": not args.no_curve,
                               "api_key": api_key is not None, "requests": args.requests,
                               "concurrency": args.concurrency, "fuzz_examples": args.fuzz_examples,
                               "wire_per_kind": args.wire_per_kind, "burst": args.burst, "stall_s": stalls,
                               "skipped": sorted(skip), "workdir": str(workdir)},
                    "phases": {}, "notes": []}
    phases = result["phases"]
    t_start = time.monotonic()
    _log(f"starting the 1P2D cluster and the single-node reference (logs in {workdir})")
    c = ReliabilityCluster(workdir, curve=not args.no_curve, api_key=api_key, log=_log)
    with c:
        items = soak_workload(args.requests, args.seed, speculative=not args.no_speculative)
        result["startup_s"] = time.monotonic() - t_start
        warm_up(c, items)
        rss_warm = c.rss()
        _log(f"warm: RSS {({k: round(v) for k, v in rss_warm.items()})} MiB")
        if "api" not in skip:
            _log("phase 1: API fuzz (schemathesis)")
            _phase(phases, "api_fuzz", lambda: ph.api_fuzz(c, args.fuzz_examples, _log, args.seed))
        if "access" not in skip:
            _log("phase 2: access")
            _phase(phases, "access", lambda: acc.access(c, _log))
        if "wire" not in skip:
            _log("phase 3: wire fuzz")
            _phase(phases, "wire_fuzz", lambda: wi.wire_fuzz(c, args.wire_per_kind, _log, args.seed))
        if "soak" not in skip:
            spec = "off (--no-speculative)" if args.no_speculative else so.speculative_available(c)
            if not spec.startswith("yes"):
                items = soak_workload(args.requests, args.seed, speculative=False)
            else:
                spec = f"on for {sum(i.speculative for i in items)} of the greedy requests (prompt_lookup, 4 drafts)"
            _log(f"phase 4: soak of {len(items)} requests at concurrency {args.concurrency}; speculative: {spec}")
            _phase(phases, "soak", lambda: asyncio.run(so.soak(c, items, args.concurrency, _log, spec)))
            phases["soak"]["kinds_note"] = "chat: short chats; tenant: shared system prompts, 1-2 turns; long: " \
                                           "1-2k-token prompts; disconnect: stream closed after 1-4 chunks; " \
                                           "sampled: temperature 0.8"
        if "faults" not in skip:
            faults = phases["faults"] = {}
            _log("phase 5a: kill -9 a decode worker mid-stream")
            kill = _phase(faults, "kill -9 decode worker", lambda: asyncio.run(so.fault_kill(c, _log)))
            if "victim" in kill:
                rss_warm[kill["victim"]] = c.rss().get(kill["victim"], 0.0)  # the new process's own baseline
            result["notes"].append(f"{kill['victim']} was killed and restarted in phase 5: its RSS ratio compares "
                                   "its end with the new process right after its recovery requests.")
            for s in stalls:
                _log(f"phase 5b: SIGSTOP the prefill worker for {s:.0f} s")
                _phase(faults, f"slow peer {s:.0f} s", lambda: asyncio.run(so.fault_stall(c, _log, s)))
            faults["lost messages"] = so.lost_messages_note()
        if "overload" not in skip:
            _log(f"phase 6: overload burst of {args.burst}")
            _phase(phases, "overload", lambda: asyncio.run(so.overload(c, args.burst, _log)))
        if "baseline" not in skip:
            _log("phase 7: baseline")
            _phase(phases, "baseline", lambda: ph.baseline(c, rss_warm, _abandoned_deadline_s() + 30, _log))
        if "access" in phases:  # logs are complete now: scan them again
            phases["access"].update(_phase({}, "scan", lambda: acc.scan_secrets(c)))
    result["duration_s"] = time.monotonic() - t_start
    return result


def _phase(into: dict, name: str, fn) -> dict:
    """Run one phase; a harness error is recorded (and fails the run) instead of ending every later phase."""
    import traceback

    try:
        into[name] = fn()
    except Exception as exc:
        _log(f"  phase {name} failed: {type(exc).__name__}: {exc}")
        into[name] = {"harness_error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
    return into[name]


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)


def main(argv: Sequence[str]) -> int:
    from benchmarks.reliability_report import failures, render_markdown, write_outputs

    args = build_parser().parse_args(list(argv))
    if args.requests < 0 or args.concurrency < 1 or args.burst < 1:
        print("mlx-pd bench reliability: error: --requests >= 0, --concurrency >= 1, --burst >= 1", file=sys.stderr)
        return 2
    if args.soak_only:
        from benchmarks.reliability_long import main as long_main

        if args.rss_every <= 0 or not 0 <= args.rss_warmup < 1:
            print("mlx-pd bench reliability: error: --rss-every > 0, 0 <= --rss-warmup < 1", file=sys.stderr)
            return 2
        return long_main(args, list(argv))
    if args.fast_model or args.rss_plot:
        print("mlx-pd bench reliability: error: --fast-model and --rss-plot go with --soak-only", file=sys.stderr)
        return 2
    try:
        result = run_reliability(args)
    except (RuntimeError, ValueError) as exc:
        print(f"mlx-pd bench reliability: error: {exc}", file=sys.stderr)
        return 2
    result["command"] = "mlx-pd bench reliability " + shlex.join(argv)
    result["failures"] = failures(result)
    return write_outputs(result, render_markdown(result), args.out, args.markdown)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
