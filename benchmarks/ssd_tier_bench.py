"""The SSD tier under the KV pool on an agent's workload: long sessions whose KV together is several times the
RAM pool, follow-up turns round-robin, with the tier, without it, and next to mlx_lm.server; then a restart.

    mlx-pd bench ssd-tier --out ssd.json --markdown ssd.md

Model: SmolLM2-135M-Instruct (`--model-dir` for another), mlx-pd with 8-bit KV (`--kv-bits`). `--sessions` K (4)
sessions of about `--session-tokens` (6000) tokens each: a system message tagged with the session (sessions
differ from their first tokens on) and one long user message of numbered passages (hybrid_bench's
`user_turns`). Turn 0 of every session is sent first (its cold prefill, measured too); then `--rounds` (3)
follow-up rounds, each sending every session one follow-up in turn (round-robin): the session's previous
messages, the assistant's answer exactly as it came back, and a short new user message (loadgen's prompts).
Chat completions, streaming, temperature 0, `--max-tokens` (16) with EOS blocked by logit_bias, one request in
flight at a time.

The pool: `--kv-cache-gb` (default: `--pool-sessions` 1.25 times the KV of the longest prompt, from the model's
8-bit bytes per block) holds about one session, so when a session comes round again its blocks have left RAM.

Targets, one server up at a time, in ABBA order over `--repeats` (1; each repeat with fresh sessions and a fresh
tier folder):
- ``mlx-pd ssd``: `--ssd-cache-gb` (2) in a folder under `--tmp-dir`: its follow-ups load their sessions back.
- ``mlx-pd no-ssd``: ``--ssd-cache-gb 0``: its follow-ups recompute what left the pool.
- ``mlx_lm.server``: its prompt cache as it comes (an LRU of 10 prompt caches in RAM, no byte bound; float KV:
  `--theirs-args "--kv-bits 8"` quantizes its KV too).
Then ``mlx-pd ssd`` is stopped (once its write-behind is quiet, or after 60 s), started again on the same folder,
and every session gets one more follow-up (``after restart``): nothing of it is in RAM.

Reported: per target the TTFT p50 and p90 of the follow-up turns, as ratios to ``mlx-pd ssd`` and to ``mlx-pd
no-ssd``; `usage.prompt_tokens_details.cached_tokens` of every follow-up; the cold opening turns.

Restore throughput: the server's `mlx_pd_kv_ssd_bytes_loaded_total` / `mlx_pd_kv_ssd_load_seconds_total` deltas
(read and verify of the block files; copying them into the pool is not in it; a block still in the write queue
counts as loaded at no disk cost), with the page cache dropped
(``sync; echo 3 > /proc/sys/vm/drop_caches``, root) before every request after the restart, and as the follow-up
rounds left it (the files were written moments before: mostly in the page cache); as a ratio to the disk's
sequential read of a `--disk-probe-gb` (1) GiB file in the same folder, timed with the page cache dropped. oMLX's
published figure (16,384 tokens of a 27B hybrid restored from SSD in 3.66 s, on other hardware) is printed
beside it as context only. The output says when the page cache could not be dropped.

`--ports LO-HI` keeps the servers' ports in a range. The tables live in this module (`tables`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from benchmarks.compare import OURS, REPO_ROOT, THEIRS, eos_token_ids, machine_info, round_order
from benchmarks.hybrid_bench import _brief, _client, _log, user_turns
from benchmarks.loadgen import WorkloadConfig, make_prompts, send_request, warmup
from benchmarks.prefix_bench import PREFIX_COUNTERS, _delta, prom_counters
from benchmarks.servers import ServerProcess, free_port, mlx_lm_command, mlx_pd_command
from benchmarks.stats import distribution
from benchmarks.workloads import Conversation

TIER, NO_TIER = f"{OURS} ssd", f"{OURS} no-ssd"
RESTART = f"{TIER} after restart"
TARGETS = (TIER, NO_TIER, THEIRS)
SYSTEM = ("[{tag}] You are a coding agent. The user pastes long notes and asks short follow-up questions; "
          "answer briefly.")
TEMPLATE_TOKENS = 16  # the chat template's tokens around a system and a user message (SmolLM2: 12), about
SSD_METRICS = tuple(f"mlx_pd_kv_ssd_{m}" for m in ("blocks_loaded", "bytes_loaded", "load_seconds",
                                                   "blocks_written", "blocks_dropped", "bad_blocks", "blocks",
                                                   "bytes"))
# oMLX's published SSD restore (other hardware): 16,384 tokens of a 27B hybrid model in 3.66 s
OMLX = {"tokens": 16384, "seconds": 3.66, "model": "27B hybrid", "note": "published by oMLX, other hardware"}
GB = 1e9


# --- the workload ------------------------------------------------------------------------------------------


def build_sessions(k: int, session_tokens: int, followups: int, count: Callable[[str], int], *, tag: str,
                   seed: int = 0) -> list[Conversation]:
    """`k` sessions: each a system message tagged ``[s<i> tag]``, one long user message (numbered passages)
    that brings system + message to about `session_tokens` tokens (by `count`; the chat template's few tokens
    aside), then `followups` short user messages (one per later turn). Deterministic in all arguments."""
    out = []
    for i in range(k):
        own = f"s{i} {tag}"  # the session first: sessions share no 8-token head (no head hit across sessions)
        system = SYSTEM.format(tag=own)
        target = max(1, session_tokens - count(system) - TEMPLATE_TOKENS)
        opening = user_turns(1, target, count, tag=own, seed=seed)[0]
        questions = make_prompts(followups, seed, tag=f"{own} follow-up") if followups else []
        out.append(Conversation(i, 0, system, (opening, *questions)))
    return out


def longest_prompt_tokens(sessions: Sequence[Conversation], turns: int, max_tokens: int,
                          count: Callable[[str], int]) -> int:
    """An upper bound on the prompt of turn `turns` (0-based) of any session: system, every user message up to it,
    `max_tokens` per answer before it, and the chat template's tokens per message."""
    return max(sum(count(q) for q in (s.system, *s.questions[:turns + 1])) + turns * max_tokens
               + (2 * turns + 2) * TEMPLATE_TOKENS // 2 for s in sessions)


def pool_gb(prompt_tokens: int, bytes_per_block: int, block_size: int, sessions: float) -> float:
    """GiB of a pool holding `sessions` times the blocks of a `prompt_tokens`-token prompt (plus one block for its
    answer), from the KV format's `bytes_per_block`."""
    blocks = -(-prompt_tokens // block_size) + 1
    return sessions * blocks * bytes_per_block / 2**30


def parse_ports(text: Optional[str]) -> Optional[tuple[int, int]]:
    """``LO-HI`` -> (LO, HI), None for None."""
    if not text:
        return None
    lo, sep, hi = text.partition("-")
    try:
        lo_i, hi_i = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port range like 8600-8699, got {text!r}") from None
    if not 0 < lo_i <= hi_i < 65536:
        raise argparse.ArgumentTypeError(f"bad port range {text!r}")
    return lo_i, hi_i


def port_in(ports: Optional[tuple[int, int]], avoid: set[int]) -> int:
    """A port nothing listens on: from `ports` (LO, HI) when given (none of `avoid`), else any free one."""
    import socket

    if ports is None:
        return free_port()
    for port in range(ports[0], ports[1] + 1):
        if port in avoid:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        avoid.add(port)
        return port
    raise RuntimeError(f"no free port in {ports[0]}-{ports[1]}")


# --- the report's arithmetic -------------------------------------------------------------------------------


def followup_summary(rows: Sequence[dict]) -> dict:
    """Of follow-up rows ({"record": a brief RequestRecord dict, ...}): requests, errors, the TTFT distribution of
    the ones that succeeded, their cached and prompt tokens (per follow-up, and summed) and the hit rate."""
    ok = [r["record"] for r in rows if r["record"]["error"] is None and r["record"]["ttft_s"] is not None]
    cached = [r["cached_tokens"] for r in ok]
    prompt = [r["prompt_tokens"] for r in ok]
    known = [(c, p) for c, p in zip(cached, prompt) if c is not None and p]
    return {"requests": len(rows), "errors": len(rows) - len(ok), "ttft_s": distribution([r["ttft_s"] for r in ok]),
            "cached_tokens": cached, "prompt_tokens": prompt,
            "cached_tokens_sum": sum(c for c, _ in known) if known else None,
            "prompt_tokens_sum": sum(p for _, p in known) if known else None,
            "hit_rate": sum(c for c, _ in known) / sum(p for _, p in known) if known else float("nan")}


def ttft_ratios(summaries: dict[str, dict], base: str) -> dict[str, dict]:
    """Per target, its follow-up TTFT p50 and p90 over `base`'s (above 1: slower than `base`)."""
    b = summaries.get(base)
    out = {}
    for name, s in summaries.items():
        out[name] = {}
        for q in ("p50", "p90"):
            den = b["ttft_s"][q] if b else float("nan")
            out[name][q] = s["ttft_s"][q] / den if den and den == den else float("nan")
    return out


def restore_rate(before: dict, after: dict, block_size: int, disk_gbps: Optional[float] = None) -> dict:
    """What the SSD tier loaded between two reads of its /metrics counters (`SSD_METRICS`): blocks, bytes,
    seconds, GB/s (1e9 bytes), tokens/s (blocks x `block_size`), and GB/s over the disk's sequential read
    `disk_gbps` (NaN where unknown)."""
    d = _delta({k: before.get(k) for k in SSD_METRICS}, {k: after.get(k) for k in SSD_METRICS})
    blocks, nbytes, secs = (d["mlx_pd_kv_ssd_blocks_loaded"], d["mlx_pd_kv_ssd_bytes_loaded"],
                            d["mlx_pd_kv_ssd_load_seconds"])
    nan = float("nan")
    gbps = nbytes / secs / GB if nbytes is not None and secs else nan
    return {"blocks": blocks, "bytes": nbytes, "seconds": secs, "gbps": gbps,
            "tokens_per_s": blocks * block_size / secs if blocks is not None and secs else nan,
            "of_disk": gbps / disk_gbps if disk_gbps and gbps == gbps else nan}


def omlx_tokens_per_s() -> float:
    """oMLX's published restore rate in tokens/s (other hardware, a 27B hybrid)."""
    return OMLX["tokens"] / OMLX["seconds"]


# --- the disk ----------------------------------------------------------------------------------------------


def drop_page_cache() -> Optional[str]:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``: None when done, else why not (not root, no such file, ...)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def filesystem_of(path: Path) -> dict:
    """The mount (device, mount point, type) holding `path`, from /proc/mounts (empty off Linux)."""
    best: dict = {}
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    real = str(Path(path).resolve())
    for line in lines:
        parts = line.split()
        if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")):
            if len(parts[1]) >= len(best.get("mount", "")):
                best = {"device": parts[0], "mount": parts[1], "type": parts[2]}
    return best


def disk_read(folder: Path, size_bytes: int, chunk: int = 16 << 20) -> dict:
    """The disk's sequential read: write a `size_bytes` file in `folder` (fsynced), drop the page cache, read it
    back in `chunk`-byte reads, delete it. {bytes, seconds, gbps, write_gbps, page_cache_dropped, why_not}."""
    path = folder / "disk-probe.bin"
    block = os.urandom(min(chunk, size_bytes))
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = size_bytes
        while left > 0:
            left -= f.write(block[:left])
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    why = drop_page_cache()
    buf = bytearray(chunk)
    view = memoryview(buf)
    got = 0
    try:
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                got += n
        secs = time.perf_counter() - t0
    finally:
        path.unlink(missing_ok=True)
    return {"bytes": got, "seconds": secs, "gbps": got / secs / GB if secs else float("nan"),
            "write_gbps": size_bytes / write_s / GB if write_s else float("nan"),
            "page_cache_dropped": why is None, "why_not": why}


# --- running one target ------------------------------------------------------------------------------------


async def _turn(url: str, sessions: Sequence[Conversation], turn: int, replies: dict[int, list[str]],
                max_tokens: int, suppress: tuple[int, ...], *, metrics: bool, drop: bool, log,
                label: str) -> list[dict]:
    """Turn `turn` of every session, in order, one at a time; each reply is appended to `replies` (the
    conversation goes on with the target's own answers). Per request a row: the record, and with `metrics` the
    SSD tier's counters before and after it; with `drop`, the page cache is dropped before each request."""
    cfg = WorkloadConfig(url=url, max_tokens=max_tokens, suppress_token_ids=suppress)
    rows = []
    async with _client() as client:
        t0 = time.perf_counter()
        for s in sessions:
            row = {"session": s.user, "turn": turn}
            if drop:
                row["drop_page_cache"] = await asyncio.to_thread(drop_page_cache)
            before = await asyncio.to_thread(prom_counters, url, SSD_METRICS) if metrics else None
            msgs = tuple(s.messages(turn, replies[s.user]))
            rec = await send_request(client, cfg, turn, msgs, t0)
            if metrics:
                row["ssd_before"], row["ssd_after"] = before, await asyncio.to_thread(prom_counters, url, SSD_METRICS)
            row["record"] = _brief(rec)
            replies[s.user].append(rec.text if rec.ok else "")
            rows.append(row)
            loaded = ""
            if metrics and row["ssd_after"]["mlx_pd_kv_ssd_blocks_loaded"] is not None:
                n = row["ssd_after"]["mlx_pd_kv_ssd_blocks_loaded"] - before["mlx_pd_kv_ssd_blocks_loaded"]
                loaded = f", ssd loaded {n:.0f} blocks"
            log(f"{label} turn {turn} session {s.user}: " + (
                f"TTFT {rec.ttft_s:.2f} s, prompt {rec.prompt_tokens}, cached {rec.cached_tokens}{loaded}"
                if rec.ok else f"failed: {rec.error}"))
    return rows


def _server(name: str, argv: Callable[[int], list[str]], port: int) -> ServerProcess:
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    return ServerProcess(name.replace(" ", "_"), argv(port), port, env=env, cwd=str(REPO_ROOT))


def wait_writes_quiet(url: str, deadline_s: float = 60.0, quiet_s: float = 1.0) -> dict:
    """Wait until the tier's written and dropped counters have not moved for `quiet_s` (its queue is then
    written, as far as /metrics shows), at most `deadline_s`; {seconds, quiet, counters}."""
    t0 = time.monotonic()
    last, since = None, time.monotonic()
    while True:
        got = prom_counters(url, SSD_METRICS)
        key = (got["mlx_pd_kv_ssd_blocks_written"], got["mlx_pd_kv_ssd_blocks_dropped"])
        if key != last:
            last, since = key, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return {"seconds": time.monotonic() - t0, "quiet": True, "counters": got}
        if time.monotonic() - t0 > deadline_s:
            return {"seconds": time.monotonic() - t0, "quiet": False, "counters": got}
        time.sleep(0.25)


def run_target(name: str, argv: Callable[[int], list[str]], sessions: Sequence[Conversation], args, suppress,
               ports, used: set[int], log) -> dict:
    """One target's run: start it, warm it up, the opening turns, the follow-up rounds; for the tier target also
    the restart and its round. Stops every server it started."""
    ours = name != THEIRS
    replies: dict[int, list[str]] = {s.user: [] for s in sessions}
    out: dict = {}
    with _server(name, argv, port_in(ports, used)) as server:
        out["argv"] = server.argv
        out["start_s"] = server.wait_healthy(args.health_deadline)
        log(f"{name} healthy on port {server.port} after {out['start_s']:.1f} s (log {server.log_path})")
        warm = asyncio.run(warmup(WorkloadConfig(url=server.url, max_tokens=4, suppress_token_ids=suppress), 2, 1,
                                  progress=False))
        if warm and not any(r.ok for r in warm):
            raise RuntimeError(f"{name}: every warm-up request failed: {warm[0].error}")
        counters = prom_counters(server.url, PREFIX_COUNTERS + SSD_METRICS) if ours else {}
        kw = dict(metrics=ours, log=log, label=name)
        out["opening"] = asyncio.run(_turn(server.url, sessions, 0, replies, args.max_tokens, suppress, drop=False,
                                           **kw))
        out["followups"] = []
        for r in range(1, args.rounds + 1):
            out["followups"] += asyncio.run(_turn(server.url, sessions, r, replies, args.max_tokens, suppress,
                                                  drop=False, **kw))
        if ours:
            out["metrics"] = _delta(counters, prom_counters(server.url, PREFIX_COUNTERS + SSD_METRICS))
            out["memory"] = server.memory()
        if name == TIER and not args.no_restart:
            out["writes_quiet"] = wait_writes_quiet(server.url, args.quiet_deadline)
            t0 = time.perf_counter()
            out["exit_code"] = server.stop()
            out["stop_s"] = time.perf_counter() - t0
    if name == TIER and not args.no_restart:
        with _server(RESTART, argv, port_in(ports, used)) as server:
            out["restart_start_s"] = server.wait_healthy(args.health_deadline)
            found = prom_counters(server.url, SSD_METRICS)
            out["restart_found"] = {"blocks": found["mlx_pd_kv_ssd_blocks"], "bytes": found["mlx_pd_kv_ssd_bytes"]}
            log(f"{RESTART} healthy after {out['restart_start_s']:.1f} s: the tier holds "
                f"{found['mlx_pd_kv_ssd_blocks']} blocks")
            out["restart"] = asyncio.run(_turn(server.url, sessions, args.rounds + 1, replies, args.max_tokens,
                                               suppress, metrics=True, drop=True, log=log, label=RESTART))
    return out


# --- the command -------------------------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=4, help="long sessions, K (default 4)")
    p.add_argument("--session-tokens", type=int, default=6000, help="tokens of each session's opening (6000)")
    p.add_argument("--rounds", type=int, default=3, help="follow-up rounds, every session once per round (3)")
    p.add_argument("--max-tokens", type=int, default=16, help="answer tokens per turn (16)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every target in ABBA order, each with fresh sessions (default 1)")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"a subset of {', '.join(TARGETS)}")
    p.add_argument("--kv-bits", type=int, default=8, choices=[4, 8], help="mlx-pd's KV format (8)")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="mlx-pd's pool (default: --pool-sessions times the longest prompt's KV)")
    p.add_argument("--pool-sessions", type=float, default=1.25,
                   help="the pool in sessions (of the longest prompt) when --kv-cache-gb is not given (1.25)")
    p.add_argument("--ssd-cache-gb", type=float, default=2.0, help="the tier's budget (2 GiB)")
    p.add_argument("--tmp-dir", default=None,
                   help="where the tier's folder and the disk probe go (default: the system's temp folder)")
    p.add_argument("--keep-tier", action="store_true", help="leave the tier's folder behind")
    p.add_argument("--disk-probe-gb", type=float, default=1.0,
                   help="GiB of the sequential-read probe file (1; 0 skips the probe)")
    p.add_argument("--no-restart", action="store_true", help="skip the restart of mlx-pd ssd")
    p.add_argument("--ports", type=parse_ports, default=None,
                   help="the servers' ports from this range, e.g. 8600-8699 (default: any free port)")
    p.add_argument("--model-dir", default=None, help="mlx-lm model folder (default: the imported SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--ours-args", default="", help="extra `mlx-pd serve` flags for both mlx-pd targets")
    p.add_argument("--theirs-args", default="", help="extra mlx_lm.server flags")
    p.add_argument("--health-deadline", type=float, default=600.0, help="seconds a server may take to start (600)")
    p.add_argument("--quiet-deadline", type=float, default=60.0,
                   help="seconds to wait for the tier's writes before the restart (60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the full results as JSON")
    p.add_argument("--markdown", default=None, help="also write the tables as Markdown")


def _targets(args) -> list[str]:
    names = [n.strip() for n in args.targets.split(",") if n.strip()]
    if not names or any(n not in TARGETS for n in names):
        raise ValueError(f"--targets takes some of {', '.join(TARGETS)}, got {args.targets!r}")
    return [n for n in TARGETS if n in names]


def run(args, log=None) -> dict:
    log = log or _log
    if min(args.sessions, args.session_tokens, args.rounds, args.max_tokens, args.repeats) < 1:
        raise ValueError("--sessions, --session-tokens, --rounds, --max-tokens and --repeats must be >= 1")
    names = _targets(args)
    from cluster.config import EngineConfig
    from cluster.kv.store import kv_bytes_per_block
    from cluster.model import read_model_spec, resolve_model_path
    from benchmarks.workloads import ChatTokens

    model_dir = args.model_dir or str(resolve_model_path(None, dtype=args.dtype))
    spec = read_model_spec(Path(model_dir))
    defaults = EngineConfig()
    block_size = defaults.block_size
    tokens = ChatTokens.from_model_dir(model_dir)
    suppress = eos_token_ids(model_dir)
    turns = args.rounds + 1 + (0 if args.no_restart else 1)  # the opening, the rounds, the restart's round
    nonces = [f"{random.Random(f'{args.seed}:{r}:{time.time_ns()}').getrandbits(32):08x}" for r in range(args.repeats)]
    repeats = [build_sessions(args.sessions, args.session_tokens, turns - 1, tokens.count,
                              tag=f"ssd {nonce}", seed=args.seed + r) for r, nonce in enumerate(nonces)]
    longest = max(longest_prompt_tokens(s, turns - 1, args.max_tokens, tokens.count) for s in repeats)
    if longest + args.max_tokens > spec.max_model_len:
        raise ValueError(f"the last turn's prompt reaches about {longest} tokens, past the model's context of "
                         f"{spec.max_model_len}: lower --session-tokens or --rounds")
    per_block = kv_bytes_per_block(spec, block_size, args.dtype, args.kv_bits, defaults.kv_group_size)
    kv_gb = args.kv_cache_gb or pool_gb(longest, per_block, block_size, args.pool_sessions)
    session_bytes = args.session_tokens * per_block / block_size  # one opening's KV
    tmp = Path(tempfile.mkdtemp(prefix="mlx-pd-ssd-bench-", dir=args.tmp_dir))
    result = {"kind": "ssd-tier", "machine": machine_info(), "model_dir": model_dir, "targets": names,
              "sessions": args.sessions, "session_tokens": args.session_tokens, "rounds": args.rounds,
              "max_tokens": args.max_tokens, "repeats": args.repeats, "kv_bits": args.kv_bits,
              "block_size": block_size, "kv_bytes_per_block": per_block, "kv_cache_gb": kv_gb,
              "pool_tokens": int(kv_gb * 2**30 // per_block) * block_size, "longest_prompt_tokens_bound": longest,
              "session_kv_bytes": session_bytes, "ssd_cache_gb": args.ssd_cache_gb, "tmp_dir": str(tmp),
              "filesystem": filesystem_of(tmp), "omlx": {**OMLX, "tokens_per_s": omlx_tokens_per_s()},
              "opening_tokens": [[tokens.count(s.system) + tokens.count(s.questions[0]) for s in ss] for ss in repeats],
              "runs": [], "errors": 0}
    log(f"pool {kv_gb:.4f} GiB = {result['pool_tokens']} tokens of {args.kv_bits}-bit KV; {args.sessions} sessions "
        f"of ~{args.session_tokens} tokens ({session_bytes / 2**20:.0f} MiB of KV each, "
        f"{args.sessions * session_bytes / (kv_gb * 2**30):.1f}x the pool); tier in {tmp} "
        f"({result['filesystem'].get('type', '?')})")
    t_start = time.perf_counter()
    try:
        if args.disk_probe_gb > 0:
            result["disk"] = disk_read(tmp, int(args.disk_probe_gb * 2**30))
            d = result["disk"]
            log(f"disk: sequential read {d['gbps']:.2f} GB/s of {d['bytes'] / 2**30:.2f} GiB "
                + ("(page cache dropped)" if d["page_cache_dropped"] else f"(page cache NOT dropped: {d['why_not']})"))
        ours_extra, theirs_extra = shlex.split(args.ours_args), shlex.split(args.theirs_args)
        ports, used = args.ports, set()
        for r, sessions in enumerate(repeats):
            tier_dir = tmp / f"tier-{r}"

            def ours(tier_gb: float):
                flags = ["--kv-bits", str(args.kv_bits), "--kv-cache-gb", f"{kv_gb:.6f}", "--ssd-cache-gb",
                         str(tier_gb)] + (["--ssd-cache-dir", str(tier_dir)] if tier_gb else [])
                return lambda port: mlx_pd_command(port, model_dir, args.dtype) + flags + ours_extra

            argvs = {TIER: ours(args.ssd_cache_gb), NO_TIER: ours(0),
                     THEIRS: lambda port: mlx_lm_command(port, model_dir) + theirs_extra}
            run_r = {"repeat": r, "order": list(round_order(r, names)), "targets": {}}
            for name in run_r["order"]:
                run_r["targets"][name] = run_target(name, argvs[name], sessions, args, suppress, ports, used, log)
            result["runs"].append(run_r)
    finally:
        if not args.keep_tier:
            shutil.rmtree(tmp, ignore_errors=True)
    from benchmarks.prefix_report import finish_run

    return finish_run(result, t_start, summarize, tables)


def summarize(result: dict) -> dict:
    """Fill in result["summary"] from result["runs"]: per target (and the restart) the follow-up summary, the
    opening turns' TTFT, the TTFT ratios to the tier and to no tier, and the restore rates; counts errors."""
    disk = (result.get("disk") or {}).get("gbps")
    bs = result["block_size"]
    follow: dict[str, list] = {}
    opening: dict[str, list] = {}
    for run in result["runs"]:
        for name, t in run["targets"].items():
            follow.setdefault(name, []).extend(t["followups"])
            opening.setdefault(name, []).extend(t["opening"])
            if "restart" in t:
                follow.setdefault(RESTART, []).extend(t["restart"])
    s = {name: followup_summary(rows) for name, rows in follow.items()}
    for name, rows in opening.items():
        s[name]["opening"] = followup_summary(rows)
    summary = {"followups": s, "ratio_to_tier": ttft_ratios(s, TIER), "ratio_to_no_tier": ttft_ratios(s, NO_TIER)}
    restore = {}
    for label, name, key in (("follow-up rounds (page cache as it was)", TIER, "followups"),
                             ("after restart (page cache dropped first)", TIER, "restart")):
        rows = [row for run in result["runs"] for row in run["targets"].get(name, {}).get(key, [])
                if row.get("ssd_before") is not None]
        if not rows:
            continue
        per = [restore_rate(row["ssd_before"], row["ssd_after"], bs, disk) for row in rows]
        tot = {k: sum(p[k] for p in per if p[k] is not None) for k in ("blocks", "bytes", "seconds")}
        gbps = tot["bytes"] / tot["seconds"] / GB if tot["seconds"] else float("nan")
        restore[label] = {**tot, "requests": len(per), "gbps": gbps,
                          "tokens_per_s": tot["blocks"] * bs / tot["seconds"] if tot["seconds"] else float("nan"),
                          "of_disk": gbps / disk if disk and gbps == gbps else float("nan"),
                          "page_cache_dropped": all(row.get("drop_page_cache", "not asked") is None for row in rows),
                          "why_not": next((row.get("drop_page_cache") for row in rows if row.get("drop_page_cache")),
                                          None),
                          "per_request": per}
    summary["restore"] = restore
    result["summary"] = summary
    result["errors"] = sum(x["errors"] for x in s.values()) + sum(x["opening"]["errors"] for x in s.values()
                                                                  if "opening" in x)
    return summary


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) for the terminal and Markdown."""
    out = []
    sm = result["summary"]
    s, r_tier, r_none = sm["followups"], sm["ratio_to_tier"], sm["ratio_to_no_tier"]
    rows = []
    for name in (*TARGETS, RESTART):
        if name not in s:
            continue
        x = s[name]
        op = x.get("opening")
        rows.append([name, f"{x['requests'] - x['errors']} / {x['requests']}", _f(x["ttft_s"]["p50"]),
                     _f(x["ttft_s"]["p90"]), _f(r_tier[name]["p50"]) + "x", _f(r_tier[name]["p90"]) + "x",
                     _f(r_none.get(name, {}).get("p50")) + "x",
                     _f(_mean(x["cached_tokens"]), ".0f"), _f(_mean(x["prompt_tokens"]), ".0f"),
                     _f(100 * x["hit_rate"], ".0f") + "%", _f(op["ttft_s"]["p50"]) if op else "-"])
    out.append((f"Follow-up turns: {result['sessions']} sessions of ~{result['session_tokens']} tokens, "
                f"{result['rounds']} rounds round-robin, max_tokens {result['max_tokens']}, pool "
                f"{result['pool_tokens']} tokens ({result['kv_bits']}-bit KV), {result['repeats']} repeat(s)",
                ["target", "ok", "TTFT p50 s", "TTFT p90 s", "p50 / ssd", "p90 / ssd", "p50 / no-ssd",
                 "cached tok mean", "prompt tok mean", "hit rate", "opening (cold) TTFT p50 s"], rows))
    names = [n for n in TARGETS if n in s]
    per_rows = []
    for run in result["runs"]:
        keyed = {}
        for name, t in run["targets"].items():
            for row in t["followups"]:
                keyed.setdefault((row["turn"], row["session"]), {})[name] = row["record"]
            for row in t.get("restart", []):
                keyed.setdefault((row["turn"], row["session"]), {})[RESTART] = row["record"]
        cols = names + ([RESTART] if RESTART in s else [])
        for (turn, sess), recs in sorted(keyed.items()):
            row = [str(run["repeat"] + 1), str(turn), str(sess)]
            for n in cols:
                rec = recs.get(n)
                row.append("-" if rec is None else f"{rec['prompt_tokens']} / {rec['cached_tokens']} / "
                           f"{_f(rec['ttft_s'])}")
            per_rows.append(row)
    out.append(("Every follow-up: prompt tok / cached_tokens / TTFT s",
                ["repeat", "turn", "session"] + names + ([RESTART] if RESTART in s else []), per_rows))
    disk = result.get("disk")
    rrows = []
    for label, x in sm["restore"].items():
        page = "dropped" if x["page_cache_dropped"] else ("as it was" if x["why_not"] is None else
                                                          f"NOT dropped ({x['why_not']})")
        rrows.append([label, str(int(x["blocks"])), _f(x["bytes"] / 2**20, ".1f"), _f(x["seconds"], ".3f"),
                      _f(x["gbps"]), _f(x["tokens_per_s"], ".0f"), _f(x["of_disk"]) + "x", page])
    if disk:
        rrows.append([f"disk: sequential read of a {disk['bytes'] / 2**30:.2f} GiB file", "-",
                      _f(disk["bytes"] / 2**20, ".0f"), _f(disk["seconds"], ".3f"), _f(disk["gbps"]), "-", "1.00x",
                      "dropped" if disk["page_cache_dropped"] else f"NOT dropped ({disk['why_not']})"])
    o = result["omlx"]
    rrows.append([f"oMLX, published: {o['tokens']:,} tokens of a {o['model']} from SSD (other hardware, "
                  "context only)", "-", "-", _f(o["seconds"]), "-", _f(o["tokens_per_s"], ".0f"), "-", "-"])
    fs = result.get("filesystem") or {}
    out.append((f"SSD tier restore (read + verify of block files; bytes/s from /metrics deltas) in "
                f"{result['tmp_dir']} ({fs.get('type', '?')} on {fs.get('device', '?')})",
                ["what", "blocks", "MiB", "seconds", "GB/s", "tokens/s", "/ disk read", "page cache"], rrows))
    crow = []
    for run in result["runs"]:
        t = run["targets"].get(TIER)
        if not t:
            continue
        m = t.get("metrics") or {}
        q = t.get("writes_quiet") or {}
        crow.append([str(run["repeat"] + 1), _f(m.get("mlx_pd_kv_ssd_blocks_written"), ".0f"),
                     _f(m.get("mlx_pd_kv_ssd_blocks_dropped"), ".0f"), _f(m.get("mlx_pd_kv_ssd_bad_blocks"), ".0f"),
                     _f(q.get("seconds"), ".1f") + ("" if q.get("quiet", True) else " (not quiet)"),
                     _f(t.get("stop_s"), ".1f"), str(t.get("exit_code", "-")), _f(t.get("restart_start_s"), ".1f"),
                     _f((t.get("restart_found") or {}).get("blocks"), ".0f")])
    if crow:
        out.append(("The tier's writes and the restart", ["repeat", "blocks written", "dropped", "bad",
                                                          "writes quiet after s", "stop s", "exit code",
                                                          "restart healthy s", "blocks found at restart"], crow))
    return out


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    add_args(p)
    run(p.parse_args(sys.argv[1:]))
