"""`mlx-pd bench reliability --soak-only`: a long soak that asks one question: does any process leak?

    mlx-pd bench reliability --soak-only --fast-model --requests 10000 --rss-plot docs/img/reliability-soak-rss.png \\
        --markdown docs/RELIABILITY.md --json /tmp/soak.json

Runs the same 1P2D cluster of processes (`mlx-pd worker` x3 + `mlx-pd router`) and the same mixed soak as phase
4 of `mlx-pd bench reliability` (chats, tenants with shared system prompts over one or two turns, long prompts
through the prefill worker, sampled requests, client disconnects, prompt-lookup speculative decoding for every
other greedy request, each greedy answer checked against the single-node reference), then phase 7's baseline
(every KV block free, nothing running, waiting or in transfer on every worker). Nothing else: no fuzzing, no
faults, no overload, so nothing but the soak can move memory.

While it runs, a sampler reads VmRSS from /proc/PID/status of every process (router, prefill-0, decode-0,
decode-1, the reference) every `--rss-every` seconds, next to the number of answers so far. After warm-up (the
first `--rss-warmup` fraction of the answers) each process's RSS is fitted by least squares against that count:
the slope, in MiB per 1,000 requests, is the leak rate. `--rss-plot` draws the samples (PNG).

`--fast-model` serves a random-weight 2-layer llama (`fast_model_dir`: hidden 256, 4 heads, 2 KV heads,
head_dim 64, SmolLM2's tokenizer and vocabulary; an untied output head, since with tied random embeddings the
residual stream makes every token predict itself and each answer is one token repeated), built from mlx-lm's
own classes and saved once as an mlx-lm model folder in the mlx-pd cache (never in the repository): about 3
requests/s through the cluster on the shared 2-core dev machine, 10,000 in an hour. Its greedy output is
garbage text, but deterministic, so the comparison with the reference still holds. With it the engine's KV
pool is `FAST_KV_GB` (1,024 blocks a worker; the default model's 0.5 GiB would be 8,192 blocks of this model,
far more than the soak's prompts fill), and the soak's prompt pools are larger (`FAST_POOLS`: 24 tenants, 24
long documents; 1,443 distinct full prompt blocks), so no worker's pool holds every prompt and, as blocks are
taken least recently freed first, each pool is cycled through many times: what grows after the warm-up is not
first touches of the pool.

The generated section goes between its own markers in `--markdown` (`BEGIN`/`END` below), apart from the full
run's tables. Every request loop is bounded: the soak sends exactly `--requests` requests, each with a 300 s
deadline; the sampler stops when the soak ends; the baseline waits at most the abandoned-transfer deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from benchmarks.host_cpu import child_pids
from benchmarks.random_models import random_model_dir

BEGIN = "<!-- BEGIN GENERATED: mlx-pd bench reliability --soak-only -->"
END = "<!-- END GENERATED: mlx-pd bench reliability --soak-only -->"
FAST_NAME = "fast-llama-2l"
FAST_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
               "num_hidden_layers": 2, "intermediate_size": 768, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "vocab_size": 49152,
               "max_position_embeddings": 8192, "tie_word_embeddings": False, "attention_bias": False,
               "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
FAST_KV_GB = 1 / 16  # 2 layers x 2 KV heads x 64 x 4 bytes x 2 = 2 KiB a token: 64 MiB = 1,024 blocks of 32
FAST_POOLS = {"num_tenants": 24, "num_long": 24}  # the soak's default is 6 and 6
PROCESSES = ("router", "prefill-0", "decode-0", "decode-1", "reference")


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the fast model ------------------------------------------------------------------------------------------

def fast_model_dir(root: Optional[Path] = None, seed: int = 0) -> Path:
    """A random-weight 2-layer llama (FAST_CONFIG, weights from `mx.random.seed(seed)`) as an mlx-lm model folder
    (config.json, model.safetensors, SmolLM2's tokenizer files), built once under `root` (default: next to the
    default model in the mlx-pd cache, `$MLX_PD_CACHE` or ~/.cache/mlx-pd/models); returns the folder."""
    return random_model_dir(FAST_NAME, FAST_CONFIG, seed, root)


# -- resident memory -----------------------------------------------------------------------------------------

def vmrss_mib(pid: int) -> Optional[float]:
    """VmRSS of `pid` from /proc/PID/status, in MiB (None: the process is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


async def sample_rss(pids: dict[str, int], progress: dict, every_s: float, stop: asyncio.Event,
                     t0: float) -> list[dict]:
    """Every `every_s` until `stop`: {"t": seconds since t0, "n": answers so far, "rss": {name: MiB}}."""
    samples = []
    while True:
        rss = {name: v for name, pid in pids.items() if (v := vmrss_mib(pid)) is not None}
        samples.append({"t": round(time.monotonic() - t0, 2), "n": progress.get("n", 0),
                        "rss": {k: round(v, 1) for k, v in rss.items()}})
        if stop.is_set():
            return samples
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


def fit_slopes(samples: list[dict], from_n: int) -> dict[str, dict]:
    """Per process, over the samples with at least `from_n` answers: the least-squares slope of RSS against the
    answer count (MiB per 1,000 requests), the RSS at the first and last of them, their min and max."""
    out = {}
    names = [n for n in PROCESSES if any(n in s["rss"] for s in samples)]
    names += sorted({n for s in samples for n in s["rss"]} - set(names))
    for name in names:
        pts = [(s["n"], s["rss"][name]) for s in samples if s["n"] >= from_n and name in s["rss"]]
        if len(pts) < 2:
            continue
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        mx_, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx_) ** 2 for x in xs)
        slope = sum((x - mx_) * (y - my) for x, y in pts) / sxx if sxx else 0.0
        first = next(s["rss"][name] for s in samples if name in s["rss"])
        out[name] = {"slope_mib_per_1000": slope * 1000, "samples": len(pts), "start_mib": first,
                     "warm_mib": ys[0], "end_mib": ys[-1], "min_mib": min(ys), "max_mib": max(ys),
                     "fitted_growth_mib": slope * (xs[-1] - xs[0])}
    return out


def plot_rss(samples: list[dict], from_n: int, slopes: dict, path: Path, title: str) -> None:
    """RSS of each process against answers so far (one panel per process, own scale), the warm-up shaded and
    the post-warm-up fit drawn; a small PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in slopes]
    fig, axes = plt.subplots(len(names), 1, figsize=(7.5, 1.45 * len(names) + 0.6), sharex=True, dpi=80)
    axes = [axes] if len(names) == 1 else list(axes)
    for ax, name in zip(axes, names):
        pts = [(s["n"], s["rss"][name]) for s in samples if name in s["rss"]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=0.9, color="tab:blue")
        sl = slopes[name]
        xs = [p[0] for p in pts if p[0] >= from_n]
        if xs:
            ys = [p[1] for p in pts if p[0] >= from_n]
            mx_, my = sum(xs) / len(xs), sum(ys) / len(ys)
            k = sl["slope_mib_per_1000"] / 1000
            ax.plot([xs[0], xs[-1]], [my + k * (xs[0] - mx_), my + k * (xs[-1] - mx_)], lw=1.2, ls="--",
                    color="tab:red")
        ax.axvspan(0, from_n, color="0.9", lw=0)
        ax.set_ylabel("MiB", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.text(0.01, 0.93, f"{name}: {sl['slope_mib_per_1000']:+.2f} MiB / 1,000 requests after warm-up",
                transform=ax.transAxes, fontsize=8, va="top")
        lo, hi = min(p[1] for p in pts), max(p[1] for p in pts)
        pad = max(4.0, (hi - lo) * 0.25)
        ax.set_ylim(lo - pad, hi + pad)
    axes[-1].set_xlabel("answers so far (shaded: warm-up, left out of the fit)", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


# -- the run -------------------------------------------------------------------------------------------------

def run_long_soak(args: argparse.Namespace, log: Callable[[str], None] = _log) -> dict:
    from benchmarks import reliability_phases as ph
    from benchmarks import reliability_soak as so
    from benchmarks.reliability import _abandoned_deadline_s, _cpus, warm_up
    from benchmarks.reliability_cluster import ENGINE, ROUTING, TRANSFER, ReliabilityCluster
    from benchmarks.reliability_inputs import soak_workload

    engine, pools, model, name = dict(ENGINE), {}, None, None
    if args.fast_model:
        model = fast_model_dir(seed=args.seed)
        engine["kv_cache_gb"], pools, name = FAST_KV_GB, dict(FAST_POOLS), FAST_NAME
        log(f"fast model: {model}")
    api_key = None if args.no_api_key else "mlxpd-" + secrets.token_urlsafe(24)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="mlx-pd-soak-"))
    result: dict = {"started": datetime.datetime.now().isoformat(timespec="seconds"),
                    "machine": f"{platform.system()} {platform.machine()}, {_cpus()} CPUs",
                    "config": {"engine": engine, "routing": ROUTING, "transfer": TRANSFER, "curve": not args.no_curve,
                               "api_key": api_key is not None, "requests": args.requests,
                               "concurrency": args.concurrency, "model": str(model) if model else "default",
                               "fast_model": FAST_CONFIG if args.fast_model else None, "pools": pools,
                               "rss_every_s": args.rss_every, "rss_warmup": args.rss_warmup, "workdir": str(workdir)},
                    "phases": {}, "notes": []}
    t_start = time.monotonic()
    log(f"starting the 1P2D cluster and the single-node reference (logs in {workdir})")
    with ReliabilityCluster(workdir, curve=not args.no_curve, api_key=api_key, log=log, engine=engine,
                            model=str(model) if model else None, served_name=name) as c:
        result["startup_s"] = time.monotonic() - t_start
        result["pids"] = c.pids()
        result["children"] = {n: child_pids(pid) for n, pid in c.pids().items()}
        items = soak_workload(args.requests, args.seed, speculative=not args.no_speculative, **pools)
        warm_up(c, items)
        rss_warm = c.rss()
        spec = "off (--no-speculative)" if args.no_speculative else so.speculative_available(c)
        if not spec.startswith("yes"):
            items = soak_workload(args.requests, args.seed, speculative=False, **pools)
        else:
            spec = f"on for {sum(i.speculative for i in items)} of the greedy requests (prompt_lookup, 4 drafts)"
        log(f"soak of {len(items)} requests at concurrency {args.concurrency}; speculative: {spec}; RSS every "
            f"{args.rss_every} s")
        progress: dict = {"n": 0}

        async def go():
            stop, t0 = asyncio.Event(), time.monotonic()
            sampler = asyncio.ensure_future(sample_rss(c.pids(), progress, args.rss_every, stop, t0))
            try:
                return await so.soak(c, items, args.concurrency, log, spec, progress=progress)
            finally:
                stop.set()
                result["rss_samples"] = await sampler

        from benchmarks.reliability import _phase

        _phase(result["phases"], "soak", lambda: asyncio.run(go()))
        log("baseline")
        _phase(result["phases"], "baseline", lambda: ph.baseline(c, rss_warm, _abandoned_deadline_s() + 30, log))
        result["final_rss"] = {n: vmrss_mib(pid) for n, pid in c.pids().items()}
        result["final_stats"] = {w["name"]: c.probe(w["name"]) for w in c.workers}
    result["duration_s"] = time.monotonic() - t_start
    samples = result.get("rss_samples", [])
    from_n = int(args.requests * args.rss_warmup)
    result["rss_fit"] = {"from_answers": from_n, "slopes": fit_slopes(samples, from_n)}
    return result


# -- verdict and report --------------------------------------------------------------------------------------

CLUSTER = ("router", "prefill-0", "decode-0", "decode-1")


def failures(result: dict, max_growth: float = 0.02) -> list[str]:
    """The soak's rules (lost, errors, mismatches, baseline: `reliability_report.failures`) plus: no cluster
    process's fitted post-warm-up growth over `max_growth` of its RSS (and over 8 MiB, an allocator's step). The
    reference is plotted and fitted but not judged: it serves each distinct greedy request once, most of them
    early, so its RSS against the cluster's answers is no per-request rate."""
    from benchmarks.reliability_report import failures as base

    out = base(result)
    for name, s in result.get("rss_fit", {}).get("slopes", {}).items():
        if name in CLUSTER and s["fitted_growth_mib"] > max(8.0, max_growth * s["warm_mib"]):
            out.append(f"RSS of {name} grew {s['fitted_growth_mib']:.0f} MiB after warm-up "
                       f"({s['slope_mib_per_1000']:+.2f} MiB per 1,000 requests)")
    if not result.get("rss_fit", {}).get("slopes"):
        out.append("no RSS samples after warm-up")
    return out


def render_markdown(result: dict, plot: Optional[str] = None) -> str:
    from benchmarks.reliability_report import OUTCOMES, _get, _table

    p = result.get("phases", {})
    s, b = p.get("soak", {}), p.get("baseline", {})
    fails = failures(result)
    cfg = result.get("config", {})
    model = (f"random-weight 2-layer llama `{FAST_NAME}` (hidden {FAST_CONFIG['hidden_size']}, "
             f"{FAST_CONFIG['num_attention_heads']} heads, {FAST_CONFIG['num_key_value_heads']} KV heads, vocab "
             f"{FAST_CONFIG['vocab_size']}), KV pool {cfg['engine']['kv_cache_gb']:g} GiB a worker"
             if cfg.get("fast_model") else "the default model")
    out = [f"Run: `{result.get('command', 'mlx-pd bench reliability --soak-only')}` on {result.get('machine', '?')}, "
           f"{result.get('started', '?')}, {result.get('duration_s', 0) / 60:.1f} min in all (soak "
           f"{s.get('duration_s', 0) / 60:.1f} min). Model: {model}. Verdict: "
           f"**{'every rule held' if not fails else 'FAILED: ' + '; '.join(fails)}**.", ""]
    if s and not s.get("harness_error"):
        heads = [o for o in (*OUTCOMES, "mismatch", "mismatch_batch_only")
                 if any(o in v for v in s.get("by_kind", {}).values()) or o in ("completed", "error", "lost")]
        lat = s.get("latency_s", {})
        rows = [[k, sum(v.values())] + [v.get(o, 0) for o in heads]
                + [f"{lat[k]['p50']:.2f}" if lat.get(k) else "-", f"{lat[k]['p95']:.2f}" if lat.get(k) else "-"]
                for k, v in s.get("by_kind", {}).items()]
        t = s.get("totals", {})
        rows.append(["all", s.get("sent", 0)] + [t.get(o, 0) for o in heads] + ["", ""])
        rate = s.get("sent", 0) / s["duration_s"] if s.get("duration_s") else 0
        out += [f"Soak: {s.get('sent', 0)} requests at concurrency {s.get('concurrency')}, "
                f"{s.get('duration_s', 0):.0f} s ({rate:.1f} requests/s); greedy compared with the reference {s.get('compared', 0)}, equal "
                f"{s.get('equal', 0)}; speculative: {s.get('speculative', '-')}"
                + (f" ({_get(s, 'draft_tokens', 'accepted')} of {_get(s, 'draft_tokens', 'drafted')} draft tokens "
                   "accepted)" if _get(s, "draft_tokens", "drafted") else "") + ".", "",
                _table(["kind", "sent"] + heads + ["p50 s", "p95 s"], rows), ""]
    fit = result.get("rss_fit", {})
    samples = result.get("rss_samples", [])
    if fit.get("slopes"):
        rows = [[n, f"{v['start_mib']:.0f}", f"{v['warm_mib']:.0f}", f"{v['end_mib']:.0f}",
                 f"{v['min_mib']:.0f}-{v['max_mib']:.0f}", f"{v['slope_mib_per_1000']:+.3f}",
                 f"{v['fitted_growth_mib']:+.1f}"] for n, v in fit["slopes"].items()]
        every = result.get("config", {}).get("rss_every_s")
        out += [f"Resident memory (VmRSS from /proc/PID/status, {len(samples)} samples, every {every:g} s; fit: least "
                f"squares against answers so far, over the {fit['slopes'][next(iter(fit['slopes']))]['samples']} "
                f"samples from answer {fit['from_answers']} on):", "",
                _table(["process", "start MiB", "after warm-up MiB", "end MiB", "range after warm-up MiB",
                        "slope MiB / 1,000 requests", "fitted growth MiB"], rows), ""]
    if plot:
        out += [f"![RSS of every process during the soak]({plot})", ""]
    if b and not b.get("harness_error"):
        rows = [[n, f"{st.get('kv_blocks_free', '?')}/{st.get('kv_blocks_total', '?')}", st.get("num_running", "?"),
                 st.get("num_waiting", "?"), st.get("transfers_inflight", "-"), st.get("awaiting_kv", "-"),
                 st.get("num_preemptions", "-"), _int(st.get("transfer_timeouts", "-")),
                 _int(_get(result, "final_stats", n, "tokens_out", default="-")),
                 _hits(_get(result, "final_stats", n, default={}))]
                for n, st in b.get("workers", {}).items()]
        out += ["At the end (each worker's stats from a Ping on its control socket):", "",
                _table(["worker", "KV free/total", "running", "waiting", "transfers", "awaiting KV", "preemptions",
                        "transfer timeouts", "tokens out", "prefix-cache hit tokens"], rows), ""]
    for key in ("error", "lost", "mismatch", "mismatch_batch_only"):
        ex = s.get("examples", {}).get(key)
        if ex:
            out += [f"Examples ({key}):", ""] + [f"- `{e}`" for e in ex] + [""]
    return "\n".join(out).rstrip() + "\n"


def _int(v):
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _hits(st) -> str:
    q, h = (st or {}).get("prefix_cache_queries"), (st or {}).get("prefix_cache_hits")
    return f"{h}/{q}" if q else "-"


def main(args: argparse.Namespace, argv: list[str]) -> int:
    """`mlx-pd bench reliability --soak-only ...` (argument checks are the caller's)."""
    import shlex

    try:
        result = run_long_soak(args)
    except (RuntimeError, ValueError) as exc:
        print(f"mlx-pd bench reliability: error: {exc}", file=sys.stderr)
        return 2
    result["command"] = "mlx-pd bench reliability " + shlex.join(argv)
    result["failures"] = failures(result)
    plot = None
    if args.rss_plot and result.get("rss_fit", {}).get("slopes"):
        path = Path(args.rss_plot)
        title = (f"{result['phases'].get('soak', {}).get('sent', 0)} soak requests, 1P2D cluster of processes"
                 + (f", {FAST_NAME}" if args.fast_model else ""))
        plot_rss(result["rss_samples"], result["rss_fit"]["from_answers"], result["rss_fit"]["slopes"], path, title)
        plot = os.path.relpath(path.resolve(), Path(args.markdown).resolve().parent) if args.markdown else str(path)
        _log(f"RSS plot: {path} ({path.stat().st_size // 1024} KiB)")
    from benchmarks.reliability_report import write_outputs

    return write_outputs(result, render_markdown(result, plot), args.out, args.markdown, BEGIN, END)
