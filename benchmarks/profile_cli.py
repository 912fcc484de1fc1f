"""The command line of `mlx-pd profile` (cluster/launch/cli.py dispatches here); see benchmarks/profile.py."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 128,256, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    from benchmarks import profile

    p = argparse.ArgumentParser(prog="mlx-pd profile", description=profile.__doc__.split("\n\n")[0],
                                epilog=profile.__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="profile this OpenAI endpoint over HTTP instead of in-process")
    p.add_argument("--model", default=None, help="model (default SmolLM2-135M-Instruct); with --url the local "
                                                  "copy whose tokenizer and config describe the served model")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights and KV dtype (default: the engine's, float32 on Linux)")
    p.add_argument("--topology", default=None, help="take the engine settings from this topology ...")
    p.add_argument("--worker", default=None, help="... and this worker of it (default: the topology's [engine])")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV pool GiB (default: the engine's)")
    p.add_argument("--kv-bits", type=int, default=None, choices=[4, 8], help="quantized KV")
    p.add_argument("--prefill-chunk-size", type=int, default=None, help="default: the engine's (2048)")
    p.add_argument("--max-len", type=int, default=2048,
                   help="longest prompt: lengths are 128, 256, ... up to it, held out 3/4 of it (default 2048)")
    p.add_argument("--lengths", type=_ints, default=None, help="explicit fitted prompt lengths (overrides --max-len)")
    p.add_argument("--held-out", type=_ints, default=None, help="explicit held-out prompt lengths")
    p.add_argument("--repeats", type=int, default=2, help="prompts per length (the median is fitted; default 2)")
    p.add_argument("--batches", type=_ints, default=(1, 4, 8, 16), help="decode batch sizes (default 1,4,8,16)")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per batch (default 16)")
    p.add_argument("--context", type=_ints, default=(2048, 8192),
                   help="context lengths for the capacity line (default 2048,8192)")
    p.add_argument("--chip", default=None, help="judge against this Apple chip's figures, e.g. 'M2 Max'")
    p.add_argument("--gpu-cores", type=int, default=None, help="with --chip: the GPU bin (default: the largest)")
    p.add_argument("--mlx-cache-limit-gb", type=float, default=None,
                   help="diagnostic: mx.set_cache_limit first (default: MLX's own, as the servers run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="out", default=None, help="write the profile (every sample, the fit) here")
    p.add_argument("--markdown", default=None, help="also write the tables as Markdown here")
    p.add_argument("--plot", default=None,
                   help="write the prefill curve with its fit (and decode) as a PNG here (default: next to the --json "
                        "file, with .png for its suffix; none without --json)")
    p.add_argument("--no-plot", action="store_true", help="draw no plot")
    p.add_argument("--plot-with", nargs="+", default=(), metavar="LABEL=PROFILE.json",
                   help="also draw these saved profiles on the plot's axes (side by side with this run)")
    p.add_argument("--no-progress", action="store_true")
    return p


def _engine_config(args):
    import dataclasses

    from cluster.config import EngineConfig
    from cluster.topology import load_topology

    base = EngineConfig()
    if args.topology:
        topo = load_topology(args.topology)
        base = topo.worker(args.worker).engine if args.worker else topo.engine
    over = {k: v for k, v in (("dtype", args.dtype), ("kv_cache_gb", args.kv_cache_gb), ("kv_bits", args.kv_bits),
                              ("prefill_chunk_size", args.prefill_chunk_size)) if v is not None}
    return dataclasses.replace(base, **over), (topo.model.source if args.topology else None)


def run(args) -> dict:
    """Measure and analyze as `args` say; returns the analyzed profile."""
    from benchmarks import chips, profile

    lengths, held = profile.default_lengths(args.max_len)
    cfg = profile.ProfileConfig(lengths=args.lengths or lengths, held_out=args.held_out or held,
                                repeats=args.repeats, batches=args.batches, decode_steps=args.decode_steps,
                                contexts=args.context, seed=args.seed)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    engine_config, topo_model = _engine_config(args)
    if args.mlx_cache_limit_gb is not None:
        import mlx.core as mx

        mx.set_cache_limit(int(args.mlx_cache_limit_gb * 2**30))
    peak = chips.machine_peak(args.chip, args.gpu_cores)
    log(f"peak: {peak.source}")
    if args.url:
        from benchmarks.profile_http import run_url_profile
        from cluster.model import resolve_model_path

        model_dir = resolve_model_path(args.model or topo_model, dtype=engine_config.dtype)
        raw = run_url_profile(args.url, cfg, model_dir, engine_config.dtype, engine_config.kv_cache_gb,
                              engine_config.block_size, engine_config.kv_bits, engine_config.kv_group_size,
                              api_key=os.environ.get("MLX_PD_API_KEY"), progress=not args.no_progress)
    else:
        raw = profile.run_engine_profile(cfg, engine_config, args.model or topo_model, progress=not args.no_progress,
                                         log=log)
    from benchmarks.compare import machine_info

    raw["machine"] = machine_info()
    raw["mlx_cache_limit_gb"] = args.mlx_cache_limit_gb
    return profile.analyze(raw, peak)


def plot_path(args) -> Optional[Path]:
    """The plot's file: `--plot`, else the `--json` file with a .png suffix; None with `--no-plot` or neither."""
    if args.no_plot or not (args.plot or args.out):
        return None
    if args.plot:
        return Path(args.plot)
    out = Path(args.out)
    return out.with_suffix(".png") if out.suffix != ".png" else out.with_name(out.name + ".png")


def main(argv: Sequence[str]) -> int:
    """Run `mlx-pd profile` with `argv`; returns the exit code (2 for bad arguments or a failed run)."""
    from benchmarks.profile_report import markdown_profile, print_profile
    from benchmarks.report import write_json

    args = build_parser().parse_args(list(argv))
    if args.worker and not args.topology:
        print("mlx-pd profile: error: --worker needs --topology", file=sys.stderr)
        return 2
    try:
        result = run(args)
    except (ValueError, RuntimeError, FileNotFoundError, KeyError) as exc:
        print(f"mlx-pd profile: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mlx-pd profile: interrupted", file=sys.stderr)
        return 130
    result["command"] = "mlx-pd profile " + shlex.join(argv)
    print_profile(result)
    write_json(result, args.out)
    if args.markdown:
        Path(args.markdown).write_text(markdown_profile(result), encoding="utf-8")
    plot = plot_path(args)
    if plot:
        import json

        from benchmarks.plots import plot_profiles

        others = {}
        for item in args.plot_with:
            label, _, path = item.rpartition("=")
            others[label or Path(path).stem] = json.loads(Path(path).read_text(encoding="utf-8"))
        plot_profiles({("this run" if others else ""): result, **others}, plot)
        print(f"mlx-pd profile: plot: {plot}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
