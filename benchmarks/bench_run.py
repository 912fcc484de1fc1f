"""The runs behind `mlx-pd bench --url ...` and `mlx-pd bench --compare` (benchmarks/cli.py parses; this runs).

Outputs of every run: the terminal table; ``--out`` JSON (every request's record); ``--markdown`` the
tables; PNGs (benchmarks/plots.py): ``NAME-latency-cdf.png`` (TTFT, TPOT, E2E CDFs, one line per level, or per
target at the highest level when comparing) and ``NAME-throughput.png`` (output tokens/s vs concurrency, one line
per target), next to the ``--out`` JSON and named after it by default (``--plots DIR`` and ``--plot-name``
choose, ``--no-plot`` draws none); the paths are printed.

- One ``--url``: each level runs on its own (closed loop at a concurrency, or Poisson arrivals at ``--rate``).
- Several ``--url`` (``--labels`` names them): the endpoints are compared in ABBA rounds, as ``--compare``.
- ``--compare``: the tool starts ``--targets`` itself (benchmarks/compare.py).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path
from typing import Optional


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload, SLO, plot and target options of `mlx-pd bench`."""
    from benchmarks.compare import OURS, THEIRS, TARGETS
    from benchmarks.scenarios import WORKLOADS

    p.add_argument("--workload", default="chat", choices=WORKLOADS,
                   help="chat (short), shared-prefix (multi-tenant system prompts), long-prompt (RAG-like), mixed "
                        "(see benchmarks/scenarios.py; default chat)")
    p.add_argument("--tenants", type=int, default=4, help="shared-prefix: distinct system prompts (default 4)")
    p.add_argument("--system-tokens", type=int, default=512, help="shared-prefix: tokens per system prompt")
    p.add_argument("--long-tokens", type=_floats, default=(2048, 8192),
                   help="long-prompt: prompt tokens drawn uniformly from LO,HI (default 2048,8192)")
    p.add_argument("--mix", type=_floats, default=(0.6, 0.3, 0.1),
                   help="mixed: weights of chat, shared-prefix, long-prompt (default 0.6,0.3,0.1)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. --goodput ttft:2000 tpot:150 e2e:10000 (milliseconds)")
    p.add_argument("--plots", default=None, metavar="DIR",
                   help="write the PNG plots into DIR (default: the folder of --out; none without --out)")
    p.add_argument("--plot-name", default=None,
                   help="file name prefix of the plots (default: bench with --plots, else the --out file's name "
                        "without its suffix)")
    p.add_argument("--no-plot", action="store_true", help="draw no plots")
    p.add_argument("--labels", default=None, help="names of several --url endpoints, comma-separated")
    p.add_argument("--targets", default=f"{OURS},{THEIRS}",
                   help=f"--compare: what to start and compare, comma-separated, from {', '.join(TARGETS)} "
                        f"(default {OURS},{THEIRS})")


def _maker(args):
    """(workload spec, make(n, seed) -> prompts) from the options."""
    from benchmarks.scenarios import WorkloadSpec, build_workload

    lo, hi = (int(v) for v in args.long_tokens)
    spec = WorkloadSpec(args.workload, tenants=args.tenants, system_tokens=args.system_tokens, long_tokens=(lo, hi),
                        mix=tuple(args.mix))
    return spec, lambda n, seed: build_workload(spec, n, seed, shared_prefix=args.shared_prefix)


def _slos(args) -> Optional[dict]:
    from benchmarks.stats import parse_slos

    return parse_slos(args.goodput) if args.goodput else None


def _levels(args) -> list[Optional[int]]:
    if args.concurrency:
        return list(args.concurrency)
    return [None] if args.rate else [1]


def plot_prefix(args) -> Optional[Path]:
    """Where the plots go, as a path prefix (`DIR/NAME`; each plot adds `-latency-cdf.png` and so on), or None
    for no plots: `--no-plot`, else `--plots DIR` (NAME `--plot-name`, default "bench"), else next to the `--out`
    JSON (NAME `--plot-name`, default the JSON file's name without its suffix); none without either."""
    if getattr(args, "no_plot", False) or not (args.plots or args.out):
        return None
    if args.plots:
        return Path(args.plots) / (args.plot_name or "bench")
    return Path(args.out).parent / (args.plot_name or Path(args.out).stem)


def _done(paths: list[Path]) -> None:
    print(f"mlx-pd bench: plots: {', '.join(str(p) for p in paths)}", file=sys.stderr, flush=True)


def _plot_levels(result: dict, prefix: Path) -> None:
    """CDFs and throughput of a comparison-shaped result (levels x targets)."""
    from benchmarks.plots import plot_latency_cdfs, plot_throughput

    levels = result["levels"]
    names = levels[0]["targets"]
    top = levels[-1]
    title = f"{result.get('workload', 'chat')}, {len(names)} targets at concurrency {top['concurrency']}"
    paths = [plot_latency_cdfs({n: top["records"][n] for n in names}, f"{prefix}-latency-cdf.png", title)]
    if all(lv["concurrency"] for lv in levels):
        paths.append(plot_throughput({n: [(lv["concurrency"], lv["servers"][n]["output_throughput"]) for lv in levels]
                                      for n in names}, f"{prefix}-throughput.png"))
    _done(paths)


def _report_levels(result: dict, args) -> int:
    """Print a comparison-shaped result, write its JSON/Markdown/plots as asked; exit code 1 if any request
    failed, else 0."""
    from benchmarks.report import markdown_compare, print_compare, write_json

    print_compare(result)
    write_json(result, args.out)
    if args.markdown:
        Path(args.markdown).write_text(markdown_compare(result), encoding="utf-8")
    prefix = plot_prefix(args)
    if prefix is not None:
        _plot_levels(result, prefix)
    return 1 if any(s["errors"] for lv in result["levels"] for s in lv["servers"].values()) else 0


def run_url(args) -> int:
    """One or several --url endpoints (see the module doc)."""
    from benchmarks.loadgen import WorkloadConfig, run_benchmark
    from benchmarks.report import markdown_runs, print_single, write_json

    spec, make = _maker(args)
    slos = _slos(args)
    levels = _levels(args)
    counts = args.num_requests * len(levels) if len(args.num_requests) == 1 else args.num_requests
    if len(counts) != len(levels):
        print("mlx-pd bench: error: give one --num-requests or one per concurrency level", file=sys.stderr)
        return 2
    if len(args.url) > 1:
        from benchmarks.compare import run_levels

        labels = args.labels.split(",") if args.labels else [u.split("//")[-1].rstrip("/") for u in args.url]
        if len(labels) != len(args.url) or len(set(labels)) != len(labels):
            print("mlx-pd bench: error: --labels needs one distinct name per --url", file=sys.stderr)
            return 2
        log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
        result = {"workload": spec.name, "max_tokens": args.max_tokens, "targets": labels, "slo_s": slos or {},
                  "urls": dict(zip(labels, args.url)), "command": "mlx-pd bench " + shlex.join(args.argv)}
        result["levels"] = run_levels(dict(zip(labels, args.url)), levels, counts, max_tokens=args.max_tokens,
                                      rounds=args.rounds, seed=args.seed, progress=not args.no_progress,
                                      suppress=args.suppress_tokens, make=make, slos=slos, rate=args.rate, log=log)
        return _report_levels(result, args)
    cfg = WorkloadConfig(url=args.url[0], model=args.model, max_tokens=args.max_tokens, api_key=args.api_key,
                         ignore_eos=not args.no_ignore_eos, suppress_token_ids=args.suppress_tokens)
    results = []
    for c, n in zip(levels, counts):
        result = asyncio.run(run_benchmark(cfg, num_requests=n, concurrency=c, rate=args.rate,
                                           warmup_requests=args.warmup, seed=args.seed,
                                           shared_prefix=args.shared_prefix, progress=not args.no_progress,
                                           prompts=make(n, args.seed), workload=spec.name, slos=slos))
        print_single(result)
        results.append(result)
    write_json(results[0] if len(results) == 1 else {"runs": results}, args.out)
    if args.markdown:
        Path(args.markdown).write_text(markdown_runs(results), encoding="utf-8")
    prefix = plot_prefix(args)
    if prefix is not None:
        from benchmarks.plots import plot_latency_cdfs, plot_throughput

        label = lambda r: (f"c={r['config']['concurrency']}" if not r["config"]["rate"]  # noqa: E731
                           else f"rate {r['config']['rate']}/s")
        paths = [plot_latency_cdfs({label(r): r["records"] for r in results}, f"{prefix}-latency-cdf.png",
                                   f"{spec.name} on {cfg.endpoint}")]
        if all(c for c in levels):
            paths.append(plot_throughput({spec.name: [(c, r["summary"]["output_throughput"])
                                                      for c, r in zip(levels, results)]}, f"{prefix}-throughput.png"))
        _done(paths)
    return 1 if any(r["summary"]["errors"] for r in results) else 0


def run_compare(args) -> int:
    """`--compare`: start the targets, run the levels, report."""
    from benchmarks.compare import run_compare as compare

    if args.rate is not None:
        print("mlx-pd bench: error: --compare runs fixed concurrency levels; drop --rate", file=sys.stderr)
        return 2
    if args.fast_model and args.model_dir:
        print("mlx-pd bench: error: give --fast-model or --model-dir, not both", file=sys.stderr)
        return 2
    model_dir = args.model_dir
    if args.fast_model:
        from benchmarks.reliability_long import fast_model_dir

        model_dir = str(fast_model_dir())
    spec, make = _maker(args)
    result = compare(args.concurrency or [1, 4, 8], args.num_requests, max_tokens=args.max_tokens,
                     model_dir=model_dir, dtype=args.dtype, rounds=args.rounds, seed=args.seed,
                     progress=not args.no_progress, suppress_eos=not args.no_eos_bias,
                     log=lambda msg: print(msg, file=sys.stderr, flush=True),
                     targets=[t.strip() for t in args.targets.split(",") if t.strip()], make=make, slos=_slos(args),
                     workload=spec.name)
    result["command"] = "mlx-pd bench " + shlex.join(args.argv)
    return _report_levels(result, args)
