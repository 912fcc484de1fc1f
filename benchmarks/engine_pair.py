"""What the engine-speed scenarios share (`mlx-pd bench interference`, `mixed-prefill`, `aiperf`): mlx-pd and
mlx_lm.server started on one model folder and kept up throughout, the ABBA order of their rounds, medians over
rounds, and unique long prompts of a given token length.

The model folder is `--model-dir`, or with `--fast-model` the random-weight 2-layer stand-in for a fast
accelerator (benchmarks/reliability_long.py: `fast_model_dir`), or by default the imported SmolLM2 (the default
of `bench --compare`). Both servers run with their default settings (mlx-pd: `mlx_pd_command`, mlx_lm.server:
`mlx_lm_command`, benchmarks/servers.py); every request is greedy and, unless `--no-eos-bias`, carries
``logit_bias`` -100 on the model's EOS ids (mlx_lm.server has no ``ignore_eos``), as `bench --compare` does.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import statistics
from typing import Callable, Iterator, Optional, Sequence

from benchmarks.compare import OURS, THEIRS, eos_token_ids, round_order

NAMES = (OURS, THEIRS)


def add_pair_args(p: argparse.ArgumentParser, rounds: int) -> None:
    """The options every engine-speed scenario takes: model, dtype, rounds, seed, EOS bias, outputs."""
    p.add_argument("--model-dir", default=None, help="mlx-lm model folder both servers load (default: the imported "
                                                     "SmolLM2, as bench --compare)")
    p.add_argument("--fast-model", action="store_true",
                   help="both servers load the random-weight 2-layer stand-in for a fast accelerator "
                        "(benchmarks/reliability_long.py: fast_model_dir)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="our server's dtype and the default model folder's (default float32)")
    p.add_argument("--rounds", type=int, default=rounds,
                   help=f"measured rounds per server, in ABBA order (default {rounds})")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (default 0)")
    p.add_argument("--no-eos-bias", action="store_true",
                   help="do not suppress the model's EOS ids with logit_bias -100")
    p.add_argument("--out", default=None, help="write the full results as JSON")
    p.add_argument("--markdown", default=None, help="also write the tables as Markdown")
    p.add_argument("--no-progress", action="store_true", help="no progress output")


def model_dir_of(args) -> str:
    """The model folder the options name (see the module doc). Raises ValueError for both --fast-model and
    --model-dir."""
    if getattr(args, "fast_model", False) and args.model_dir:
        raise ValueError("give --fast-model or --model-dir, not both")
    if getattr(args, "fast_model", False):
        from benchmarks.reliability_long import fast_model_dir

        return str(fast_model_dir())
    if args.model_dir:
        return str(args.model_dir)
    from cluster.model import resolve_model_path

    return str(resolve_model_path(None, dtype=args.dtype))


def suppressed_ids(args, model_dir: str) -> tuple[int, ...]:
    """The EOS ids to send with logit_bias -100 (none with --no-eos-bias)."""
    return () if getattr(args, "no_eos_bias", False) else eos_token_ids(model_dir)


@contextlib.contextmanager
def pair(model_dir: str, dtype: str, log: Callable[[str], None]) -> Iterator[dict]:
    """mlx-pd and mlx_lm.server on `model_dir`, both healthy; yields {name: ServerProcess}; stops both on leaving."""
    from benchmarks.prefix_bench import running_servers, server_argvs

    with running_servers(server_argvs(NAMES, model_dir, dtype), log=log) as servers:
        yield servers


def abba(rounds: int, names: Sequence[str] = NAMES) -> list[tuple[int, str]]:
    """(round, server) in the order they run: ABBA as `bench --compare` (ours, theirs, theirs, ours, ...)."""
    return [(r, name) for r in range(rounds) for name in round_order(r, names)]


def median(values: Sequence[Optional[float]]) -> float:
    """The median of the values that are numbers (None and NaN left out); NaN when none is."""
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return statistics.median(vals) if vals else math.nan


def medians(rounds: Sequence[dict], keys: Sequence[str]) -> dict[str, float]:
    """{key: median over `rounds` of round[key]} for each of `keys` (a round may lack a key: left out)."""
    return {k: median([r.get(k) for r in rounds]) for k in keys}


def summarize(result: dict, keys: Sequence[str], tables: Callable[[dict], list]) -> dict:
    """Finish a run's `result` in place: per server the medians of `keys` over its rounds without an error
    (`median`), its failed rounds (`errors`), the ratios ours / theirs of the medians, the total errors; then
    print `tables(result)`. Returns `result`."""
    from benchmarks.prefix_report import print_tables

    for s in result["servers"].values():
        ok = [g for g in s["rounds"] if g["error"] is None]
        s["median"] = medians(ok, keys)
        s["errors"] = len(s["rounds"]) - len(ok)
    result["ratios"] = {k: ratio(result["servers"][NAMES[0]]["median"][k], result["servers"][NAMES[1]]["median"][k])
                        for k in keys}
    result["errors"] = sum(s["errors"] for s in result["servers"].values())
    print_tables(tables(result))
    return result


def ratio(ours: Optional[float], theirs: Optional[float]) -> float:
    """ours / theirs; NaN when either is missing or NaN, or theirs is 0."""
    if ours is None or theirs is None or math.isnan(ours) or math.isnan(theirs) or theirs == 0:
        return math.nan
    return ours / theirs


def chat_token_counter(model_dir: str) -> Callable[[str], int]:
    """Tokens of a prompt sent as one user message, as the servers count it: the model's chat template rendered
    with the generation prompt, then encoded (benchmarks/workloads.py: `ChatTokens`)."""
    from benchmarks.workloads import ChatTokens

    chat = ChatTokens.from_model_dir(model_dir)
    return lambda text: len(chat.render([{"role": "user", "content": text}]))


def long_prompt(tokens: int, tag: str, count: Callable[[str], int], seed: int = 0) -> str:
    """A prompt of at least `tokens` tokens by `count` (over by less than its last note line, ~10-70 tokens): a unique
    ``[tag]`` first, then numbered notes drawn from benchmarks/prompts.jsonl (seeded by `seed` and `tag`).
    Different tags differ from the first characters on, so no two prompts share more than the chat template's
    prefix."""
    from benchmarks.loadgen import load_prompts

    rng = random.Random(f"{seed}:{tag}")
    pool = load_prompts()
    text = f"[{tag}] Read the notes below, then summarize them in one sentence.\n\n"
    n = 0
    while count(text) < tokens:
        n += 1
        text += f"Note {n} (source {rng.randint(100, 999)}): {pool[rng.randrange(len(pool))]}\n"
    return text


def fmt_ms(x: Optional[float]) -> str:
    """Seconds as milliseconds with one decimal, '-' for missing."""
    return "-" if x is None or math.isnan(x) else f"{1000 * x:.1f}"


def fmt_ratio(x: Optional[float]) -> str:
    """A ratio as '1.23x', '-' for missing."""
    return "-" if x is None or math.isnan(x) else f"{x:.2f}x"
