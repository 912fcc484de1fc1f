"""Side-by-side: mlx-pd against mlx-lm's own server, same model folder, same workload, one run.

For each concurrency level both servers get the *same* list of unique prompts, split into rounds;
the rounds alternate between the servers in ABBA order (ours, theirs, theirs, ours, ...), so that
drift in machine speed (other processes, thermal state) hits both alike and neither always goes
first. Only one server has requests in flight at any time; both processes stay up throughout.
Each server is warmed up at each level (``concurrency`` requests, not measured) before its first
round. Aggregate throughput is total output tokens over the summed round durations.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import time
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.loadgen import WorkloadConfig, make_prompts, run_load, warmup
from benchmarks.servers import ServerProcess, free_port, mlx_lm_command, mlx_pd_command
from benchmarks.stats import RequestRecord, merge_rounds

OURS, THEIRS = "mlx-pd", "mlx_lm.server"
REPO_ROOT = Path(__file__).resolve().parent.parent
RATIO_KEYS = (("output_throughput", None), ("request_throughput", None), ("ttft_s", "p50"), ("ttft_s", "p99"),
              ("tpot_s", "p50"), ("tpot_s", "p99"), ("e2e_s", "p50"), ("e2e_s", "p99"))


def split_rounds(items: Sequence, rounds: int) -> list[list]:
    """`items` cut into `rounds` contiguous, nearly equal parts (earlier parts one longer)."""
    rounds = max(1, min(rounds, len(items)))
    size, extra = divmod(len(items), rounds)
    out, start = [], 0
    for r in range(rounds):
        end = start + size + (1 if r < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out


def round_order(r: int) -> tuple[str, str]:
    """Which server goes first in round `r`: ABBA (ours first in rounds 0, 3, 4, 7, ...)."""
    return (OURS, THEIRS) if r % 4 in (0, 3) else (THEIRS, OURS)


def ratios(ours: dict, theirs: dict) -> dict[str, float]:
    """ours / theirs for the headline numbers (throughput: higher is better; latencies: lower)."""
    out = {}
    for key, sub in RATIO_KEYS:
        a, b = (ours[key], theirs[key]) if sub is None else (ours[key][sub], theirs[key][sub])
        out[key if sub is None else f"{key}_{sub}"] = a / b if b else float("nan")
    return out


def sanity(ours: list[RequestRecord], theirs: list[RequestRecord]) -> dict:
    """Do both answer every prompt, with the same greedy text? (mlx_lm.server ignores ignore_eos, so
    it may stop early; such answers are compared over its shorter length.)"""
    by_prompt = {r.prompt: r for r in theirs}
    same = prefix = 0
    for r in ours:
        other = by_prompt.get(r.prompt)
        if other is None or not (r.ok and other.ok):
            continue
        same += r.text == other.text
        prefix += r.text.startswith(other.text) or other.text.startswith(r.text)
    return {"pairs": len(ours), "identical_text": same, "one_text_prefix_of_other": prefix,
            "errors": {OURS: sum(not r.ok for r in ours), THEIRS: sum(not r.ok for r in theirs)},
            "early_stops": {OURS: sum(r.finish_reason == "stop" for r in ours),
                            THEIRS: sum(r.finish_reason == "stop" for r in theirs)},
            "empty_answers": {OURS: sum(r.ok and not r.text.strip() for r in ours),
                              THEIRS: sum(r.ok and not r.text.strip() for r in theirs)}}


def eos_token_ids(model_dir: str) -> tuple[int, ...]:
    """The end-of-sequence ids of an mlx-lm model folder: ``eos_token_id`` of config.json and
    generation_config.json, plus tokenizer_config.json's ``eos_token`` looked up in tokenizer.json."""
    import json

    root, ids = Path(model_dir), set()

    def read(name: str) -> dict:
        try:
            return json.loads((root / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    for name in ("config.json", "generation_config.json"):
        value = read(name).get("eos_token_id")
        ids.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    eos = read("tokenizer_config.json").get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    for tok in read("tokenizer.json").get("added_tokens", []):
        if eos is not None and tok.get("content") == eos:
            ids.add(int(tok["id"]))
    return tuple(sorted(ids))


def machine_info() -> dict:
    """What the numbers were measured on."""
    import importlib.metadata as md

    def version(pkg: str) -> Optional[str]:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    from cluster.platform import preload_env

    return {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "mlx": version("mlx"), "mlx_lm": version("mlx-lm"),
            "ld_preload": preload_env().get("LD_PRELOAD"), "loadavg_start": os.getloadavg()}


async def _level(servers: dict[str, ServerProcess], concurrency: int, num_requests: int, rounds: int,
                 max_tokens: int, seed: int, progress: bool, suppress: tuple[int, ...]) -> dict:
    level_seed = seed * 1000 + concurrency
    cfgs = {name: WorkloadConfig(url=s.url, max_tokens=max_tokens, suppress_token_ids=suppress)
            for name, s in servers.items()}
    load_start = os.getloadavg()
    for name in (OURS, THEIRS):
        warm = await warmup(cfgs[name], max(2, concurrency), concurrency, seed=level_seed, progress=progress)
        bad = [r for r in warm if not r.ok]
        if len(bad) == len(warm):
            raise RuntimeError(f"{name}: every warm-up request failed at concurrency {concurrency}: {bad[0].error}")
    prompts = make_prompts(num_requests, level_seed)
    parts = split_rounds(prompts, rounds)
    done: dict[str, list] = {OURS: [], THEIRS: []}
    t0 = time.perf_counter()
    for r, part in enumerate(parts):
        for name in round_order(r):
            recs, dur = await run_load(cfgs[name], part, concurrency=concurrency, progress=progress,
                                       desc=f"c={concurrency} round {r + 1}/{len(parts)} {name}")
            done[name].append((recs, dur))
    summaries = {name: merge_rounds(done[name]) for name in done}
    records = {name: [rec for recs, _ in done[name] for rec in recs] for name in done}
    return {"concurrency": concurrency, "num_requests": num_requests, "rounds": len(parts),
            "wall_s": time.perf_counter() - t0, "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
            "servers": summaries, "ratios": ratios(summaries[OURS], summaries[THEIRS]),
            "sanity": sanity(records[OURS], records[THEIRS]),
            "records": {name: [r.to_dict() for r in recs] for name, recs in records.items()}}


def run_compare(levels: Sequence[int], num_requests: Sequence[int], *, max_tokens: int = 64,
                model_dir: Optional[str] = None, dtype: str = "float32", rounds: int = 4, seed: int = 0,
                min_round_waves: int = 2, health_deadline_s: float = 600.0, progress: bool = True,
                suppress_eos: bool = True, log: Optional[callable] = print) -> dict:
    """Start both servers, run every level, measure memory, stop both; return the JSON-ready result.

    `num_requests` has one count per level (or one for all). A level's rounds are at most `rounds`
    and at least `min_round_waves` x concurrency requests long. With `suppress_eos` every request
    carries ``logit_bias`` -100 on the model's EOS ids, since mlx_lm.server has no ``ignore_eos``:
    both servers then produce exactly `max_tokens` tokens (the same greedy text).
    """
    if len(num_requests) == 1:
        num_requests = list(num_requests) * len(levels)
    if len(num_requests) != len(levels):
        raise ValueError(f"give one request count or one per level; got {len(num_requests)} for {len(levels)} levels")
    if model_dir is None:
        from cluster.model import resolve_model_path

        model_dir = str(resolve_model_path(None, dtype=dtype))
    log = log or (lambda *a, **k: None)
    suppress = eos_token_ids(model_dir) if suppress_eos else ()
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    p1, p2 = free_port(), free_port()
    servers = {OURS: ServerProcess(OURS, mlx_pd_command(p1, model_dir, dtype), p1, env=env, cwd=str(REPO_ROOT)),
               THEIRS: ServerProcess(THEIRS, mlx_lm_command(p2, model_dir), p2, env=env, cwd=str(REPO_ROOT))}
    result = {"machine": machine_info(), "model_dir": model_dir, "dtype": dtype, "max_tokens": max_tokens,
              "seed": seed, "suppressed_token_ids": list(suppress),
              "commands": {n: s.argv for n, s in servers.items()}, "levels": []}
    with contextlib.ExitStack() as stack:
        for s in servers.values():
            stack.enter_context(s)
        for name, s in servers.items():
            waited = s.wait_healthy(health_deadline_s)
            log(f"{name} healthy on port {s.port} after {waited:.1f} s (log: {s.log_path})")
        result["memory_idle"] = {name: s.memory() for name, s in servers.items()}
        for c, n in zip(levels, num_requests):
            r = max(1, min(rounds, n // max(1, min_round_waves * c)))
            level = asyncio.run(_level(servers, c, n, r, max_tokens, seed, progress, suppress))
            result["levels"].append(level)
            log(f"concurrency {c}: {level['wall_s']:.0f} s, ratios {_fmt(level['ratios'])}")
        result["memory"] = {name: s.memory() for name, s in servers.items()}
    result["machine"]["loadavg_end"] = os.getloadavg()
    return result


def _fmt(r: dict) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in r.items() if k in ("output_throughput", "ttft_s_p99", "tpot_s_p50"))
