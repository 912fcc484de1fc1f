"""PNG plots of profiles and benchmark runs (matplotlib, Agg backend; small files for docs/img/).

- :func:`plot_profiles`: prefill time vs prompt length (every sample, the medians,
  the fitted a*T + b*T^2 curve, held-out points marked) beside decode tokens/s vs batch size; several
  profiles (endpoints or configurations) side by side on the same axes.
- :func:`plot_latency_cdfs`: empirical CDFs of TTFT, TPOT and E2E latency, one line per run (endpoint,
  configuration or concurrency level), so two endpoints sit side by side on the same axes.
- :func:`plot_throughput`: output tokens/s vs concurrency, one line per endpoint.

Every figure is about 640 px wide at 80 dpi and PNG-compressed: 20-60 KB.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

DPI = 80
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 8, "axes.titlesize": 9, "legend.fontsize": 7, "axes.grid": True,
                         "grid.alpha": 0.3})
    return plt


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, metadata={"Software": None})  # no version stamp: stable bytes across runs
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def ecdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """(sorted values, cumulative fraction i/n for i = 1..n): the empirical CDF's steps."""
    xs = sorted(float(v) for v in values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def plot_profiles(profiles: Mapping[str, dict], path) -> Path:
    """Prefill curve with its fit (left) and decode tokens/s per batch (right) of one or more analyzed profiles
    (endpoints, machines or configurations) on the same axes, one color per label (label "": a single one)."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8.0, 3.2))
    for k, (label, profile) in enumerate(profiles.items()):
        color, tag = COLORS[k % len(COLORS)], f"{label}: " if label else ""
        samples = profile["prefill_samples"]
        ax1.scatter([s["tokens"] for s in samples], [s["prefill_s"] for s in samples], s=8, color=color, alpha=0.35,
                    label=None if label else "each prompt", zorder=2)
        pts = profile["prefill"]
        fitted = [p for p in pts if not p["held_out"]]
        held = [p for p in pts if p["held_out"]]
        ax1.plot([p["tokens"] for p in fitted], [p["prefill_s"] for p in fitted], "o", color=color,
                 label=f"{tag}median (fitted)", zorder=3)
        if held:
            ax1.plot([p["tokens"] for p in held], [p["prefill_s"] for p in held], "s", color=color, mfc="none",
                     label=f"{tag}held out", zorder=3)
        f = profile["fit"]
        top = max(p["tokens"] for p in pts)
        xs = [top * i / 100 for i in range(101)]
        ax1.plot(xs, [f["a"] * x + f["b"] * x * x for x in xs], "-", color=color, lw=1,
                 label=f"{tag}fit a·T + b·T², R² = {f['r2']:.3f}")
        dec = profile["decode"]
        if dec:
            b = [d["batch"] for d in dec]
            ax2.plot(b, [d["tokens_per_s"] for d in dec], "o-", color=color, label=label or "measured")
            for d in dec:
                ax2.annotate(f"MBU {100 * d['mbu']:.1f}%", (d["batch"], d["tokens_per_s"]), fontsize=7,
                             textcoords="offset points", xytext=(3, -10))
    batches = sorted({d["batch"] for p in profiles.values() for d in p["decode"]})
    if batches:
        ax2.set_xticks(batches)
    ax1.set(xlabel="prompt tokens T", ylabel="prefill seconds", title="prefill time vs prompt length")
    ax1.legend(loc="upper left")
    ax2.set(xlabel="decode batch size", ylabel="output tokens/s", title="decode throughput")
    ax2.legend(loc="upper left")
    return _save(fig, path)


METRIC_LABELS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E latency"))


def plot_latency_cdfs(runs: Mapping[str, Sequence[dict]], path, title: str = "") -> Path:
    """CDFs of TTFT, TPOT and E2E (ms) per run; `runs` maps a label to its request records (dicts with
    ttft_s, tpot_s, e2e_s and error, as the result JSON holds them)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(8.0, 2.9))
    for k, (label, records) in enumerate(runs.items()):
        ok = [r for r in records if not r.get("error")]
        for ax, (metric, _) in zip(axes, METRIC_LABELS):
            vals = [1000 * r[metric] for r in ok if r.get(metric) is not None]
            if vals:
                xs, ys = ecdf(vals)
                ax.step(xs, ys, where="post", color=COLORS[k % len(COLORS)], lw=1.2, label=label)
    for ax, (_, name) in zip(axes, METRIC_LABELS):
        ax.set(xlabel=f"{name} (ms)", ylim=(0, 1.02), title=name)
        for q in (0.5, 0.9, 0.99):
            ax.axhline(q, color="0.8", lw=0.6, zorder=0)
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend(loc="lower right")
    if title:
        fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def plot_throughput(series: Mapping[str, Sequence[tuple[float, float]]], path, title: str = "",
                    xlabel: str = "concurrency (requests in flight)") -> Path:
    """Output tokens/s vs concurrency; `series` maps a label to [(concurrency, tokens/s), ...]."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.0, 3.2))
    for k, (label, pts) in enumerate(series.items()):
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=COLORS[k % len(COLORS)], label=label)
    ax.set_xticks(sorted({p[0] for pts in series.values() for p in pts}))
    ax.set(xlabel=xlabel, ylabel="output tokens/s", title=title or "throughput vs concurrency")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left")
    return _save(fig, path)
