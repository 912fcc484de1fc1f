"""The `mlx-pd` command: serve (single-node, single_node.py), generate (one prompt from the shell), keys (CurveZMQ),
up / status / down (cluster mode on Ray, ray_up.py), monitor (Prometheus and a Grafana dashboard for a running
cluster, monitor.py), worker / router (one cluster process without Ray, processes.py); bench and profile run
the benchmarks tool beside the product (benchmarks/, the `[bench]` extra).

Documented environment variables: MLX_PD_CACHE (model cache folder), MLX_PD_NO_OPENBLAS=1 (do not
preload OpenBLAS on Linux), MLX_PD_API_KEY (default for --api-key).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import uuid
from typing import Optional, Sequence

from cluster.config import EngineConfig


ENGINE_FLAGS = {  # CLI flag -> EngineConfig field; unset flags leave the topology's (or the default) value
    "block_size": int, "kv_cache_gb": float, "kv_bits": int, "kv_group_size": int, "max_num_seqs": int,
    "prefill_chunk_size": int, "max_num_batched_tokens": int, "itl_target_ms": float, "prefill_slowdown": float,
    "long_prefill_token_threshold": int, "max_model_len": int, "dtype": str, "decode_mirror_gb": float, "state_cache_gb": float,
    "state_snapshot_interval": int, "ssd_cache_gb": float, "ssd_cache_dir": str,
    "speculative_method": str, "num_draft_tokens": int, "draft_model": str, "draft_quantize_bits": int,
    "draft_cost_per_token": float,
}


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--topology", default=None,
                   help="a topology file or name in topologies/ (default: built-in single-node settings); "
                        "flags given on the command line override it")
    p.add_argument("--model", default=None,
                   help="mlx-lm model folder, .gguf file or Hugging Face repo id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="name clients use in the `model` field; more names are aliases the model also answers "
                        "to, globs allowed (e.g. --served-model-name qwen3 'claude-*' 'gpt-5*' for agent CLIs "
                        "that send their own model ids)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights and KV dtype (default: float32 on Linux's CPU backend, bfloat16 on a Mac)")
    p.add_argument("--kv-cache-gb", type=float, default=None, help=f"KV pool budget in GiB (default {d.kv_cache_gb})")
    p.add_argument("--kv-bits", type=int, default=None, choices=[4, 8], help="quantize KV blocks")
    p.add_argument("--kv-group-size", type=int, default=None, choices=[32, 64, 128],
                   help=f"values per quantization group (default {d.kv_group_size})")
    p.add_argument("--block-size", type=int, default=None, help=f"tokens per KV block (default {d.block_size})")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences in the running batch (default: follows the KV budget, one sequence per 256 "
                        "tokens of the pool, at least 16 and at most 256: 64 or more from about 0.7 GiB for "
                        "SmolLM2 in float32)")
    p.add_argument("--prefill-chunk-size", type=int, default=None,
                   help=f"a prompt's tokens per step at most (default {d.prefill_chunk_size})")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step at most: one per decoding sequence (plus drafts) first, prompt "
                        "chunks in the rest (default: max(prefill chunk size, max_num_seqs + block size))")
    p.add_argument("--itl-target-ms", type=float, default=None,
                   help="while streams decode, size each step's prompt chunk so the step (the streams' "
                        "inter-token latency) takes at most this long (default: twice the measured decode step)")
    p.add_argument("--prefill-slowdown", type=float, default=None,
                   help=f"a long prompt computed beside decoding streams finishes within about this many times its "
                        f"prefill time alone: when behind, its chunks stretch the streams' steps up to twice the "
                        f"ITL target (default {d.prefill_slowdown})")
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help=f"a new prompt of at most this many tokens runs whole in one step even while streams "
                        f"decode, so short requests keep their TTFT; short prompts waiting together share a step "
                        f"up to this many tokens (default {d.long_prefill_token_threshold})")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--decode-mirror-gb", type=float, default=None,
                   help="GiB for contiguous decode-batch contexts kept between steps (default: as large as "
                        "the KV pool; 0 disables)")
    p.add_argument("--state-cache-gb", type=float, default=None,
                   help="GiB for recurrent-state snapshots, the prefix cache of hybrid models such as qwen3_next "
                        "(default: half of --kv-cache-gb, which holds them; 0 recomputes every prompt)")
    p.add_argument("--state-snapshot-interval", type=int, default=None,
                   help="tokens between recurrent-state snapshots while a prompt is computed, a multiple of "
                        "--block-size (default: the prefill chunk size); when a request ends those at 1, 2, 4, "
                        "8, ... intervals stay. Smaller lets prompts that share shorter prefixes (a system "
                        "prompt) restore them, at the cost of shorter prefill chunks")
    p.add_argument("--ssd-cache-gb", type=float, default=None,
                   help="GiB of disk for a KV tier under the pool: cached blocks are written there too, prefix "
                        "hits load them back, and they survive a restart (default 0: off)")
    p.add_argument("--ssd-cache-dir", default=None,
                   help="the SSD tier's folder, one per server (default: kv-tier in mlx-pd's cache folder)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix-cache reuse")
    p.add_argument("--skip-load-check", action="store_true",
                   help="skip the load check (a short probe proving the paged path equals mlx-lm's own on the real "
                        "weights) for a family the tests cover; any other family is checked regardless")
    p.add_argument("--speculative-method", default=None, choices=["prompt_lookup", "draft_model"],
                   help="speculative decoding for requests that do not choose (default: off; a request turns it "
                        'on with "speculative": {"method": ..., "num_draft_tokens": k})')
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help=f"most draft tokens per sequence per step (default {d.num_draft_tokens}; each sequence "
                        "adapts below it to its acceptance rate)")
    p.add_argument("--draft-model", default=None,
                   help="draft model for speculative decoding (same forms as --model; it must share the "
                        "target's tokenizer; default with --speculative-method draft_model: a 4-bit copy of the target)")
    p.add_argument("--draft-quantize-bits", type=int, default=None, choices=[4, 8],
                   help="quantize the draft model's weights (default: as loaded; 4 for a copy of the target)")
    p.add_argument("--draft-cost-per-token", type=float, default=None,
                   help="a draft token's cost relative to a decode step, for the adaptive draft length "
                        "(default: measured at load)")


def _topology(args: argparse.Namespace):
    from cluster.topology import TopologySpec, load_topology

    return load_topology(args.topology) if args.topology else TopologySpec(name="single-node")


def _engine_config(args: argparse.Namespace, topology) -> EngineConfig:
    """EngineConfig defaults <- the topology's [engine] <- flags given on the command line."""
    import dataclasses

    overrides = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    if args.no_prefix_caching:
        overrides["enable_prefix_caching"] = False
    if getattr(args, "skip_load_check", False):
        overrides["skip_load_check"] = True
    return dataclasses.replace(topology.engine, **overrides)


def _start(args: argparse.Namespace):
    """Load the model (a GGUF import shows a progress bar, loading logs its size and time); returns (client,
    model folder)."""
    from cluster.launch.single_node import start_single_node_engine

    topology = _topology(args)
    model = args.model or topology.model.source
    name = args.served_model_name[0] if args.served_model_name else topology.model.served_name
    return start_single_node_engine(model, _engine_config(args, topology), name,
                                    tensor_parallel=getattr(args, "tensor_parallel", 1),
                                    pipeline_parallel=getattr(args, "pipeline_parallel", 1),
                                    memory_budget_gb=getattr(args, "memory_budget_gb", None))


def _aliases(args: argparse.Namespace, topology) -> tuple[str, ...]:
    """More names the served model answers to: the flag's names after the first, else the topology's."""
    return tuple(args.served_model_name[1:]) if args.served_model_name else topology.model.aliases


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the OpenAI API in the layout `--layout` names or `auto` picks (`platform.choose_layout`): the
    engine in this process (single_node.py) or in a child process (split_serve.py)."""
    import uvicorn

    from cluster.launch.platform import choose_layout
    from router.app import create_app_for_model

    topology = _topology(args)
    host = args.host or topology.router.host
    port = args.port or topology.router.port
    layout, reason = choose_layout(args.layout)
    from cluster.launch.local_group import group_shape

    try:
        kind, ranks = group_shape(args.tensor_parallel, args.pipeline_parallel)
    except ValueError as exc:
        print(f"mlx-pd serve: {exc}", file=sys.stderr)
        return 2
    if ranks > 1:
        layout, reason = "one-process", f"rank 0 of a {kind}-parallel group of {ranks} local ranks leads in this process"
    if layout == "split":
        from cluster.launch.split_serve import serve_split

        return serve_split(source=args.model or topology.model.source,
                           served_name=args.served_model_name[0] if args.served_model_name else topology.model.served_name,
                           aliases=_aliases(args, topology), engine=_engine_config(args, topology), host=host, port=port,
                           api_key=args.api_key, max_body_bytes=args.max_body_bytes or topology.router.max_body_bytes,
                           log_level=args.log_level, reason=reason, curve_keys_dir=topology.security.curve_keys_dir)
    print(f"mlx-pd: layout one-process (pid {os.getpid()}): {reason}", file=sys.stderr, flush=True)
    client, path = _start(args)
    app = create_app_for_model(client, path, args.api_key,
                               max_body_bytes=args.max_body_bytes or topology.router.max_body_bytes,
                               aliases=_aliases(args, topology),
                               layout={"name": "one-process", "reason": reason, "router_pid": os.getpid(),
                                       "engine_pid": os.getpid()})
    print(f"mlx-pd: serving {client.model_name} at http://{host}:{port}/v1 "
          f"(context {client.max_model_len} tokens)", file=sys.stderr, flush=True)

    def stopped(sig, _frame) -> None:  # uvicorn re-raises the signal it stopped on once it has shut down: end
        raise SystemExit(0)  # through the `finally` and atexit (a group's followers get their Stop), not by it

    previous = {s: signal.signal(s, stopped) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.run(app, host=host, port=port, log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        client.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from cluster.model import load_tokenizer
    from cluster.request import GenerateRequest, SamplingParams

    client, path = _start(args)
    tokenizer = load_tokenizer(path)
    if args.raw:
        ids = tokenizer.encode(args.prompt)
    else:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)

    async def go() -> Optional[str]:
        last = None
        async for out in client.generate(GenerateRequest(uuid.uuid4().hex, tuple(ids), params)):
            sys.stdout.write(out.text)
            sys.stdout.flush()
            last = out
        sys.stdout.write("\n")
        return last.error if last else None

    try:
        error = asyncio.run(go())
    finally:
        client.stop()  # join the engine thread before the interpreter tears MLX down
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


# `mlx-pd bench` and `mlx-pd profile` are commands of the benchmarks tool beside the product (benchmarks/). The
# product never imports it: the CLI loads the tool's entry point by name when one of these commands runs, and
# says how to install it when it or its dependencies (`benchmarks.REQUIRES`, the `[bench]` extra) are missing.
TOOL_COMMANDS = {"bench": "benchmarks.cli", "profile": "benchmarks.profile_cli"}
TOOL_HINT = ("mlx-pd: `mlx-pd {command}` needs the benchmark tools ({missing} missing): "
             "pip install -e '.[bench]' in a checkout, or pip install 'mlx-pd[bench]'")


def cmd_tool(command: str, argv: Sequence[str]) -> int:
    """Run `mlx-pd bench|profile ARGV` in the benchmarks tool; exit 2 with one line when it is not installed."""
    import importlib
    import importlib.util

    missing = ["benchmarks"] if importlib.util.find_spec("benchmarks") is None else [
        name for name in importlib.import_module("benchmarks").REQUIRES if importlib.util.find_spec(name) is None]
    if missing:
        print(TOOL_HINT.format(command=command, missing=", ".join(missing)), file=sys.stderr)
        return 2
    return importlib.import_module(TOOL_COMMANDS[command]).main(list(argv))


def cmd_keys(args: argparse.Namespace) -> int:
    """Create CurveZMQ keys in args.dir and print the topology snippet that references them."""
    import json
    from pathlib import Path

    from cluster.transport import generate_keys

    directory = Path(args.dir).expanduser().resolve()
    keys = generate_keys(directory, overwrite=args.force)
    print(f"mlx-pd: wrote CurveZMQ keys to {directory} (server.key, server.key_secret, client.key, "
          f"client.key_secret; {len(keys.authorized_clients)} authorized client key(s))")
    print("Reference them in the topology file:\n")
    print(f"[security]\ncurve_keys_dir = {json.dumps(str(directory))}\n")
    print(f"Copy {directory} to every machine of the cluster over a secure channel (e.g. scp -r); "
          f"the *.key_secret files are secrets.")
    return 0


def _cluster_command(fn) -> int:
    """Run `fn() -> int` (a cluster-mode command); a LaunchError (Ray unreachable, a worker that failed to
    start) prints its message and exits 1."""
    from cluster.launch.ray_up import LaunchError

    try:
        return fn()
    except LaunchError as exc:
        print(f"mlx-pd: error: {exc}", file=sys.stderr)
        return 1


def cmd_up(args: argparse.Namespace) -> int:
    """Start a topology on Ray (ray_up.py) and return once it serves."""
    from cluster.launch.ray_up import up

    if args.timeout <= 0:
        raise ValueError(f"--timeout={args.timeout} is invalid: must be > 0 seconds")

    def run() -> int:
        up(args.topology, timeout_s=args.timeout, api_key=args.api_key or None)
        return 0

    return _cluster_command(run)


def cmd_status(args: argparse.Namespace) -> int:
    """Print the topology's actors; exit 0 only if the router, every worker and every rank of a group are alive."""
    from cluster.launch.ray_up import format_status, status

    def run() -> int:
        rows = status(args.topology)
        if all(r["state"] == "stopped" for r in rows):
            print(f"mlx-pd: {args.topology} is not running")
            return 1
        print(format_status(rows))
        return 0 if all(r["state"] == "alive" and all(k["state"] == "alive" for k in r.get("ranks") or ())
                        for r in rows) else 1

    return _cluster_command(run)


def cmd_down(args: argparse.Namespace) -> int:
    """Stop a topology's actors (and the local Ray head its `up` started)."""
    from cluster.launch.ray_up import down

    def run() -> int:
        down(args.topology)
        return 0

    return _cluster_command(run)


def cmd_monitor(args: argparse.Namespace) -> int:
    """Write a Prometheus config and a Grafana dashboard for a running topology and run Prometheus on it
    (monitor.py); exit 1 with one line when Ray or Prometheus fails."""
    from cluster.launch.monitor import monitor

    return _cluster_command(lambda: monitor(args.topology, out_dir=args.out, port=args.port, start=not args.no_start,
                                            scrape_interval_s=args.scrape_interval, api_key=args.api_key or None))


def cmd_worker(args: argparse.Namespace) -> int:
    from cluster.launch.processes import run_worker

    if args.exit_with_parent is not None and args.exit_with_parent <= 0:
        raise ValueError(f"--exit-with-parent={args.exit_with_parent} is invalid: must be a process id > 0")
    return run_worker(args.topology, args.name, exit_with_parent=args.exit_with_parent, rank=args.rank)


def cmd_router(args: argparse.Namespace) -> int:
    from cluster.launch.processes import run_router

    return run_router(args.topology, args.api_key or None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-pd", description="Prefill/decode-disaggregated LLM serving on MLX")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI API on this machine (single-node mode)")
    _add_engine_args(serve)
    serve.add_argument("--host", default=None,
                       help="bind address (default: the topology's, 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=None, help="default: the topology's, 8000")
    serve.add_argument("--api-key", default=os.environ.get("MLX_PD_API_KEY"),
                       help="require `Authorization: Bearer KEY` (default: $MLX_PD_API_KEY, else open)")
    serve.add_argument("--max-body-bytes", type=int, default=None,
                       help="refuse larger request bodies with 413 (default: the topology's, else sized to the context)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--layout", default="auto",
                       help="processes: one-process (router and engine share one interpreter), split (the engine "
                            "in a child process, the router here, over ZeroMQ), or auto (default: split when the "
                            "model runs on a GPU and the host has at least 4 performance cores, else one-process; "
                            "see README, 'Process layout')")
    serve.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                       help="run the model across N local ranks (one process each, MLX's ring backend over "
                            "loopback), each holding 1/N of every layer's heads and of the KV (default 1; see "
                            "README, 'Worker groups')")
    serve.add_argument("--pipeline-parallel", type=int, default=1, metavar="N",
                       help="run the model across N local ranks, each holding a range of whole layers and their "
                            "KV: more memory, not more speed (default 1; not with --tensor-parallel). For families "
                            "whose mlx-lm class can pipeline (qwen2, qwen3_moe, deepseek_v2/v3, glm4_moe, ...; not "
                            "llama), without sliding-window or recurrent layers, at most one rank per layer; see "
                            "README, 'Worker groups'")
    serve.add_argument("--memory-budget-gb", type=float, default=None, metavar="GB",
                       help="each rank's budget for weights plus KV, checked at load: a model over it is refused "
                            "(default: unchecked)")
    gen = sub.add_parser("generate", help="generate from one prompt, streaming to the terminal")
    _add_engine_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    up = sub.add_parser("up", help="start a cluster topology on Ray (workers and router as Ray actors)")
    up.add_argument("topology", help="a topology file or name in topologies/, e.g. local-1p1d")
    up.add_argument("--timeout", type=float, default=600.0,
                    help="seconds to wait for every worker and the router (default 600)")
    up.add_argument("--api-key", default=os.environ.get("MLX_PD_API_KEY"),
                    help="require `Authorization: Bearer KEY` at the router (default: $MLX_PD_API_KEY, else open)")
    for name, text in (("status", "show the actors of a running topology (exit 1 unless all are alive)"),
                       ("down", "stop a topology's actors (and the local Ray head that `up` started)")):
        sub.add_parser(name, help=text).add_argument("topology", help="the topology file or name given to `up`")
    mon = sub.add_parser("monitor", help="Prometheus (and a Grafana dashboard) for a running topology")
    mon.add_argument("topology", help="the topology file or name given to `up`")
    mon.add_argument("--out", default=None,
                     help="folder for prometheus.yml, its data and the dashboard JSON "
                          "(default: $MLX_PD_CACHE/monitor/TOPOLOGY, ~/.cache/mlx-pd/monitor/TOPOLOGY)")
    mon.add_argument("--port", type=int, default=9090, help="Prometheus listens on 127.0.0.1:PORT (default 9090)")
    mon.add_argument("--scrape-interval", type=float, default=5.0,
                     help="seconds between scrapes (default 5)")
    mon.add_argument("--no-start", action="store_true",
                     help="only write the files and print the command that starts Prometheus")
    mon.add_argument("--api-key", default=os.environ.get("MLX_PD_API_KEY"),
                     help="the router's API key, sent when scraping it (default: $MLX_PD_API_KEY)")
    worker = sub.add_parser("worker", help="run one worker of a topology in this process (no Ray)")
    worker.add_argument("topology", help="a topology file or name")
    worker.add_argument("name", help="the worker's name in the topology, e.g. decode-0")
    worker.add_argument("--rank", type=int, default=0,
                        help="a worker group's following rank to run here (1..N-1; default 0: the worker itself, "
                             "which leads its group)")
    worker.add_argument("--exit-with-parent", type=int, default=None, metavar="PID",
                        help="stop when this process's parent is no longer PID (serve --layout split passes its pid)")
    router = sub.add_parser("router", help="run a topology's router in this process (no Ray)")
    router.add_argument("topology", help="a topology file or name")
    router.add_argument("--api-key", default=os.environ.get("MLX_PD_API_KEY"),
                        help="require `Authorization: Bearer KEY` (default: $MLX_PD_API_KEY, else open)")
    sub.add_parser("bench", help="load-test OpenAI endpoints (see `mlx-pd bench --help`)", add_help=False)
    sub.add_parser("profile", help="prefill fit, decode speed, MFU/MBU and KV capacity of this machine "
                                   "(see `mlx-pd profile --help`)", add_help=False)
    keys = sub.add_parser("keys", help="create CurveZMQ keys that encrypt and authenticate cluster sockets")
    keys.add_argument("dir", help="folder for the keys (created with mode 0700)")
    keys.add_argument("--force", action="store_true", help="replace keys already in DIR")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the `mlx-pd` console script."""
    from cluster.launch.platform import reexec_with_openblas

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] not in (["keys"], ["monitor"]):  # these never touch MLX, so they need no OpenBLAS re-exec
        reexec_with_openblas()
    if argv[:1] and argv[0] in TOOL_COMMANDS:
        return cmd_tool(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return {"serve": cmd_serve, "generate": cmd_generate, "keys": cmd_keys, "up": cmd_up,
                "status": cmd_status, "down": cmd_down, "monitor": cmd_monitor, "worker": cmd_worker,
                "router": cmd_router}[args.command](args)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as exc:
        print(f"mlx-pd: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
