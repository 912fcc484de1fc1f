"""mlx-pd vs mlx_lm.server measured by NVIDIA's aiperf, an independent load generator, in ABBA rounds.

    python -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf      # once, outside the project
    mlx-pd bench aiperf --aiperf /tmp/aiperf-venv/bin/aiperf --concurrency 1,4,8 --out aiperf.json --markdown aiperf.md
    mlx-pd bench aiperf --aiperf /tmp/aiperf-venv/bin/aiperf --fast-model

aiperf is not a dependency of mlx-pd: it lives in its own virtualenv and is run as a program (`--aiperf`, default
`aiperf` on PATH); the scenario stops before starting anything when it is missing. Both servers run on one model
folder (benchmarks/engine_pair.py) and stay up throughout. Per concurrency level each server is warmed up with
`concurrency` unmeasured requests of the project's own load generator, then each round runs `aiperf profile`
once per server, in ABBA order (ours, theirs, theirs, ours, ...): the chat endpoint, streaming, `--num-requests`
requests at the level's concurrency, synthetic prompts of `--isl` tokens (no spread), `--osl` output tokens
(``max_completion_tokens``) with ``ignore_eos`` and ``logit_bias`` -100 on the model's EOS ids and temperature 0
in the body (aiperf's ``--extra-inputs``), token counts from the servers' usage (``--use-server-token-count``),
the model's own tokenizer. Both servers get the same prompts in a round (the same ``--random-seed``), and each
round gets new ones (the seed changes), so no round hits a prefix cache that an earlier one filled. aiperf's own
server-metrics and GPU-telemetry collectors are off (``--no-server-metrics``, ``--no-gpu-telemetry``): by default
aiperf scrapes the server's ``/metrics`` about three times a second and parses every scrape, work that only
mlx-pd (which serves ``/metrics``; mlx_lm.server answers 404) would pay for, on the same 2 cores.

From each run's JSON export (``profile_export_aiperf.json``, `parse_export`): output token throughput (tokens/s),
ITL p50 and TTFT p50 (aiperf reports ms; stored here in seconds), requests and errors. Each row is the median
over a server's rounds; ratios are ours / theirs (throughput: higher is better; latencies: lower). Each run's
artifacts stay in `--artifacts` (default: a temporary folder, named in the result).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.engine_pair import (NAMES, abba, add_pair_args, fmt_ms, fmt_ratio, medians, model_dir_of, pair,
                                    ratio, suppressed_ids)

INSTALL = "python -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf"
EXPORT = "profile_export_aiperf.json"
KEYS = ("output_token_throughput", "itl_p50_s", "ttft_p50_s")


def find_aiperf(given: Optional[str]) -> str:
    """The aiperf program to run: `given` (a path or a name on PATH), default ``aiperf`` on PATH. Raises
    FileNotFoundError naming the install command when there is none."""
    path = shutil.which(given or "aiperf")
    if path is None:
        raise FileNotFoundError(f"aiperf not found ({given or 'aiperf on PATH'}); it is not a dependency of mlx-pd: "
                                f"install it in its own virtualenv with `{INSTALL}` and pass "
                                "--aiperf /tmp/aiperf-venv/bin/aiperf")
    return path


def extra_inputs(suppress: Sequence[int]) -> dict:
    """The fields aiperf adds to every request body: greedy, ignore_eos, and logit_bias -100 on `suppress`."""
    body: dict = {"temperature": 0, "ignore_eos": True}
    if suppress:
        body["logit_bias"] = {str(t): -100 for t in suppress}
    return body


def aiperf_argv(aiperf: str, *, model: str, url: str, tokenizer: str, concurrency: int, requests: int, isl: int,
                osl: int, seed: int, artifact_dir: str, suppress: Sequence[int], workers: int = 1) -> list[str]:
    """argv of one `aiperf profile` run (flags of aiperf 0.13; see the module doc)."""
    return [aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
            "--concurrency", str(concurrency), "--request-count", str(requests), "--isl", str(isl),
            "--isl-stddev", "0", "--osl", str(osl), "--extra-inputs", json.dumps(extra_inputs(suppress)),
            "--tokenizer", tokenizer, "--use-server-token-count", "--random-seed", str(seed),
            "--artifact-dir", artifact_dir, "--ui-type", "none", "--workers-max", str(workers),
            "--record-processors", "1", "--no-server-metrics", "--no-gpu-telemetry"]


def _stat(export: dict, key: str, field: str) -> Optional[float]:
    value = export.get(key)
    return float(value[field]) if isinstance(value, dict) and value.get(field) is not None else None


def parse_export(export: dict) -> dict:
    """The numbers of one aiperf JSON export (``profile_export_aiperf.json``): output_token_throughput
    (tokens/s), itl_p50_s and ttft_p50_s (seconds; aiperf's are ms), requests, errors (aiperf's error request
    count, else the counts in its error summary), output_tokens_mean and input_tokens_mean (per request).
    Raises ValueError when the throughput is missing (a run that measured nothing)."""
    ms = lambda key: None if _stat(export, key, "p50") is None else _stat(export, key, "p50") / 1000  # noqa: E731
    throughput = _stat(export, "output_token_throughput", "avg")
    if throughput is None:
        raise ValueError("the aiperf export has no output_token_throughput")
    errors = _stat(export, "error_request_count", "avg")
    if errors is None:
        errors = sum(int(e.get("count", 1)) for e in export.get("error_summary") or [] if isinstance(e, dict))
    return {"output_token_throughput": throughput, "itl_p50_s": ms("inter_token_latency"),
            "ttft_p50_s": ms("time_to_first_token"), "requests": int(_stat(export, "request_count", "avg") or 0),
            "errors": int(errors), "output_tokens_mean": _stat(export, "output_sequence_length", "avg"),
            "input_tokens_mean": _stat(export, "input_sequence_length", "avg")}


def served_model(name: str, url: str, model_dir: str) -> str:
    """The `model` field each server accepts: mlx-pd's first name in ``GET /v1/models``; mlx_lm.server's own
    model folder (the path it was started with, so it loads nothing new)."""
    if name != NAMES[0]:
        return model_dir
    import httpx

    return httpx.get(url + "/v1/models", timeout=10.0).json()["data"][0]["id"]


def run_aiperf(argv: list[str], artifact_dir: Path, timeout_s: float) -> dict:
    """Run aiperf, parse its export; raises RuntimeError (with the end of its output) when it fails."""
    artifact_dir.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"aiperf ran longer than {timeout_s:.0f} s (artifacts in {artifact_dir})") from None
    (artifact_dir / "aiperf-output.txt").write_text(done.stdout + done.stderr, encoding="utf-8")
    export = artifact_dir / EXPORT
    if done.returncode != 0 or not export.is_file():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise RuntimeError(f"aiperf exited with {done.returncode} (artifacts in {artifact_dir}):\n{tail}")
    return parse_export(json.loads(export.read_text(encoding="utf-8")))


def add_args(p: argparse.ArgumentParser) -> None:
    """The options of `mlx-pd bench aiperf`."""
    p.add_argument("--aiperf", default=None, help=f"the aiperf program (default: aiperf on PATH; install: {INSTALL})")
    p.add_argument("--concurrency", default="1,4,8", help="comma-separated levels (default 1,4,8)")
    p.add_argument("--num-requests", type=int, default=16, help="requests per aiperf run (default 16)")
    p.add_argument("--isl", type=int, default=128, help="synthetic prompt tokens (default 128)")
    p.add_argument("--osl", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--workers", type=int, default=1, help="aiperf's --workers-max (default 1)")
    p.add_argument("--run-timeout-s", type=float, default=1800.0, help="kill an aiperf run after this (default 1800)")
    p.add_argument("--artifacts", default=None, help="folder for aiperf's artifacts (default: a temporary folder)")
    add_pair_args(p, rounds=2)


def run(args, log=None) -> dict:
    """Check for aiperf, start both servers, run the levels; returns the JSON-ready result."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    aiperf = find_aiperf(args.aiperf)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or min(levels + [args.num_requests, args.isl, args.osl, args.rounds]) < 1:
        raise ValueError("--concurrency, --num-requests, --isl, --osl and --rounds must be >= 1")
    from benchmarks.compare import machine_info
    from benchmarks.loadgen import WorkloadConfig, warmup

    model_dir = model_dir_of(args)
    suppress = suppressed_ids(args, model_dir)
    root = Path(args.artifacts or tempfile.mkdtemp(prefix="mlx-pd-aiperf-"))
    version = subprocess.run([aiperf, "--version"], capture_output=True, text=True).stdout.strip()
    result = {"machine": machine_info(), "aiperf": aiperf, "aiperf_version": version, "model_dir": model_dir,
              "dtype": args.dtype, "isl": args.isl, "osl": args.osl, "num_requests": args.num_requests,
              "rounds": args.rounds, "suppressed_token_ids": list(suppress), "artifacts": str(root), "levels": []}
    with pair(model_dir, args.dtype, log) as servers:
        result["commands"] = {n: s.argv for n, s in servers.items()}
        models = {n: served_model(n, s.url, model_dir) for n, s in servers.items()}
        for c in levels:
            level = {"concurrency": c, "servers": {n: {"rounds": []} for n in NAMES}}
            for name in NAMES:
                cfg = WorkloadConfig(url=servers[name].url, max_tokens=args.osl, suppress_token_ids=suppress)
                asyncio.run(warmup(cfg, max(2, c), c, seed=args.seed * 1000 + c, progress=False))
            for r, name in abba(args.rounds):
                folder = root / f"c{c}" / f"round{r}" / name
                argv = aiperf_argv(aiperf, model=models[name], url=servers[name].url, tokenizer=model_dir,
                                   concurrency=c, requests=args.num_requests, isl=args.isl, osl=args.osl,
                                   seed=args.seed * 10007 + c * 101 + r, artifact_dir=str(folder), suppress=suppress,
                                   workers=args.workers)
                got = run_aiperf(argv, folder, args.run_timeout_s)
                got["round"], got["argv"] = r, argv
                level["servers"][name]["rounds"].append(got)
                if not args.no_progress:
                    log(f"c={c} round {r + 1}/{args.rounds} {name}: {got['output_token_throughput']:.1f} tok/s, ITL "
                        f"p50 {fmt_ms(got['itl_p50_s'])} ms, TTFT p50 {fmt_ms(got['ttft_p50_s'])} ms, "
                        f"{got['errors']} errors")
            for s in level["servers"].values():
                s["median"] = medians(s["rounds"], KEYS)
                s["errors"] = sum(g["errors"] for g in s["rounds"])
            level["ratios"] = {k: ratio(level["servers"][NAMES[0]]["median"][k],
                                        level["servers"][NAMES[1]]["median"][k]) for k in KEYS}
            result["levels"].append(level)
    result["machine"]["loadavg_end"] = os.getloadavg()
    result["errors"] = sum(s["errors"] for lv in result["levels"] for s in lv["servers"].values())
    from benchmarks.prefix_report import print_tables

    print_tables(tables(result))
    return result


def tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows): per level one row per server (medians over rounds), then the ratios ours/theirs."""
    head = ["conc.", "server", "output tok/s", "ITL p50 ms", "TTFT p50 ms", "requests", "errors"]
    rows = []
    for level in result["levels"]:
        c = str(level["concurrency"])
        for name, s in level["servers"].items():
            m = s["median"]
            tok_s = m["output_token_throughput"]
            rows.append([c, name, "-" if tok_s != tok_s else f"{tok_s:.2f}", fmt_ms(m["itl_p50_s"]),
                         fmt_ms(m["ttft_p50_s"]), str(sum(g["requests"] for g in s["rounds"])), str(s["errors"])])
        r = level["ratios"]
        rows.append([c, "ratio ours/theirs"] + [fmt_ratio(r[k]) for k in KEYS] + ["", ""])
    title = (f"aiperf {result.get('aiperf_version') or ''}: chat, streaming, {result['isl']} prompt tokens, "
             f"{result['osl']} output tokens, {result['num_requests']} requests a run (medians over rounds)")
    return [(title, head, rows)]
