"""Speculative decoding: plain decoding vs prompt lookup vs a draft model, on a workload whose answers
repeat their prompts (repeat, reformat, correct, summarize a paragraph), at several concurrency levels.

    mlx-pd bench speculative --concurrency 1,4 --num-requests 16 --out speculative.json --markdown speculative.md

One mlx-pd server serves all three modes: it loads a draft model (default: a 4-bit copy of the target) and
each request picks its mode with the `speculative` field ({"method": ..., "num_draft_tokens": k}, none for
plain), so the modes share one process and the machine's state. Each level runs `--rounds` rounds; a round
runs every mode once over the same prompts, in ABC order on even rounds and CBA on odd ones, so drift in
machine speed hits every mode alike. The server runs without prefix caching and the requests are greedy
without ignore_eos, so every mode computes the same prompts and must produce the same tokens (checked:
`identical`); output tokens/s then compares like with like. Acceptance rates come from the server's /metrics
counters around each mode's runs. Before starting, the benchmark waits (up to `--wait-idle-s`) until no
pytest or Ray worker process runs on the machine, and records whether it had to start anyway.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

from benchmarks.compare import REPO_ROOT, machine_info
from benchmarks.loadgen import WorkloadConfig, run_load
from benchmarks.prefix_bench import prom_counters
from benchmarks.report import write_json
from benchmarks.servers import ServerProcess, free_port, mlx_pd_command
from benchmarks.stats import merge_rounds

MODES = ("plain", "prompt_lookup", "draft_model")
DRAFT_COUNTERS = ("mlx_pd_draft_tokens", "mlx_pd_draft_accepted_tokens")

PARAGRAPHS = (
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night its keeper "
    "climbed the narrow stairs, cleaned the glass and lit the lamp, so that the fishing boats could find their "
    "way home through the fog. When the keeper retired, the town decided to keep the light burning with an "
    "electric lamp, but the people still tell stories about him.",
    "Our team meeting has been moved from Monday to Wednesday at ten in the morning. Please bring the quarterly "
    "report, the updated budget and your notes from the customer visits. If you cannot attend, send your "
    "comments to the project manager before Tuesday evening so that they can be discussed.",
    "To make a simple tomato soup, cook one chopped onion in olive oil until it is soft. Add two cloves of "
    "garlic, a tin of tomatoes and half a litre of vegetable stock. Let it simmer for twenty minutes, then "
    "blend it until smooth and season it with salt, pepper and a little sugar.",
    "The library will be closed for repairs from the first to the fifteenth of March. During this time, books "
    "can be returned at the town hall, and the online catalogue will remain available. We thank our readers "
    "for their patience and look forward to welcoming them back to the renovated reading room.",
    "Water boils at one hundred degrees Celsius at sea level, but at lower temperatures on high mountains, "
    "because the air pressure is lower there. This is why cooking pasta takes longer in the mountains. A "
    "pressure cooker raises the boiling point and makes food cook faster.",
    "The train to the coast leaves from platform four at half past eight. It stops at every station until the "
    "river crossing and then runs fast to the harbour. Tickets can be bought at the machines in the hall or "
    "from the conductor on the train, who accepts cash and cards.",
    "Maria planted a small garden behind her house last spring. She grew beans, carrots, lettuce and a row of "
    "sunflowers along the fence. By the end of the summer the sunflowers were taller than the fence, and the "
    "neighbours came to take pictures of them.",
    "The museum's new exhibition shows paintings from the harbour towns of the north. Most of the pictures show "
    "ships, markets and the people who worked on the docks. The exhibition is open every day except Monday, and "
    "entry is free for children and students.",
)
INSTRUCTIONS = (
    "Repeat the following text exactly as it is written:\n\n{}",
    "Rewrite the following text, keeping every sentence but putting each sentence on its own line:\n\n{}",
    "Correct any mistakes in the following text and return the full corrected text:\n\n{}",
    "Summarize the following text, reusing its own words and sentences:\n\n{}",
)


def workload(n: int, offset: int = 0) -> list[str]:
    """`n` prompts: instruction x paragraph pairs in a fixed interleaved order, from `offset` on."""
    pairs = [INSTRUCTIONS[i % len(INSTRUCTIONS)].format(PARAGRAPHS[(i // len(INSTRUCTIONS) + i) % len(PARAGRAPHS)])
             for i in range(len(INSTRUCTIONS) * len(PARAGRAPHS))]
    return [pairs[(offset + i) % len(pairs)] for i in range(n)]


@dataclass(frozen=True)
class SpeculativeWorkload(WorkloadConfig):
    """A WorkloadConfig whose requests carry `speculative` (None = plain decoding)."""

    speculative: Optional[dict] = None

    def body(self, prompt) -> dict:
        body = super().body(prompt)
        if self.speculative is not None:
            body["speculative"] = dict(self.speculative)
        return body


def wait_for_idle(max_s: float, poll_s: float = 30.0, log=print) -> bool:
    """Wait until `pgrep -f "pytest|ray::"` finds nothing (polling every `poll_s`, at most `max_s`).
    Returns True when the machine was idle, False when the wait ran out."""
    deadline = time.monotonic() + max_s
    while True:
        lines = subprocess.run(["pgrep", "-af", "pytest|ray::"], capture_output=True, text=True).stdout.splitlines()
        # wrappers (flock, shells, timeout) that merely mention pytest in their arguments do not count
        busy = [line for line in lines if line.split()[0] != str(os.getpid())
                and os.path.basename(line.split()[1]) not in ("flock", "bash", "sh", "timeout", "pgrep")]
        if not busy:
            return True
        if time.monotonic() >= deadline:
            log(f"spec bench: {len(busy)} pytest/ray processes still running after {max_s:.0f} s; running anyway")
            return False
        log(f"spec bench: waiting for {len(busy)} pytest/ray processes to finish")
        time.sleep(poll_s)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", default="1,4", help="comma-separated levels (default 1,4)")
    p.add_argument("--num-requests", type=int, default=16, help="measured requests per mode and level (default 16)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per level (default 2)")
    p.add_argument("--max-tokens", type=int, default=160, help="output tokens per request at most (default 160)")
    p.add_argument("--num-draft-tokens", type=int, default=8, help="draft tokens per step at most (default 8)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument("--model-dir", default=None, help="mlx-lm model folder (default: the imported SmolLM2)")
    p.add_argument("--draft-model", default=None, help="draft model source (default: the target, quantized)")
    p.add_argument("--draft-quantize-bits", type=int, default=4, choices=[4, 8],
                   help="quantize the draft model's weights (default 4)")
    p.add_argument("--draft-cost-per-token", type=float, default=None,
                   help="the server's --draft-cost-per-token (default: measured at load; a small value such as "
                        "0.05 keeps the draft model speculating where it does not pay)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="the server's running batch (default 8)")
    p.add_argument("--wait-idle-s", type=float, default=600.0,
                   help="wait this long at most for pytest/ray processes to finish before starting (default 600)")
    p.add_argument("--out", default=None, help="write the full results as JSON")
    p.add_argument("--markdown", default=None, help="also write the tables as Markdown")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


async def _level(url: str, modes: list[str], concurrency: int, args, log) -> dict:
    cfgs = {m: SpeculativeWorkload(url=url, max_tokens=args.max_tokens, ignore_eos=False,
                            speculative=None if m == "plain" else {"method": m, "num_draft_tokens": args.num_draft_tokens})
            for m in modes}
    for m in modes:  # warm-up, unmeasured
        await run_load(cfgs[m], workload(max(2, concurrency), offset=7), concurrency=concurrency, progress=False)
    per_round = max(1, args.num_requests // args.rounds)
    done: dict[str, list] = {m: [] for m in modes}
    counters = {m: [0.0, 0.0] for m in modes}
    texts: dict[str, dict[str, str]] = {m: {} for m in modes}
    for r in range(args.rounds):
        prompts = workload(per_round, offset=r * per_round)
        for m in (modes if r % 2 == 0 else modes[::-1]):
            before = prom_counters(url, DRAFT_COUNTERS)
            recs, duration = await run_load(cfgs[m], prompts, concurrency=concurrency, progress=not args.no_progress,
                                            desc=f"c={concurrency} round {r + 1}/{args.rounds} {m}")
            after = prom_counters(url, DRAFT_COUNTERS)
            for i, name in enumerate(DRAFT_COUNTERS):
                counters[m][i] += (after[name] or 0.0) - (before[name] or 0.0)
            done[m].append((recs, duration))
            texts[m].update({f"{r}:{i}": rec.text for i, rec in enumerate(recs)})
    out = {"concurrency": concurrency, "modes": {}}
    for m in modes:
        s = merge_rounds(done[m])
        drafted, accepted = counters[m]
        s["draft_tokens"], s["accepted_tokens"] = drafted, accepted
        s["acceptance_rate"] = accepted / drafted if drafted else None
        s["identical_to_plain"] = (sum(texts[m][k] == texts["plain"][k] for k in texts[m]) / len(texts[m])
                                   if "plain" in texts else None)
        out["modes"][m] = s
    if "plain" in out["modes"]:
        base = out["modes"]["plain"]["output_throughput"]
        for m in modes:
            out["modes"][m]["speedup"] = out["modes"][m]["output_throughput"] / base if base else None
    log(f"concurrency {concurrency}: " + ", ".join(
        f"{m} {s['output_throughput']:.1f} tok/s" for m, s in out["modes"].items()))
    return out


def run(args, log=None) -> dict:
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"--modes must name some of {', '.join(MODES)}, got {args.modes!r}")
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1 or args.num_requests < 1 or args.rounds < 1:
        raise ValueError("--concurrency, --num-requests and --rounds must be >= 1")
    idle = wait_for_idle(args.wait_idle_s, log=log)
    from cluster.model import resolve_model_path

    model_dir = args.model_dir or str(resolve_model_path(None))
    port = free_port()
    argv = mlx_pd_command(port, model_dir) + ["--no-prefix-caching", "--max-num-seqs", str(args.max_num_seqs),
                                             "--max-model-len", "2048"]
    if "draft_model" in modes:
        argv += ["--draft-model", args.draft_model or model_dir, "--draft-quantize-bits", str(args.draft_quantize_bits)]
        if args.draft_cost_per_token is not None:
            argv += ["--draft-cost-per-token", str(args.draft_cost_per_token)]
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    result = {"machine": machine_info(), "idle_at_start": idle, "model_dir": model_dir, "server_argv": argv,
              "max_tokens": args.max_tokens, "num_draft_tokens": args.num_draft_tokens, "modes": modes,
              "draft": None if "draft_model" not in modes else {"source": args.draft_model or "(the target)",
                                                                 "quantize_bits": args.draft_quantize_bits,
                                                                 "cost_per_token": args.draft_cost_per_token},
              "levels": []}
    with ServerProcess("mlx-pd-spec", argv, port, env=env, cwd=str(REPO_ROOT)) as server:
        log(f"server healthy after {server.wait_healthy(600):.1f} s (log: {server.log_path})")
        costs = re.findall(r"relative cost per draft token ([0-9.]+)", server.log_tail(200))
        if result["draft"] is not None and costs:
            result["draft"]["cost_per_token"] = float(costs[-1])
        for c in levels:
            result["levels"].append(asyncio.run(_level(server.url, modes, c, args, log)))
            if args.out:  # what is done survives an interrupted run
                write_json(result, args.out)
    result["machine"]["loadavg_end"] = os.getloadavg()
    result["errors"] = sum(s["errors"] for level in result["levels"] for s in level["modes"].values())
    return result


def tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) for the Markdown report."""
    def fmt(v, spec=".2f") -> str:
        return "-" if v is None else format(v, spec)

    rows = []
    for level in result["levels"]:
        for m, s in level["modes"].items():
            rows.append([str(level["concurrency"]), m, fmt(s["output_throughput"], ".1f"), fmt(s.get("speedup")) + "x",
                         fmt(s["tpot_s"]["p50"] * 1000, ".0f"), fmt(s["e2e_s"]["p50"], ".1f"),
                         fmt(s["acceptance_rate"]), f"{s['accepted_tokens']:.0f} / {s['draft_tokens']:.0f}",
                         fmt(s["identical_to_plain"])])
    head = ["concurrency", "mode", "output tok/s", "vs plain", "TPOT p50 ms", "e2e p50 s", "acceptance",
            "accepted / drafted", "same text as plain"]
    return [(f"Speculative decoding, {result['max_tokens']} tokens at most, k <= {result['num_draft_tokens']}", head,
             rows)]
