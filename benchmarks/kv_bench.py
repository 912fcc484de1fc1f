"""KV-cache formats: bytes per token measured from the pool, sequences per budget, and decode speed.

    mlx-pd bench kv                                   # the pool table only (no server, seconds)
    mlx-pd bench kv --engine-check --decode --out kv.json

**Pool table.** For each format (float32, bfloat16, float16; 8- and 4-bit with `--group-size` 64, with
float32 scales as on the CPU backend's default dtype and float16 scales as on a Mac's half dtypes) a
`cluster.kv.store.KVStore` of `--probe-blocks` blocks is allocated and its `nbytes` divided by blocks x
block_size: the bytes per token the pool really holds, next to the formula (`kv_bytes_per_block`) and
the textbook layers x 2 x kv_heads x head_dim x bytes. Then the engine's pool for `--kv-cache-gb`
(EngineCore: 1 + budget // bytes per block blocks, the first one the null block) and how many
`--seq-len`-token sequences fit in it at once.

**--engine-check** starts `mlx-pd serve --kv-cache-gb G --dtype D [--kv-bits B]` for each format and
reads the engine's own pool size from ``GET /metrics`` (``mlx_pd_kv_group_blocks_total{group="full"}``: usable blocks),
so the table's block counts are the engine's, not a copy of its arithmetic.

**--decode** starts two servers, unquantized and `--decode-kv-bits` (default 8), and runs the same
unique prompts through both with the load generator at `--concurrency` (default 8), `--max-tokens`
(default 64) each, in ABBA rounds like `bench --compare`: output tok/s and TPOT.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Optional

from benchmarks.compare import eos_token_ids, machine_info, split_rounds
from benchmarks.loadgen import WorkloadConfig, make_prompts, run_load, warmup
from benchmarks.prefix_bench import interleave, prom_counters, running_servers
from benchmarks.servers import mlx_pd_command
from benchmarks.stats import merge_rounds

POOL_BLOCKS = 'mlx_pd_kv_group_blocks_total{group="full"}'  # the engine's usable blocks (GET /metrics)
# (label, dtype of values / scales, kv_bits)
FORMATS = (("float32", "float32", None), ("bfloat16", "bfloat16", None), ("float16", "float16", None),
           ("8-bit (f32 scales)", "float32", 8), ("4-bit (f32 scales)", "float32", 4),
           ("8-bit (f16 scales)", "float16", 8), ("4-bit (f16 scales)", "float16", 4))


def engine_num_blocks(kv_cache_gb: float, bytes_per_block: int) -> int:
    """Blocks in the engine's pool for a budget: `cluster.engine.EngineCore`'s rule (1 + budget //
    bytes per block; block 0 is the null block). `--engine-check` compares it with the engine's own."""
    return 1 + int(kv_cache_gb * 2**30 // bytes_per_block)


def pool_row(spec, label: str, dtype: str, kv_bits: Optional[int], *, group_size: int = 64, block_size: int = 32,
             probe_blocks: int = 16, kv_cache_gb: float = 1.0, seq_len: int = 2048) -> dict:
    """One format's measured bytes per token and its capacity under `kv_cache_gb` (see the module doc)."""
    import mlx.core as mx

    from cluster.kv.store import KVStore, kv_bytes_per_block

    store = KVStore(spec, probe_blocks, block_size, dtype, kv_bits, group_size)
    measured = store.nbytes / (probe_blocks * block_size)
    del store
    per_block = kv_bytes_per_block(spec, block_size, dtype, kv_bits, group_size)
    blocks = engine_num_blocks(kv_cache_gb, per_block)
    usable = blocks - 1
    itemsize = mx.zeros((), getattr(mx, dtype)).itemsize
    return {"label": label, "dtype": dtype, "kv_bits": kv_bits, "group_size": group_size if kv_bits else None,
            "bytes_per_token": measured, "formula_bytes_per_token": per_block / block_size,
            "seeds_formula_bytes_per_token": spec.kv_bytes_per_token(itemsize) if kv_bits is None else None,
            "num_blocks": blocks, "usable_blocks": usable, "max_seqs": usable * block_size // seq_len}


def pool_table(spec, *, group_size: int = 64, block_size: int = 32, probe_blocks: int = 16, kv_cache_gb: float = 1.0,
               seq_len: int = 2048, formats=FORMATS) -> list[dict]:
    """`pool_row` for each format, with `vs_float16`: max_seqs over float16's."""
    rows = [pool_row(spec, label, dtype, bits, group_size=group_size, block_size=block_size,
                     probe_blocks=probe_blocks, kv_cache_gb=kv_cache_gb, seq_len=seq_len)
            for label, dtype, bits in formats]
    f16 = next((r["max_seqs"] for r in rows if r["dtype"] == "float16" and r["kv_bits"] is None), None)
    for r in rows:
        r["vs_float16"] = r["max_seqs"] / f16 if f16 else float("nan")
    return rows


def _serve_flags(dtype: str, kv_bits: Optional[int], group_size: int, kv_cache_gb: float, block_size: int) -> list[str]:
    flags = ["--kv-cache-gb", str(kv_cache_gb), "--block-size", str(block_size)]
    if kv_bits:
        flags += ["--kv-bits", str(kv_bits), "--kv-group-size", str(group_size)]
    return flags


def engine_check(rows: list[dict], model_dir: str, *, group_size: int, kv_cache_gb: float, block_size: int,
                 log) -> None:
    """Start one server per format (one at a time) and store its /metrics pool size in each row."""
    for r in rows:
        flags = _serve_flags(r["dtype"], r["kv_bits"], group_size, kv_cache_gb, block_size)
        argv = {r["label"]: lambda port, d=r["dtype"], f=flags: mlx_pd_command(port, model_dir, d) + f}
        with running_servers(argv, log=log) as servers:
            got = prom_counters(servers[r["label"]].url, [POOL_BLOCKS])
        r["engine_usable_blocks"] = got[POOL_BLOCKS]


async def _decode(urls: dict[str, str], *, num_requests: int, concurrency: int, max_tokens: int, rounds: int,
                  seed: int, suppress: tuple[int, ...], log) -> dict:
    cfgs = {n: WorkloadConfig(url=u, max_tokens=max_tokens, suppress_token_ids=suppress) for n, u in urls.items()}
    for cfg in cfgs.values():
        await warmup(cfg, max(2, concurrency), concurrency, seed=seed, progress=False)
    parts = split_rounds(make_prompts(num_requests, seed), rounds)
    done: dict[str, list] = {n: [] for n in urls}
    for r, part in enumerate(parts):
        for name in interleave(list(urls), r):
            recs, dur = await run_load(cfgs[name], part, concurrency=concurrency, progress=False)
            done[name].append((recs, dur))
            log(f"round {r + 1}/{len(parts)} {name}: {sum(x.output_tokens for x in recs) / dur:.1f} tok/s")
    texts = {n: {rec.prompt: rec.text for recs, _ in done[n] for rec in recs} for n in urls}
    a, b = list(urls)
    return {"summaries": {n: merge_rounds(done[n]) for n in urls},
            "identical_text": sum(texts[a][p] == texts[b].get(p) for p in texts[a]), "pairs": len(texts[a])}


def decode_run(model_dir: str, *, kv_bits: int, group_size: int, kv_cache_gb: float, block_size: int,
               num_requests: int, concurrency: int, max_tokens: int, rounds: int, seed: int, log) -> dict:
    """Unquantized vs `kv_bits` KV on two live servers (float32 weights), same prompts, ABBA rounds."""
    full, quant = "kv float32", f"kv {kv_bits}-bit"
    argvs = {full: lambda p: mlx_pd_command(p, model_dir, "float32") + _serve_flags("float32", None, group_size,
                                                                                    kv_cache_gb, block_size),
             quant: lambda p: mlx_pd_command(p, model_dir, "float32") + _serve_flags("float32", kv_bits, group_size,
                                                                                     kv_cache_gb, block_size)}
    with running_servers(argvs, log=log) as servers:
        urls = {n: s.url for n, s in servers.items()}
        blocks = {n: prom_counters(u, [POOL_BLOCKS])[POOL_BLOCKS] for n, u in urls.items()}
        load_start = os.getloadavg()
        out = asyncio.run(_decode(urls, num_requests=num_requests, concurrency=concurrency, max_tokens=max_tokens,
                                  rounds=rounds, seed=seed, suppress=eos_token_ids(model_dir), log=log))
        memory = {n: s.memory() for n, s in servers.items()}
    return {**out, "engine_usable_blocks": blocks, "memory": memory, "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(), "concurrency": concurrency, "max_tokens": max_tokens,
            "num_requests": num_requests, "commands": {n: a(0)[2:] for n, a in argvs.items()}}


# --- the command ------------------------------------------------------------------------------------


def add_kv_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=None, help="mlx-lm model folder (default: the imported SmolLM2)")
    p.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128])
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--probe-blocks", type=int, default=16, help="blocks of the KVStore measured per format")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="the budget the capacity column assumes")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence in the capacity column")
    p.add_argument("--engine-check", action="store_true", help="read each format's pool size from a live engine")
    p.add_argument("--decode", action="store_true", help="decode throughput: unquantized vs --decode-kv-bits")
    p.add_argument("--decode-kv-bits", type=int, default=8, choices=[4, 8])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=32, help="measured requests per server (--decode)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the full results as JSON")
    p.add_argument("--markdown", default=None, help="also write the tables as Markdown here")


def run_kv(args, log=None) -> dict:
    """`mlx-pd bench kv`: returns the JSON-ready result (also printed as tables)."""
    from cluster.model import read_model_spec, resolve_model_path

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    model_dir = args.model_dir or str(resolve_model_path(None, dtype="float32"))
    spec = read_model_spec(Path(model_dir))
    rows = pool_table(spec, group_size=args.group_size, block_size=args.block_size, probe_blocks=args.probe_blocks,
                      kv_cache_gb=args.kv_cache_gb, seq_len=args.seq_len)
    result = {"kind": "kv", "machine": machine_info(), "model_dir": model_dir,
              "spec": {"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim},
              "block_size": args.block_size, "kv_cache_gb": args.kv_cache_gb, "seq_len": args.seq_len, "pool": rows}
    t0 = time.perf_counter()
    if args.engine_check:
        engine_check(rows, model_dir, group_size=args.group_size, kv_cache_gb=args.kv_cache_gb,
                     block_size=args.block_size, log=log)
    if args.decode:
        result["decode"] = decode_run(model_dir, kv_bits=args.decode_kv_bits, group_size=args.group_size,
                                      kv_cache_gb=args.kv_cache_gb, block_size=args.block_size,
                                      num_requests=args.num_requests, concurrency=args.concurrency,
                                      max_tokens=args.max_tokens, rounds=args.rounds, seed=args.seed, log=log)
    result["wall_s"] = time.perf_counter() - t0
    from benchmarks.prefix_report import print_tables

    print_tables(kv_tables(result))
    return result


def kv_tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    from benchmarks.report import _ms, _num

    s = result["spec"]
    h1 = ["format", "bytes/token (measured)", "formula", "layers x 2 x heads x dim x bytes", "pool blocks",
          "engine blocks (/metrics)", f"{result['seq_len']}-token seqs", "vs float16"]
    r1 = []
    for r in result["pool"]:
        eng = r.get("engine_usable_blocks")
        r1.append([r["label"], _num(r["bytes_per_token"], 1), _num(r["formula_bytes_per_token"], 1),
                   _num(r["seeds_formula_bytes_per_token"], 1) if r["seeds_formula_bytes_per_token"] else "-",
                   str(r["usable_blocks"]), "-" if eng is None else f"{eng:.0f}", str(r["max_seqs"]),
                   _num(r["vs_float16"]) + "x"])
    tables = [(f"KV pool: {s['num_layers']} layers, {s['num_kv_heads']} KV heads x {s['head_dim']}, block "
               f"{result['block_size']}, budget {result['kv_cache_gb']} GiB", h1, r1)]
    if "decode" in result:
        d = result["decode"]
        h2 = ["server", "out tok/s", "TTFT p50", "TPOT p50", "TPOT p99", "ITL p50", "requests", "errors"]
        r2 = [[n, _num(m["output_throughput"]), _ms(m["ttft_s"]["p50"]), _ms(m["tpot_s"]["p50"]),
               _ms(m["tpot_s"]["p99"]), _ms(m["itl_s"]["p50"]), str(m["requests"]), str(m["errors"])]
              for n, m in d["summaries"].items()]
        tables.append((f"decode at concurrency {d['concurrency']}, {d['max_tokens']} tokens/request "
                       f"(identical greedy text {d['identical_text']}/{d['pairs']}; latencies in ms)", h2, r2))
    return tables
