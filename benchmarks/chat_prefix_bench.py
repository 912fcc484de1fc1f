"""Multi-tenant chat benchmark: the prefix hit rate that shared system prompts buy over multi-turn
conversations, against what a perfect cache could have served, with TTFT and throughput.

    mlx-pd bench chat --users 16 --system-prompts 4 --concurrency 8 --out chat.json   # multi-tenant chat

As `bench prefix` does (benchmarks/prefix_bench.py, whose server start-up, ABBA order and common flags this
uses), it starts mlx-pd and mlx_lm.server on the same model folder (`--servers` picks one) or measures one
running server (`--url`), and interleaves the servers in ABBA order so that drift in machine speed hits both
alike. Only one server has requests in flight at any time.

The workload: `--system-prompts` tenants with ~1k-token system prompts, `--users` users each bound to one
tenant (user u -> tenant u mod N), two turns each: turn 2 = turn 1's messages + the assistant's reply
+ a new user message. A worker runs one user's turns back to back; `--concurrency` workers.

Hit rate = sum cached_tokens / sum prompt_tokens (the servers' `usage`). The *ideal* is what a perfect
cache could have served: for each request, the longest common token prefix with what some other request
had computed by the time this one was sent — its prompt once its first token had arrived, and once it had
finished also all but its last output token (the reply rendered as the next turn renders it) — capped at
prompt - 1 (one prompt token is always computed). "Block ideal" rounds that down to whole blocks (mlx-pd
shares full blocks only, by design).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import httpx

from benchmarks.compare import eos_token_ids, machine_info, split_rounds
from benchmarks.loadgen import send_request, warmup
from benchmarks.prefix_bench import (PREFIX_COUNTERS, ChatWorkloadConfig, _check_warm, _client, _delta, _targets,
                                     add_common_args, interleave, prom_counters)
from benchmarks.prefix_report import print_chat
from benchmarks.stats import RequestRecord, merge_rounds
from benchmarks.workloads import (ChatTokens, Conversation, Served, build_conversations, computed_ids, hit_rates,
                                  ideal_cached_tokens, system_prompt)

# --- running the conversations -------------------------------------------------------------------------


@dataclass
class ChatResult:
    conv: Conversation
    turn: int
    messages: list
    rec: RequestRecord


async def _chat_round(cfg: ChatWorkloadConfig, convs: Sequence[Conversation], concurrency: int,
                      t0: float) -> tuple[list[ChatResult], float]:
    """Run each conversation's turns back to back on `concurrency` workers; (results, wall seconds)."""
    results: list[ChatResult] = []
    queue = iter(convs)

    async def worker(client: httpx.AsyncClient) -> None:
        for conv in queue:  # a shared iterator: each conversation is taken once
            replies: list[str] = []
            for turn in range(len(conv.questions)):
                msgs = conv.messages(turn, replies)
                cfg.messages[conv.key(turn)] = msgs
                rec = await send_request(client, cfg, len(results), conv.key(turn), t0)
                results.append(ChatResult(conv, turn, msgs, rec))
                if not rec.ok:
                    break
                replies.append(rec.text)

    start = time.perf_counter()
    async with _client(concurrency, cfg.timeout_s) as client:
        await asyncio.gather(*(worker(client) for _ in range(min(concurrency, len(convs)))))
    return results, time.perf_counter() - start


def chat_hit_rates(results: Sequence[ChatResult], tokens: ChatTokens, block_size: int) -> dict:
    """Hit rates (overall and per turn) against the token-exact and block ideals; also how many prompt
    token counts the client's rendering got exactly as the server's usage."""
    served, ok = [], [r for r in results if r.rec.ok]
    for r in results:
        prompt = tokens.render(r.messages)
        end = r.rec.start_s + r.rec.e2e_s if r.rec.ok else None
        reply = [{"role": "assistant", "content": r.rec.text}]
        with_reply = tokens.render(r.messages + reply, generation_prompt=False) if r.rec.ok else prompt
        first = r.rec.start_s + r.rec.ttft_s if r.rec.ok else None
        served.append(Served(r.rec.start_s, end, prompt, computed_ids(prompt, with_reply, r.rec.output_tokens), first))
    exact, block = ideal_cached_tokens(served), ideal_cached_tokens(served, block_size)
    idx = [i for i, r in enumerate(results) if r.rec.ok]
    out = {"prompt_count_matches": sum(len(served[i].prompt_ids) == results[i].rec.prompt_tokens for i in idx),
           "requests_ok": len(ok), "ideal_per_request": exact, "block_ideal_per_request": block}
    for label, sel in (("all", idx), *((f"turn {t + 1}", [i for i in idx if results[i].turn == t])
                                        for t in range(max((r.turn for r in results), default=0) + 1))):
        prompt = [results[i].rec.prompt_tokens or 0 for i in sel]
        cached = [results[i].rec.cached_tokens or 0 for i in sel]
        out[label] = {**hit_rates(prompt, cached, [exact[i] for i in sel]),
                      "block_ideal_tokens": sum(block[i] for i in sel),
                      "of_block_ideal": (sum(cached) / sum(block[i] for i in sel)) if sum(block[i] for i in sel)
                      else float("nan")}
    return out


async def _run_chat(cfgs: dict[str, ChatWorkloadConfig], convs: list[Conversation], concurrency: int, rounds: int,
                    urls: dict[str, str], log) -> dict:
    names = list(cfgs)
    for name, cfg in cfgs.items():
        _check_warm(name, await warmup(cfg, max(2, concurrency), concurrency, progress=False))
    counters = {n: prom_counters(urls[n], PREFIX_COUNTERS) for n in names}
    done: dict[str, list[tuple[list[ChatResult], float]]] = {n: [] for n in names}
    t0 = time.perf_counter()
    parts = split_rounds(convs, rounds)
    for r, part in enumerate(parts):
        for name in interleave(names, r):
            results, wall = await _chat_round(cfgs[name], part, concurrency, t0)
            done[name].append((results, wall))
            log(f"round {r + 1}/{len(parts)} {name}: {len(results)} requests in {wall:.0f} s")
    out = {}
    for name in names:
        out[name] = {"results": [x for results, _ in done[name] for x in results],
                     "summary": merge_rounds([([x.rec for x in res], wall) for res, wall in done[name]]),
                     "metrics_delta": _delta(counters[name], prom_counters(urls[name], PREFIX_COUNTERS))}
    return out


# --- the command ------------------------------------------------------------------------------------


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--system-prompts", type=int, default=4, help="tenants, one system prompt each")
    p.add_argument("--system-tokens", type=int, default=1000, help="system prompt length in tokens (at least)")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per turn")
    p.add_argument("--rounds", type=int, default=4, help="ABBA rounds (users split into this many parts)")
    add_common_args(p)


def run_chat(args, log=None) -> dict:
    """`mlx-pd bench chat`: returns the JSON-ready result (also printed as tables)."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    with _targets(args, log) as (urls, model_dir):
        tokens = ChatTokens.from_model_dir(model_dir)
        nonce = f"{random.Random(args.seed).getrandbits(32):08x}"
        systems = [system_prompt(i, args.system_tokens, tokens.count, tag=f"tenant {i} {nonce}", seed=args.seed)
                   for i in range(args.system_prompts)]
        convs = build_conversations(args.users, systems, args.turns, args.seed)
        cfgs = {n: ChatWorkloadConfig(url=u, max_tokens=args.max_tokens, suppress_token_ids=eos_token_ids(model_dir),
                                      messages={}) for n, u in urls.items()}
        load_start = os.getloadavg()
        runs = asyncio.run(_run_chat(cfgs, convs, args.concurrency, args.rounds, urls, log))
    servers = {}
    for name, run in runs.items():
        servers[name] = {"summary": run["summary"], "metrics_delta": run["metrics_delta"],
                         "hits": chat_hit_rates(run["results"], tokens, args.block_size),
                         "records": [{"key": x.conv.key(x.turn), **x.rec.to_dict()}
                                     for x in run["results"]]}
    result = {"kind": "chat", "machine": machine_info(), "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
              "model_dir": model_dir, "users": args.users, "system_prompts": args.system_prompts,
              "system_prompt_tokens": [tokens.count(s) for s in systems], "turns": args.turns,
              "concurrency": args.concurrency, "max_tokens": args.max_tokens, "servers": servers}
    print_chat(result)
    return result
