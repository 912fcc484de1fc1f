"""Side-by-side: mlx-pd against mlx-lm's own server (and/or a local 1P1D cluster), same model, same workload.

Targets (``--targets``, default ``mlx-pd,mlx_lm.server``): ``mlx-pd`` (single-node ``mlx-pd serve``),
``mlx-pd-1p1d`` (``mlx-pd worker`` x 2 + ``mlx-pd router`` on loopback, benchmarks/servers.py), ``mlx-pd-0p1d``
(one ``mlx-pd worker`` that prefills and decodes + ``mlx-pd router``: the engine in its own process) and
``mlx_lm.server``, all started by the tool on one model folder; or endpoints already running
(``mlx-pd bench --url A --url B``, :func:`run_levels`).

For each concurrency level every target gets the *same* list of prompts (a workload of
benchmarks/scenarios.py), split into rounds; the rounds alternate between the targets in ABBA order
(forward, backward, backward, forward, ...; with two targets: ours, theirs, theirs, ours), so that
drift in machine speed (other processes, thermal state) hits all alike and none always goes first.
Only one target has requests in flight at any time; all processes stay up throughout. Each target is
warmed up at each level (``concurrency`` requests, not measured) before its first round. Aggregate
throughput is total output tokens over the summed round durations. Ratios are the first target over
each other one. When the tool started the targets it also reads each one's host CPU time (its process
tree's, benchmarks/host_cpu.py) before and after each of its rounds: ``host_cpu_s`` is the sum of those
differences and ``host_cpu_s_per_output_token`` that over the rounds' output tokens (lower is better).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import time
from pathlib import Path
from typing import Optional, Sequence

from benchmarks import host_cpu
from benchmarks.loadgen import WorkloadConfig, make_prompts, run_load, warmup
from benchmarks.servers import ClusterProcess, ServerProcess, free_port, mlx_lm_command, mlx_pd_command
from benchmarks.stats import RequestRecord, merge_rounds

OURS, THEIRS = "mlx-pd", "mlx_lm.server"
CLUSTER = "mlx-pd-1p1d"
ENGINE_PROCESS = "mlx-pd-0p1d"  # the router and one decode worker (which prefills too), each its own process
TARGETS = (OURS, CLUSTER, ENGINE_PROCESS, THEIRS)
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


def round_order(r: int, names: Sequence[str] = (OURS, THEIRS)) -> tuple[str, ...]:
    """The order of the targets in round `r`: ABBA, generalized as forward in rounds 0, 3, 4, 7, ... and
    backward in the others (two targets: ours first in rounds 0, 3, 4, 7, ...)."""
    return tuple(names) if r % 4 in (0, 3) else tuple(reversed(names))


def ratios(ours: dict, theirs: dict) -> dict[str, float]:
    """ours / theirs for the headline numbers (throughput: higher is better; latencies and host CPU time per
    output token, when both summaries carry it: lower)."""
    out = {}
    keys = RATIO_KEYS + ((("host_cpu_s_per_output_token", None),)
                         if "host_cpu_s_per_output_token" in ours and "host_cpu_s_per_output_token" in theirs else ())
    for key, sub in keys:
        a, b = (ours[key], theirs[key]) if sub is None else (ours[key][sub], theirs[key][sub])
        out[key if sub is None else f"{key}_{sub}"] = a / b if b else float("nan")
    return out


def sanity(ours: list[RequestRecord], theirs: list[RequestRecord], names: Sequence[str] = (OURS, THEIRS)) -> dict:
    """Do both answer every prompt, with the same greedy text? (mlx_lm.server ignores ignore_eos, so
    it may stop early; such answers are compared over its shorter length.) `names` label the two sides."""
    by_prompt = {r.prompt: r for r in theirs}
    same = prefix = 0
    for r in ours:
        other = by_prompt.get(r.prompt)
        if other is None or not (r.ok and other.ok):
            continue
        same += r.text == other.text
        prefix += r.text.startswith(other.text) or other.text.startswith(r.text)
    a, b = names
    return {"pairs": len(ours), "identical_text": same, "one_text_prefix_of_other": prefix,
            "errors": {a: sum(not r.ok for r in ours), b: sum(not r.ok for r in theirs)},
            "early_stops": {a: sum(r.finish_reason == "stop" for r in ours),
                            b: sum(r.finish_reason == "stop" for r in theirs)},
            "empty_answers": {a: sum(r.ok and not r.text.strip() for r in ours),
                              b: sum(r.ok and not r.text.strip() for r in theirs)}}


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

    from cluster.launch.platform import preload_env

    return {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "mlx": version("mlx"), "mlx_lm": version("mlx-lm"),
            "ld_preload": preload_env().get("LD_PRELOAD"), "loadavg_start": os.getloadavg()}


async def _level(urls: dict[str, str], concurrency: Optional[int], num_requests: int, rounds: int, max_tokens: int,
                 seed: int, progress: bool, suppress: tuple[int, ...], make=None, slos=None,
                 rate: Optional[float] = None, cpu: Optional[dict] = None) -> dict:
    """One level: warm up every target, then the ABBA rounds; `make(n, seed)` gives the prompts; `cpu` (name ->
    a function giving that target's host CPU seconds so far) adds host CPU time per output token."""
    level_seed = seed * 1000 + (concurrency or 0)
    names = list(urls)
    cfgs = {name: WorkloadConfig(url=url, max_tokens=max_tokens, suppress_token_ids=suppress)
            for name, url in urls.items()}
    load_start = os.getloadavg()
    for name in names:
        warm = await warmup(cfgs[name], max(2, concurrency or 2), concurrency or 2, seed=level_seed,
                            progress=progress)
        bad = [r for r in warm if not r.ok]
        if len(bad) == len(warm):
            raise RuntimeError(f"{name}: every warm-up request failed at concurrency {concurrency}: {bad[0].error}")
    prompts = (make or make_prompts)(num_requests, level_seed)
    parts = split_rounds(prompts, rounds)
    done: dict[str, list] = {name: [] for name in names}
    cpu_s = {name: 0.0 for name in names}
    t0 = time.perf_counter()
    for r, part in enumerate(parts):
        for name in round_order(r, names):
            before = cpu[name]() if cpu else 0.0
            recs, dur = await run_load(cfgs[name], part, concurrency=concurrency, rate=rate, seed=level_seed + r,
                                       progress=progress, desc=f"c={concurrency} round {r + 1}/{len(parts)} {name}")
            cpu_s[name] += (cpu[name]() - before) if cpu else 0.0
            done[name].append((recs, dur))
    summaries = {name: merge_rounds(done[name], slos) for name in names}
    if cpu:
        for name, s in summaries.items():
            s["host_cpu_s"] = cpu_s[name]
            s["host_cpu_s_per_output_token"] = host_cpu.per_token(cpu_s[name], s["output_tokens_total"])
    records = {name: [rec for recs, _ in done[name] for rec in recs] for name in names}
    first, others = names[0], names[1:]
    level = {"concurrency": concurrency, "rate": rate, "num_requests": num_requests, "rounds": len(parts),
             "wall_s": time.perf_counter() - t0, "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
             "targets": names, "servers": summaries,
             "ratios_vs": {o: ratios(summaries[first], summaries[o]) for o in others},
             "sanity_vs": {o: sanity(records[first], records[o], (first, o)) for o in others},
             "records": {name: [r.to_dict() for r in recs] for name, recs in records.items()}}
    if others:  # the headline pair: the first two targets
        level["ratios"], level["sanity"] = level["ratios_vs"][others[0]], level["sanity_vs"][others[0]]
    return level


def run_levels(urls: dict[str, str], levels: Sequence[Optional[int]], num_requests: Sequence[int], *,
               max_tokens: int = 64, rounds: int = 4, min_round_waves: int = 2, seed: int = 0, progress: bool = True,
               suppress: tuple[int, ...] = (), make=None, slos=None, rate: Optional[float] = None,
               log: Optional[callable] = None, cpu: Optional[dict] = None) -> list[dict]:
    """Run every level against endpoints already up (`urls`: name -> URL), alternating as the module doc says;
    `cpu` (name -> host CPU seconds so far, e.g. ``ServerProcess.cpu_seconds``) adds host CPU time per token."""
    if len(num_requests) == 1:
        num_requests = list(num_requests) * len(levels)
    if len(num_requests) != len(levels):
        raise ValueError(f"give one request count or one per level; got {len(num_requests)} for {len(levels)} levels")
    out = []
    for c, n in zip(levels, num_requests):
        r = max(1, min(rounds, n // max(1, min_round_waves * (c or 2))))
        out.append(level := asyncio.run(_level(urls, c, n, r, max_tokens, seed, progress, suppress, make, slos, rate,
                                               cpu)))
        if log:
            log(f"concurrency {c}: {level['wall_s']:.0f} s" + (f", ratios {_fmt(level['ratios'])}"
                                                              if "ratios" in level else ""))
    return out


def start_target(name: str, model_dir: str, dtype: str, env: dict):
    """A (not yet started) server process for target `name` on a free port."""
    port = free_port()
    if name == OURS:
        return ServerProcess(OURS, mlx_pd_command(port, model_dir, dtype), port, env=env, cwd=str(REPO_ROOT))
    if name == THEIRS:
        return ServerProcess(THEIRS, mlx_lm_command(port, model_dir), port, env=env, cwd=str(REPO_ROOT))
    if name in (CLUSTER, ENGINE_PROCESS):
        return ClusterProcess(name, model_dir, dtype, port, env=env, cwd=str(REPO_ROOT),
                              prefill_worker=name == CLUSTER,  # the engine process: single-node's chunk size
                              **({} if name == CLUSTER else {"prefill_chunk_size": 2048}))
    raise ValueError(f"unknown target {name!r}; choose from {', '.join(TARGETS)}")


def run_compare(levels: Sequence[int], num_requests: Sequence[int], *, max_tokens: int = 64,
                model_dir: Optional[str] = None, dtype: str = "float32", rounds: int = 4, seed: int = 0,
                min_round_waves: int = 2, health_deadline_s: float = 600.0, progress: bool = True,
                suppress_eos: bool = True, log: Optional[callable] = print, targets: Sequence[str] = (OURS, THEIRS),
                make=None, slos=None, workload: str = "chat") -> dict:
    """Start every target, run every level, measure memory, stop them; return the JSON-ready result.

    `num_requests` has one count per level (or one for all). A level's rounds are at most `rounds`
    and at least `min_round_waves` x concurrency requests long. With `suppress_eos` every request
    carries ``logit_bias`` -100 on the model's EOS ids, since mlx_lm.server has no ``ignore_eos``:
    all targets then produce exactly `max_tokens` tokens (the same greedy text). `make(n, seed)` gives
    a level's prompts (default: unique chat prompts); `slos` ({metric: seconds}) adds goodput.
    """
    if len(set(targets)) != len(targets) or len(targets) < 2:
        raise ValueError(f"give at least two different targets, got {list(targets)}")
    if model_dir is None:
        from cluster.model import resolve_model_path

        model_dir = str(resolve_model_path(None, dtype=dtype))
    log = log or (lambda *a, **k: None)
    suppress = eos_token_ids(model_dir) if suppress_eos else ()
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    servers = {name: start_target(name, model_dir, dtype, env) for name in targets}
    result = {"machine": machine_info(), "model_dir": model_dir, "dtype": dtype, "max_tokens": max_tokens,
              "seed": seed, "suppressed_token_ids": list(suppress), "targets": list(targets), "workload": workload,
              "slo_s": slos or {}, "commands": {n: s.argv for n, s in servers.items()}, "levels": []}
    with contextlib.ExitStack() as stack:
        for s in servers.values():
            stack.enter_context(s)
        for name, s in servers.items():
            waited = s.wait_healthy(health_deadline_s)
            log(f"{name} healthy on port {s.port} after {waited:.1f} s (log: {s.log_path})")
        result["memory_idle"] = {name: s.memory() for name, s in servers.items()}
        cpu = {n: s.cpu_seconds for n, s in servers.items()} if host_cpu.supported() else None
        result["levels"] = run_levels({n: s.url for n, s in servers.items()}, levels, num_requests,
                                      max_tokens=max_tokens, rounds=rounds, min_round_waves=min_round_waves, seed=seed,
                                      progress=progress, suppress=suppress, make=make, slos=slos, log=log, cpu=cpu)
        result["memory"] = {name: s.memory() for name, s in servers.items()}
    result["machine"]["loadavg_end"] = os.getloadavg()
    return result


def _fmt(r: dict) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in r.items()
                     if k in ("output_throughput", "ttft_s_p99", "tpot_s_p50", "host_cpu_s_per_output_token"))
