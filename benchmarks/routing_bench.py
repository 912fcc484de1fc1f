"""`mlx-pd bench routing`: prefix-aware routing against round-robin and least-loaded on a 1P2D cluster.

    mlx-pd bench routing --users 32 --rounds 2 --out routing.json --markdown routing.md

One prefill worker and two decode workers run as `mlx-pd worker` processes (prefill-0 on `--prefill-cpus`,
both decode workers on `--decode-cpus`), started once; one `mlx-pd router` per policy runs over the same
workers (each from its own generated topology file, differing only in `[routing] policy` and the port), so
the policies see identical workers. Workload (benchmarks/workloads.py, as `bench chat`): `--system-prompts`
tenants with ~`--system-tokens`-token system prompts, `--users` users (user u -> tenant u mod N), `--turns`
turns each (turn t+1 = turn t's messages + the reply + a new question), a worker running one user's turns back
to back, `--concurrency` workers. The users are split into `--rounds` parts; every part runs once per policy,
policies in ABC / CBA order, and before each slot POST /reset_prefix_cache empties every worker's prefix cache,
so every slot starts cold and each policy gets the same requests.

Hit rate = prompt tokens a worker did not recompute (its scheduler's prefix-cache hits, read from each worker
with a Ping before and after the slot: the prefill worker's for disaggregated requests, the decode worker's for
locally prefilled ones) / prompt tokens. The ideal is what one infinite cache could have served (the longest
prefix another request had computed when this one was sent; see benchmarks/workloads.py), per slot. The
`usage.cached_tokens` the client sees are also reported: for a disaggregated request they are the larger of
the prefill worker's hit and the blocks the decode worker already held (which the transfer skips).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.cluster_procs import make_workers, run_cluster, topology_toml, worker_stats
from benchmarks.compare import machine_info, split_rounds
from benchmarks.stats import merge_rounds

POLICIES = ("prefix_aware", "round_robin", "least_loaded")
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "kv_blocks_received", "tokens_out")


def add_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--policies", default=",".join(POLICIES), help="routing policies to compare (one router each)")
    a("--system-prompts", type=int, default=8, help="tenants, one system prompt each")
    a("--system-tokens", type=int, default=1000, help="system prompt length in tokens (at least)")
    a("--users", type=int, default=32)
    a("--turns", type=int, default=2)
    a("--concurrency", type=int, default=8)
    a("--max-tokens", type=int, default=32, help="output tokens per turn")
    a("--rounds", type=int, default=2, help="parts of the users; each runs once per policy (ABC, CBA, ...)")
    a("--prefill-cpus", default="0")
    a("--decode-cpus", default="1", help="CPUs of both decode workers")
    a("--router-cpus", default="0,1")
    a("--kv-cache-gb", type=float, default=1.0, help="KV pool of each worker")
    a("--prefill-chunk-size", type=int, default=512)
    a("--local-prefill-max-tokens", type=int, default=256, help="the topology default")
    a("--transfer-timeout-s", type=float, default=600.0)
    a("--block-size", type=int, default=32)
    a("--model-dir", default=None)
    a("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a("--seed", type=int, default=0)
    a("--out", default=None, help="write the full results as JSON")
    a("--markdown", default=None, help="also write the tables as Markdown here")


def policy_order(policies, r: int) -> list[str]:
    """ABC in even rounds, CBA in odd ones."""
    return list(policies) if r % 2 == 0 else list(policies)[::-1]


def counter_delta(before: dict, after: dict) -> dict:
    """Per worker, the growth of COUNTERS between two worker_stats() snapshots (None when a probe failed)."""
    out = {}
    for name in before:
        b, a = before[name], after.get(name)
        out[name] = None if not (a and b) else {k: (a.get(k) or 0) - (b.get(k) or 0) for k in COUNTERS}
    return out


def _cpus(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c.strip()]


def _topologies(args, workers, model_dir: str, tmp: str, policies) -> dict[str, str]:
    from benchmarks.servers import free_port

    engine = {"block_size": args.block_size, "kv_cache_gb": args.kv_cache_gb, "prefill_chunk_size":
              args.prefill_chunk_size, "dtype": args.dtype, "max_num_seqs": 16}
    out = {}
    for policy in policies:
        path = Path(tmp) / f"bench-1p2d-{policy}.toml"
        path.write_text(topology_toml(workers, free_port(), engine=engine, model_source=model_dir,
                                      routing={"policy": policy,
                                               "local_prefill_max_tokens": args.local_prefill_max_tokens},
                                      transfer={"timeout_s": args.transfer_timeout_s}))
        out[policy] = str(path)
    return out


async def _slots(args, urls: dict, workers, convs, policies, log) -> dict:
    from benchmarks.loadgen import warmup
    from benchmarks.chat_prefix_bench import _chat_round
    from benchmarks.prefix_bench import ChatWorkloadConfig

    cfgs = {p: ChatWorkloadConfig(url=u, max_tokens=args.max_tokens, messages={}) for p, u in urls.items()}
    for p, cfg in cfgs.items():
        bad = [r for r in await warmup(cfg, 2, 2, progress=False) if not r.ok]
        if bad:
            raise RuntimeError(f"{p}: warm-up failed: {bad[0].error}")
    runs: dict[str, list] = {p: [] for p in policies}
    parts = split_rounds(convs, args.rounds)
    for r, part in enumerate(parts):
        for p in policy_order(policies, r):
            async with httpx.AsyncClient(timeout=600.0) as client:
                reset = (await client.post(urls[p] + "/reset_prefix_cache")).json()
            before = worker_stats(workers)
            results, wall = await _chat_round(cfgs[p], part, args.concurrency, time.perf_counter())
            delta = counter_delta(before, worker_stats(workers))
            runs[p].append({"results": results, "wall_s": wall, "workers": delta, "reset": reset})
            log(f"round {r + 1}/{len(parts)} {p}: {len(results)} requests in {wall:.0f} s, "
                f"{sum(not x.rec.ok for x in results)} errors, load {os.getloadavg()[0]:.2f}, workers {delta}")
    return runs


def policy_summary(slots: list, tokens, block_size: int) -> dict:
    """TTFT/TPOT over a policy's slots, and hit rates: worker counters and usage against the per-slot ideal."""
    from benchmarks.chat_prefix_bench import chat_hit_rates

    summary = merge_rounds([([x.rec for x in s["results"]], s["wall_s"]) for s in slots])
    sums = {k: 0 for k in ("prompt_tokens", "usage_cached", "ideal", "block_ideal", "queries", "hits")}
    where = {}
    for s in slots:
        h = chat_hit_rates(s["results"], tokens, block_size)["all"]
        sums["prompt_tokens"] += h["prompt_tokens"]
        sums["usage_cached"] += h["cached_tokens"]
        sums["ideal"] += h["ideal_tokens"]
        sums["block_ideal"] += h["block_ideal_tokens"]
        for name, d in s["workers"].items():
            if d is None:
                continue
            sums["queries"] += d["prefix_cache_queries"]
            sums["hits"] += d["prefix_cache_hits"]
            w = where.setdefault(name, dict.fromkeys(COUNTERS, 0))
            for k in COUNTERS:
                w[k] += d[k]
    nan = float("nan")
    ratio = lambda a, b: a / b if b else nan  # noqa: E731
    return {"summary": summary, "tokens": sums, "workers": where,
            "hit_rate": ratio(sums["hits"], sums["queries"]), "ideal_rate": ratio(sums["ideal"], sums["prompt_tokens"]),
            "of_ideal": ratio(sums["hits"], sums["ideal"]), "of_block_ideal": ratio(sums["hits"], sums["block_ideal"]),
            "usage_hit_rate": ratio(sums["usage_cached"], sums["prompt_tokens"])}


def run(args, log=None) -> dict:
    """`mlx-pd bench routing`: returns the JSON-ready result (also printed as tables)."""
    from benchmarks.prefix_report import print_tables
    from benchmarks.workloads import ChatTokens, build_conversations, system_prompt
    from cluster.model import resolve_model_path

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    model_dir = args.model_dir or str(resolve_model_path(None, dtype=args.dtype))
    tokens = ChatTokens.from_model_dir(model_dir)
    nonce = f"{random.Random(args.seed).getrandbits(32):08x}"
    systems = [system_prompt(i, args.system_tokens, tokens.count, tag=f"tenant {i} {nonce}", seed=args.seed)
               for i in range(args.system_prompts)]
    convs = build_conversations(args.users, systems, args.turns, args.seed)
    workers = make_workers([("prefill-0", "prefill", _cpus(args.prefill_cpus)),
                            ("decode-0", "decode", _cpus(args.decode_cpus)),
                            ("decode-1", "decode", _cpus(args.decode_cpus))])
    result = {"kind": "routing", "machine": machine_info(), "model_dir": model_dir,
              "args": {k: v for k, v in vars(args).items() if k not in ("out", "markdown")},
              "system_prompt_tokens": [tokens.count(s) for s in systems], "policies": {}}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mlx-pd-bench-routing-") as tmp:
        topologies = _topologies(args, workers, model_dir, tmp, policies)
        with run_cluster(workers, topologies, log_dir=tmp, router_cpus=_cpus(args.router_cpus), log=log) as procs:
            urls = {p: r.url for p, r in procs["routers"].items()}
            runs = asyncio.run(_slots(args, urls, workers, convs, policies, log))
    result["wall_s"] = time.monotonic() - t0
    result["machine"]["loadavg_end"] = os.getloadavg()
    for p, slots in runs.items():
        result["policies"][p] = {**policy_summary(slots, tokens, args.block_size),
                                 "records": [{"round": i, "key": x.conv.key(x.turn), **x.rec.to_dict()}
                                             for i, s in enumerate(slots) for x in s["results"]]}
    result["errors"] = sum(s["summary"]["errors"] for s in result["policies"].values())
    pa, rr = result["policies"].get("prefix_aware"), result["policies"].get("round_robin")
    if pa and rr:
        result["targets"] = {"of_ideal": pa["of_ideal"],
                             "ttft_p50_rr_over_pa": rr["summary"]["ttft_s"]["p50"] / pa["summary"]["ttft_s"]["p50"]}
    print_tables(tables(result))
    return result


def tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    from benchmarks.report import _ms, _num

    pct = lambda x: "-" if x is None or x != x else f"{100 * x:.1f}%"  # noqa: E731
    a = result["args"]
    h1 = ["policy", "requests", "errors", "TTFT p50", "TTFT p99", "TPOT p50", "out tok/s", "hit rate (workers)",
          "ideal rate", "hits / ideal", "hits / block ideal", "usage cached rate"]
    h2 = ["policy", "worker", "prompt tok looked up", "hit tok", "KV blocks received", "tokens out"]
    r1, r2 = [], []
    for p, s in result["policies"].items():
        m = s["summary"]
        r1.append([p, str(m["requests"]), str(m["errors"]), _ms(m["ttft_s"]["p50"]), _ms(m["ttft_s"]["p99"]),
                   _ms(m["tpot_s"]["p50"]), _num(m["output_throughput"]), pct(s["hit_rate"]), pct(s["ideal_rate"]),
                   pct(s["of_ideal"]), pct(s["of_block_ideal"]), pct(s["usage_hit_rate"])])
        for w, d in s["workers"].items():
            r2.append([p, w, str(d["prefix_cache_queries"]), str(d["prefix_cache_hits"]), str(d["kv_blocks_received"]),
                       str(d["tokens_out"])])
    title = (f"1P2D, {a['system_prompts']} system prompts of ~{a['system_tokens']} tokens, {a['users']} users x "
             f"{a['turns']} turns, concurrency {a['concurrency']}, {a['max_tokens']} output tokens, {a['rounds']} "
             "rounds (caches reset before every slot); latencies in ms")
    out = [(title, h1, r1), ("where the prompts were computed (worker counters summed over the slots)", h2, r2)]
    if result.get("targets"):
        t = result["targets"]
        out.append(("targets", ["prefix_aware hits / ideal (>= 90%)", "TTFT p50 round_robin / prefix_aware (>= 2x)"],
                    [[pct(t["of_ideal"]), _num(t["ttft_p50_rr_over_pa"]) + "x"]]))
    return out
