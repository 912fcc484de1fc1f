"""`mlx-pd bench`: load-test an OpenAI endpoint, or compare mlx-pd with mlx_lm.server side by side.

    mlx-pd bench --url http://127.0.0.1:8000 --concurrency 4 --num-requests 32 --max-tokens 64
    mlx-pd bench --url http://127.0.0.1:8000 --rate 0.5 --num-requests 32          # Poisson arrivals
    mlx-pd bench --compare --concurrency 1,4,8 --num-requests 16,32,48 --max-tokens 64 --out results.json
    mlx-pd bench --url http://127.0.0.1:8000 --workload shared-prefix --goodput ttft:2000 tpot:150 --plots docs/img
    mlx-pd bench --url http://A:8000 --url http://B:8000 --labels a,b --concurrency 1,4   # two endpoints, ABBA
    mlx-pd bench --compare --targets mlx-pd,mlx-pd-1p1d,mlx_lm.server --concurrency 1,4
    mlx-pd bench prefix --pairs 8 --system-tokens 1500      # TTFT: cached vs cold system prompt
    mlx-pd bench chat --users 16 --system-prompts 4         # multi-tenant 2-turn chat: prefix hit rate
    mlx-pd bench kv --engine-check --decode                 # KV bytes/token, capacity, 8-bit decode
    mlx-pd bench transfer --json transfer.json              # KV shipping vs raw pyzmq, bytes, projection
    mlx-pd bench cluster --out cluster.json                 # 1P1D on pinned cores vs single-node, mixed load
    mlx-pd bench routing --out routing.json                 # 1P2D: prefix_aware vs round_robin vs least_loaded
    mlx-pd bench routing-sim                                # placement latency at 64 workers / 1M blocks
    mlx-pd bench reliability --json r.json --markdown docs/RELIABILITY.md   # fuzz, soak, faults, overload
    mlx-pd bench speculative --concurrency 1,4 --out s.json  # speculative decoding: plain vs prompt lookup vs draft
    mlx-pd bench hybrid-turns --out h.json                  # hybrid model, 16-turn chat: TTFT cached vs cold, RSS
    mlx-pd bench structured --out st.json                   # JSON-schema constrained vs free decode tok/s, mask cost
    mlx-pd bench ssd-tier --out ssd.json                    # agent sessions past the RAM pool: SSD tier vs none, restart
    mlx-pd bench ssd-soak --out soak.json                   # 240 sessions, a 32 MiB tier: folder vs budget, RSS slope
    mlx-pd bench --compare --fast-model --concurrency 1,8   # the 2-layer stand-in; host CPU s per output token too
    mlx-pd bench interference --out i.json                  # stream ITL while a 1.5k-token prompt prefills
    mlx-pd bench mixed-prefill --out m.json                 # 8 prompts of 100-2000 tokens at once: prefill tok/s
    mlx-pd bench aiperf --aiperf /tmp/aiperf-venv/bin/aiperf  # NVIDIA aiperf against both servers, ABBA rounds
    mlx-pd bench host-profile --fast-model --concurrency 32,64   # py-spy: a token's host time per stage
    mlx-pd bench tensor-parallel --random-model smol-shape --ranks 2 --concurrency 1,8   # TP2: mlx-pd vs mlx-lm

Every run warms up first (not measured), sends unique prompts (unless --shared-prefix), and reports
p50/p90/p99. See docs/BENCHMARKS.md for the rules and the latest numbers.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from typing import Sequence


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,4,8, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _token_ids(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 0,2, got {text!r}")
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"token ids are >= 0, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `mlx-pd bench`."""
    p = argparse.ArgumentParser(prog="mlx-pd bench", epilog=__doc__.split("\n\n", 1)[1],
                                description="Load-test an OpenAI endpoint, or compare mlx-pd with "
                                            "mlx_lm.server side by side.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", action="append",
                        help="an OpenAI endpoint: server root, /v1 base or full /v1/chat/completions; give it "
                             "several times to compare endpoints in alternating rounds")
    target.add_argument("--compare", action="store_true",
                        help="start mlx-pd and mlx_lm.server (or --targets) on the same model and compare them")
    p.add_argument("--concurrency", type=_int_list, default=None,
                   help="requests in flight (closed loop); a list like 1,4,8 runs one level each "
                        "(default 1; with --rate, a cap on requests in flight)")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals at this many requests/s (open loop)")
    p.add_argument("--num-requests", type=_int_list, default=[32],
                   help="measured requests per level (per server with --compare); one count, or one per level")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos is sent)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up requests (default: max(2, concurrency))")
    p.add_argument("--model", default=None, help="`model` field to send (default: left out; --url only)")
    p.add_argument("--api-key", default=None, help="bearer key for --url")
    p.add_argument("--model-dir", default=None,
                   help="mlx-lm model folder both servers load with --compare (default: the imported SmolLM2)")
    p.add_argument("--fast-model", action="store_true",
                   help="--compare: both servers load the random-weight 2-layer stand-in for a fast accelerator "
                        "(benchmarks/reliability_long.py: fast_model_dir) instead of --model-dir")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="--compare: our server's dtype and the default model folder's (default float32)")
    p.add_argument("--rounds", type=int, default=4, help="--compare: alternating rounds per level (at most)")
    p.add_argument("--shared-prefix", action="store_true",
                   help="do not make prompts unique (measures the prefix cache)")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos: true")
    p.add_argument("--suppress-tokens", type=_token_ids, default=(),
                   help="--url: token ids to send with logit_bias -100 (e.g. the EOS ids, for servers without "
                        "ignore_eos)")
    p.add_argument("--no-eos-bias", action="store_true",
                   help="--compare: do not suppress the model's EOS ids with logit_bias (mlx_lm.server has no "
                        "ignore_eos, so its answers may then be shorter)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompt order, prefixes and arrivals")
    p.add_argument("--out", default=None, help="write the full results (per-request records too) as JSON")
    p.add_argument("--markdown", default=None, help="also write the tables as Markdown here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    from benchmarks.bench_run import add_workload_args

    add_workload_args(p)
    return p


def _run_url(args: argparse.Namespace) -> int:
    from benchmarks.bench_run import run_url

    return run_url(args)


def _run_compare(args: argparse.Namespace) -> int:
    from benchmarks.bench_run import run_compare

    return run_compare(args)


SUBCOMMANDS = {
    "prefix": "TTFT of a chat request whose long system prompt is cached vs cold (benchmarks/prefix_bench.py)",
    "chat": "multi-tenant 2-turn chat workload: prefix hit rate vs the ideal, TTFT, throughput",
    "kv": "KV bytes per token per format, sequences per budget, decode with quantized KV (benchmarks/kv_bench.py)",
    "transfer": "KV transfer over loopback vs raw pyzmq, bytes on the wire per format, and a projection for an 8B "
                "model (benchmarks/transfer_bench.py)",
    "cluster": "1P1D on pinned cores vs single-node on the same cores: short chats streaming while long prompts "
               "arrive, and a projection to Macs (benchmarks/cluster_bench.py)",
    "routing": "1P2D with a multi-tenant chat workload: prefix hit rate and TTFT per routing policy "
               "(benchmarks/routing_bench.py)",
    "routing-sim": "placement latency, index memory and event throughput at 64 workers / 1M blocks, no model "
                   "(benchmarks/routing_sim.py)",
    "reliability": "a live 1P2D cluster of processes under API and wire fuzzing, access checks, a mixed soak "
                   "checked against single-node, faults, overload (benchmarks/reliability.py, docs/RELIABILITY.md)",
    "speculative": "speculative decoding on a rewrite/summarize workload: plain vs prompt lookup vs draft model, "
                   "output tokens/s and acceptance rates (benchmarks/speculative_bench.py)",
    "hybrid-turns": "a hybrid model (qwen3_next, or qwen3_5 with --family) in a 16-turn chat: TTFT with its "
                    "recurrent-state prefix cache vs cold, next to mlx_lm.server; snapshot bytes; RSS over many "
                    "conversations (benchmarks/hybrid_bench.py)",
    "ssd-tier": "an agent's long sessions whose KV is several times the RAM pool, follow-ups round-robin: mlx-pd with "
                "its SSD tier, without it, and mlx_lm.server; TTFT, cached tokens, a restart, restore GB/s against "
                "the disk's sequential read (benchmarks/ssd_tier_bench.py)",
    "ssd-soak": "many distinct sessions through one server with a small pool and a small SSD tier, some followed up "
                "from the tier: the server's RSS slope and the tier folder's bytes against its budget "
                "(benchmarks/ssd_tier_soak.py)",
    "structured": "constrained decoding in process: decode tok/s with every request JSON-schema constrained vs "
                  "unconstrained at concurrency 8, and the grammar mask's cost per step (benchmarks/structured_bench.py)",
    "interference": "mlx-pd vs mlx_lm.server: decoding streams' ITL before and during a long prompt's prefill, and "
                    "its TTFT (benchmarks/interference_bench.py)",
    "mixed-prefill": "mlx-pd vs mlx_lm.server: prompts of 100-2000 tokens arriving at once, prefill tokens/s and "
                     "TTFT (benchmarks/mixed_prefill_bench.py)",
    "aiperf": "mlx-pd vs mlx_lm.server measured by NVIDIA's aiperf (installed apart), ABBA rounds "
              "(benchmarks/aiperf_compare.py)",
    "link-transfer": "KV transfer between two lab hosts (network namespaces) over a shaped link, per format, as a "
                     "ratio to the link's rate; root (benchmarks/link_transfer.py)",
    "lab-ttft": "TTFT and the decode worker's first token of 2k-token prompts on a 1P2D lab over shaped links, per KV "
                "format on the wire; root (benchmarks/lab_ttft.py)",
    "load-check": "what the load check costs per model: seconds, seconds per billion parameters, and against one "
                  "512-token prefill (benchmarks/load_check_bench.py)",
    "host-profile": "where a token's host time goes: every server process sampled with py-spy under streaming load, "
                    "single-node and 1P1D, per stage, per thread, against the model's compute floor "
                    "(benchmarks/host_profile.py)",
    "tensor-parallel": "mlx-pd's tensor-parallel server vs mlx_lm.server on the same ranks over MLX's ring backend "
                       "on loopback, one at a time: output tokens/s and TTFT p50 per concurrency "
                       "(benchmarks/tp_compare.py)",
}
MODULES = {"cluster": "cluster_bench", "routing": "routing_bench", "routing-sim": "routing_sim",
           "speculative": "speculative_bench", "hybrid-turns": "hybrid_bench", "ssd-tier": "ssd_tier_bench",
           "ssd-soak": "ssd_tier_soak",
           "structured": "structured_bench", "interference": "interference_bench",
           "mixed-prefill": "mixed_prefill_bench", "aiperf": "aiperf_compare", "link-transfer": "link_transfer",
           "lab-ttft": "lab_ttft", "load-check": "load_check_bench",
           "host-profile": "host_profile", "tensor-parallel": "tp_compare"}  # own add/run/tables


def build_subcommand_parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of `mlx-pd bench prefix|chat|kv|transfer`."""
    import importlib

    if name == "reliability":
        from benchmarks.reliability import build_parser as reliability_parser

        return reliability_parser()

    from benchmarks import chat_prefix_bench, kv_bench, prefix_bench, transfer_bench

    if name in MODULES:
        module = importlib.import_module(f"benchmarks.{MODULES[name]}")
        p = argparse.ArgumentParser(prog=f"mlx-pd bench {name}", description=SUBCOMMANDS[name],
                                    epilog=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_args(p)
        return p
    add = {"prefix": prefix_bench.add_prefix_args, "chat": chat_prefix_bench.add_chat_args,
           "kv": kv_bench.add_kv_args, "transfer": transfer_bench.add_transfer_args}
    module = {"chat": chat_prefix_bench, "kv": kv_bench, "transfer": transfer_bench}.get(name, prefix_bench)
    p = argparse.ArgumentParser(prog=f"mlx-pd bench {name}", description=SUBCOMMANDS[name],
                                epilog=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add[name](p)
    return p


def _run_subcommand(name: str, argv: Sequence[str]) -> int:
    from pathlib import Path

    from benchmarks import chat_prefix_bench, kv_bench, prefix_bench, prefix_report, transfer_bench
    from benchmarks.report import write_json

    if name == "reliability":  # its own report (a generated section of docs/RELIABILITY.md) and exit codes
        from benchmarks.reliability import main as reliability_main

        return reliability_main(argv)
    args = build_subcommand_parser(name).parse_args(list(argv))
    if name in MODULES:
        import importlib

        module = importlib.import_module(f"benchmarks.{MODULES[name]}")
        result = module.run(args)
        result["command"] = f"mlx-pd bench {name} " + shlex.join(argv)
        write_json(result, args.out)
        if args.markdown:
            Path(args.markdown).write_text(prefix_report.markdown(module.tables(result)), encoding="utf-8")
        return 1 if result.get("errors") else 0
    if getattr(args, "max_tokens", 1) < 1:
        print(f"mlx-pd bench {name}: error: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    run = {"prefix": prefix_bench.run_prefix, "chat": chat_prefix_bench.run_chat, "kv": kv_bench.run_kv,
           "transfer": transfer_bench.run_transfer}[name]
    result = run(args)
    result["command"] = f"mlx-pd bench {name} " + shlex.join(argv)
    write_json(result, args.out)
    if args.markdown:
        tables = {"prefix": prefix_report.prefix_tables, "chat": prefix_report.chat_tables,
                  "kv": kv_bench.kv_tables, "transfer": transfer_bench.transfer_tables}[name](result)
        Path(args.markdown).write_text(prefix_report.markdown(tables), encoding="utf-8")
    if name in ("kv", "transfer"):  # a failed transfer raises (exit code 2)
        return 0
    servers = result["servers"].values()
    errors = sum(sum(k["errors"] for k in s["kinds"].values()) if name == "prefix" else s["summary"]["errors"]
                 for s in servers)
    return 1 if errors else 0


def _sigterm_as_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str]) -> int:
    """Run `mlx-pd bench` with `argv` (the arguments after `bench`); returns the exit code.

    1 when any measured request failed, 2 for bad arguments or a failed setup, 130 on Ctrl-C.
    """
    argv = list(argv)
    sub = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    args = None if sub else build_parser().parse_args(argv)
    if args is not None:
        args.argv = argv
    if args is not None and args.max_tokens < 1:
        print("mlx-pd bench: error: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    if args is not None and args.rate is not None and args.rate <= 0:
        print("mlx-pd bench: error: --rate must be > 0", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)  # stop servers on SIGTERM too
    try:
        if sub:
            return _run_subcommand(sub, argv[1:])
        return _run_compare(args) if args.compare else _run_url(args)
    except KeyboardInterrupt:
        print("mlx-pd bench: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        print(f"mlx-pd bench: error: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
