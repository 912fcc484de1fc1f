"""What the load check costs (cluster/load_check.py): seconds per run, per billion parameters, and as a ratio to one
512-token prefill of the same model through mlx-lm on the same machine (the ratio carries to a Mac; the seconds do
not).

    mlx-pd bench load-check --out load-check.json --markdown load-check.md
    # = --models smollm2,hybrid,fast --runs 3

Models: `smollm2` (the default SmolLM2-135M-Instruct), `hybrid` (the random qwen3_next of `bench hybrid-turns`,
110M parameters: Gated DeltaNet beside attention), `fast` (the 2-layer random llama of the fast-accelerator
stand-in). Each is loaded once; the check runs `--runs` times (the least is reported, the machine's noise above it)
and so does the 512-token prefill.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

MODELS = ("smollm2", "hybrid", "fast")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--runs", type=int, default=3, help="runs of the check and of the prefill per model (3)")
    p.add_argument("--out", default=None, help="write the results as JSON")
    p.add_argument("--markdown", default=None, help="also write the table as Markdown")


def _model_dir(name: str) -> Path:
    from benchmarks.hybrid_model import hybrid_model_dir
    from benchmarks.reliability_long import fast_model_dir
    from cluster.gguf_import import ensure_default_model

    return {"smollm2": lambda: ensure_default_model(progress=False), "hybrid": hybrid_model_dir,
            "fast": fast_model_dir}[name]()


def run(args, log=None) -> dict:
    """Load each model, time the load check and a 512-token prefill `args.runs` times; returns the results."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from benchmarks.compare import machine_info
    from benchmarks.hybrid_model import num_parameters
    from cluster.config import EngineConfig
    from cluster.load_check import run_load_check
    from cluster.model import load_model, read_model_spec

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    if not names or any(m not in MODELS for m in names) or args.runs < 1:
        raise ValueError(f"--models must name some of {', '.join(MODELS)} and --runs be >= 1")
    out = {"kind": "load-check", "machine": machine_info(), "models": {}}
    for name in names:
        path = _model_dir(name)
        model, tokenizer = load_model(path, "float32")
        spec = read_model_spec(path)
        checks, prefills, check = [], [], None
        for _ in range(args.runs):
            t0 = time.perf_counter()
            check = run_load_check(model, tokenizer, spec, EngineConfig(dtype="float32"))
            checks.append(time.perf_counter() - t0)
            tokens = mx.array([[100 + i % 1000 for i in range(512)]], dtype=mx.int32)
            t0 = time.perf_counter()
            mx.eval(model(tokens, cache=make_prompt_cache(model)))
            prefills.append(time.perf_counter() - t0)
        params = num_parameters(path)
        out["models"][name] = {"path": str(path), "parameters": params, "check_s": checks, "prefill_512_s": prefills,
                               "checks": list(check.checks)}
        log(f"{name}: check {min(checks):.2f} s, 512-token prefill {min(prefills):.2f} s")
    return out


def tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows): per model its parameters, the check's least and median seconds, seconds per billion
    parameters, and the check over a 512-token prefill."""
    rows = []
    for name, r in result["models"].items():
        check, prefill = sorted(r["check_s"]), sorted(r["prefill_512_s"])
        rows.append([name, f"{r['parameters'] / 1e6:.0f}M", f"{check[0]:.2f}", f"{check[len(check) // 2]:.2f}",
                     f"{check[0] / r['parameters'] * 1e9:.0f}", f"{prefill[0]:.2f}", f"{check[0] / prefill[0]:.2f}x"])
    return [("The load check's cost", ["model", "parameters", "check s (least)", "check s (median)",
                                       "s per billion parameters", "512-token prefill s", "check / prefill"], rows)]
