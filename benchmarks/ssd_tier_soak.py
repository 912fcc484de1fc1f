"""The SSD tier's soak: many distinct sessions through one server whose RAM pool holds a few of them and whose
tier a few tens of MiB: does the tier's folder stay within its budget, and the server's RSS flat?

    mlx-pd bench ssd-soak --sessions 240 --out soak.json --markdown soak.md

Model: the random-weight 2-layer llama (`--model-dir` for another; default `fast_model_dir`, the stand-in
`mlx-pd bench reliability --soak-only` uses: 2 KiB of float32 KV a token, so the pool and the tier cycle fast).
One `mlx-pd serve` with a pool (`--kv-cache-gb`, default `--pool-sessions` 4 times the KV of a follow-up's
prompt) that holds a few sessions, and an SSD tier of `--ssd-budget-mb` (32) MiB (2**20 bytes; passed as
`--ssd-cache-gb` in GiB) in a fresh folder under `--tmp-dir`.

`--sessions` N (240) sessions, each new from its first tokens on (ssd_tier_bench's `build_sessions`: a system
message tagged with the session, one user message of numbered passages, about `--session-tokens` (300) tokens
together). Every `--followup-every`-th (2nd) session also gets one follow-up turn (its opening, the answer as it
came back, a short new message), sent `--followup-lag` sessions after its opening (default: twice the pool in
sessions, plus the concurrency), when its blocks have left the pool: its prefix comes back from the tier. The
last `--followup-lag` sessions get none. Session k's opening and the follow-up due then are sent one after the
other; `--concurrency` (1 or 2) such sessions at a time. Chat completions, streaming, temperature 0,
`--max-tokens` (8) with EOS blocked by logit_bias.

Every `--sample-every` (10) sessions, and once before the first: the server's RSS (VmRSS of /proc/PID/status,
summed over the process and its descendants), the tier folder's total bytes and file count (a walk of the whole
folder: block files, temporary files, the lock), and the server's `mlx_pd_kv_ssd_*` /metrics (blocks written,
dropped, loaded, bytes loaded, bad; the tier's blocks, bytes and budget). After the last session, once the
tier's written and dropped counters have stood still for a second (at most `--quiet-deadline` s), a last sample.

Reported: RSS at the first sample, at the start of steady state (the first sample after the first
`--warmup-fraction` (0.1) of the sessions) and at the end; the least-squares slope of RSS against sessions over
the samples after the warm-up, in MiB per 100 sessions; the folder's largest total against the budget, and at
how many samples it was over; the counters at the end; the follow-ups' cached tokens; WARNING/ERROR lines and
tracebacks in the server's log. `--ports LO-HI` keeps the server's port in a range. The tables live in this
module (`tables`).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from benchmarks.compare import REPO_ROOT, eos_token_ids, machine_info
from benchmarks.host_cpu import process_tree
from benchmarks.hybrid_bench import _brief, _log
from benchmarks.loadgen import WorkloadConfig, send_request, warmup
from benchmarks.prefix_bench import PREFIX_COUNTERS, _client, prom_counters
from benchmarks.reliability_long import fit_slopes, vmrss_mib
from benchmarks.servers import ServerProcess, mlx_pd_command
from benchmarks.ssd_tier_bench import (SSD_METRICS, build_sessions, filesystem_of, longest_prompt_tokens,
                                       parse_ports, pool_gb, port_in, wait_writes_quiet)
from benchmarks.workloads import Conversation

METRICS = SSD_METRICS + ("mlx_pd_kv_ssd_budget_bytes",) + PREFIX_COUNTERS
MIB = 2**20


# --- the plan ----------------------------------------------------------------------------------------------


def followup_plan(sessions: int, every: int, lag: int) -> dict[int, int]:
    """{k: j}: after session k's opening, session j's follow-up (j = k - `lag`, every `every`-th session from 0;
    `every` 0: none)."""
    if every < 1:
        return {}
    return {j + lag: j for j in range(0, sessions - lag, every)}


def default_lag(pool_sessions: float, concurrency: int) -> int:
    """Sessions between an opening and its follow-up: twice the pool in sessions, plus the sessions in flight."""
    return int(math.ceil(2 * pool_sessions)) + concurrency


# --- what is sampled ---------------------------------------------------------------------------------------


def tree_rss_mib(pid: int) -> tuple[float, int]:
    """VmRSS of `pid` and its descendants (/proc/PID/status), summed, in MiB; and how many processes were read."""
    values = [v for p in process_tree(pid) if (v := vmrss_mib(p)) is not None]
    return sum(values), len(values)


def folder_usage(root: Path) -> dict:
    """Everything under `root`: bytes and files in all, block files (``.kv``/``.st``) and their bytes, temporary
    files (``.tmp``) and folders. Files that vanish while it walks are skipped."""
    out = {"bytes": 0, "files": 0, "block_files": 0, "block_bytes": 0, "tmp_files": 0, "dirs": 0}
    for dirpath, dirnames, filenames in os.walk(root):
        out["dirs"] += len(dirnames)
        for name in filenames:
            try:
                size = os.stat(os.path.join(dirpath, name), follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
            out["bytes"] += size
            out["files"] += 1
            if name.endswith((".kv", ".st")) and not name.startswith("."):
                out["block_files"] += 1
                out["block_bytes"] += size
            elif name.endswith(".tmp"):
                out["tmp_files"] += 1
    return out


def log_findings(text: str, examples: int = 5) -> dict:
    """WARNING, ERROR and CRITICAL lines and tracebacks in a server's log, and the first few distinct ones."""
    out = {"warnings": 0, "errors": 0, "tracebacks": 0, "examples": []}
    for line in text.splitlines():
        kind = ("tracebacks" if line.startswith("Traceback") else
                "errors" if "ERROR" in line or "CRITICAL" in line else "warnings" if "WARNING" in line else None)
        if kind is None:
            continue
        out[kind] += 1
        if len(out["examples"]) < examples and line.strip() not in out["examples"]:
            out["examples"].append(line.strip())
    return out


# --- the report's arithmetic -------------------------------------------------------------------------------


def rss_fit(samples: Sequence[dict], from_n: int) -> dict:
    """Of samples ({"n": sessions done, "rss_mib": ...}): RSS at the first sample, at the first with at least
    `from_n` sessions (steady state's start) and at the last; min and max after `from_n`; and the least-squares
    slope of RSS against sessions over the samples from `from_n` on (reliability_long's `fit_slopes`), in MiB per
    100 sessions, with the growth it fits over them. NaN where fewer than two samples are left."""
    nan = float("nan")
    fit = fit_slopes([{"n": s["n"], "rss": {"server": s["rss_mib"]}} for s in samples], from_n).get("server")
    first = samples[0]["rss_mib"] if samples else nan
    if fit is None:
        after = [s["rss_mib"] for s in samples if s["n"] >= from_n]
        return {"first_mib": first, "steady_start_mib": after[0] if after else nan,
                "end_mib": after[-1] if after else nan, "min_mib": min(after, default=nan),
                "max_mib": max(after, default=nan), "slope_mib_per_100": nan, "fitted_growth_mib": nan,
                "samples": len(after), "from_n": from_n}
    return {"first_mib": first, "steady_start_mib": fit["warm_mib"], "end_mib": fit["end_mib"],
            "min_mib": fit["min_mib"], "max_mib": fit["max_mib"], "slope_mib_per_100": fit["slope_mib_per_1000"] / 10,
            "fitted_growth_mib": fit["fitted_growth_mib"], "samples": fit["samples"], "from_n": from_n}


def folder_summary(samples: Sequence[dict], budget_bytes: int) -> dict:
    """The folder's largest total (and block files' total) over `samples` against `budget_bytes`, the sessions
    at which it peaked, the samples over the budget (n, bytes), the most files, and where it ended."""
    if not samples:
        return {"budget_bytes": budget_bytes, "max_bytes": None, "over_budget": []}
    peak = max(samples, key=lambda s: s["folder"]["bytes"])
    return {"budget_bytes": budget_bytes, "max_bytes": peak["folder"]["bytes"], "max_at_n": peak["n"],
            "max_block_bytes": max(s["folder"]["block_bytes"] for s in samples),
            "max_of_budget": peak["folder"]["bytes"] / budget_bytes if budget_bytes else float("nan"),
            "over_budget": [[s["n"], s["folder"]["bytes"]] for s in samples if s["folder"]["bytes"] > budget_bytes],
            "max_files": max(s["folder"]["files"] for s in samples),
            "max_tmp_files": max(s["folder"]["tmp_files"] for s in samples),
            "end_bytes": samples[-1]["folder"]["bytes"], "end_files": samples[-1]["folder"]["files"],
            "first_full_n": next((s["n"] for s in samples if s["folder"]["block_bytes"] >= 0.9 * budget_bytes),
                                 None)}


def request_summary(rows: Sequence[dict]) -> dict:
    """Per turn (0: openings, 1: follow-ups): requests, errors, prompt and cached tokens summed, the hit rate."""
    out = {}
    for turn in (0, 1):
        mine = [r for r in rows if r["turn"] == turn]
        ok = [r for r in mine if r["error"] is None]
        prompt = sum(r["prompt_tokens"] or 0 for r in ok)
        cached = sum(r["cached_tokens"] or 0 for r in ok)
        out["openings" if turn == 0 else "followups"] = {
            "requests": len(mine), "errors": len(mine) - len(ok), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else float("nan"),
            "ttft_p50_s": _median([r["ttft_s"] for r in ok if r["ttft_s"] is not None])}
    return out


def summarize(result: dict) -> dict:
    """Fill in result["summary"] (RSS, folder, counters, requests) from result["samples"] and result["requests"]."""
    samples = [s for s in result["samples"] if not s.get("quiet")]
    from_n = result["warmup_sessions"]
    end = result["samples"][-1]["metrics"] if result["samples"] else {}
    start = result["samples"][0]["metrics"] if result["samples"] else {}
    budget = int(end.get("mlx_pd_kv_ssd_budget_bytes") or result["ssd_budget_bytes"])
    counters = {k: end.get(k) for k in SSD_METRICS + ("mlx_pd_kv_ssd_budget_bytes",)}
    deltas = {k: (end[k] - start[k]) if end.get(k) is not None and start.get(k) is not None else None
              for k in PREFIX_COUNTERS}
    summary = {"rss": rss_fit(samples, from_n), "folder": folder_summary(result["samples"], budget),
               "counters": counters, "prefix_cache": deltas, "requests": request_summary(result["requests"])}
    result["summary"] = summary
    result["errors"] = sum(x["errors"] for x in summary["requests"].values())
    return summary


# --- the table ---------------------------------------------------------------------------------------------


def _f(x, spec: str = ".1f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def _mib(x, spec: str = ".1f") -> str:
    return "-" if x is None or x != x else format(x / MIB, spec)


def tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) for the terminal and Markdown: the figures, then every sample."""
    sm = result["summary"]
    r, f, c, q = sm["rss"], sm["folder"], sm["counters"], sm["requests"]
    log = result.get("server_log") or {}
    over = f.get("over_budget") or []
    fu = q["followups"]
    rows = [
        ["RSS at the first sample (after warm-up requests)", f"{_f(r['first_mib'])} MiB"],
        [f"RSS at steady state's start (session {r['from_n']}+)", f"{_f(r['steady_start_mib'])} MiB"],
        ["RSS at the end", f"{_f(r['end_mib'])} MiB"],
        ["RSS min / max after warm-up", f"{_f(r['min_mib'])} / {_f(r['max_mib'])} MiB"],
        [f"RSS slope after warm-up (least squares, {r['samples']} samples)",
         f"{_f(r['slope_mib_per_100'], '+.2f')} MiB per 100 sessions "
         f"(fitted {_f(r['fitted_growth_mib'], '+.1f')} MiB)"],
        ["tier folder: largest total / budget",
         f"{_mib(f.get('max_bytes'), '.2f')} / {_mib(f['budget_bytes'], '.2f')} MiB "
         f"({_f(100 * f.get('max_of_budget', float('nan')), '.1f')}%) at session {f.get('max_at_n', '-')}"],
        ["samples over the budget", "none" if not over else
         f"{len(over)}: " + ", ".join(f"session {n} ({_mib(b, '.2f')} MiB)" for n, b in over[:5])],
        ["tier folder: most files (temporary files)", f"{f.get('max_files', '-')} ({f.get('max_tmp_files', '-')})"],
        ["tier folder at the end (writes quiet)",
         f"{_mib(f.get('end_bytes'), '.2f')} MiB, {f.get('end_files', '-')} files"],
        ["block files first filled 90% of the budget at session", str(f.get("first_full_n", "-"))],
        ["blocks written / dropped / bad", " / ".join(_f(c.get(f"mlx_pd_kv_ssd_{k}"), ".0f")
                                                      for k in ("blocks_written", "blocks_dropped", "bad_blocks"))],
        ["blocks loaded (MiB loaded)", f"{_f(c.get('mlx_pd_kv_ssd_blocks_loaded'), '.0f')} "
                                       f"({_mib(c.get('mlx_pd_kv_ssd_bytes_loaded'))})"],
        ["tier holds at the end (/metrics)", f"{_f(c.get('mlx_pd_kv_ssd_blocks'), '.0f')} blocks, "
                                             f"{_mib(c.get('mlx_pd_kv_ssd_bytes'), '.2f')} MiB"],
        ["openings: ok / sent, cached tokens of prompt tokens",
         f"{q['openings']['requests'] - q['openings']['errors']} / {q['openings']['requests']}, "
         f"{q['openings']['cached_tokens']} of {q['openings']['prompt_tokens']}"],
        ["follow-ups: ok / sent, cached tokens of prompt tokens",
         f"{fu['requests'] - fu['errors']} / {fu['requests']}, {fu['cached_tokens']} of {fu['prompt_tokens']} "
         f"({_f(100 * fu['hit_rate'], '.0f')}%)"],
        ["server log: warnings / errors / tracebacks",
         f"{log.get('warnings', '-')} / {log.get('errors', '-')} / {log.get('tracebacks', '-')}"],
    ]
    title = (f"SSD tier soak: {result['sessions']} sessions of ~{result['session_tokens']} tokens, "
             f"{result['followups']} follow-ups {result['followup_lag']} sessions later, concurrency "
             f"{result['concurrency']}, pool {result['pool_tokens']} tokens, tier budget "
             f"{_mib(result['ssd_budget_bytes'], '.0f')} MiB, {_f(result.get('wall_s'), '.0f')} s")
    srows = []
    for s in result["samples"]:
        m = s["metrics"]
        srows.append([str(s["n"]) + (" (quiet)" if s.get("quiet") else ""), str(s["requests"]), _f(s["t"], ".0f"),
                      _f(s["rss_mib"]), _mib(s["folder"]["bytes"], ".2f"), str(s["folder"]["files"]),
                      str(s["folder"]["tmp_files"]), _mib(m.get("mlx_pd_kv_ssd_bytes"), ".2f"),
                      _f(m.get("mlx_pd_kv_ssd_blocks_written"), ".0f"), _f(m.get("mlx_pd_kv_ssd_blocks_loaded"), ".0f"),
                      _f(m.get("mlx_pd_kv_ssd_blocks_dropped"), ".0f")])
    return [(title, ["what", "value"], rows),
            ("Samples", ["sessions", "requests", "s", "RSS MiB", "folder MiB", "files", "tmp", "tier MiB (/metrics)",
                         "written", "loaded", "dropped"], srows)]


def _median(values) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


# --- the run -----------------------------------------------------------------------------------------------


def take_sample(n: int, requests: int, t: float, pid: int, folder: Path, url: str) -> dict:
    """One sample after `n` sessions and `requests` requests, `t` s in: the server's RSS, the folder, /metrics."""
    rss, procs = tree_rss_mib(pid)
    return {"n": n, "requests": requests, "t": round(t, 2), "rss_mib": round(rss, 2), "processes": procs,
            "folder": folder_usage(folder), "metrics": prom_counters(url, METRICS)}


async def _soak(server: ServerProcess, sessions: Sequence[Conversation], plan: dict[int, int], folder: Path,
                args, suppress: tuple[int, ...], log, t0: float) -> tuple[list[dict], list[dict]]:
    """Every session (and the follow-ups `plan` puts after it), `args.concurrency` at a time; a sample before the
    first and every `args.sample_every` sessions (`t`: seconds since `t0`). Returns (samples, request rows)."""
    cfg = WorkloadConfig(url=server.url, max_tokens=args.max_tokens, suppress_token_ids=suppress)
    replies: dict[int, str] = {}
    rows: list[dict] = []

    def sample(n: int) -> dict:
        s = take_sample(n, len(rows), time.perf_counter() - t0, server.proc.pid, folder, server.url)
        m = s["metrics"]
        log(f"session {n}/{len(sessions)}: RSS {s['rss_mib']:.1f} MiB, folder {s['folder']['bytes'] / MIB:.2f} MiB "
            f"in {s['folder']['files']} files, written {_f(m['mlx_pd_kv_ssd_blocks_written'], '.0f')}, loaded "
            f"{_f(m['mlx_pd_kv_ssd_blocks_loaded'], '.0f')}, dropped {_f(m['mlx_pd_kv_ssd_blocks_dropped'], '.0f')}, "
            f"{len(rows)} requests in {s['t']:.0f} s")
        return s

    followed = set(plan.values())

    async def one(client, k: int) -> None:
        mine = []
        rec = await send_request(client, cfg, len(rows), tuple(sessions[k].messages(0)), t0)
        mine.append({"session": k, "turn": 0, **_brief(rec)})
        if k in followed:  # its answer, for its follow-up
            replies[k] = rec.text if rec.ok else ""
        if k in plan:
            j = plan[k]
            rec = await send_request(client, cfg, len(rows), tuple(sessions[j].messages(1, [replies.pop(j)])), t0)
            mine.append({"session": j, "turn": 1, **_brief(rec)})
        rows.extend(mine)
        for r in mine:
            if r["error"] is not None:
                log(f"session {r['session']} turn {r['turn']} failed: {r['error']}")

    samples = [await asyncio.to_thread(sample, 0)]
    async with _client(args.concurrency, 600.0) as client:
        for lo in range(0, len(sessions), args.concurrency):
            batch = range(lo, min(lo + args.concurrency, len(sessions)))
            await asyncio.gather(*(one(client, k) for k in batch))
            done = batch[-1] + 1
            if done // args.sample_every > lo // args.sample_every or done == len(sessions):
                samples.append(await asyncio.to_thread(sample, done))
    return samples, rows


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=240, help="distinct sessions (240)")
    p.add_argument("--session-tokens", type=int, default=300, help="tokens of each session's opening (300)")
    p.add_argument("--max-tokens", type=int, default=8, help="answer tokens per turn (8)")
    p.add_argument("--followup-every", type=int, default=2,
                   help="every k-th session gets one follow-up turn (2; 0: none)")
    p.add_argument("--followup-lag", type=int, default=None,
                   help="sessions between an opening and its follow-up (default: twice --pool-sessions, plus "
                        "--concurrency)")
    p.add_argument("--concurrency", type=int, default=1, choices=[1, 2], help="sessions in flight (1)")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="the server's pool (default: --pool-sessions times a follow-up prompt's KV)")
    p.add_argument("--pool-sessions", type=float, default=4.0,
                   help="the pool in sessions (of a follow-up's prompt) when --kv-cache-gb is not given (4)")
    p.add_argument("--ssd-budget-mb", type=float, default=32.0,
                   help="the tier's budget in MiB (2**20 bytes; 32), passed as --ssd-cache-gb in GiB")
    p.add_argument("--sample-every", type=int, default=10, help="sessions between samples (10)")
    p.add_argument("--warmup-fraction", type=float, default=0.1,
                   help="the first fraction of the sessions left out of the RSS fit (0.1)")
    p.add_argument("--tmp-dir", default=None, help="where the tier's folder goes (default: the system's temp folder)")
    p.add_argument("--keep-tier", action="store_true", help="leave the tier's folder behind")
    p.add_argument("--ports", type=parse_ports, default=None,
                   help="the server's port from this range, e.g. 8600-8699 (default: any free port)")
    p.add_argument("--model-dir", default=None,
                   help="mlx-lm model folder (default: the random-weight 2-layer llama, reliability_long's "
                        "fast_model_dir)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--ours-args", default="", help="extra `mlx-pd serve` flags")
    p.add_argument("--health-deadline", type=float, default=600.0, help="seconds the server may take to start (600)")
    p.add_argument("--quiet-deadline", type=float, default=60.0,
                   help="seconds to wait for the tier's writes before the last sample (60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the full results as JSON")
    p.add_argument("--markdown", default=None, help="also write the tables as Markdown")


def run(args, log=None) -> dict:
    log = log or _log
    if min(args.sessions, args.session_tokens, args.max_tokens, args.sample_every) < 1 or args.ssd_budget_mb <= 0:
        raise ValueError("--sessions, --session-tokens, --max-tokens, --sample-every and --ssd-budget-mb must be > 0")
    if not 0 <= args.warmup_fraction < 1:
        raise ValueError("--warmup-fraction must be in [0, 1)")
    from cluster.config import EngineConfig
    from cluster.kv.store import kv_bytes_per_block
    from cluster.model import read_model_spec
    from benchmarks.reliability_long import fast_model_dir
    from benchmarks.workloads import ChatTokens

    lag = args.followup_lag if args.followup_lag is not None else default_lag(args.pool_sessions, args.concurrency)
    if lag < args.concurrency:
        raise ValueError("--followup-lag must be at least --concurrency")
    model_dir = args.model_dir or str(fast_model_dir())
    spec = read_model_spec(Path(model_dir))
    defaults = EngineConfig()
    block_size = defaults.block_size
    tokens = ChatTokens.from_model_dir(model_dir)
    suppress = eos_token_ids(model_dir)
    nonce = f"{random.Random(f'{args.seed}:{time.time_ns()}').getrandbits(32):08x}"
    sessions = build_sessions(args.sessions, args.session_tokens, 1, tokens.count, tag=f"soak {nonce}", seed=args.seed)
    plan = followup_plan(args.sessions, args.followup_every, lag)
    longest = longest_prompt_tokens(sessions, 1, args.max_tokens, tokens.count)
    per_block = kv_bytes_per_block(spec, block_size, args.dtype, None, defaults.kv_group_size)
    kv_gb = args.kv_cache_gb or pool_gb(longest, per_block, block_size, args.pool_sessions)
    budget = int(args.ssd_budget_mb * MIB)
    tmp = Path(tempfile.mkdtemp(prefix="mlx-pd-ssd-soak-", dir=args.tmp_dir))
    folder = tmp / "tier"
    result = {"kind": "ssd-soak", "machine": machine_info(), "model_dir": model_dir, "sessions": args.sessions,
              "session_tokens": args.session_tokens, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
              "followup_every": args.followup_every, "followup_lag": lag, "followups": len(plan),
              "block_size": block_size, "kv_bytes_per_block": per_block, "kv_cache_gb": kv_gb,
              "pool_tokens": int(kv_gb * 2**30 // per_block) * block_size, "longest_prompt_tokens_bound": longest,
              "session_kv_bytes": args.session_tokens * per_block / block_size, "ssd_budget_bytes": budget,
              "sample_every": args.sample_every,
              "warmup_sessions": int(math.ceil(args.sessions * args.warmup_fraction)),
              "tmp_dir": str(tmp), "filesystem": filesystem_of(tmp), "errors": 0}
    log(f"pool {kv_gb:.5f} GiB = {result['pool_tokens']} tokens; {args.sessions} sessions of ~{args.session_tokens} "
        f"tokens ({result['session_kv_bytes'] / MIB:.2f} MiB of KV each, "
        f"{args.sessions * result['session_kv_bytes'] / budget:.1f}x the tier's {args.ssd_budget_mb:g} MiB); "
        f"{len(plan)} follow-ups {lag} sessions later; tier in {folder} ({result['filesystem'].get('type', '?')})")
    flags = ["--kv-cache-gb", repr(kv_gb), "--ssd-cache-gb", repr(args.ssd_budget_mb / 1024), "--ssd-cache-dir",
             str(folder)] + shlex.split(args.ours_args)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    t_start = time.perf_counter()
    try:
        port = port_in(args.ports, set())
        with ServerProcess("mlx-pd-ssd-soak", mlx_pd_command(port, model_dir, args.dtype) + flags, port, env=env,
                           cwd=str(REPO_ROOT)) as server:
            result["argv"] = server.argv
            result["server_log_path"] = str(server.log_path)
            result["start_s"] = server.wait_healthy(args.health_deadline)
            log(f"server healthy on port {server.port} after {result['start_s']:.1f} s (log {server.log_path})")
            warm = asyncio.run(warmup(WorkloadConfig(url=server.url, max_tokens=4, suppress_token_ids=suppress), 2,
                                      1, progress=False))
            if warm and not any(r.ok for r in warm):
                raise RuntimeError(f"every warm-up request failed: {warm[0].error}")
            t0 = time.perf_counter()
            samples, rows = asyncio.run(_soak(server, sessions, plan, folder, args, suppress, log, t0))
            quiet = wait_writes_quiet(server.url, args.quiet_deadline)
            last = take_sample(args.sessions, len(rows), time.perf_counter() - t0, server.proc.pid, folder,
                               server.url)
            last.update(quiet=True, quiet_after_s=quiet["seconds"], writes_quiet=quiet["quiet"])
            samples.append(last)
            result["exit_code"] = server.stop()
        result["samples"], result["requests"] = samples, rows
        result["server_log"] = log_findings(server.log_path.read_text(errors="replace"))
    finally:
        if not args.keep_tier:
            shutil.rmtree(tmp, ignore_errors=True)
    from benchmarks.prefix_report import finish_run

    return finish_run(result, t_start, summarize, tables)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    add_args(p)
    run(p.parse_args(sys.argv[1:]))
