"""Constrained decoding: decode throughput with every request JSON-schema constrained vs unconstrained.

    mlx-pd bench structured --out structured.json --markdown structured.md

In process, no HTTP: this measures the engine (`cluster.engine.EngineCore` over the model, stepped on its
single-node decode worker's loop thread through `Worker.call`), not the router. Per model (`--models`: the
real SmolLM2-135M, and the random-weight 2-layer llama of benchmarks/reliability_long.py, whose decode step
takes ~1-2 ms on a 2-core CPU so the mask's share shows), `--concurrency` (8) requests run at once, greedy,
with the same 8 prompts (a shop's stock list to write as JSON) in both modes:

- **constrained**: each request carries the grammar of `schema(max_tokens)` (an object whose "items" array
  holds {"name": string, "count": integer} objects, at least `max_tokens` of them, so no output within
  `max_tokens` tokens completes it: every request finishes with `length`);
- **unconstrained**: the same requests without a grammar, with `ignore_eos`, so they finish with `length` too.

Both modes thus generate exactly `max_tokens` tokens per request (checked: `finish` and `decode_tokens`).
Each run steps the engine until every request has its first token (prompts and first tokens: not measured),
then times the remaining steps: decode tok/s = tokens those steps produced / their summed wall time. Each
mode runs once unmeasured first; then `--rounds` rounds run both modes in ABBA order
(`benchmarks.compare.round_order`) so drift in machine speed hits both alike. Reported: medians of decode
tok/s, the per-round ratios constrained / unconstrained and their median (the headline), and the mask's cost
per step from the engine's own counters (`Grammars.mask_seconds` and `num_mask_rows` around the timed steps)
and measured alone by replaying the constrained outputs through fresh matchers (`mask_alone`). On the real
model, `--speculative-rounds` (2; 0 = leave out) more rounds compare both modes with prompt-lookup speculation
(`--num-draft-tokens` 4). The random model's constrained output is whatever the mask permits its random
logits: fine for throughput. Before starting, the benchmark waits (up to `--wait-idle-s`) until no pytest or
Ray worker process runs, and records the load average per round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Optional

from benchmarks.compare import machine_info, round_order
from benchmarks.speculative_bench import wait_for_idle
from benchmarks.structured_mask import mask_alone

MODES = ("unconstrained", "constrained")
MODELS = ("real", "random")
# the JSON layout without free whitespace: the model cannot pad the output with spaces
COMPACT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
GOODS = ("apples", "pears", "plums", "lemons", "carrots", "onions", "leeks", "beans", "rice", "flour", "sugar",
         "salt", "tea", "coffee", "soap", "candles", "matches", "string", "nails", "glue")


def schema(max_tokens: int) -> dict:
    """The JSON schema every constrained request follows: {"items": [{"name": str, "count": int}, ...]} with at
    least `max_tokens` items (each takes tokens, so `max_tokens` tokens never complete it) and at most 4x."""
    item = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                             "count": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["name", "count"], "additionalProperties": False}
    items = {"type": "array", "items": item, "minItems": max_tokens, "maxItems": 4 * max_tokens}
    return {"type": "object", "properties": {"items": items}, "required": ["items"], "additionalProperties": False}


def prompt_text(k: int) -> str:
    """Request k's prompt: shop k's stock list (12 goods with counts) and the ask to write it as JSON."""
    goods = [GOODS[(k * 3 + i) % len(GOODS)] for i in range(12)]
    listing = ", ".join(f"{g} {(k * 7 + i * 13) % 50 + 1}" for i, g in enumerate(goods))
    return (f"Here is the stock list of shop {k + 1}: {listing}. Write it as JSON: an object whose key \"items\" "
            "holds an array of objects, each with a \"name\" and a \"count\".")


def make_requests(tokenizer, mode: str, n: int, max_tokens: int, grammar: str, tag: str,
                  num_draft_tokens: int = 0) -> list:
    """`n` greedy `GenerateRequest`s of `mode` (prompt k = `prompt_text(k)` in the chat template); constrained
    ones carry `grammar`, unconstrained ones `ignore_eos`; with `num_draft_tokens`, prompt-lookup speculation."""
    from cluster.request import GenerateRequest, SamplingParams

    spec = dict(speculative_method="prompt_lookup", num_draft_tokens=num_draft_tokens) if num_draft_tokens else {}
    extra = dict(grammar=grammar) if mode == "constrained" else dict(ignore_eos=True)
    return [GenerateRequest(f"{tag}-{mode}-{k}", tuple(tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt_text(k)}], add_generation_prompt=True)),
        SamplingParams(max_tokens=max_tokens, temperature=0, **spec, **extra)) for k in range(n)]


def drive(engine, requests: list) -> dict:
    """Add `requests` to `engine` (on its owner thread) and step it until all finish. Steps before every
    request has its first token (prompts) are not timed; the rest are. Returns decode_tokens (tokens of the
    timed steps), decode_s, tok_s, steps, step_ms_p50, the mask counters' growth over the timed steps
    (mask_s, mask_rows, draft_mask_rows), finish ({reason: count}), add_s (adding the requests: grammar
    compiles) and outputs (each request's output token ids). Raises RuntimeError for a request that ends
    at once (e.g. a grammar that does not compile)."""
    g = engine.grammars
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finish: dict[str, str] = {}

    def absorb(outputs) -> None:
        for out in outputs:
            tokens[out.request_id] += out.token_ids
            if out.finished:
                finish[out.request_id] = out.finish_reason.value
    start = time.perf_counter()
    for r in requests:
        out = engine.add_request(r)
        if out is not None:
            raise RuntimeError(f"request {r.request_id} ended at once: {out.finish_reason.value} {out.error or ''}")
    add_s = time.perf_counter() - start
    while engine.has_work() and any(not t for t in tokens.values()):
        absorb(engine.step())
    first = sum(map(len, tokens.values()))
    before = (g.mask_seconds, g.num_mask_rows, g.num_draft_mask_rows)
    step_s = []
    while engine.has_work():
        start = time.perf_counter()
        outputs = engine.step()
        step_s.append(time.perf_counter() - start)
        absorb(outputs)
    decode_tokens, decode_s = sum(map(len, tokens.values())) - first, sum(step_s)
    reasons = [finish.get(r.request_id, "unfinished") for r in requests]
    return {"decode_tokens": decode_tokens, "decode_s": decode_s, "tok_s": decode_tokens / decode_s if decode_s else 0,
            "steps": len(step_s), "step_ms_p50": 1000 * statistics.median(step_s) if step_s else None,
            "mask_s": g.mask_seconds - before[0], "mask_rows": g.num_mask_rows - before[1],
            "draft_mask_rows": g.num_draft_mask_rows - before[2],
            "finish": {k: reasons.count(k) for k in sorted(set(reasons))}, "add_s": add_s,
            "outputs": [tokens[r.request_id] for r in requests]}


def compare_modes(engine, concurrency: int, max_tokens: int, rounds: int, num_draft_tokens: int = 0,
                  warmup_tokens: int = 4, log=print, label: str = "") -> dict:
    """One unmeasured run per mode (`warmup_tokens` tokens each), then `rounds` ABBA rounds of both modes
    (`drive`) at `concurrency`, `max_tokens` each. Returns {"rounds": [{mode: run without outputs, "loadavg",
    "ratio"}], "modes": {mode: {"tok_s_p50", "step_ms_p50"}}, "ratio_of_medians", "ratio_p50" (median of the
    per-round ratios constrained / unconstrained tok/s), "mask": the constrained runs' mask cost from the
    counters (ms per row and per timed step), "outputs": the last constrained run's output token ids,
    "grammar"}."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema(max_tokens), defaults=COMPACT)
    tok = engine.tokenizer
    for mode in MODES:
        drive(engine, make_requests(tok, mode, concurrency, warmup_tokens, grammar, "warm", num_draft_tokens))
    out_rounds, outputs = [], None
    for r in range(rounds):
        row: dict = {"loadavg": os.getloadavg(), "order": list(round_order(r, MODES))}
        for mode in row["order"]:
            got = drive(engine, make_requests(tok, mode, concurrency, max_tokens, grammar, f"r{r}", num_draft_tokens))
            if mode == "constrained":
                outputs = got["outputs"]
            row[mode] = {k: v for k, v in got.items() if k != "outputs"}
        u, c = row["unconstrained"]["tok_s"], row["constrained"]["tok_s"]
        row["ratio"] = c / u if u else None
        out_rounds.append(row)
        log(f"{label} round {r + 1}/{rounds}: unconstrained {u:.1f} tok/s, constrained {c:.1f} tok/s, "
            f"ratio {row['ratio']:.3f}, load {row['loadavg'][0]:.2f}")
    modes = {m: {"tok_s_p50": statistics.median(x[m]["tok_s"] for x in out_rounds),
                 "step_ms_p50": statistics.median(x[m]["step_ms_p50"] for x in out_rounds)} for m in MODES}
    runs = [x["constrained"] for x in out_rounds]
    mask_s, rows, steps = (sum(x[k] for x in runs) for k in ("mask_s", "mask_rows", "steps"))
    return {"rounds": out_rounds, "modes": modes, "concurrency": concurrency, "max_tokens": max_tokens,
            "num_draft_tokens": num_draft_tokens, "grammar": grammar, "outputs": outputs,
            "ratio_of_medians": modes["constrained"]["tok_s_p50"] / modes["unconstrained"]["tok_s_p50"],
            "ratio_p50": statistics.median(x["ratio"] for x in out_rounds),
            "mask": {"s": mask_s, "rows": rows, "steps": steps, "ms_per_row": 1000 * mask_s / rows if rows else None,
                     "ms_per_step": 1000 * mask_s / steps if steps else None}}


def on_engine_thread(engine, fn: Callable, timeout_s: float = 3600.0):
    """`fn(engine)` run on the loop thread of a single-node decode worker over `engine` (which owns the engine
    from then on and gives it its prompt-lookup speculator); the worker stops afterwards."""
    from cluster.launch.single_node import start_in_process_worker

    client = start_in_process_worker(engine)
    try:
        return client.worker.call(lambda worker: fn(worker.engine), timeout_s)
    finally:
        client.stop()


def load_engine(which: str, model_dir: Optional[str], concurrency: int):
    """An EngineCore over the real model (`model_dir`, default the imported SmolLM2) or the random 2-layer
    llama, with `concurrency` running sequences and no prefix caching."""
    from cluster.config import EngineConfig
    from cluster.engine import EngineCore
    from cluster.model import load_model, read_model_spec, resolve_model_path

    if which == "random":
        from benchmarks.reliability_long import FAST_KV_GB, fast_model_dir

        path, kv_gb = fast_model_dir() if model_dir is None else model_dir, FAST_KV_GB
    else:
        path, kv_gb = resolve_model_path(model_dir), 0.25
    model, tokenizer = load_model(path, "float32")
    config = EngineConfig(max_num_seqs=concurrency, kv_cache_gb=kv_gb, enable_prefix_caching=False,
                          max_model_len=2048, queue_timeout_s=900.0)
    return EngineCore(model, tokenizer, read_model_spec(path), config), str(path)


def measure_model(engine, concurrency: int, max_tokens: int, rounds: int, speculative_rounds: int = 0,
                  num_draft_tokens: int = 4, log=print, label: str = "") -> dict:
    """On `engine` (its owner thread): `compare_modes` plain, the mask measured alone over its constrained
    outputs (`mask_alone`), and with `speculative_rounds`, `compare_modes` with prompt-lookup speculation."""
    plain = compare_modes(engine, concurrency, max_tokens, rounds, log=log, label=label)
    plain["mask_alone"] = mask_alone(engine.grammars, plain.pop("grammar"), plain.pop("outputs"))
    out = {"plain": plain}
    if speculative_rounds:
        spec = compare_modes(engine, concurrency, max_tokens, speculative_rounds, num_draft_tokens, log=log,
                             label=f"{label} + prompt lookup")
        spec.pop("grammar"), spec.pop("outputs")
        out["speculative"] = spec
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--concurrency", type=int, default=8, help="requests running at once (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request, real model (64)")
    p.add_argument("--rounds", type=int, default=4, help="ABBA rounds, real model (default 4)")
    p.add_argument("--random-max-tokens", type=int, default=256, help="output tokens per request, random model")
    p.add_argument("--random-rounds", type=int, default=8, help="ABBA rounds, random model (default 8)")
    p.add_argument("--speculative-rounds", type=int, default=2,
                   help="rounds with prompt-lookup speculation, real model only (default 2; 0 = leave out)")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="draft tokens per step at most (default 4)")
    p.add_argument("--model-dir", default=None, help="the real model's mlx-lm folder (default: the imported SmolLM2)")
    p.add_argument("--wait-idle-s", type=float, default=600.0,
                   help="wait this long at most for pytest/ray processes to finish before starting (default 600)")
    p.add_argument("--out", default=None, help="write the full results as JSON")
    p.add_argument("--markdown", default=None, help="also write the tables as Markdown")


def run(args, log=None) -> dict:
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in MODELS for m in models):
        raise ValueError(f"--models must name some of {', '.join(MODELS)}, got {args.models!r}")
    if min(args.concurrency, args.max_tokens, args.rounds, args.random_max_tokens, args.random_rounds) < 1:
        raise ValueError("--concurrency, --max-tokens, --rounds, --random-max-tokens and --random-rounds must be >= 1")
    idle = wait_for_idle(args.wait_idle_s, log=log)
    result = {"kind": "structured", "machine": machine_info(), "idle_at_start": idle, "models": {}, "errors": 0}
    t0 = time.perf_counter()
    for which in models:
        engine, path = load_engine(which, args.model_dir if which == "real" else None, args.concurrency)
        real = which == "real"
        got = on_engine_thread(engine, lambda e: measure_model(
            e, args.concurrency, args.max_tokens if real else args.random_max_tokens,
            args.rounds if real else args.random_rounds, args.speculative_rounds if real else 0,
            args.num_draft_tokens, log=log, label=which))
        got["model_dir"] = path
        result["models"][which] = got
        for variant in ("plain", "speculative"):
            for row in got.get(variant, {}).get("rounds", ()):
                result["errors"] += sum(n for m in MODES for k, n in row[m]["finish"].items() if k != "length")
                result["errors"] += row["unconstrained"]["decode_tokens"] != row["constrained"]["decode_tokens"]
    result["wall_s"] = time.perf_counter() - t0
    result["machine"]["loadavg_end"] = os.getloadavg()
    from benchmarks.prefix_report import print_tables

    print_tables(tables(result))
    return result


def tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) for the Markdown report: throughput per model and variant, and the mask's cost."""
    def f(v, spec=".2f") -> str:
        return "-" if v is None else format(v, spec)

    rows, cost = [], []
    for which, got in result["models"].items():
        for variant, s in (("", got["plain"]), (" + prompt lookup", got.get("speculative"))):
            if s is None:
                continue
            u, c = s["modes"]["unconstrained"], s["modes"]["constrained"]
            first = s["rounds"][0]
            rows.append([which + variant, str(s["concurrency"]), str(first["constrained"]["decode_tokens"]),
                         f(u["tok_s_p50"], ".1f"), f(c["tok_s_p50"], ".1f"), f(u["step_ms_p50"]),
                         f(c["step_ms_p50"]), f(s["ratio_p50"], ".3f") + "x", f(s["ratio_of_medians"], ".3f") + "x",
                         " ".join(f(x["ratio"]) for x in s["rounds"]),
                         " ".join(f(x["loadavg"][0], ".1f") for x in s["rounds"])])
        m, alone = got["plain"]["mask"], got["plain"]["mask_alone"]
        cost.append([which, f(m["ms_per_row"], ".4f"), f(m["ms_per_step"], ".3f"), f(alone["fill_ms_p50"], ".3f"),
                     f(alone["unpack_ms_p50"], ".3f"), f(alone["apply_ms_p50"], ".3f"), f(alone["total_ms_p50"], ".3f"),
                     f(alone["numpy_unpack_ms_p50"], ".3f"),
                     f(got["plain"]["modes"]["constrained"]["step_ms_p50"]
                       - got["plain"]["modes"]["unconstrained"]["step_ms_p50"], ".3f")])
    head = ["model", "concurrency", "decode tokens a run", "unconstrained tok/s p50", "constrained tok/s p50",
            "unconstrained step ms p50", "constrained step ms p50", "ratio p50", "ratio of medians", "ratio per round",
            "load avg per round"]
    cost_head = ["model", "mask ms per row (counters)", "mask ms per step (counters)", "fill ms per step (alone)",
                 "unpack ms per step (alone)", "apply ms per step (alone)", "sum ms (alone)",
                 "unpack on the host (NumPy) ms per step",
                 "step ms p50 gap (constrained - unconstrained)"]
    return [("Decode throughput, constrained vs unconstrained (in process, greedy)", head, rows),
            ("The mask's cost per decode step", cost_head, cost)]
