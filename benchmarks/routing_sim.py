"""`mlx-pd bench routing-sim`: the router's placement at scale, with no model and no sockets.

    mlx-pd bench routing-sim --workers 64 --blocks 1000000 --placements 20000 --out sim.json

Builds the router's `PrefixIndex` for `--workers` workers (`--prefill-workers` of them prefill workers) from
synthetic KV events until it indexes `--blocks` distinct block hashes: `--tenants` tenant prefixes of
`--tenant-blocks` blocks, each held by `--replicas` random workers, and conversations that extend a tenant
prefix by 8-40 blocks, each held by one of that tenant's holders. Hashes are the real chained ones
(`cluster.kv.hashing.block_hashes` over random token ids); events are one hash each, as a worker's `BlockPool`
emits them, applied in batches of `--batch` (`PrefixIndex.apply_events`, timed per call).

Then `--placements` placements of `--prompt-tokens`-token prompts, a third each of: a tenant prefix plus a new
suffix, a known conversation plus a new suffix, and a prompt nobody holds. Each is timed from the prompt's
token ids to the chosen workers, exactly as the router does it: the first block's key
(`cluster.kv.hashing.first_block_key`), `PrefixIndex.match_prompt` (the prompt's `block_hashes`, then `match`) and
`router.placement.place` over
`WorkerState`s with random requests in flight. Reported: p50/p99/p99.9/max per step, the index's memory
(the objects it owns, counted with sys.getsizeof, and the process's RSS growth), event throughput with and
without the wire's msgpack + pydantic decoding, and the time garbage collections took during the placements.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time

import numpy as np

from benchmarks.stats import distribution, percentile


def add_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--workers", type=int, default=64)
    a("--prefill-workers", type=int, default=8)
    a("--blocks", type=int, default=1_000_000, help="distinct block hashes to index")
    a("--tenants", type=int, default=2000)
    a("--tenant-blocks", type=int, default=32, help="blocks of each tenant prefix (32 = 1k tokens)")
    a("--replicas", type=int, default=2, help="workers holding each tenant prefix")
    a("--batch", type=int, default=16, help="events per batch (a 512-token chunk fills 16 blocks)")
    a("--prompt-tokens", type=int, default=2048)
    a("--placements", type=int, default=20000)
    a("--block-size", type=int, default=32)
    a("--seed", type=int, default=0)
    a("--out", default=None, help="write the results as JSON")
    a("--markdown", default=None, help="also write the tables as Markdown here")


def rss_mib() -> float:
    try:
        for line in open(f"/proc/{os.getpid()}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def index_bytes(index) -> int:
    """Bytes of the objects a PrefixIndex owns: the holders dicts, their keys and masks, the per-worker sets."""
    size = sys.getsizeof(index.holders) + sum(
        sys.getsizeof(held) + sum(sys.getsizeof(h) + sys.getsizeof(m) for h, m in held.items())
        for held in index.holders.values())
    return size + sum(sys.getsizeof(g.hashes) for w in index.workers.values() for g in w.groups.values())


class Synthetic:
    """The synthetic cluster: tenant prefixes and conversations as (token ids, hashes, holders)."""

    def __init__(self, args):
        self.args, self.bs = args, args.block_size
        self.rng = np.random.default_rng(args.seed)
        self.key = self.first_key(None)
        self.names = [f"{'prefill' if i < args.prefill_workers else 'decode'}-{i}" for i in range(args.workers)]
        self.tenants: list[tuple[np.ndarray, list[int], list[int]]] = []
        self.sample: list[np.ndarray] = []  # some conversations' token ids, for placement prompts

    def first_key(self, cache_salt) -> int:
        """The first block's key of the simulated model and KV format, as every worker and the router key it."""
        from cluster.kv.hashing import first_block_key

        return first_block_key("sim-model", "rev0", "bfloat16", None, 64, self.bs, cache_salt)

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, 49152, n, dtype=np.int64)

    def stored(self):
        """(worker slot, hashes) of every block a worker stores, until `--blocks` distinct hashes exist."""
        from cluster.kv.hashing import block_hashes

        a, made = self.args, 0
        for _ in range(a.tenants):
            toks = self.tokens(a.tenant_blocks * self.bs)
            hashes = block_hashes(toks, self.bs, self.key)
            holders = self.rng.choice(a.workers, size=min(a.replicas, a.workers), replace=False).tolist()
            self.tenants.append((toks, hashes, holders))
            made += len(hashes)
            for w in holders:
                yield w, hashes
        while made < a.blocks:
            toks, hashes, holders = self.tenants[int(self.rng.integers(len(self.tenants)))]
            n = min(int(self.rng.integers(8, 41)), a.blocks - made)
            conv = np.concatenate([toks, self.tokens(n * self.bs)])
            new = block_hashes(conv, self.bs, self.key, start=len(hashes), parent=hashes[-1])
            if len(self.sample) < 2000:
                self.sample.append(conv)
            made += len(new)
            yield holders[int(self.rng.integers(len(holders)))], new

    def prompt(self, kind: str) -> tuple[int, ...]:
        n = self.args.prompt_tokens
        if kind == "tenant":
            head = self.tenants[int(self.rng.integers(len(self.tenants)))][0]
        elif kind == "conversation":
            head = self.sample[int(self.rng.integers(len(self.sample)))]
        else:
            head = np.zeros(0, np.int64)
        head = head[:n]
        return tuple(np.concatenate([head, self.tokens(n - len(head))]).tolist())


def build_index(syn: Synthetic, batch: int):
    """(PrefixIndex, {blocks, events, seconds, ...}) with every stored hash applied as one-hash events."""
    from cluster.kv.block_pool import KVEvent
    from router.prefix_index import PrefixIndex

    index = PrefixIndex(syn.names)
    for name in syn.names:
        index.apply_snapshot(name, "boot", 0, [(0, None, [])])  # one group, every block
    seqs = [0] * len(syn.names)
    pending: dict[int, list] = {}
    spent, events = 0.0, 0

    def flush(slot: int) -> float:
        t0 = time.perf_counter()
        ok = index.apply_events(syn.names[slot], "boot", pending.pop(slot))
        dt = time.perf_counter() - t0
        assert ok, "a batch was refused (sequence gap)"
        return dt

    for slot, hashes in syn.stored():
        for h in hashes:
            seqs[slot] += 1
            pending.setdefault(slot, []).append(KVEvent(seqs[slot], "stored", (h,)))
            events += 1
            if len(pending[slot]) >= batch:
                spent += flush(slot)
    for slot in list(pending):
        spent += flush(slot)
    return index, {"events": events, "distinct_blocks": len(index), "seconds": spent,
                   "events_per_s": events / spent if spent else float("nan")}


def wire_throughput(syn: Synthetic, index, batch: int, blocks: int = 100_000) -> dict:
    """Blocks/s of the router's whole path for `blocks` more one-hash events: msgpack + pydantic decode, apply."""
    from cluster.kv.hashing import block_hashes
    from cluster.protocol import KV_EVENTS, PROTOCOL_VERSION, KVEvent, KVEvents, pack, unpack

    name = syn.names[-1]
    w = index.workers[name]
    toks = syn.tokens((blocks + 1) * syn.bs)
    hashes = block_hashes(toks, syn.bs, syn.key ^ 1)[:blocks]
    frames, base = [], w.last_seq
    for i in range(0, blocks, batch):
        evs = [KVEvent(seq=base + j + 1, kind="stored", block_hashes=[h])
               for j, h in enumerate(hashes[i:i + batch], start=i)]
        frames.append(pack(KVEvents(worker=name, boot_id="boot", events=evs)))
    decode = apply = 0.0
    for frame in frames:
        t0 = time.perf_counter()
        msg = unpack(frame, KV_EVENTS, PROTOCOL_VERSION)
        t1 = time.perf_counter()
        assert index.apply_events(msg.worker, msg.boot_id, msg.events)
        apply += time.perf_counter() - t1
        decode += t1 - t0
    removal = [KVEvent(seq=w.last_seq + 1, kind="removed", block_hashes=hashes)]
    t0 = time.perf_counter()
    index.apply_events(name, "boot", removal)
    removed = time.perf_counter() - t0
    return {"blocks": blocks, "decode_s": decode, "apply_s": apply,
            "blocks_per_s_decode_and_apply": blocks / (decode + apply), "blocks_per_s_apply": blocks / apply,
            "removed_blocks_per_s": blocks / removed}


def place_many(syn: Synthetic, index, n: int) -> dict:
    """Time `n` placements (hashing + match, place) and the garbage collections that ran meanwhile."""
    from cluster.request import GenerateRequest
    from cluster.stats import KVGroupStats, WorkerStats
    from cluster.topology import RoutingSection, WorkerSpec
    from router.placement import WorkerState, place

    routing = RoutingSection(policy="prefix_aware")
    rnd = random.Random(syn.args.seed)
    workers = []
    for i, name in enumerate(syn.names):
        role = "prefill" if name.startswith("prefill") else "decode"
        w = WorkerState(WorkerSpec(name, role, 10000 + i, kv_port=20000 + i if role == "decode" else None))
        w.alive, w.stats = True, WorkerStats(kv_groups=(KVGroupStats("full", 5000, rnd.randrange(0, 5000)),))
        w.inflight = {f"x{i}-{k}" for k in range(rnd.randrange(0, 9))}
        workers.append(w)
    kinds = ("tenant", "conversation", "cold")
    times = {"match_s": [], "place_s": [], "total_s": []}
    by_kind: dict[str, list] = {k: [] for k in kinds}
    gcs: list[float] = []
    started = {}

    def on_gc(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            gcs.append(time.perf_counter() - started.pop("t"))

    prompts = [(kinds[i % 3], syn.prompt(kinds[i % 3])) for i in range(n)]
    gc.callbacks.append(on_gc)
    try:
        for i, (kind, tokens) in enumerate(prompts):
            request = GenerateRequest(f"r{i}", tokens)
            t0 = time.perf_counter()
            cached = index.match_prompt(request.prompt_token_ids, syn.bs, syn.first_key(request.cache_salt))
            t1 = time.perf_counter()
            prefill, decode = place(workers, request, routing, cached, syn.bs)
            t2 = time.perf_counter()
            times["match_s"].append(t1 - t0)
            times["place_s"].append(t2 - t1)
            times["total_s"].append(t2 - t0)
            by_kind[kind].append(t2 - t0)
            decode.inflight.add(request.request_id)  # load moves: requests arrive and leave
            victim = workers[rnd.randrange(len(workers))]
            if victim.inflight:
                victim.inflight.pop()
    finally:
        gc.callbacks.remove(on_gc)
    out = {k: {**distribution(v), "p99.9": percentile(v, 99.9)} for k, v in times.items()}
    out["by_kind_total_s"] = {k: {**distribution(v), "p99.9": percentile(v, 99.9)} for k, v in by_kind.items()}
    out["gc"] = {"collections": len(gcs), "max_s": max(gcs, default=0.0), "total_s": sum(gcs)}
    out["placements"] = n
    return out


def run(args, log=None) -> dict:
    """`mlx-pd bench routing-sim`: returns the JSON-ready result (also printed as tables)."""
    from benchmarks.compare import machine_info
    from benchmarks.prefix_report import print_tables

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    syn = Synthetic(args)
    rss0 = rss_mib()
    t0 = time.perf_counter()
    index, build = build_index(syn, args.batch)
    build["wall_s"] = time.perf_counter() - t0
    log(f"index: {build['distinct_blocks']} distinct blocks from {build['events']} events in {build['wall_s']:.0f} s "
        f"(apply {build['seconds']:.1f} s)")
    memory = {"index_objects_mib": index_bytes(index) / 2**20, "rss_growth_mib": rss_mib() - rss0,
              "held_blocks": sum(index.num_blocks(name) for name in index.workers)}
    wire = wire_throughput(syn, index, args.batch)
    placement = place_many(syn, index, args.placements)
    result = {"kind": "routing-sim", "machine": machine_info(), "args": {k: v for k, v in vars(args).items()
                                                                         if k not in ("out", "markdown")},
              "build": build, "memory": memory, "wire": wire, "placement": placement,
              "target_met": placement["total_s"]["p99"] < 1e-3}
    result["machine"]["loadavg_end"] = os.getloadavg()
    print_tables(tables(result))
    return result


def tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    a, p = result["args"], result["placement"]
    us = lambda x: f"{x * 1e6:.0f}"  # noqa: E731
    h1 = ["step (us)", "p50", "p99", "p99.9", "max", "mean"]
    labels = (("hash + match (match_prompt)", p["match_s"]), ("place", p["place_s"]), ("total", p["total_s"]),
              *((f"total, {k} prompts", v) for k, v in p["by_kind_total_s"].items()))
    r1 = [[label, us(d["p50"]), us(d["p99"]), us(d["p99.9"]), us(d["max"]), us(d["mean"])] for label, d in labels]
    b, m, w, g = result["build"], result["memory"], result["wire"], p["gc"]
    h2 = ["quantity", "value"]
    r2 = [["distinct blocks indexed / held by workers", f"{b['distinct_blocks']:,} / {m['held_blocks']:,}"],
          ["index objects (sys.getsizeof)", f"{m['index_objects_mib']:.0f} MiB"],
          ["process RSS growth while building", f"{m['rss_growth_mib']:.0f} MiB"],
          ["apply_events, one-hash events", f"{b['events_per_s'] / 1e3:.0f}k blocks/s"],
          ["msgpack + pydantic decode, then apply", f"{w['blocks_per_s_decode_and_apply'] / 1e3:.0f}k blocks/s"],
          ["removed (one batch)", f"{w['removed_blocks_per_s'] / 1e3:.0f}k blocks/s"],
          ["GC during the placements", f"{g['collections']} collections, max {g['max_s'] * 1e3:.1f} ms"],
          ["target: placement p99 < 1 ms", "met" if result["target_met"] else "MISSED"]]
    title = (f"Placement of {a['prompt_tokens']}-token prompts, {a['workers']} workers ({a['prefill_workers']} "
             f"prefill), {p['placements']} placements")
    return [(title, h1, r1), ("index", h2, r2)]
