"""The collective's share of a tensor-parallel decode step: on N ring ranks over loopback, each rank runs mlx-lm's
sharded model (its own forward, KV cache and all-sums) over a batch of B rows at a context of C tokens, and times

- a decode step: one forward of B x 1 tokens, evaluated (the ranks' all-sums inside);
- the same step's collectives alone: as many all-sums of [B, 1, hidden] as the sharded model makes per forward
  (mlx-lm's `shard` puts one after the attention output and one after the MLP of each layer), evaluated together
  as a chain;
- on one rank, the unsharded model's step (N=1), for the speedup.

Each rank runs on a core of its own (`taskset`), and so does the baseline, as each rank would have a Mac.

    python -m benchmarks.tp_collective --model DIR [--ranks 2] [--batch 1,8] [--context 256] [--steps 30]

Prints one JSON line per batch size: step_ms (sharded), collective_ms, share (collective / step), single_ms.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence


def _time_steps(fn, steps: int) -> float:
    """Median milliseconds of `fn()` over `steps` runs, after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]


def measure(model, batch: int, context: int, steps: int, group=None) -> dict:
    """Decode-step and collective milliseconds for `model` (sharded over `group`, or whole when None)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prompt = mx.random.randint(100, 1000, (batch, context), key=mx.random.key(0))
    mx.eval(model(prompt, cache=cache))
    token = mx.random.randint(100, 1000, (batch, 1), key=mx.random.key(1))

    def step():
        mx.eval(model(token, cache=cache))
        for c in cache:  # stay at the same context: undo the step's one position
            c.offset -= 1

    out = {"batch": batch, "context": context, "step_ms": _time_steps(step, steps)}
    if group is not None:
        hidden = model.args.hidden_size
        n = 2 * len(model.layers)
        x = mx.ones((batch, 1, hidden), dtype=mx.float32)

        def collectives():
            y = x
            for _ in range(n):
                y = mx.distributed.all_sum(y, group=group) * 0.5
            mx.eval(y)

        out["collective_ms"] = _time_steps(collectives, steps)
        out["all_sums_per_step"] = n
        out["share"] = round(out["collective_ms"] / out["step_ms"], 3)
    return out


def rank_main(model_dir: str, batches: Sequence[int], context: int, steps: int, out: Optional[str]) -> None:
    import mlx.core as mx
    from mlx_lm.utils import sharded_load

    group = mx.distributed.init(strict=True, backend="ring")
    model, _ = sharded_load(model_dir, tensor_group=group)
    rows = [measure(model, b, context, steps, group) for b in batches]
    if group.rank() == 0 and out:
        Path(out).write_text(json.dumps(rows))


def single(model_dir: str, batches: Sequence[int], context: int, steps: int) -> list[dict]:
    from mlx_lm.utils import load

    model, _ = load(model_dir)
    return [measure(model, b, context, steps) for b in batches]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tp_collective", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)  # set on the ranks this starts
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    if "MLX_RANK" in os.environ:
        rank_main(args.model, batches, args.context, args.steps, args.rank_out)
        return 0
    from benchmarks.cluster_procs import pinned
    from cluster.ports import free_ports

    with tempfile.TemporaryDirectory() as tmp:
        hosts, out = Path(tmp) / "hosts.json", Path(tmp) / "out.json"
        hosts.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(args.ranks)]))
        argv_rank = [sys.executable, "-m", "benchmarks.tp_collective", "--model", args.model, "--batch", args.batch,
                     "--context", str(args.context), "--steps", str(args.steps), "--rank-out", str(out)]
        # each rank on a core of its own where taskset exists, as each would have a Mac of its own
        procs = [subprocess.Popen(pinned(argv_rank, [r % (os.cpu_count() or 1)]),
                                  env={**os.environ, "MLX_HOSTFILE": str(hosts), "MLX_RANK": str(r)})
                 for r in range(args.ranks)]
        if any(proc.wait(600) for proc in procs):
            print("a rank failed", file=sys.stderr)
            return 1
        sharded = json.loads(out.read_text())
    from cluster.launch.platform import pin_cpus

    pin_cpus([0])  # the single-rank baseline on one core too
    for row, alone in zip(sharded, single(args.model, batches, args.context, args.steps)):
        row["single_ms"] = alone["step_ms"]
        row["ranks"] = args.ranks
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
