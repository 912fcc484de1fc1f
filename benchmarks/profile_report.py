"""Tables of an analyzed profile (benchmarks/profile.py): terminal text and Markdown.

Times in seconds for prefill, milliseconds per decode step; MFU and MBU in percent of the peak that
`peak.source` names; GB = 10^9 bytes.
"""

from __future__ import annotations

import math
from typing import Optional, TextIO

from benchmarks.report import _print_table, markdown_table


def _n(x, digits: int = 2, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{100 * x:.{digits}f}%" if pct else f"{x:,.{digits}f}"


PREFILL_HEADER = ["prompt tokens", "TTFT s", "prefill s", "tokens/s", "MFU", "fit s", "measured - fit", "cached"]
DECODE_HEADER = ["batch", "tokens/s", "step ms p50", "KV tokens read/step", "MB read/step", "MBU",
                 "bandwidth roofline tok/s"]


def prefill_rows(p: dict) -> list[list[str]]:
    rows = []
    for pt in p["prefill"]:
        res = pt["prefill_s"] - pt["predicted_s"]
        rows.append([f"{pt['tokens']:,}" + (" (held out)" if pt["held_out"] else ""), _n(pt["ttft_s"], 3),
                     _n(pt["prefill_s"], 3), _n(pt["tokens_per_s"], 1), _n(pt["mfu"], 2, pct=True),
                     _n(pt["predicted_s"], 3), f"{100 * res / pt['prefill_s']:+.1f}%", str(pt["cached_tokens_max"])])
    return rows


def decode_rows(p: dict) -> list[list[str]]:
    return [[str(d["batch"]), _n(d["tokens_per_s"], 1), _n(1000 * d["step_s_p50"], 1) if "step_s_p50" in d else "-",
             _n(d["context_tokens_mean"], 0), _n(d["bytes_per_step"] / 1e6, 1), _n(d["mbu"], 2, pct=True),
             _n(d["roofline_tokens_per_s"], 0)] for d in p["decode"]]


def fit_lines(p: dict) -> list[str]:
    f = p["fit"]
    lines = [f"fit: prefill_s = a*T + b*T^2 with a = {f['a']:.4e} s/token, b = {f['b']:.4e} s/token^2 "
             f"(over {len(f['tokens'])} lengths, medians of {p['config']['repeats']}); R^2 = {f['r2']:.4f}, "
             f"RMS residual {f['rms_residual_s']:.3f} s, largest |residual| {100 * f['max_rel_residual']:.1f}%"]
    for h in p.get("held_out", []):
        lines.append(f"held out: {h['tokens']:,} tokens measured {h['measured_s']:.3f} s, predicted "
                     f"{h['predicted_s']:.3f} s, error {100 * h['rel_error']:+.1f}%")
    return lines


def summary_lines(p: dict) -> list[str]:
    m, pk = p["model"], p["peak"]
    bits = f"{m['kv_bits']}-bit (group {m['kv_group_size']})" if m["kv_bits"] else m["dtype"]
    kv = (f"KV: {m['kv_bytes_per_token']:,.0f} bytes/token = {m['layers']} layers x 2 x {m['kv_heads']} KV heads x "
          f"{m['head_dim']} x {bits}")
    pool = p["kv_pool"]
    cap = ", ".join(f"{c['sequences']} at {c['context']:,}" for c in p.get("capacity", []))
    where = "assumed" if pool.get("assumed") else f"{pool['worker']}'s" if pool.get("worker") else "this engine's"
    lines = [f"model: {m['name']} ({m['dtype']}), {m['params_total'] / 1e6:.1f} M parameters "
             f"({m['params_matmul'] / 1e6:.1f} M in matmuls), {m['param_bytes'] / 1e6:.0f} MB of weights",
             f"peak: {pk['flops'] / 1e12:.3g} TFLOP/s, {pk['bandwidth_bytes_per_s'] / 1e9:.3g} GB/s ({pk['source']})",
             kv, f"capacity ({where} KV pool, {pool['usable_blocks']:,} blocks of {pool['block_size']} = "
                 f"{pool['usable_blocks'] * pool['block_size']:,} tokens): sequences per context length: {cap}"]
    return lines + rank_lines(p.get("workers") or [])


def rank_lines(workers: list[dict]) -> list[str]:
    """One line per rank of each worker group the server reported (`profile_http.served_workers`): where it
    runs, whether its leader hears it, and its weights, KV pool and MLX peak (MiB)."""
    lines = []
    for w in workers:
        ranks = w.get("ranks") or []
        if not ranks:
            continue
        lines.append(f"{w['name']} ({w['role']}): a {w.get('parallel') or 'tensor'}-parallel group of {len(ranks)} "
                     "ranks, each holding its share of the weights and of the KV")
        for r in ranks:
            mib = {k: r.get(k, 0) / 2**20 for k in ("parameter_bytes", "kv_bytes", "peak_bytes")}
            lines.append(f"  rank {r['rank']} @ {r['host']}{'' if r.get('alive') else ' (not heard)'}: weights "
                         f"{mib['parameter_bytes']:,.1f} MiB, KV {mib['kv_bytes']:,.1f} MiB, peak "
                         f"{mib['peak_bytes']:,.1f} MiB")
    return lines


def print_profile(p: dict, out: Optional[TextIO] = None) -> None:
    """Print an analyzed profile: model and peak, the prefill table and fit, the decode table, capacity."""
    import sys

    out = out or sys.stdout
    head = f"mlx-pd profile ({p['mode']}{': ' + p['url'] if p.get('url') else ''})"
    print(head, file=out)
    for line in summary_lines(p)[:2]:
        print(line, file=out)
    _print_table("prefill (unique prompts; MFU = 2 x matmul params x tokens/s / peak FLOP/s)", PREFILL_HEADER,
                 prefill_rows(p), out)
    for line in fit_lines(p):
        print(line, file=out)
    _print_table("decode (MBU = (weight bytes + KV bytes read) per step x steps/s / peak bandwidth)",
                 DECODE_HEADER, decode_rows(p), out)
    for line in summary_lines(p)[2:]:
        print(line, file=out)


def markdown_profile(p: dict) -> str:
    """The profile as Markdown: summary bullets, the prefill table, the fit, the decode table."""
    parts = ["\n".join(f"- {line}" for line in summary_lines(p)), markdown_table(PREFILL_HEADER, prefill_rows(p)),
             "\n".join(f"- {line}" for line in fit_lines(p)), markdown_table(DECODE_HEADER, decode_rows(p))]
    return "\n\n".join(parts) + "\n"
