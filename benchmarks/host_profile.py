"""`mlx-pd bench host-profile`: where a token's host time goes, stage by stage, sampled with py-spy.

    mlx-pd bench host-profile --fast-model --concurrency 32,64 --duration 30 --out hp.json --markdown hp.md
    mlx-pd bench host-profile --fast-model --layouts single --concurrency 32 --duration 20

What runs, per layout (``single``: `mlx-pd serve`, one process; ``1p1d``: `mlx-pd router` + a prefill and a
decode `mlx-pd worker`, each a process, benchmarks/servers.py `ClusterProcess`) and per concurrency:

1. The server starts on the model (`--fast-model`: the random-weight 2-layer llama, whose forward takes a
   millisecond or two, so host overhead dominates). A warm-up of `concurrency` requests runs, not measured.
2. Load: `concurrency` closed-loop streaming chat requests (benchmarks/loadgen.py `send_request`: unique
   prompts, `--max-tokens` output tokens, greedy, ``ignore_eos`` plus ``logit_bias`` -100 on the EOS ids).
   After `--ramp` seconds every process of the server is sampled for `--duration` seconds by its own
   ``py-spy record --format raw --rate R --threads --idle --nonblocking --pid PID`` (``--idle``: idle threads
   are sampled too, so every thread has about R samples a second and busy + idle adds up to its total); the
   per-thread CPU time of each process (``/proc/PID/task/TID/stat``) is read at both ends of the window. The load
   stops after the window, and the requests in flight finish.
3. Each sample is classified (`classify`, a pure function of its stack, root first) into a stage:
   idle first, by its leaf frame (`idle_leaf`: a selector's ``select``, a condition/event/queue wait, a ZeroMQ
   poll, the worker's control poll, a parked thread); then, from the leaf up, the first frame with a rule
   decides: an MLX or mlx-lm frame is **model compute**; a project frame by its file and function (`STAGES`;
   a project leaf whose source line calls ``.tolist()``/``.item()`` is **sampling read-back**, one that calls
   ``mx.eval``/``mx.async_eval`` is **model compute**); helpers without a rule of their own (cluster/kv/,
   prefix matching, pydantic, json, transformers) take their caller's stage. A stack with no project frame
   (uvicorn/h11/asyncio/ZeroMQ only) falls back to its innermost library's stage, else **other**.

How to read the result (per layout and concurrency):

- stage | ms per output token | share of busy: sampled thread time in the stage, summed over every Python
  thread of every server process, divided by the output tokens streamed in the window. For a Python stage it is
  CPU time (less waits for the GIL); **model compute** and **sampling read-back** are the time the engine thread
  spends inside MLX calls: on a Mac that is GPU time, on this CPU backend MLX computes on its own native threads
  and the Python thread waits for them there. Those native threads are invisible to py-spy; their CPU time (from
  /proc) is the row **native threads' CPU** (MLX, BLAS; ZeroMQ's I/O threads apart), outside the busy total.
- the waits: **engine waits** is the engine loop's idle time while requests are in flight (the load keeps
  `concurrency` open the whole window: the engine had nothing to step, waiting for the router/event loop);
  **event loop waits** is the event loop's time in epoll while streams are open (waiting for the engine's
  outputs). Both are ms per output token, and are part of their thread's idle time, not of busy.
- **compute floor**: the model's forward + greedy sampling alone, in this process before any server starts, over
  a decode batch of each concurrency with a realistic context (`compute_floor`), in ms per output token; the
  table's **busy less the floor** is the host time a token costs beyond the model itself.
- per thread: samples, busy, idle (busy + idle = samples), busy share, and the thread's CPU ms per output
  token from /proc over the window. Samples are wall time: where busy threads outnumber cores, a runnable
  thread waiting for one counts as busy in its stage; its /proc CPU says how much of that ran.

py-spy is a tool, not a dependency of the server: install it with ``pip install py-spy`` (it needs ptrace
rights over the servers: run as the same user, with ``kernel.yama.ptrace_scope`` 0 or as root).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Optional, Sequence

from benchmarks.host_stages import (IDLE, REPO_ROOT, STAGES, Frame, LineText, Sample, classify, parse_raw,
                                    repo_line_text)

LAYOUTS = ("single", "1p1d")
PY_SPY_INSTALL = "pip install py-spy  (e.g. /path/to/.venv/bin/pip install py-spy)"


# -- thread roles and tallies ----------------------------------------------------------------------------------

def thread_role(name: str, stacks: Iterable[Sequence[Frame]]) -> str:
    """What a thread is, from its name and its stacks: ``engine loop`` (runs cluster/worker.py ``Worker._loop``),
    ``event loop`` (runs an asyncio loop), ``tokenizer pool``, else its name."""
    funcs = {f.func for frames in stacks for f in frames}
    if "Worker._loop" in funcs:
        return "engine loop"
    if "BaseEventLoop.run_forever" in funcs or "BaseEventLoop._run_once" in funcs:
        return "event loop"
    if name.startswith("tokenize"):
        return "tokenizer pool"
    return name


def tally(samples: Sequence[Sample], process: str, line_text: Optional[LineText] = None) -> dict:
    """Per thread of one process: {tid: {"process", "thread", "role", "stages": {stage: samples}}} (idle among
    the stages). Partial stacks count for their thread like any other."""
    threads: dict[int, dict] = {}
    stacks: dict[int, list] = defaultdict(list)
    for s in samples:
        t = threads.setdefault(s.tid, {"process": process, "tid": s.tid, "thread": s.thread, "stages": Counter()})
        t["stages"][classify(s.frames, line_text)] += s.count
        stacks[s.tid].append(s.frames)
    for tid, t in threads.items():
        t["role"] = thread_role(t["thread"], stacks[tid])
        t["stages"] = dict(t["stages"])
    return threads


def tokens_in_window(records: Iterable[dict], start_s: float, end_s: float) -> float:
    """Output tokens streamed between `start_s` and `end_s` (seconds on the load's clock), from the loadgen
    records (``start_s``, ``ttft_s``, ``itls_s``, ``output_tokens``, ``content_chunks``): each content chunk's
    arrival time, each chunk weighted output_tokens / content_chunks (a chunk may carry several tokens)."""
    total = 0.0
    for r in records:
        if r.get("ttft_s") is None or not r.get("content_chunks"):
            continue
        weight = (r.get("output_tokens") or r["content_chunks"]) / r["content_chunks"]
        t = r["start_s"] + r["ttft_s"]
        times = [t]
        for gap in r.get("itls_s") or []:
            t += gap
            times.append(t)
        total += weight * sum(1 for x in times if start_s <= x < end_s)
    return total


def summarize_profile(threads: Sequence[dict], rate: float, tokens: float, *, cpu_ms: Optional[dict] = None,
                      native_cpu_s: float = 0.0, zmq_cpu_s: float = 0.0, floor_ms: Optional[float] = None) -> dict:
    """One configuration's table from its threads (`tally` values of every process), the sample `rate` (Hz) and
    the output `tokens` of the window.

    Returns {"stages": {stage: {"samples", "ms_per_token", "busy_share"}}, "busy_ms_per_token", "waits":
    {"engine": {process: ms per token}, "event_loop": {process: ...}} (an engine loop's or event loop's idle
    samples), "threads": [...], "native_cpu_ms_per_token",
    "zmq_io_cpu_ms_per_token", "floor_ms_per_token", "busy_less_floor_ms_per_token"}. ms per token is samples /
    rate / tokens * 1000; shares are of all busy (non-idle) samples; per thread, busy + idle = its samples.
    `cpu_ms` is {tid: the thread's CPU ms per token from /proc}."""
    per_token = (lambda n: 1000.0 * n / rate / tokens) if tokens > 0 and rate > 0 else (lambda n: math.nan)
    stage_samples: Counter = Counter()
    waits: dict[str, Counter] = {"engine": Counter(), "event_loop": Counter()}
    rows = []
    for t in threads:
        st = t["stages"]
        total = sum(st.values())
        idle = st.get(IDLE, 0)
        busy = total - idle
        for stage, n in st.items():
            if stage != IDLE:
                stage_samples[stage] += n
        if t["role"] == "engine loop":
            waits["engine"][t["process"]] += idle
        elif t["role"] == "event loop":
            waits["event_loop"][t["process"]] += idle
        rows.append({"process": t["process"], "tid": t["tid"], "thread": t["thread"], "role": t["role"],
                     "samples": total, "busy": busy, "idle": idle, "busy_share": busy / total if total else math.nan,
                     "busy_ms_per_token": per_token(busy),
                     "cpu_ms_per_token": (cpu_ms or {}).get(t["tid"], math.nan)})
    busy_total = sum(stage_samples.values())
    stages = {s: {"samples": stage_samples.get(s, 0), "ms_per_token": per_token(stage_samples.get(s, 0)),
                  "busy_share": stage_samples.get(s, 0) / busy_total if busy_total else math.nan}
              for s in STAGES}
    busy_ms = per_token(busy_total)
    native = 1000.0 * native_cpu_s / tokens if tokens > 0 else math.nan
    zmq_io = 1000.0 * zmq_cpu_s / tokens if tokens > 0 else math.nan
    return {"stages": stages, "busy_samples": busy_total, "busy_ms_per_token": busy_ms,
            "waits": {k: {proc: per_token(n) for proc, n in sorted(v.items())} for k, v in waits.items()},
            "wait_samples": {k: dict(v) for k, v in waits.items()}, "threads": rows,
            "native_cpu_ms_per_token": native, "zmq_io_cpu_ms_per_token": zmq_io,
            "floor_ms_per_token": floor_ms if floor_ms is not None else math.nan,
            "busy_less_floor_ms_per_token": busy_ms - floor_ms if floor_ms is not None else math.nan}


# -- /proc per-thread CPU --------------------------------------------------------------------------------------

def thread_cpu_ticks(pid: int, proc: Path = Path("/proc")) -> dict[int, tuple[str, int]]:
    """{tid: (comm, utime + stime ticks)} of every thread of `pid` now ({} when it is gone)."""
    from benchmarks.host_cpu import stat_cpu_ticks

    out = {}
    for task in (proc / str(pid) / "task").glob("*"):
        try:
            utime, stime, _, _ = stat_cpu_ticks((task / "stat").read_text())
            out[int(task.name)] = ((task / "comm").read_text().strip(), utime + stime)
        except (OSError, ValueError):
            continue
    return out


def cpu_delta_s(before: dict, after: dict, clk_tck: Optional[int] = None) -> dict[int, tuple[str, float]]:
    """{tid: (comm, CPU seconds between two `thread_cpu_ticks` readings)}; a thread born between them counts
    from 0."""
    from benchmarks.host_cpu import CLK_TCK

    tck = clk_tck or CLK_TCK
    return {tid: (comm, (ticks - before.get(tid, (comm, 0))[1]) / tck) for tid, (comm, ticks) in after.items()}


# -- the compute floor -----------------------------------------------------------------------------------------

def compute_floor(model_dir: str, batches: Sequence[int], *, context: int = 128, steps: int = 24,
                  dtype: str = "float32") -> dict[int, dict]:
    """The model alone: per batch size B, a plain mlx-lm forward over a KV cache holding `context` tokens per
    row, plus greedy sampling (argmax), evaluated each step, timed over `steps` decode steps after 3 untimed
    ones. Returns {B: {"step_ms", "ms_per_token"}} (ms per token = step time / B)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from cluster.model import load_model

    model, _ = load_model(model_dir, dtype=dtype)
    out = {}
    for b in batches:
        cache = make_prompt_cache(model)
        prompt = mx.random.randint(0, 1000, (b, context))
        mx.eval(model(prompt, cache=cache))
        tokens = mx.zeros((b, 1), dtype=mx.int32)
        for i in range(steps + 3):
            if i == 3:
                t0 = time.perf_counter()
            tokens = mx.argmax(model(tokens, cache=cache)[:, -1, :], axis=-1)[:, None]
            mx.eval(tokens)
        step = (time.perf_counter() - t0) / steps
        out[b] = {"step_ms": 1000 * step, "ms_per_token": 1000 * step / b}
    return out


# -- running it ------------------------------------------------------------------------------------------------

def py_spy_path() -> Optional[str]:
    """The py-spy executable: on PATH, or next to this Python (a virtual environment's bin); None if absent."""
    found = shutil.which("py-spy")
    if found:
        return found
    local = Path(sys.executable).with_name("py-spy")
    return str(local) if local.exists() else None


def add_args(p: argparse.ArgumentParser) -> None:
    """The options of `mlx-pd bench host-profile`."""
    from benchmarks.engine_pair import add_pair_args

    add_pair_args(p, rounds=1)
    p.add_argument("--layouts", default="single,1p1d", help="which layouts: single, 1p1d (default both)")
    p.add_argument("--concurrency", default="32,64", help="requests in flight, one profile each (default 32,64)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (default 128)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds sampled per configuration (default 30)")
    p.add_argument("--ramp", type=float, default=3.0, help="seconds of load before sampling starts (default 3)")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second per thread (default 200)")
    p.add_argument("--floor-context", type=int, default=128,
                   help="tokens in each row's KV cache for the compute floor (default 128)")
    p.add_argument("--keep-raw", default=None, help="keep py-spy's raw files in this folder")


def _levels(text: str) -> list[int]:
    values = [int(v) for v in str(text).split(",") if v.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"--concurrency: expected integers >= 1 like 32,64, got {text!r}")
    return values


async def _load_and_sample(url: str, pids: dict[str, int], concurrency: int, args, suppress: tuple[int, ...],
                           spy: str, raw_dir: Path, tag: str, log) -> dict:
    """Closed-loop load at `concurrency`; py-spy on every pid of `pids` for the window; /proc thread CPU at its
    ends. Returns {"records", "window": (start_s, end_s), "raw": {name: path}, "cpu": {name: delta},
    "spy_errors": [...]}."""
    import httpx

    from benchmarks.loadgen import WorkloadConfig, make_prompts, send_request, warmup

    cfg = WorkloadConfig(url=url, max_tokens=args.max_tokens, suppress_token_ids=suppress)
    await warmup(cfg, concurrency, concurrency, seed=args.seed, progress=False)
    prompts = iter(make_prompts(100_000, args.seed, tag=f"hp{concurrency}"))
    stop = asyncio.Event()
    records: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(cfg.timeout_s, connect=30.0)) as client:
        t0 = time.perf_counter()

        async def worker() -> None:
            i = 0
            while not stop.is_set():
                rec = await send_request(client, cfg, i, next(prompts), t0)
                records.append(rec.to_dict())
                i += 1

        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        await asyncio.sleep(args.ramp)
        raw = {name: raw_dir / f"{tag}-{name}-{pid}.txt" for name, pid in pids.items()}
        before = {name: thread_cpu_ticks(pid) for name, pid in pids.items()}
        start = time.perf_counter() - t0
        procs = {name: subprocess.Popen([spy, "record", "--format", "raw", "--rate", str(args.rate), "--threads",
                                         "--idle", "--nonblocking", "--pid", str(pid), "--duration",
                                         str(max(1, round(args.duration))), "-o", str(raw[name])],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for name, pid in pids.items()}
        while any(p.poll() is None for p in procs.values()):
            await asyncio.sleep(0.1)
        end = time.perf_counter() - t0
        after = {name: thread_cpu_ticks(pid) for name, pid in pids.items()}
        stop.set()
        log(f"  window {end - start:.1f} s sampled; draining the {concurrency} requests in flight")
        await asyncio.gather(*tasks)
    errors = []
    for name, p in procs.items():
        text = p.stdout.read().decode("utf-8", "replace") if p.stdout else ""
        if p.returncode != 0 or not raw[name].exists():
            errors.append(f"py-spy on {name} (pid {pids[name]}) exited {p.returncode}: {text.strip()[-500:]}")
    return {"records": records, "window": (start, end), "raw": {k: str(v) for k, v in raw.items()},
            "cpu": {name: cpu_delta_s(before[name], after[name]) for name in pids}, "spy_errors": errors}


def _server(layout: str, model_dir: str, dtype: str, log_dir: str):
    from benchmarks.servers import ClusterProcess, ServerProcess, free_port, mlx_pd_command

    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    port = free_port()
    if layout == "single":
        return ServerProcess("hp-single", mlx_pd_command(port, model_dir, dtype), port, env=env, log_dir=log_dir,
                             cwd=str(REPO_ROOT))
    return ClusterProcess("hp-1p1d", model_dir, dtype, port, env=env, log_dir=log_dir, cwd=str(REPO_ROOT))


def _server_pids(server) -> dict[str, int]:
    """{process name: pid} of every server process (each one's descendants too)."""
    from benchmarks.host_cpu import process_tree

    parts = [(server.name.removeprefix("hp-"), server)] if not hasattr(server, "workers") else \
        [(p.name.removeprefix("hp-1p1d-"), p) for p in (server.router, *server.workers)]
    out = {}
    for name, p in parts:
        for i, pid in enumerate(process_tree(p.proc.pid)):
            out[name if i == 0 else f"{name}.{pid}"] = pid
    return out


def profile_config(layout: str, concurrency: int, server, args, suppress, spy: str, raw_dir: Path,
                   floor: dict, log) -> dict:
    """Load, sample and classify one (layout, concurrency); returns its summary (`summarize_profile`) with the
    window, tokens, output tokens/s and the requests' errors."""
    pids = _server_pids(server)
    got = asyncio.run(_load_and_sample(server.url, pids, concurrency, args, suppress, spy, raw_dir,
                                       f"{layout}-c{concurrency}", log))
    start, end = got["window"]
    tokens = tokens_in_window(got["records"], start, end)
    text = repo_line_text()
    threads, cpu_ms, native_s, zmq_s = [], {}, 0.0, 0.0
    for name, path in got["raw"].items():
        if not Path(path).exists():
            continue
        tallied = tally(parse_raw(Path(path).read_text(encoding="utf-8", errors="replace")), name, text)
        threads += tallied.values()
        for tid, (comm, cpu_s) in got["cpu"][name].items():
            if tid in tallied:
                cpu_ms[tid] = 1000 * cpu_s / tokens if tokens else math.nan
            elif comm.startswith("ZMQbg"):
                zmq_s += cpu_s
            else:
                native_s += cpu_s
    summary = summarize_profile(threads, args.rate, tokens, cpu_ms=cpu_ms, native_cpu_s=native_s, zmq_cpu_s=zmq_s,
                                floor_ms=floor.get(concurrency, {}).get("ms_per_token"))
    errors = [r["error"] for r in got["records"] if r.get("error")]
    summary.update({"layout": layout, "concurrency": concurrency, "window_s": end - start, "output_tokens": tokens,
                    "output_tokens_per_s": tokens / (end - start) if end > start else math.nan,
                    "requests": len(got["records"]), "request_errors": len(errors),
                    "first_error": errors[0] if errors else None, "spy_errors": got["spy_errors"],
                    "processes": {k: v for k, v in pids.items()}})
    return summary


def run(args) -> dict:
    """Run `mlx-pd bench host-profile` (see the module doc); returns the JSON-ready result and prints the
    tables. Raises RuntimeError when py-spy is not installed."""
    from benchmarks.compare import machine_info
    from benchmarks.engine_pair import model_dir_of, suppressed_ids
    from benchmarks.prefix_report import print_tables

    spy = py_spy_path()
    if spy is None:
        raise RuntimeError(f"bench host-profile samples the servers with py-spy, which is not installed: "
                           f"{PY_SPY_INSTALL}")
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad or not layouts:
        raise ValueError(f"--layouts: choose from {', '.join(LAYOUTS)}, got {args.layouts!r}")
    levels = _levels(args.concurrency)
    log = (lambda *a: None) if args.no_progress else (lambda msg: print(msg, file=sys.stderr, flush=True))
    model_dir = model_dir_of(args)
    suppress = suppressed_ids(args, model_dir)
    log(f"compute floor: {model_dir}, batches {levels}, context {args.floor_context}")
    floor = compute_floor(model_dir, levels, context=args.floor_context, dtype=args.dtype)
    result = {"machine": machine_info(), "model_dir": model_dir, "dtype": args.dtype, "max_tokens": args.max_tokens,
              "rate_hz": args.rate, "duration_s": args.duration, "floor": {str(b): v for b, v in floor.items()},
              "configs": [], "errors": []}
    raw_root = Path(args.keep_raw) if args.keep_raw else Path(tempfile.mkdtemp(prefix="mlx-pd-host-profile-"))
    raw_root.mkdir(parents=True, exist_ok=True)
    for layout in layouts:
        with tempfile.TemporaryDirectory() as log_dir:
            server = _server(layout, model_dir, args.dtype, log_dir)
            with server:
                log(f"{layout}: starting")
                server.wait_healthy(600)
                for c in levels:
                    log(f"{layout}: concurrency {c}, {args.duration:.0f} s sampled")
                    summary = profile_config(layout, c, server, args, suppress, spy, raw_root, floor, log)
                    result["configs"].append(summary)
                    result["errors"] += summary["spy_errors"]
                    if summary["request_errors"]:
                        result["errors"].append(f"{layout} c={c}: {summary['request_errors']} requests failed: "
                                                f"{summary['first_error']}")
    if not args.keep_raw:
        shutil.rmtree(raw_root, ignore_errors=True)
    print_tables(tables(result))
    return result


# -- tables ----------------------------------------------------------------------------------------------------

def _f(x: Optional[float], digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _pct(x: Optional[float]) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def stage_rows(cfg: dict) -> list[list[str]]:
    """The stage table of one configuration: each stage, then the totals, the floor and the waits."""
    rows = [[s, _f(v["ms_per_token"]), _pct(v["busy_share"])] for s, v in cfg["stages"].items()]
    rows.append(["**busy total** (sampled Python threads)", _f(cfg["busy_ms_per_token"]), "100.0%"])
    rows.append(["compute floor (forward + sampling alone)", _f(cfg["floor_ms_per_token"]), ""])
    rows.append(["busy less the floor", _f(cfg["busy_less_floor_ms_per_token"]), ""])
    rows.append(["native threads' CPU (MLX, BLAS; /proc, not in busy)", _f(cfg["native_cpu_ms_per_token"]), ""])
    rows.append(["ZeroMQ I/O threads' CPU (/proc, not in busy)", _f(cfg["zmq_io_cpu_ms_per_token"]), ""])
    for proc, ms in cfg["waits"]["engine"].items():
        rows.append([f"engine waits, {proc} (idle, requests in flight)", _f(ms), ""])
    for proc, ms in cfg["waits"]["event_loop"].items():
        rows.append([f"event loop waits, {proc} (epoll, streams open)", _f(ms), ""])
    return rows


def thread_rows(cfg: dict) -> list[list[str]]:
    """Per thread of one configuration: process, thread, role, samples, busy, idle, busy share, CPU ms/token."""
    rows = sorted(cfg["threads"], key=lambda t: (-t["busy"], t["process"], t["tid"]))
    return [[t["process"], f"{t['thread']} ({t['tid']})", t["role"], str(t["samples"]), str(t["busy"]),
             str(t["idle"]), _pct(t["busy_share"]), _f(t["cpu_ms_per_token"])] for t in rows]


def tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) per configuration: the stage table and the thread table."""
    out = []
    for cfg in result["configs"]:
        head = (f"{cfg['layout']}, concurrency {cfg['concurrency']}: {cfg['output_tokens_per_s']:.0f} output "
                f"tokens/s over {cfg['window_s']:.0f} s ({cfg['output_tokens']:.0f} tokens)")
        out.append((head + ", where a token's host time goes", ["stage", "ms per output token", "share of busy"],
                    stage_rows(cfg)))
        out.append((head + ", per thread", ["process", "thread", "role", "samples", "busy", "idle", "busy share",
                                            "CPU ms per output token (/proc)"], thread_rows(cfg)))
    return out
