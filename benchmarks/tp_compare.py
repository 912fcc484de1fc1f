"""`mlx-pd bench tensor-parallel`: mlx-pd's tensor-parallel group against mlx_lm.server's, on one model and ranks.

    mlx-pd bench tensor-parallel --random-model fast --ranks 2 --concurrency 1,8 --out tp-fast.json
    mlx-pd bench tensor-parallel --random-model smol-shape --concurrency 1,8 --num-requests 8,32 --max-tokens 32
    mlx-pd bench tensor-parallel --model-dir DIR --targets mlx_lm.server          # mlx-lm's side alone
    mlx-pd bench tensor-parallel --parallel pipeline --random-model smol-qwen2    # both split into layers
    mlx-pd bench tensor-parallel --random-model fast --passes 2 --pin-ranks       # ABBA passes, pinned ranks
    mlx-pd bench tensor-parallel --mlx-pd-command "{python} -m cluster.launch.cli serve --model {model} \\
        --tensor-parallel {ranks} --port {port} --log-level warning"

Two targets run one after the other, never together (each is a group of `--ranks` processes that shares the
machine's cores), on the same model folder and number of ranks, on loopback:

- ``mlx_lm.server``: mlx-lm's own server on `--ranks` ranks over MLX's ring backend (benchmarks/tp_servers.py:
  `MlxLmTensorParallel`; `--launcher direct` starts the ranks itself with `MLX_HOSTFILE` and `MLX_RANK`, the
  default, or `--launcher mlx.launch` through MLX's launcher, whose I/O threads spin on a core);
  `--pin-ranks` runs each rank under taskset on its own share of the CPUs, which on a small machine decides
  the speed (see that module's doc);
- ``mlx-pd``: the command `--mlx-pd-command` (default `MLX_PD_COMMAND`, `mlx-pd serve --tensor-parallel N`),
  whose `{python}`, `{model}`, `{ranks}` and `{port}` are filled in. When it exits before it is ready and its
  output names the flag in an error (`flag_rejected`: an `mlx-pd serve` without `--tensor-parallel` prints
  "unrecognized arguments: --tensor-parallel 2"), the target is skipped with that line as the reason, not
  failed.

The model folder is `--model-dir`, or `--random-model fast` (the random-weight 2-layer stand-in of
benchmarks/reliability_long.py, the default) or `smol-shape` (a random llama of SmolLM2-135M's size with 8 query
and 4 KV heads, benchmarks/random_models.py); its heads must divide by `--ranks`.

For each pass of a target: start it, wait until /v1/models answers and a 1-token chat completion does (the ready time);
check one greedy answer of `--check-tokens` tokens against mlx-lm's single-process `generate` on the same
model (computed once, in this process, before any server starts); read the group's host CPU over
`--idle-seconds` with nothing in flight (mlx_lm.server's ranks poll each other while idle); then the levels of
`bench --compare` (benchmarks/compare.py: `run_levels`, one target): per concurrency level a warm-up, then
`--num-requests` unique chat prompts in `--rounds` rounds, greedy, `--max-tokens` each with the EOS ids
suppressed by logit_bias (unless `--no-eos-bias`); output tokens/s over the rounds' wall time, TTFT, host CPU
time per output token; then stop it. The two groups cannot be up at once without sharing the cores, so the
alternation of `bench --compare` happens between passes instead of rounds: `--passes N` runs each target N
times in ABBA order (mlx_lm.server, mlx-pd, mlx-pd, mlx_lm.server, ...; `pass_order`), each pass a fresh
start, so that drift in machine speed (other processes on a shared host) hits both alike. The table has, per
level, each target's output tokens/s and TTFT p50 (medians over its passes) and the ratios mlx-pd /
mlx_lm.server; the JSON has every pass and the load averages at each level's start and end. A target that is
skipped or fails is not started again.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from benchmarks.cli import _int_list
from benchmarks.compare import REPO_ROOT, eos_token_ids, machine_info, round_order, run_levels
from benchmarks.engine_pair import fmt_ms, fmt_ratio, ratio
from benchmarks.servers import ServerProcess
from benchmarks.tp_servers import LAUNCHERS, MlxLmTensorParallel, rank_cpus, stop_tree, wait_ready
from cluster.ports import free_ports

OURS, THEIRS = "mlx-pd", "mlx_lm.server"
TARGETS = (THEIRS, OURS)  # the order they run in; ratios are OURS / THEIRS
MLX_PD_COMMAND = "{python} -m cluster.launch.cli serve --model {model} --tensor-parallel {ranks} --port {port}"
MLX_PD_PIPELINE_COMMAND = MLX_PD_COMMAND.replace("--tensor-parallel", "--pipeline-parallel")
TP_FLAG = "--tensor-parallel"
RANDOM_MODELS = ("fast", "smol-shape", "smol-qwen2")
CHECK_PROMPT = "Tell me about the sea."


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key or not all(c.isalnum() or c == "_" for c in key):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def add_args(p: argparse.ArgumentParser) -> None:
    """The options of `mlx-pd bench tensor-parallel`."""
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model-dir", default=None, help="mlx-lm model folder both targets load (its heads must "
                                                         "divide by --ranks)")
    model.add_argument("--random-model", choices=RANDOM_MODELS, default=None,
                       help="a random-weight model built once in the mlx-pd cache: fast (2-layer stand-in, the "
                            "default) or smol-shape (SmolLM2-135M's size, 8 heads over 4 KV heads)")
    p.add_argument("--ranks", type=int, default=2, help="ranks of each target's group (default 2)")
    p.add_argument("--parallel", choices=("tensor", "pipeline"), default="tensor",
                   help="how both groups split the model: tensor (default) or pipeline (mlx-pd's "
                        "--pipeline-parallel, mlx_lm.server's --pipeline; the model's mlx-lm class must pipeline, "
                        "e.g. --random-model smol-qwen2)")
    p.add_argument("--concurrency", type=_int_list, default=[1, 8], help="levels, like 1,8 (default 1,8)")
    p.add_argument("--num-requests", type=_int_list, default=[16, 32],
                   help="measured requests per level and target: one count, or one per level (default 16,32)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per level (at most; default 2)")
    p.add_argument("--passes", type=int, default=1,
                   help="start, measure and stop each target this many times, in ABBA order (mlx_lm.server, "
                        "mlx-pd, mlx-pd, mlx_lm.server, ...); the table has the medians (default 1)")
    p.add_argument("--targets", default=",".join(TARGETS),
                   help=f"which to run, in this order, from {', '.join(TARGETS)} (default {','.join(TARGETS)})")
    p.add_argument("--launcher", choices=LAUNCHERS, default="direct",
                   help="how mlx_lm.server's ranks start: direct (this tool sets MLX_HOSTFILE and MLX_RANK, the "
                        "default) or mlx.launch (MLX's launcher; its I/O threads spin on a core)")
    p.add_argument("--pin-ranks", action="store_true",
                   help="run each of mlx_lm.server's ranks under taskset on its own share of the CPUs (direct "
                        "launcher); mlx-pd's side runs as its command says, so pin its ranks there too")
    p.add_argument("--mlx-pd-command", default=None,
                   help="mlx-pd's tensor-parallel server; {python} {model} {ranks} {port} are filled in "
                        f"(default: {MLX_PD_COMMAND!r})")
    p.add_argument("--env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for every process of both targets (repeatable)")
    p.add_argument("--check-tokens", type=int, default=16,
                   help="greedy tokens of the answer checked against single-process mlx-lm (0: no check)")
    p.add_argument("--idle-seconds", type=float, default=2.0,
                   help="seconds of host CPU read with nothing in flight, per target (0: not read)")
    p.add_argument("--ready-deadline", type=float, default=600.0, help="seconds a target may take to be ready")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (default 0)")
    p.add_argument("--no-eos-bias", action="store_true", help="do not suppress the EOS ids with logit_bias -100")
    p.add_argument("--out", default=None, help="write the full results (every request's record too) as JSON")
    p.add_argument("--markdown", default=None, help="also write the tables as Markdown")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def model_dir_of(args) -> str:
    """The model folder the options name: `--model-dir`, else the `--random-model` (default fast), built once."""
    if args.model_dir:
        return str(args.model_dir)
    if (args.random_model or "fast") == "fast":
        from benchmarks.reliability_long import fast_model_dir

        return str(fast_model_dir())
    from benchmarks.random_models import smol_qwen2_model_dir, smol_shape_model_dir

    return str(smol_qwen2_model_dir() if args.random_model == "smol-qwen2" else smol_shape_model_dir())


def mlx_pd_command_of(args) -> str:
    """`--mlx-pd-command`, else mlx-pd's serve with `--tensor-parallel` or `--pipeline-parallel` per `--parallel`."""
    if args.mlx_pd_command:
        return args.mlx_pd_command
    return MLX_PD_PIPELINE_COMMAND if getattr(args, "parallel", "tensor") == "pipeline" else MLX_PD_COMMAND


def parse_targets(text: str) -> list[str]:
    """The `--targets` names in the order given (they run in it); raises ValueError for an unknown or repeated
    name, or none."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in TARGETS]
    if not names or bad or len(set(names)) != len(names):
        raise ValueError(f"--targets: give distinct names from {', '.join(TARGETS)}, got {text!r}")
    return names


def level_counts(levels: Sequence[int], counts: Sequence[int]) -> list[int]:
    """One request count per level: `counts` as it is, or its one count for every level. Raises ValueError."""
    if len(counts) == 1:
        return list(counts) * len(levels)
    if len(counts) != len(levels):
        raise ValueError(f"give one --num-requests or one per level; got {len(counts)} for {len(levels)} levels")
    return list(counts)


def heads_divide(model_dir: str, ranks: int) -> Optional[str]:
    """None when the attention and KV heads of the folder's config.json divide by `ranks`, else why not."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    cfg = {**cfg, **cfg.get("text_config", {})}
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads", cfg.get("num_attention_heads"))
    if heads is None or (heads % ranks == 0 and kv % ranks == 0):
        return None
    return f"{heads} attention heads over {kv} KV heads do not divide by {ranks} ranks"


def mlx_pd_argv(template: str, model_dir: str, ranks: int, port: int, python: str = sys.executable) -> list[str]:
    """argv of mlx-pd's side: `template` split as a shell would, each word's {python} {model} {ranks} {port}
    filled in (so a model path with spaces stays one word). Raises ValueError for an unknown placeholder."""
    try:
        return [w.format(python=python, model=model_dir, ranks=ranks, port=port) for w in shlex.split(template)]
    except (KeyError, IndexError) as exc:
        raise ValueError(f"--mlx-pd-command: unknown placeholder {exc} (use {{python}} {{model}} {{ranks}} "
                         "{port})") from None


def flag_rejected(log_text: str, flag: str = TP_FLAG) -> Optional[str]:
    """The line of a server's output that is an error naming `flag` (argparse: "error: unrecognized arguments:
    --tensor-parallel 2"), or None."""
    for line in log_text.splitlines():
        if flag in line and "error" in line.lower():
            return line.strip()
    return None


def reference_text(model_dir: str, prompt: str, max_tokens: int) -> str:
    """mlx-lm's greedy answer to `prompt` (one user message, the chat template with the generation prompt) on one
    process: what a tensor-parallel group should answer. Frees the model before returning."""
    import gc

    import mlx.core as mx
    from mlx_lm import generate, load

    model, tokenizer = load(model_dir)
    tokens = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    text = generate(model, tokenizer, tokens, max_tokens=max_tokens, verbose=False)
    del model, tokenizer
    gc.collect()
    mx.clear_cache()
    return text


def check_answer(url: str, reference: str, prompt: str, max_tokens: int) -> dict:
    """Send `prompt` greedy (non-streaming, `max_tokens`) to `url` and compare the answer with `reference`:
    {"text", "identical", "same_but_spaces" (equal once leading and trailing whitespace is stripped: servers
    differ on whether the first token's leading space is sent), "common_prefix_chars", "error"}."""
    import httpx

    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.0}
    try:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600.0)
        r.raise_for_status()
        text = r.json()["choices"][0]["message"]["content"] or ""
    except Exception as exc:  # noqa: BLE001 -- any failure is the check's result
        return {"text": None, "identical": False, "same_but_spaces": False, "common_prefix_chars": 0,
                "error": f"{type(exc).__name__}: {exc}"}
    n = 0
    while n < min(len(text), len(reference)) and text[n] == reference[n]:
        n += 1
    return {"text": text, "identical": text == reference, "same_but_spaces": text.strip() == reference.strip(),
            "common_prefix_chars": n, "error": None}


def idle_cpu(cpu_seconds: Callable[[], float], seconds: float) -> Optional[float]:
    """Host CPU seconds per second a server's processes use over `seconds` with nothing in flight (None: 0 s)."""
    if seconds <= 0:
        return None
    before, t0 = cpu_seconds(), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds() - before) / (time.monotonic() - t0)


def _server(name: str, args, model_dir: str, env: dict, log_dir: str):
    """The (not yet started) server of target `name`."""
    if name == THEIRS:
        pipeline = getattr(args, "parallel", "tensor") == "pipeline"
        return MlxLmTensorParallel(model_dir, args.ranks, launcher=args.launcher,
                                   name=f"{THEIRS}-{'pp' if pipeline else 'tp'}{args.ranks}", pin=args.pin_ranks,
                                   env=env, log_dir=log_dir, cwd=str(REPO_ROOT), pipeline=pipeline)
    port = free_ports(1)[0]
    return ServerProcess(f"{OURS}-{'pp' if getattr(args, 'parallel', 'tensor') == 'pipeline' else 'tp'}{args.ranks}",
                         mlx_pd_argv(mlx_pd_command_of(args), model_dir, args.ranks, port),
                         port, env=env, log_dir=log_dir, cwd=str(REPO_ROOT))


def _ready(name: str, server, deadline_s: float) -> float:
    if name == THEIRS:
        return server.wait_ready(deadline_s)
    return wait_ready(server.url, [server], deadline_s)


def level_numbers(level: dict, name: str) -> dict:
    """The headline numbers of target `name` at one level of `run_levels`: output tokens/s, TTFT p50, host CPU
    seconds per output token, failed requests, the load averages at the level's start and end."""
    s = level["servers"][name]
    return {"output_throughput": s["output_throughput"], "ttft_s_p50": s["ttft_s"]["p50"],
            "host_cpu_s_per_output_token": s.get("host_cpu_s_per_output_token", math.nan), "errors": s["errors"],
            "loadavg_start": level.get("loadavg_start"), "loadavg_end": level.get("loadavg_end")}


def measure(name: str, args, model_dir: str, reference: Optional[str], suppress: tuple[int, ...], env: dict,
            log: Callable[[str], None]) -> dict:
    """One pass of target `name`: start it, wait until ready, check its answer, read its idle CPU, run the levels,
    stop it. Returns {"status": "ok" | "skipped" | "failed", "reason", "command", "ready_s", "check",
    "idle_cpu_s_per_s", "memory_idle", "memory", "levels" (run_levels'), "by_level" (level_numbers by
    concurrency, as strings), "log_paths"}."""
    import tempfile

    levels = list(args.concurrency)
    counts = level_counts(levels, args.num_requests)
    server = _server(name, args, model_dir, env, tempfile.gettempdir())
    out = {"status": "failed", "reason": None, "command": server.argv, "ready_s": None, "check": None,
           "idle_cpu_s_per_s": None, "memory_idle": None, "memory": None, "levels": [], "by_level": {},
           "log_paths": getattr(server, "log_paths", [str(server.log_path)])}
    log(f"{name}: starting {shlex.join(server.argv)}")
    with contextlib.ExitStack() as stack:
        stack.callback(server.stop if name == THEIRS else lambda: stop_tree(server))
        try:
            server.start()
            out["ready_s"] = _ready(name, server, args.ready_deadline)
        except (RuntimeError, OSError) as exc:
            flag = "--pipeline-parallel" if getattr(args, "parallel", "tensor") == "pipeline" else TP_FLAG
            rejected = flag_rejected(server.log_tail(50), flag) if name == OURS else None
            out["status"], out["reason"] = ("skipped", rejected) if rejected else ("failed", str(exc))
            log(f"{name}: {'skipped, its server rejected ' + flag if rejected else 'failed to start'}: "
                f"{rejected or exc}")
            return out
        log(f"{name}: ready after {out['ready_s']:.1f} s on {server.url} (logs: {', '.join(out['log_paths'])})")
        if reference is not None:
            out["check"] = check_answer(server.url, reference, CHECK_PROMPT, args.check_tokens)
            check = out["check"]
            verdict = ("identical to" if check["identical"] else "equal but for surrounding whitespace to"
                       if check["same_but_spaces"] else "DIFFERS from")
            log(f"{name}: greedy answer {verdict} single-process mlx-lm's: {check['text']!r}")
        out["memory_idle"] = server.memory()
        out["idle_cpu_s_per_s"] = idle_cpu(server.cpu_seconds, args.idle_seconds)
        try:
            out["levels"] = run_levels({name: server.url}, levels, counts, max_tokens=args.max_tokens,
                                       rounds=args.rounds, seed=args.seed, progress=not args.no_progress,
                                       suppress=suppress, log=lambda msg: log(f"{name}: {msg}"),
                                       cpu={name: server.cpu_seconds})
        except RuntimeError as exc:
            out["reason"] = str(exc)
            log(f"{name}: failed: {exc}")
            return out
        out["memory"] = server.memory()
    out["by_level"] = {str(lv["concurrency"]): level_numbers(lv, name) for lv in out["levels"]}
    out["status"] = "ok"
    return out


def pass_order(passes: int, targets: Sequence[str]) -> list[tuple[int, str]]:
    """(pass, target) in the order they run: the targets forward in passes 0, 3, 4, 7, ... and backward in the
    others (ABBA, as `bench --compare`'s rounds), so that drift in machine speed hits both alike."""
    return [(p, name) for p in range(passes) for name in round_order(p, targets)]


def _median(values) -> float:
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return statistics.median(vals) if vals else math.nan


def combine(passes: Sequence[dict]) -> dict:
    """One target's passes as one entry: each pass under "passes"; "status" "ok" when every pass was, else that
    of the first pass that was not (its "reason" too); per level ("by_level") the medians over the passes of
    output tokens/s, TTFT p50 and host CPU per output token, and the failed requests summed; the median ready
    time and idle CPU; "check_identical" (every checked answer equal to single-process mlx-lm's, None when
    none was checked) and "check_same_but_spaces" (equal once stripped); the largest RSS seen."""
    bad = next((p for p in passes if p["status"] != "ok"), None)
    ok = [p for p in passes if p["status"] == "ok"]
    by_level = {}
    for c in (ok[0]["by_level"] if ok else {}):
        nums = [p["by_level"][c] for p in ok if c in p["by_level"]]
        by_level[c] = {k: _median(n[k] for n in nums)
                       for k in ("output_throughput", "ttft_s_p50", "host_cpu_s_per_output_token")}
        by_level[c]["errors"] = sum(n["errors"] for n in nums)
    checks = [p["check"] for p in passes if p.get("check")]
    rss = [m["rss_mib"] for p in passes for m in (p.get("memory_idle"), p.get("memory")) if m]
    return {"status": "not run" if not passes else bad["status"] if bad else "ok",
            "reason": bad["reason"] if bad else None, "passes": list(passes), "passes_ok": len(ok),
            "by_level": by_level, "ready_s": _median(p["ready_s"] for p in passes),
            "idle_cpu_s_per_s": _median(p["idle_cpu_s_per_s"] for p in passes),
            "check_identical": all(c["identical"] for c in checks) if checks else None,
            "check_same_but_spaces": all(c["same_but_spaces"] for c in checks) if checks else None,
            "check_common_prefix_chars": min((c["common_prefix_chars"] for c in checks), default=None),
            "rss_mib_max": max(rss, default=None)}


def run(args, log=None) -> dict:
    """Run every target in turn, `--passes` times in ABBA order (see the module doc), print the tables; returns
    the JSON-ready result."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.ranks < 2 or args.max_tokens < 1 or args.rounds < 1 or args.passes < 1 or args.check_tokens < 0:
        raise ValueError("--ranks must be >= 2, --max-tokens, --rounds and --passes >= 1, --check-tokens >= 0")
    if args.pin_ranks and args.launcher != "direct":
        raise ValueError("--pin-ranks needs --launcher direct")
    rank_cpu_sets = rank_cpus(args.ranks) if args.pin_ranks else None
    targets = parse_targets(args.targets)
    level_counts(args.concurrency, args.num_requests)
    model_dir = model_dir_of(args)
    why = heads_divide(model_dir, args.ranks) if getattr(args, "parallel", "tensor") == "tensor" else None
    if why:
        raise ValueError(f"{model_dir}: {why}")
    mlx_pd_argv(mlx_pd_command_of(args), model_dir, args.ranks, 0)  # a bad placeholder fails before anything starts
    suppress = () if args.no_eos_bias else eos_token_ids(model_dir)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
           **dict(args.env)}
    reference = None
    if args.check_tokens:
        reference = reference_text(model_dir, CHECK_PROMPT, args.check_tokens)
        log(f"single-process mlx-lm's greedy answer: {reference!r}")
    result = {"machine": machine_info(), "model_dir": model_dir, "ranks": args.ranks, "launcher": args.launcher,
              "mlx_lm_rank_cpus": rank_cpu_sets, "mlx_pd_command": mlx_pd_command_of(args),
              "parallel": getattr(args, "parallel", "tensor"),
              "max_tokens": args.max_tokens, "concurrency": list(args.concurrency),
              "num_requests": level_counts(args.concurrency, args.num_requests), "rounds": args.rounds,
              "passes": args.passes, "seed": args.seed, "suppressed_token_ids": list(suppress),
              "env": dict(args.env), "check_prompt": CHECK_PROMPT, "reference_text": reference, "targets": targets,
              "servers": {}}
    runs: dict[str, list] = {name: [] for name in targets}
    for p, name in pass_order(args.passes, targets):
        if runs[name] and runs[name][-1]["status"] != "ok":
            continue  # skipped or failed once: not started again
        log(f"pass {p + 1}/{args.passes}: {name}")
        runs[name].append(measure(name, args, model_dir, reference, suppress, env, log))
    result["servers"] = {name: combine(runs[name]) for name in targets}
    result["machine"]["loadavg_end"] = os.getloadavg()
    result["ratios"] = level_ratios(result)
    result["errors"] = errors(result)
    from benchmarks.prefix_report import print_tables

    print_tables(tables(result))
    return result


def _summary(result: dict, name: str, concurrency: int) -> Optional[dict]:
    s = result["servers"].get(name)
    if not s or s["status"] != "ok":
        return None
    return s["by_level"].get(str(concurrency))


def level_ratios(result: dict) -> dict[str, dict]:
    """Per concurrency level (as a string key): mlx-pd / mlx_lm.server of output tokens/s and TTFT p50 (NaN where
    either side did not run)."""
    out = {}
    for c in result["concurrency"]:
        ours, theirs = _summary(result, OURS, c), _summary(result, THEIRS, c)
        out[str(c)] = {k: ratio(ours and ours[k], theirs and theirs[k]) for k in ("output_throughput", "ttft_s_p50")}
    return out


def errors(result: dict) -> list[str]:
    """What went wrong: a target that failed (a skipped one is not an error), failed requests, a wrong answer."""
    out = []
    for name, s in result["servers"].items():
        if s["status"] == "failed":
            out.append(f"{name}: {s['reason']}")
        for c, n in s["by_level"].items():
            if n["errors"]:
                out.append(f"{name}: {n['errors']} failed requests at concurrency {c}")
        if s["check_same_but_spaces"] is False:
            out.append(f"{name}: its greedy answer differs from single-process mlx-lm's")
    return out


def _num(x: Optional[float], digits: int = 1) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for the terminal and Markdown: per level each target's output tokens/s and TTFT p50
    (medians over its passes) and the ratios mlx-pd / mlx_lm.server; then one row per target (status, passes,
    ready time, answer check, idle CPU, memory, host CPU per output token, failed requests, reason)."""
    head = ["concurrency", f"{THEIRS} tok/s", f"{OURS} tok/s", "tok/s ratio", f"{THEIRS} TTFT p50 ms",
            f"{OURS} TTFT p50 ms", "TTFT p50 ratio"]
    rows = []
    for c in result["concurrency"]:
        theirs, ours = _summary(result, THEIRS, c), _summary(result, OURS, c)
        r = result["ratios"][str(c)]
        rows.append([str(c), _num(theirs and theirs["output_throughput"]), _num(ours and ours["output_throughput"]),
                     fmt_ratio(r["output_throughput"]), fmt_ms(theirs and theirs["ttft_s_p50"]),
                     fmt_ms(ours and ours["ttft_s_p50"]), fmt_ratio(r["ttft_s_p50"])])
    passes = result.get("passes", 1)
    title = (f"{result.get('parallel', 'tensor').capitalize()} parallel, {result['ranks']} ranks on loopback, {Path(result['model_dir']).name}, "
             f"{result['max_tokens']} output tokens a request, " + (f"medians over {passes} passes (ABBA), "
                                                                    if passes > 1 else "")
             + f"ratios {OURS} / {THEIRS} (tok/s: higher is better, TTFT: lower)")
    head2 = ["target", "status", "passes ok", "ready s", "answer = 1-process mlx-lm", "idle CPU s/s", "RSS MiB",
             "host CPU ms/token by level", "errors", "note"]
    rows2 = []
    for name, s in result["servers"].items():
        check = ("-" if s["check_identical"] is None else "yes" if s["check_identical"] else
                 "yes but for surrounding whitespace" if s["check_same_but_spaces"] else
                 f"no ({s['check_common_prefix_chars']} chars agree)")
        per_tok = " / ".join(fmt_ms(n["host_cpu_s_per_output_token"]) for n in s["by_level"].values())
        rows2.append([name, s["status"], f"{s['passes_ok']}/{len(s['passes'])}", _num(s["ready_s"]),
                      check,
                      _num(s["idle_cpu_s_per_s"], 2), _num(s["rss_mib_max"], 0), per_tok or "-",
                      str(sum(n["errors"] for n in s["by_level"].values())), s["reason"] or ""])
    launcher = "ranks started directly" if result["launcher"] == "direct" else "mlx.launch"
    if result.get("mlx_lm_rank_cpus"):
        launcher += ", pinned to CPUs " + " | ".join(",".join(map(str, c)) for c in result["mlx_lm_rank_cpus"])
    return [(title, head, rows), (f"Targets ({THEIRS}: {launcher}; one target up at a time)", head2, rows2)]
