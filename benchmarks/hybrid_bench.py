"""A hybrid model's multi-turn chat: what the recurrent-state prefix cache buys turn after turn, its bytes, and
whether the server's memory stays flat.

    mlx-pd bench hybrid-turns --out hybrid.json --markdown hybrid.md

Model: a random-weight qwen3_next (benchmarks/hybrid_model.py: 9 Gated DeltaNet + 3 attention layers, 110M
parameters, float32, SmolLM2's tokenizer), built once into the mlx-pd cache; `--family qwen3_5` builds and serves
a random Qwen 3.5 of the same layers with a dense MLP instead (81.5M parameters); `--model-dir` serves another
folder.
Three phases (`--phases`, default all):

**turns**: one conversation of `--turns` turns (16), each adding a user message of about `--user-tokens` tokens
(256; a ``[hybrid xxxxxxxx turn t]`` tag, then numbered passages from benchmarks/prompts.jsonl), so the prompt
grows past 4k tokens. Turn t's messages = the system message, every earlier user message with the assistant's
answer exactly as it came back, then the new user message (chat completions, streaming, greedy, `--max-tokens`
32, EOS blocked with logit_bias so every answer has max_tokens tokens). Four servers on the same model folder,
all up at once, one request in flight at a time: mlx-pd (`mlx-pd serve` defaults: prefix cache on, 0.5 GiB of
state snapshots), "mlx-pd cold" (the same plus `--cold-args`, default ``--no-prefix-caching``), mlx_lm.server
(its defaults: an LRU prompt cache of 10 entries) and "mlx_lm.server cold" (plus `--theirs-cold-args`, default
``--prompt-cache-size 0``: it keeps no cache, so every prompt is computed in full). Each server family's
conversation goes on with its own cached server's answers; the cold server is sent exactly the same messages
(so cold and cached TTFT are of the same prompt, and the cold answer must equal the cached one: checked). The
four requests of a turn go in ABBA order over the turns. Reported per turn: TTFT, prompt tokens and
`usage.prompt_tokens_details.cached_tokens`; the headline is mean cold TTFT / mean cached TTFT over the last
`--last-turns` (4) turns.

**snapshots**: the server's state snapshots (kept, bytes, budget, restores) are read from its `/metrics`
(`mlx_pd_kv_group_*{group="recurrent"}`) after every turn of the turns phase and every conversation of the rss
phase. Beside that, an in-process engine (`cluster.engine.EngineCore`, the same code `mlx-pd serve` runs, with
`EngineConfig` defaults) replays mlx-pd's conversation — the same messages, token for token as the router renders
them — and reads the recurrent-state group's snapshots after each turn: count, bytes held, budget, saved, evicted, restored
(checked against the server's /metrics). It also checks that its cached tokens and answers equal the server's,
and, from its output token ids, how far the previous turn's prompt + answer agree with the next prompt as
re-tokenized: a
random model's answers are often not in the tokenizer's canonical form, so the next prompt's ids can leave the
answer's within a few tokens, before the block boundary where the state after the answer was saved; the turn
then restores the previous prompt's last whole block instead ("block ideal": the most whole blocks a
block-granular cache could restore; "restored from": answer or prompt). `--replay-conversations N` (default 0)
also replays the first N conversations of the rss phase with that phase's budgets, for the saved and evicted
counts, which /metrics does not show.

**rss**: a fresh mlx-pd server runs `--rss-conversations` (25) conversations of `--rss-turns` (8) turns one after
another (user messages of `--rss-user-tokens` 64 tokens, `--rss-max-tokens` 16), each conversation new from its
first tokens; the server's VmRSS is read after each conversation. The budgets are small on purpose: the KV pool
is allocated (and resident) at start, but snapshots are arrays the engine keeps as it goes, so RSS grows until
their budget is full. `--rss-kv-cache-gb` 1/16 GiB with `--rss-state-cache-gb` 1/32 GiB of it (13 snapshots of
this model) fill the snapshot budget within the first conversation and make the 341-block pool evict cached
blocks (and the snapshots on them) from about the ninth on; from then on RSS should stay flat, and growth would
be a leak.

The default run takes about 16 minutes on the 2-core dev VM (the turns phase 10, the replay 1, rss 4). The
replay lives in benchmarks/hybrid_replay.py, the tables in benchmarks/hybrid_report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import httpx

from benchmarks.compare import OURS, REPO_ROOT, THEIRS, eos_token_ids, machine_info, round_order
from benchmarks.hybrid_model import FAMILIES as HYBRID_FAMILIES
from benchmarks.hybrid_replay import run_snapshots
from benchmarks.hybrid_report import FAMILIES, OURS_COLD, THEIRS_COLD, _mean, _mib, _s, tables
from benchmarks.loadgen import WorkloadConfig, load_prompts, send_request, warmup
from benchmarks.prefix_bench import PREFIX_COUNTERS, prom_counters, running_servers
from benchmarks.servers import ServerProcess, free_port, mlx_lm_command, mlx_pd_command
from benchmarks.stats import RequestRecord
from benchmarks.workloads import ChatTokens, Conversation

PHASES = ("turns", "snapshots", "rss")
SYSTEM = "[{tag}] You are a patient assistant. The user sends notes in parts; keep them in mind and reply briefly."
# /metrics of a hybrid model's server: its state snapshots (kept, bytes, budget; restores so far)
SNAPSHOT_METRICS = tuple(f'mlx_pd_kv_group_{m}{{group="recurrent"}}' for m in ("entries", "bytes", "budget_bytes",
                                                                               "restores_total"))


def snapshot_metrics(url: str) -> dict[str, Optional[float]]:
    """The server's state-snapshot gauges from `GET /metrics`: {snapshots, bytes, budget_bytes, restored} (None
    where absent: a server without them). The worker refreshes its stats before a request's final output goes
    out, so a read after a response has ended sees that request's snapshots."""
    got = prom_counters(url, SNAPSHOT_METRICS)
    return dict(zip(("snapshots", "bytes", "budget_bytes", "restored"), (got[n] for n in SNAPSHOT_METRICS)))


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- the conversation --------------------------------------------------------------------------------------


def user_turns(n: int, target_tokens: int, count: Callable[[str], int], *, tag: str, seed: int = 0,
               base: Optional[Sequence[str]] = None) -> list[str]:
    """`n` user messages of about `target_tokens` tokens each (by `count`; within half a passage, ~25 tokens): a
    ``[tag turn t]`` line, then numbered passages built from the benchmark prompts (as benchmarks/scenarios.py's
    `document`), as many as bring the message closest to the target. Deterministic in (n, target_tokens, tag,
    seed)."""
    rng = random.Random(f"{seed}:hybrid:{tag}")
    base = list(base or load_prompts())
    out = []
    for t in range(n):
        text = f"[{tag} turn {t + 1}] Here is part {t + 1} of my notes. Read it and tell me what stands out.\n\n"
        k = 0
        while True:
            k += 1
            longer = (text + f"Passage {k} (source {rng.randint(100, 999)}): {base[rng.randrange(len(base))]} The "
                      f"notes on this add {rng.randint(2, 40)} points, {rng.choice(['all', 'most', 'some'])} of them "
                      "cited.\n")
            have, more = count(text), count(longer)
            if more >= target_tokens:
                text = longer if k == 1 or more - target_tokens <= target_tokens - have else text
                break
            text = longer
        out.append(text)
    return out


def conversation(index: int, turns: int, user_tokens: int, count: Callable[[str], int], *, tag: str,
                 seed: int = 0) -> Conversation:
    """Conversation `index` (its own system message tag, so conversations differ from their first tokens on)."""
    own = f"{tag} {index}"
    return Conversation(index, 0, SYSTEM.format(tag=own), tuple(user_turns(turns, user_tokens, count, tag=own,
                                                                           seed=seed)))


def _brief(rec: RequestRecord) -> dict:
    """A record without its prompt (the whole conversation, kept once in the result instead)."""
    d = rec.to_dict()
    d.pop("prompt", None)
    d.pop("itls_s", None)
    return d


def _client(timeout_s: float = 900.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=1), timeout=httpx.Timeout(timeout_s, connect=30.0))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` (utime + stime of /proc/PID/stat); 0.0 when unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def idle_cpu(servers: dict[str, ServerProcess], window_s: float = 5.0) -> dict[str, float]:
    """Per server, the CPU share (1.0 = one core) it used while nobody sent it anything for `window_s`."""
    before = {n: cpu_seconds(s.proc.pid) for n, s in servers.items()}
    time.sleep(window_s)
    return {n: round((cpu_seconds(s.proc.pid) - before[n]) / window_s, 3) for n, s in servers.items()}


# --- phase 1: turns ----------------------------------------------------------------------------------------


async def _turns(urls: dict[str, str], conv: Conversation, max_tokens: int, suppress: tuple[int, ...],
                 log) -> dict:
    names = list(urls)
    cfgs = {n: WorkloadConfig(url=u, max_tokens=max_tokens, suppress_token_ids=suppress) for n, u in urls.items()}
    for name, cfg in cfgs.items():
        warm = await warmup(cfg, 2, 1, progress=False)
        if warm and not any(r.ok for r in warm):
            raise RuntimeError(f"{name}: every warm-up request failed: {warm[0].error}")
    families = {f: s for f, s in FAMILIES.items() if s[0] in urls}
    replies: dict[str, list[str]] = {f: [] for f in families}
    records: dict[str, list[RequestRecord]] = {n: [] for n in names}
    messages: dict[str, list[list[dict]]] = {f: [] for f in families}
    snapshots: dict[str, list[dict]] = {n: [] for n in names if n.startswith(OURS)}  # /metrics after each turn
    # after the warm-up, whose requests keep snapshots too
    baseline = {n: await asyncio.to_thread(snapshot_metrics, urls[n]) for n in snapshots}
    stopped = False
    async with _client() as client:
        t0 = time.perf_counter()
        for t in range(len(conv.questions)):
            for f in families:
                messages[f].append(conv.messages(t, replies[f]))
            for name in round_order(t, names):
                f = next(f for f, s in families.items() if name in s)
                records[name].append(await send_request(client, cfgs[name], t, tuple(messages[f][t]), t0))
            for n in snapshots:
                snapshots[n].append(await asyncio.to_thread(snapshot_metrics, urls[n]))
            for f, (cached, _) in families.items():
                rec = records[cached][-1]
                if not rec.ok:
                    log(f"turn {t + 1}: {cached} failed ({rec.error}); the conversation stops here")
                    stopped = True
                replies[f].append(rec.text)
            log(f"turn {t + 1}/{len(conv.questions)}: " + "; ".join(
                f"{n} TTFT {_s(records[n][-1].ttft_s)} s, prompt {records[n][-1].prompt_tokens}, "
                f"cached {records[n][-1].cached_tokens}" for n in names) + "".join(
                f"; {n} snapshots {m[-1]['snapshots']} ({_mib(m[-1]['bytes'])} MiB)" for n, m in snapshots.items()))
            if stopped:
                break
    return {"records": records, "messages": messages, "snapshots": snapshots, "snapshots_baseline": baseline}


def summarize_turns(records: dict[str, list[dict]], last: int) -> dict:
    """Per server family (cached and cold server both measured): the per-turn cold/cached TTFT ratios, the ratio
    of the mean TTFTs over the last `last` turns and over all turns, and on how many turns the cold answer was
    the cached one."""
    out = {}
    for family, (cached, cold) in FAMILIES.items():
        if cached not in records or cold not in records:
            continue
        a, b = records[cached], records[cold]
        n = min(len(a), len(b))
        pairs = [(a[i], b[i]) for i in range(n) if a[i]["error"] is None and b[i]["error"] is None]
        per_turn = [y["ttft_s"] / x["ttft_s"] if x["ttft_s"] else float("nan") for x, y in pairs]
        tail = pairs[-last:]
        cached_tail, cold_tail = _mean([x["ttft_s"] for x, _ in tail]), _mean([y["ttft_s"] for _, y in tail])
        cached_all, cold_all = _mean([x["ttft_s"] for x, _ in pairs]), _mean([y["ttft_s"] for _, y in pairs])
        out[family] = {
            "turns": n, "ok_pairs": len(pairs), "per_turn_ratio": per_turn,
            "last_turns": len(tail), "last_cached_ttft_s": cached_tail, "last_cold_ttft_s": cold_tail,
            "last_ratio": cold_tail / cached_tail if cached_tail else float("nan"),
            "all_ratio": cold_all / cached_all if cached_all else float("nan"),
            "last_cached_tokens": sum(x["cached_tokens"] or 0 for x, _ in tail),
            "last_prompt_tokens": sum(x["prompt_tokens"] or 0 for x, _ in tail),
            "cold_cached_tokens": sum(y["cached_tokens"] or 0 for _, y in pairs),
            "same_answer_cold_vs_cached": sum(x["text"] == y["text"] for x, y in pairs),
        }
    return out


def run_turns(args, model_dir: str, tokens: ChatTokens, nonce: str, log) -> dict:
    conv = conversation(0, args.turns, args.user_tokens, tokens.count, tag=f"hybrid {nonce}", seed=args.seed)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    if any(n not in FAMILIES for n in names):
        raise ValueError(f"--servers takes {OURS} and/or {THEIRS}, got {args.servers!r}")
    ours, theirs = shlex.split(args.ours_args), shlex.split(args.theirs_args)
    known = {OURS: lambda p: mlx_pd_command(p, model_dir) + ours,
             OURS_COLD: lambda p: mlx_pd_command(p, model_dir) + ours + shlex.split(args.cold_args),
             THEIRS: lambda p: mlx_lm_command(p, model_dir) + theirs,
             THEIRS_COLD: lambda p: mlx_lm_command(p, model_dir) + theirs + shlex.split(args.theirs_cold_args)}
    argvs = {n: known[n] for f in names for n in FAMILIES[f]}
    with running_servers(argvs, log=log) as servers:
        urls = {n: s.url for n, s in servers.items()}
        idle = idle_cpu(servers)
        log(f"idle CPU share per server (1.0 = one core): {idle}")
        before = {n: s.memory() for n, s in servers.items()}
        counters = {n: prom_counters(u, PREFIX_COUNTERS) for n, u in urls.items() if n.startswith(OURS)}
        load_start = os.getloadavg()
        t0 = time.perf_counter()
        done = asyncio.run(_turns(urls, conv, args.max_tokens, eos_token_ids(model_dir), log))
        wall = time.perf_counter() - t0
        after = {n: s.memory() for n, s in servers.items()}
        counters_after = {n: prom_counters(urls[n], PREFIX_COUNTERS) for n in counters}
        argv = {n: s.argv for n, s in servers.items()}
    records = {n: [_brief(r) for r in recs] for n, recs in done["records"].items()}
    return {"wall_s": wall, "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "server_argv": argv,
            "idle_cpu": idle, "memory_before": before, "memory_after": after,
            "metrics_before": counters, "metrics_after": counters_after,
            "user_message_tokens": [tokens.count(q) for q in conv.questions], "system": conv.system,
            "records": records, "summary": summarize_turns(records, args.last_turns),
            "snapshot_metrics": done["snapshots"], "snapshot_metrics_after_warmup": done["snapshots_baseline"],
            "messages": done["messages"]}


# --- phase 3: RSS over many conversations ------------------------------------------------------------------


async def _rss(server: ServerProcess, convs: Sequence[Conversation], max_tokens: int, suppress, log) -> list[dict]:
    cfg = WorkloadConfig(url=server.url, max_tokens=max_tokens, suppress_token_ids=suppress)
    await warmup(cfg, 2, 1, progress=False)
    rows = []
    async with _client() as client:
        t0 = time.perf_counter()
        for conv in convs:
            replies, recs = [], []
            start = time.perf_counter()
            for t in range(len(conv.questions)):
                rec = await send_request(client, cfg, t, tuple(conv.messages(t, replies)), t0)
                recs.append(rec)
                if not rec.ok:
                    break
                replies.append(rec.text)
            mem = server.memory()
            snaps = await asyncio.to_thread(snapshot_metrics, server.url)
            ok = [r for r in recs if r.ok]
            rows.append({"conversation": conv.user + 1, "rss_mib": mem["rss_mib"], "peak_rss_mib": mem["peak_rss_mib"],
                         "requests": len(recs), "errors": len(recs) - len(ok), "seconds": time.perf_counter() - start,
                         "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
                         "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
                         "ttft_s": [r.ttft_s for r in ok], "snapshot_metrics": snaps})
            log(f"rss conversation {conv.user + 1}/{len(convs)}: RSS {mem['rss_mib']:.0f} MiB, "
                f"cached {rows[-1]['cached_tokens']}/{rows[-1]['prompt_tokens']} prompt tokens, "
                f"snapshots {snaps['snapshots']} ({_mib(snaps['bytes'])} of {_mib(snaps['budget_bytes'])} MiB), "
                f"{rows[-1]['seconds']:.0f} s")
    return rows


def run_rss(args, model_dir: str, convs: list[Conversation], log) -> dict:
    port = free_port()
    argv = mlx_pd_command(port, model_dir) + ["--kv-cache-gb", str(args.rss_kv_cache_gb),
                                             "--state-cache-gb", str(args.rss_state_cache_gb)]
    argv += shlex.split(args.ours_args)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    with ServerProcess("mlx-pd-rss", argv, port, env=env, cwd=str(REPO_ROOT)) as server:
        log(f"rss server healthy after {server.wait_healthy(600):.1f} s (log {server.log_path})")
        start = server.memory()
        counters = prom_counters(server.url, PREFIX_COUNTERS)
        t0 = time.perf_counter()
        rows = asyncio.run(_rss(server, convs, args.rss_max_tokens, eos_token_ids(model_dir), log))
        wall = time.perf_counter() - t0
        counters_after = prom_counters(server.url, PREFIX_COUNTERS)
    first, last = rows[0]["rss_mib"], rows[-1]["rss_mib"]
    k = max(1, min(len(rows), args.rss_settle))  # growth is also reported from the RSS after conversation k
    return {"argv": argv, "wall_s": wall, "memory_at_start": start, "rows": rows,
            "metrics_before": counters, "metrics_after": counters_after,
            "first_rss_mib": first, "last_rss_mib": last, "growth_mib": last - first,
            "settle_after": k, "growth_after_settle_mib": last - rows[k - 1]["rss_mib"],
            "max_rss_mib": max(r["rss_mib"] for r in rows)}


# --- the command -------------------------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {', '.join(PHASES)}")
    p.add_argument("--turns", type=int, default=16, help="turns of the conversation (default 16)")
    p.add_argument("--user-tokens", type=int, default=256, help="tokens of each new user message, at least (256)")
    p.add_argument("--max-tokens", type=int, default=32, help="answer tokens per turn (default 32)")
    p.add_argument("--last-turns", type=int, default=4, help="the headline ratio is over the last N turns (4)")
    p.add_argument("--servers", default=f"{OURS},{THEIRS}", help=f"{OURS} and/or {THEIRS} (each cached and cold)")
    p.add_argument("--cold-args", default="--no-prefix-caching", help="what makes our cold server cold")
    p.add_argument("--theirs-cold-args", default="--prompt-cache-size 0",
                   help="what makes mlx_lm.server cold (default: it keeps no prompt cache)")
    p.add_argument("--ours-args", default="", help="extra `mlx-pd serve` flags for every mlx-pd server")
    p.add_argument("--theirs-args", default="", help="extra mlx_lm.server flags")
    p.add_argument("--rss-conversations", type=int, default=25, help="conversations of the rss phase (25)")
    p.add_argument("--rss-turns", type=int, default=8, help="turns per rss conversation (8)")
    p.add_argument("--rss-user-tokens", type=int, default=64, help="tokens per user message in the rss phase (64)")
    p.add_argument("--rss-max-tokens", type=int, default=16, help="answer tokens per turn in the rss phase (16)")
    p.add_argument("--rss-kv-cache-gb", type=float, default=1 / 16,
                   help="the rss server's --kv-cache-gb, snapshots included (1/16 GiB)")
    p.add_argument("--rss-state-cache-gb", type=float, default=1 / 32,
                   help="the rss server's --state-cache-gb, the snapshots' part of it (1/32 GiB)")
    p.add_argument("--rss-settle", type=int, default=2,
                   help="conversations after which the snapshot budget is full: growth is also reported from there (2)")
    p.add_argument("--replay-conversations", type=int, default=0,
                   help="rss conversations also replayed in process, to read the snapshots there (0 = none)")
    p.add_argument("--family", default="qwen3_next", choices=tuple(HYBRID_FAMILIES),
                   help="which random hybrid to build and serve: qwen3_next (default) or qwen3_5")
    p.add_argument("--model-dir", default=None,
                   help="a hybrid mlx-lm model folder (default: the random model of --family)")
    p.add_argument("--seed", type=int, default=0, help="seed of the texts and the tags")
    p.add_argument("--out", default=None, help="write the full results as JSON")
    p.add_argument("--markdown", default=None, help="also write the tables as Markdown")


def run(args, log=None) -> dict:
    log = log or _log
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not phases or any(p not in PHASES for p in phases):
        raise ValueError(f"--phases must name some of {', '.join(PHASES)}, got {args.phases!r}")
    if min(args.turns, args.user_tokens, args.max_tokens, args.last_turns, args.rss_conversations, args.rss_turns,
           args.rss_user_tokens, args.rss_max_tokens) < 1:
        raise ValueError("turn counts, token counts and conversation counts must be >= 1")
    from benchmarks.hybrid_model import GATED_DELTANET, hybrid_model_dir, num_parameters, state_bytes_per_sequence

    model_dir = str(args.model_dir or hybrid_model_dir(seed=args.seed, family=args.family))
    tokens = ChatTokens.from_model_dir(model_dir)
    nonce = f"{random.getrandbits(32):08x}"  # a fresh conversation on every run (also against a warm cache)
    rss_convs = [conversation(c, args.rss_turns, args.rss_user_tokens, tokens.count, tag=f"rss {nonce}",
                              seed=args.seed) for c in range(args.rss_conversations)]
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    result = {"kind": "hybrid-turns", "machine": machine_info(), "model_dir": model_dir, "model_config": config,
              "parameters": num_parameters(Path(model_dir)),
              "state_bytes_per_snapshot": state_bytes_per_sequence(config) if config.get("model_type") in
              GATED_DELTANET else None,
              "turns": args.turns, "user_tokens": args.user_tokens, "max_tokens": args.max_tokens,
              "last_turns": args.last_turns, "phases": phases, "errors": 0}
    t0 = time.perf_counter()
    if "turns" in phases:
        result["turns_phase"] = run_turns(args, model_dir, tokens, nonce, log)
        result["errors"] += sum(r["error"] is not None for recs in result["turns_phase"]["records"].values()
                                for r in recs)
    if "snapshots" in phases:
        result["snapshots_phase"] = run_snapshots(args, model_dir, tokens, result.get("turns_phase"), rss_convs, log)
    if "rss" in phases:
        result["rss_phase"] = run_rss(args, model_dir, rss_convs, log)
        result["errors"] += sum(r["errors"] for r in result["rss_phase"]["rows"])
    result["wall_s"] = time.perf_counter() - t0
    result["machine"]["loadavg_end"] = os.getloadavg()
    from benchmarks.prefix_report import print_tables

    print_tables(tables(result))
    return result
