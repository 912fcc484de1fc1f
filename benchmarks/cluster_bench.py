"""`mlx-pd bench cluster`: disaggregated 1P1D against single-node on the same cores, under a mixed workload.

    mlx-pd bench cluster --rounds 4 --long-tokens 2048 --out cluster.json --markdown cluster.md
    mlx-pd bench cluster --project cluster.json        # only recompute the paper projection from a result

Two systems run the same engine settings (dtype, KV budget per engine, block size, prefill chunk) on the same
two CPUs: **single** is `taskset -c 0,1 mlx-pd serve`; **1p1d** is `mlx-pd worker` prefill-0 pinned to CPU 0
(`taskset` and the topology's `cpu_affinity`), `mlx-pd worker` decode-0 pinned to CPU 1 (each a stand-in for
one machine) and `mlx-pd router` on both, from a topology file generated in a temporary folder with free
ports. Short prompts (< `local_prefill_max_tokens`) are prefilled by the decode worker itself; long ones go to
the prefill worker, whose KV travels to the decode worker over tcp loopback.

One *slot* of the workload: `--short-concurrency` closed-loop workers stream short chats (unique ~55-token
prompts, `--short-max-tokens`) from the start until every long prompt of the slot has finished, while
`--long-per-round` long prompts (unique ~`--long-tokens`-token system prompts, so no cache hits) arrive
every `--long-interval-s` from `--long-first-s` on. Rounds alternate the systems ABBA (one system busy at a
time), so drift hits both alike. A short chat meets its SLO with TTFT <= `--slo-ttft-s` and TPOT <=
`--slo-tpot-ms`; a long request with TPOT <= `--slo-tpot-ms`; goodput = requests meeting their SLO per second
of slot time. Short chats are also split by whether they overlapped a long prompt's prefill (its send ->
first token), which is where single-node streams stall.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import httpx

from benchmarks.cluster_procs import make_workers, pinned, run_cluster, topology_toml, worker_stats
from benchmarks.compare import REPO_ROOT, machine_info
from benchmarks.loadgen import WorkloadConfig, make_prompts, send_request, warmup
from benchmarks.servers import ServerProcess, free_port, mlx_pd_command
from benchmarks.stats import RequestRecord, distribution, goodput

SYSTEMS = ("single", "1p1d")
ENGINE_FLAGS = ("block_size", "kv_cache_gb", "max_num_seqs", "prefill_chunk_size", "dtype")

# --- the mixed workload ------------------------------------------------------------------------------------


def long_messages(tokens, target: int, tag: str, seed: int = 0) -> list[dict]:
    """A unique ~`target`-token chat (a long system prompt tagged `tag`, then a short question)."""
    from benchmarks.workloads import system_prompt

    text = system_prompt(0, max(1, target - 40), tokens.count, tag=tag, seed=seed)
    return [{"role": "system", "content": text}, {"role": "user", "content": "Which rule cites section 42?"}]


def abba(names: Sequence[str], r: int) -> list[str]:
    """Round `r`'s order of two systems: ABBA (the first name first in rounds 0, 3, 4, 7, ...)."""
    return list(names) if r % 4 in (0, 3) or len(names) != 2 else list(names)[::-1]


async def mixed_slot(short_cfg, long_cfg, short_prompts: Sequence[str], long_keys: Sequence[str], *,
                     concurrency: int, first_s: float, interval_s: float) -> tuple[list, float]:
    """One slot (see the module doc): ([(kind, RequestRecord)], wall seconds)."""
    records: list[tuple[str, RequestRecord]] = []
    stop = asyncio.Event()
    queue = iter(short_prompts)
    width = concurrency + len(long_keys)
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(3600.0, connect=30.0)) as client:
        t0 = time.perf_counter()

        async def short_worker() -> None:
            for prompt in queue:  # shared: each prompt is taken once
                if stop.is_set():
                    return
                records.append(("short", await send_request(client, short_cfg, len(records), prompt, t0)))

        async def longs() -> None:
            tasks = []
            for i, key in enumerate(long_keys):
                await asyncio.sleep(max(0.0, t0 + first_s + i * interval_s - time.perf_counter()))
                tasks.append(asyncio.create_task(send_request(client, long_cfg, 100_000 + i, key, t0)))
            records.extend(("long", rec) for rec in await asyncio.gather(*tasks))
            stop.set()

        await asyncio.gather(longs(), *(short_worker() for _ in range(concurrency)))
        return records, time.perf_counter() - t0


def overlaps_prefill(rec: RequestRecord, longs: Sequence[RequestRecord]) -> bool:
    """Did `rec` run while some long request was between its send and its first token (or its end)?"""
    end = rec.start_s + (rec.e2e_s or 0.0)
    for q in longs:
        busy = q.ttft_s if q.ttft_s is not None else q.e2e_s
        if busy is not None and rec.start_s < q.start_s + busy and q.start_s < end:
            return True
    return False


def slos(kind: str, ttft_s: float, tpot_s: float) -> dict[str, float]:
    """The SLOs of a kind, as benchmarks/stats.py takes them: short chats TTFT and TPOT, long prompts TPOT."""
    return {"ttft_s": ttft_s, "tpot_s": tpot_s} if kind == "short" else {"tpot_s": tpot_s}


def kind_summary(recs: Sequence[RequestRecord], kind: str, wall_s: float, ttft_s: float, tpot_s: float) -> dict:
    """Latency distributions, SLO attainment and goodput (requests meeting the SLO per second) of one kind."""
    ok = [r for r in recs if r.ok]
    good = goodput(recs, wall_s, slos(kind, ttft_s, tpot_s))
    return {"n": len(recs), "errors": len(recs) - len(ok), "slo_met": good["good_requests"],
            "slo_attainment": good["attainment"], "goodput_rps": good["request_goodput"],
            "throughput_rps": len(ok) / wall_s if wall_s else float("nan"),
            "prompt_tokens_mean": _mean([r.prompt_tokens for r in ok]),
            "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
            "tpot_s": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
            "itl_s": distribution([g for r in ok for g in r.itls_s])}


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def summarize_system(slots: Sequence[tuple[list, float]], ttft_s: float, tpot_s: float) -> dict:
    """Per kind (short, long, and short split by overlap with a long prefill) over all slots of a system."""
    wall = sum(w for _, w in slots)
    short = [r for recs, _ in slots for k, r in recs if k == "short"]
    longs = [r for recs, _ in slots for k, r in recs if k == "long"]
    during, outside = [], []
    for recs, _ in slots:
        slot_longs = [r for k, r in recs if k == "long"]
        for k, r in recs:
            if k == "short":
                (during if overlaps_prefill(r, slot_longs) else outside).append(r)
    kinds = {"short": short, "long": longs, "short, during a long prefill": during, "short, no long prefill": outside}
    out = {kind: kind_summary(recs, "long" if kind == "long" else "short", wall, ttft_s, tpot_s)
           for kind, recs in kinds.items()}
    met = out["short"]["slo_met"] + out["long"]["slo_met"]
    return {"wall_s": wall, "kinds": out, "goodput_rps": met / wall if wall else float("nan")}


RATIO_KEYS = (("short", "tpot_s", "p50"), ("short", "tpot_s", "p99"), ("short", "itl_s", "p99"),
              ("short", "ttft_s", "p50"), ("short", "ttft_s", "p99"), ("long", "ttft_s", "p50"),
              ("long", "ttft_s", "p99"), ("short", "goodput_rps", None))
_LABELS = {"tpot_s": "TPOT", "itl_s": "ITL", "ttft_s": "TTFT", "goodput_rps": "goodput"}


def ratios(a: dict, b: dict) -> dict[str, float]:
    """a / b for the headline numbers (`a`, `b`: summarize_system results), keyed like "short TPOT p99"."""
    out = {}
    for kind, key, sub in RATIO_KEYS:
        x, y = a["kinds"][kind][key], b["kinds"][kind][key]
        x, y = (x, y) if sub is None else (x[sub], y[sub])
        out[f"{kind} {_LABELS[key]}" + (f" {sub}" if sub else "")] = x / y if y else float("nan")
    out["all goodput"] = a["goodput_rps"] / b["goodput_rps"] if b["goodput_rps"] else float("nan")
    return out


# --- the command ------------------------------------------------------------------------------------------


def _cpus(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c.strip()]


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--rounds", type=int, default=4, help="ABBA rounds, one slot per system each (default 4)")
    a("--short-concurrency", type=int, default=4, help="short chats in flight (closed loop)")
    a("--short-max-tokens", type=int, default=64)
    a("--long-tokens", type=int, default=2048, help="tokens of each long prompt (about)")
    a("--long-per-round", type=int, default=3, help="long prompts per slot")
    a("--long-interval-s", type=float, default=20.0, help="seconds between long prompts' arrivals")
    a("--long-first-s", type=float, default=5.0, help="when the first long prompt arrives in a slot")
    a("--long-max-tokens", type=int, default=16)
    a("--calibrate-tokens", type=int, default=4096,
      help="before the rounds, one prompt of this many tokens prefilled alone by the 1p1d prefill worker: the "
           "projection's prefill cost (0: none; the projection then uses the long prompts)")
    a("--slo-ttft-s", type=float, default=2.0, help="short chats' TTFT SLO")
    a("--slo-tpot-ms", type=float, default=150.0, help="TPOT SLO of every request")
    a("--prefill-chunk-size", type=int, default=512, help="both systems' engines")
    a("--kv-cache-gb", type=float, default=1.0, help="KV pool of each engine")
    a("--max-num-seqs", type=int, default=16)
    a("--local-prefill-max-tokens", type=int, default=512, help="1p1d: shorter prompts prefill on the decode worker")
    a("--transfer-timeout-s", type=float, default=600.0)
    a("--cpus", default="0,1", help="single-node CPUs (and the 1p1d router's)")
    a("--prefill-cpus", default="0")
    a("--decode-cpus", default="1")
    a("--systems", default="single,1p1d", help="which systems to run (a result with both has ratios)")
    a("--model-dir", default=None, help="mlx-lm model folder (default: the imported SmolLM2)")
    a("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a("--seed", type=int, default=0)
    a("--project", default=None, metavar="RESULT.json",
      help="run nothing: recompute the projection from an earlier result and print it")
    a("--out", default=None, help="write the full results as JSON")
    a("--markdown", default=None, help="also write the tables as Markdown here")


def engine_settings(args) -> dict:
    return {"block_size": 32, "kv_cache_gb": args.kv_cache_gb, "max_num_seqs": args.max_num_seqs,
            "prefill_chunk_size": args.prefill_chunk_size, "dtype": args.dtype}


def serve_flags(engine: dict) -> list[str]:
    """`mlx-pd serve` flags for the engine settings (dtype comes with mlx_pd_command)."""
    return [x for k in ENGINE_FLAGS if k != "dtype" for x in (f"--{k.replace('_', '-')}", str(engine[k]))]


@contextlib.contextmanager
def _systems(args, model_dir: str, tmp: str, log) -> Iterator[tuple[dict, dict]]:
    """({system: URL}, {system: {process name: ServerProcess}}) of the systems asked for, started and healthy."""
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    engine = engine_settings(args)
    urls, procs, workers = {}, {}, []
    with contextlib.ExitStack() as stack:
        if "single" in names:
            port = free_port()
            argv = pinned(mlx_pd_command(port, model_dir, args.dtype) + serve_flags(engine), _cpus(args.cpus))
            s = stack.enter_context(ServerProcess("single", argv, port, env={"PYTHONPATH": str(REPO_ROOT)},
                                                  cwd=str(REPO_ROOT), log_dir=tmp))
            log(f"single healthy on port {port} after {s.wait_healthy(600):.1f} s ({' '.join(argv[:3])} ...)")
            urls["single"], procs["single"] = s.url, {"serve": s}
        if "1p1d" in names:
            workers = make_workers([("prefill-0", "prefill", _cpus(args.prefill_cpus)),
                                    ("decode-0", "decode", _cpus(args.decode_cpus))])
            topo = Path(tmp) / "bench-1p1d.toml"
            topo.write_text(topology_toml(
                workers, free_port(), engine=engine, model_source=model_dir,
                routing={"policy": "prefix_aware", "local_prefill_max_tokens": args.local_prefill_max_tokens},
                transfer={"timeout_s": args.transfer_timeout_s}))
            c = stack.enter_context(run_cluster(workers, {"1p1d": str(topo)}, log_dir=tmp,
                                                router_cpus=_cpus(args.cpus), log=log))
            urls["1p1d"], procs["1p1d"] = c["routers"]["1p1d"].url, {**c["workers"], **c["routers"]}
            procs["1p1d"]["_workers"] = workers
        yield urls, procs


async def _run(args, urls: dict, long_msgs: dict, tokens, log) -> tuple[dict, Optional[dict]]:
    from benchmarks.prefix_bench import ChatWorkloadConfig

    short = {n: WorkloadConfig(url=u, max_tokens=args.short_max_tokens) for n, u in urls.items()}
    long = {n: ChatWorkloadConfig(url=u, max_tokens=args.long_max_tokens, messages=long_msgs) for n, u in urls.items()}
    calibration = None
    for name in urls:
        warm = await warmup(short[name], 2 * args.short_concurrency, args.short_concurrency, progress=False)
        long_msgs[f"warm/{name}"] = long_messages(tokens, 600, f"warm {name} {args.nonce}")
        async with httpx.AsyncClient(timeout=3600.0) as client:
            recs = warm + [await send_request(client, long[name], -1, f"warm/{name}", time.perf_counter())]
            if name == "1p1d" and args.calibrate_tokens:
                long_msgs["calibrate"] = long_messages(tokens, args.calibrate_tokens, f"calibrate {args.nonce}")
                cal = await send_request(client, long[name], -2, "calibrate", time.perf_counter())
                calibration = {"prompt_tokens": cal.prompt_tokens, "ttft_s": cal.ttft_s, "error": cal.error}
                log(f"calibration: {cal.prompt_tokens} tokens, TTFT {cal.ttft_s or float('nan'):.1f} s")
        bad = [r for r in recs if not r.ok]
        if bad:
            raise RuntimeError(f"{name}: {len(bad)} warm-up request(s) failed; first error: {bad[0].error}")
        log(f"{name}: warmed up ({len(recs)} requests)")
    slots: dict[str, list] = {n: [] for n in urls}
    for r in range(args.rounds):
        for i, name in enumerate(abba(list(urls), r)):
            keys = [f"long/{name}/{r}/{k}" for k in range(args.long_per_round)]
            prompts = make_prompts(2000, args.seed * 1000 + 10 * r + SYSTEMS.index(name), tag="chat")
            recs, wall = await mixed_slot(short[name], long[name], prompts, keys, concurrency=args.short_concurrency,
                                          first_s=args.long_first_s, interval_s=args.long_interval_s)
            slots[name].append((recs, wall))
            n_short = sum(k == "short" for k, _ in recs)
            log(f"round {r + 1}/{args.rounds} {name}: {wall:.0f} s, {n_short} short + {len(keys)} long, "
                f"{sum(not x.ok for _, x in recs)} errors, load {os.getloadavg()[0]:.2f}")
    return slots, calibration


def run_cluster_bench(args, log=None) -> dict:
    """`mlx-pd bench cluster`: returns the JSON-ready result (also printed as tables)."""
    from benchmarks.cluster_projection import measure_host_peaks, projection_from
    from benchmarks.prefix_report import print_tables
    from benchmarks.workloads import ChatTokens
    from cluster.model import resolve_model_path

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    if args.project:
        result = json.loads(Path(args.project).read_text())
        result["projection"] = projection_from(result)
        print_tables(cluster_tables(result))
        return result
    model_dir = args.model_dir or str(resolve_model_path(None, dtype=args.dtype))
    tokens = ChatTokens.from_model_dir(model_dir)
    args.nonce = f"{random.Random(args.seed).getrandbits(32):08x}"
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    long_msgs = {f"long/{n}/{r}/{k}": long_messages(tokens, args.long_tokens, f"long {n} {r} {k} {args.nonce}")
                 for n in names for r in range(args.rounds) for k in range(args.long_per_round)}
    result = {"kind": "cluster", "machine": machine_info(), "model_dir": model_dir, "engine": engine_settings(args),
              "args": {k: v for k, v in vars(args).items() if k not in ("out", "markdown", "project")},
              "host_peaks": measure_host_peaks(_cpus(args.prefill_cpus)), "systems": {}}
    log(f"host peaks on CPU {args.prefill_cpus}: {result['host_peaks']}")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mlx-pd-bench-cluster-") as tmp, _systems(args, model_dir, tmp, log) as (
            urls, procs):
        slots, result["calibration"] = asyncio.run(_run(args, urls, long_msgs, tokens, log))
        workers = procs.get("1p1d", {}).pop("_workers", [])
        result["worker_stats"] = worker_stats(workers) if workers else {}
        result["memory"] = {n: {k: p.memory() for k, p in ps.items()} for n, ps in procs.items()}
    result["wall_s"] = time.monotonic() - t0
    result["machine"]["loadavg_end"] = os.getloadavg()
    slo = (args.slo_ttft_s, args.slo_tpot_ms / 1000)
    for name, ss in slots.items():
        result["systems"][name] = {"summary": summarize_system(ss, *slo),
                                   "records": [{"kind": k, "round": i, **rec.to_dict()}
                                               for i, (recs, _) in enumerate(ss) for k, rec in recs]}
    if {"single", "1p1d"} <= set(slots):
        result["ratios"] = ratios(result["systems"]["1p1d"]["summary"], result["systems"]["single"]["summary"])
    result["errors"] = sum(k["errors"] for s in result["systems"].values()
                           for name, k in s["summary"]["kinds"].items() if name in ("short", "long"))
    result["projection"] = projection_from(result)
    print_tables(cluster_tables(result))
    return result


def cluster_tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    from benchmarks.cluster_projection import projection_tables
    from benchmarks.report import _ms, _num

    a = result["args"]
    header = ["system", "requests", "kind", "errors", "prompt tok", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
              "ITL p99", "SLO met", "goodput req/s"]
    rows = []
    for name, s in result["systems"].items():
        for kind, k in s["summary"]["kinds"].items():
            rows.append([name, str(k["n"]), kind, str(k["errors"]), _num(k["prompt_tokens_mean"], 0),
                         _ms(k["ttft_s"]["p50"]), _ms(k["ttft_s"]["p99"]), _ms(k["tpot_s"]["p50"]),
                         _ms(k["tpot_s"]["p99"]), _ms(k["itl_s"]["p99"]), f"{100 * k['slo_attainment']:.0f}%",
                         _num(k["goodput_rps"], 3)])
        rows.append([name, "", "all (goodput)", "", "", "", "", "", "", "", "", _num(s["summary"]["goodput_rps"], 3)])
    title = (f"Mixed workload, latencies in ms: {a['short_concurrency']} short chats streaming ({a['short_max_tokens']}"
             f" tokens) while {a['long_per_round']} long prompts ({a['long_max_tokens']} tokens) arrive every "
             f"{a['long_interval_s']:.0f} s, {a['rounds']} ABBA rounds; SLO: short TTFT <= {a['slo_ttft_s']} s, "
             f"TPOT <= {a['slo_tpot_ms']:.0f} ms")
    tables = [(title, header, rows)]
    if result.get("ratios"):
        r = result["ratios"]
        tables.append(("1p1d / single (lower is better for latencies, higher for goodput)", list(r),
                       [[_num(v) + "x" for v in r.values()]]))
    if result.get("projection"):
        tables += projection_tables(result["projection"])
    return tables


add_args, run, tables = add_cluster_args, run_cluster_bench, cluster_tables  # what benchmarks/cli.py calls
