"""Prefix-cache benchmark: what a cached system prompt buys in TTFT, measured against the servers' own answers.

    mlx-pd bench prefix --pairs 8 --system-tokens 1500 --out prefix.json        # TTFT: cold vs cached

It and `bench chat` (benchmarks/chat_prefix_bench.py, which uses the helpers here: the chat workload config,
server start-up, /metrics counters, ABBA order, common flags) start mlx-pd and mlx_lm.server on the same
model folder (as `bench --compare` does; `--servers` picks one) or measure one running server (`--url`), and
interleave the servers in ABBA order so that drift in machine speed hits both alike. Only one server has
requests in flight at any time.

**prefix** (TTFT): pairs of requests sharing a ~1,500-token system prompt. The first of a pair is *cold*:
its system prompt starts with a fresh random tag, so no server has seen any of it; the second is
*cached*: the same system prompt, a different short user message. With `--older` (default) a third
request goes back to the previous pair's system prompt (is the cache more than "the last prompt"?).
max_tokens is small: only TTFT counts. One long unmeasured request per server warms up long shapes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import httpx

from benchmarks.compare import OURS, REPO_ROOT, THEIRS, eos_token_ids, machine_info, round_order
from benchmarks.loadgen import WorkloadConfig, load_prompts, make_prompts, send_request, warmup
from benchmarks.servers import ServerProcess, free_port, mlx_lm_command, mlx_pd_command
from benchmarks.stats import RequestRecord, distribution

from benchmarks.workloads import ChatTokens, system_prompt

from benchmarks.prefix_report import print_prefix

CHAT_KINDS = ("cold", "cached", "older")

# --- sending ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatWorkloadConfig(WorkloadConfig):
    """A WorkloadConfig whose "prompt" is a key into `messages` (filled in as conversations go on); a prompt
    that is no key (the load generator's warm-up) is sent as one user message, as WorkloadConfig does."""

    messages: dict = field(default_factory=dict, compare=False, repr=False)

    def body(self, prompt: str) -> dict:
        body = super().body(prompt)
        if prompt in self.messages:
            body["messages"] = self.messages[prompt]
        return body


def _client(width: int, timeout_s: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=width, max_keepalive_connections=width),
                             timeout=httpx.Timeout(timeout_s, connect=30.0))


def prom_counters(url: str, names: Sequence[str]) -> dict[str, Optional[float]]:
    """Values of Prometheus counters/gauges in ``GET /metrics`` (None when absent or not served)."""
    try:
        text = httpx.get(url.rstrip("/") + "/metrics", timeout=10.0).text
    except httpx.HTTPError:
        text = ""
    out: dict[str, Optional[float]] = {}
    for name in names:
        m = re.search(rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else None
    return out


PREFIX_COUNTERS = ("mlx_pd_prefix_cache_query_tokens", "mlx_pd_prefix_cache_hit_tokens")


def _delta(before: dict, after: dict) -> dict:
    return {k: (after[k] - before[k]) if after.get(k) is not None and before.get(k) is not None else None
            for k in before}


@contextlib.contextmanager
def running_servers(argvs: dict[str, Callable[[int], list[str]]], *, log=print,
                    health_deadline_s: float = 600.0) -> Iterator[dict[str, ServerProcess]]:
    """Start one server per entry (name -> argv for a port) the way `bench --compare` does, wait until all
    are healthy, and stop them all on leaving."""
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    servers = {}
    for name, argv in argvs.items():
        port = free_port()
        servers[name] = ServerProcess(name.replace(" ", "_"), argv(port), port, env=env, cwd=str(REPO_ROOT))
    with contextlib.ExitStack() as stack:
        for s in servers.values():
            stack.enter_context(s)
        for name, s in servers.items():
            log(f"{name} healthy on port {s.port} after {s.wait_healthy(health_deadline_s):.1f} s (log {s.log_path})")
        yield servers


def server_argvs(names: Sequence[str], model_dir: str, dtype: str, ours_args: Sequence[str] = (),
                 theirs_args: Sequence[str] = ()) -> dict[str, Callable[[int], list[str]]]:
    """name -> argv builder for mlx-pd (`mlx_pd_command` + `ours_args`) and mlx_lm.server."""
    known = {OURS: lambda port: mlx_pd_command(port, model_dir, dtype) + list(ours_args),
             THEIRS: lambda port: mlx_lm_command(port, model_dir) + list(theirs_args)}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown server {unknown[0]!r}: use {OURS} and/or {THEIRS}")
    return {n: known[n] for n in names}


def interleave(names: Sequence[str], r: int) -> list[str]:
    """The order in which `names` (one or two servers) run round `r`: ABBA, as `bench --compare`."""
    if len(names) != 2:
        return list(names)
    return list(names) if round_order(r)[0] == OURS else list(names)[::-1]


# --- TTFT: cold vs cached ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TTFTRequest:
    kind: str  # cold | cached | older
    pair: int
    key: str
    messages: list


def ttft_plan(pairs: int, make_system: Callable[[int, str], str], questions: Sequence[str], *, seed: int = 0,
              older: bool = True) -> list[list[TTFTRequest]]:
    """Per pair i: cold (new system prompt S_i, tagged afresh), cached (S_i, another question) and, with
    `older`, older (S_{i-1}, a third question). `make_system(i, tag)` builds S_i."""
    rng = random.Random(f"{seed}:ttft")
    systems, plan, q = [], [], iter(questions)
    for i in range(pairs):
        systems.append(make_system(i, f"cold {rng.getrandbits(32):08x}"))
        group = [TTFTRequest("cold", i, f"p{i}/cold", _chat(systems[i], next(q))),
                 TTFTRequest("cached", i, f"p{i}/cached", _chat(systems[i], next(q)))]
        if older and i > 0:
            group.append(TTFTRequest("older", i, f"p{i}/older", _chat(systems[i - 1], next(q))))
        plan.append(group)
    return plan


def _chat(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


async def _run_ttft(cfgs: dict[str, ChatWorkloadConfig], plan: list[list[TTFTRequest]], warm_messages: list,
                    urls: dict[str, str], log) -> dict:
    names = list(cfgs)
    for name, cfg in cfgs.items():
        _check_warm(name, await warmup(cfg, 2, 1, progress=False))
        cfg.messages["warm-long"] = warm_messages
        async with _client(1, cfg.timeout_s) as client:
            rec = await send_request(client, cfg, -1, "warm-long", time.perf_counter())
        log(f"{name}: long warm-up {'ok' if rec.ok else rec.error} (TTFT {rec.ttft_s or float('nan'):.2f} s)")
    for group in plan:
        for cfg in cfgs.values():
            cfg.messages.update({r.key: r.messages for r in group})
    counters = {n: prom_counters(urls[n], PREFIX_COUNTERS) for n in names}
    recs: dict[str, list[tuple[str, RequestRecord]]] = {n: [] for n in names}
    async with _client(1, 600.0) as client:
        t0 = time.perf_counter()
        for i, group in enumerate(plan):
            for name in interleave(names, i):
                for r in group:
                    rec = await send_request(client, cfgs[name], len(recs[name]), r.key, t0)
                    recs[name].append((r.kind, rec))
            log(f"pair {i + 1}/{len(plan)}: " + ", ".join(
                f"{n} " + "/".join(f"{rec.ttft_s or float('nan'):.2f}" for _, rec in recs[n][-len(group):])
                for n in names) + " s")
    out = {}
    for name in names:
        by_kind = {}
        for kind in CHAT_KINDS:
            rs = [rec for k, rec in recs[name] if k == kind]
            if not rs:
                continue
            ok = [r for r in rs if r.ok]
            by_kind[kind] = {"n": len(rs), "errors": len(rs) - len(ok), "ttft_s": distribution([r.ttft_s for r in ok]),
                             "prompt_tokens_mean": _mean([r.prompt_tokens for r in ok]),
                             "cached_tokens": [r.cached_tokens for r in ok]}
        cold, cached = by_kind["cold"]["ttft_s"]["p50"], by_kind["cached"]["ttft_s"]["p50"]
        out[name] = {"kinds": by_kind, "cold_over_cached_p50": cold / cached if cached else float("nan"),
                     "metrics_delta": _delta(counters[name], prom_counters(urls[name], PREFIX_COUNTERS)),
                     "records": [{"kind": k, **rec.to_dict()} for k, rec in recs[name]]}
    return out


def _check_warm(name: str, records: Sequence[RequestRecord]) -> None:
    bad = [r for r in records if not r.ok]
    if records and len(bad) == len(records):
        raise RuntimeError(f"{name}: every warm-up request failed; first error: {bad[0].error}")


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


# --- the command ------------------------------------------------------------------------------------


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="measure this running server instead of starting the servers")
    p.add_argument("--servers", default=f"{OURS},{THEIRS}", help=f"servers to start: {OURS} and/or {THEIRS}")
    p.add_argument("--model-dir", default=None, help="mlx-lm model folder (default: the imported SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--ours-args", default="", help="extra `mlx-pd serve` flags, e.g. \"--kv-bits 8\"")
    p.add_argument("--theirs-args", default="", help="extra mlx_lm.server flags")
    p.add_argument("--block-size", type=int, default=32, help="mlx-pd's block size, for the block ideal")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the full results as JSON")
    p.add_argument("--markdown", default=None, help="also write the tables as Markdown here")


def add_prefix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pairs", type=int, default=8, help="cold/cached pairs per server")
    p.add_argument("--system-tokens", type=int, default=1500, help="system prompt length in tokens (at least)")
    p.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    p.add_argument("--no-older", action="store_true", help="no third request back on the previous system prompt")
    add_common_args(p)


@contextlib.contextmanager
def _targets(args, log) -> Iterator[tuple[dict[str, str], str]]:
    """(name -> URL, model folder) of the servers to measure: `--url`, or started ones."""
    from cluster.model import resolve_model_path

    model_dir = args.model_dir or str(resolve_model_path(None, dtype=args.dtype))
    if args.url:
        yield {"server": args.url}, model_dir
        return
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    argvs = server_argvs(names, model_dir, args.dtype, shlex.split(args.ours_args), shlex.split(args.theirs_args))
    with running_servers(argvs, log=log) as servers:
        yield {n: s.url for n, s in servers.items()}, model_dir


def run_prefix(args, log=None) -> dict:
    """`mlx-pd bench prefix`: returns the JSON-ready result (also printed as tables)."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    with _targets(args, log) as (urls, model_dir):
        tokens = ChatTokens.from_model_dir(model_dir)
        suppress = eos_token_ids(model_dir)
        base = load_prompts()

        def make_system(i: int, tag: str) -> str:
            return system_prompt(i, args.system_tokens, tokens.count, tag=tag, seed=args.seed, base=base)

        questions = make_prompts(3 * args.pairs + 3, args.seed, tag="q")
        plan = ttft_plan(args.pairs, make_system, questions, seed=args.seed, older=not args.no_older)
        warm = _chat(make_system(999, f"warm {random.getrandbits(32):08x}"), questions[-1])
        cfgs = {n: ChatWorkloadConfig(url=u, max_tokens=args.max_tokens, suppress_token_ids=suppress, messages={})
                for n, u in urls.items()}
        load_start = os.getloadavg()
        servers = asyncio.run(_run_ttft(cfgs, plan, warm, urls, log))
    result = {"kind": "prefix", "machine": machine_info(), "loadavg_end": os.getloadavg(), "loadavg_start": load_start,
              "model_dir": model_dir, "pairs": args.pairs, "max_tokens": args.max_tokens,
              "system_prompt_tokens": [tokens.count(g[0].messages[0]["content"]) for g in plan],
              "servers": servers}
    print_prefix(result)
    return result
