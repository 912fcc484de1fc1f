"""Rewrite the generated blocks of docs/BENCHMARKS.md from result JSON files (`scripts/benchmarks` calls this).

A generated block sits between two HTML comments, and only its inside is ever rewritten:

    <!-- BEGIN GENERATED: profile (scripts/benchmarks) -->
    ...
    <!-- END GENERATED: profile -->

    python -m benchmarks.doc_blocks docs/BENCHMARKS.md --profile profile.json --compare compare.json

Everything outside the markers (hand-written sections, numbers from other runs) stays byte for byte.
A missing block is an error naming it, never an append in some guessed place.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Sequence

BEGIN = "<!-- BEGIN GENERATED: {name}"
END = "<!-- END GENERATED: {name} -->"


def replace_block(text: str, name: str, body: str) -> str:
    """`text` with the inside of block `name` replaced by `body`. Raises ValueError when the block's markers
    are missing, repeated or out of order."""
    begin = re.compile(re.escape(BEGIN.format(name=name)) + r"[^\n]*-->\n")
    end = END.format(name=name)
    starts = list(begin.finditer(text))
    if len(starts) != 1 or text.count(end) != 1:
        raise ValueError(f"block {name!r}: expected one '{BEGIN.format(name=name)} ... -->' line and one "
                         f"'{end}' in the document, found {len(starts)} and {text.count(end)}")
    start, stop = starts[0].end(), text.index(end)
    if stop < start:
        raise ValueError(f"block {name!r}: the END marker comes before the BEGIN marker")
    return text[:start] + body.rstrip("\n") + "\n" + text[stop:]


def _machine_line(result: dict) -> str:
    m = result.get("machine", {})
    load = m.get("loadavg_start")
    load_text = f"; 1-minute load average {load[0]:.1f} at the start" if load else ""
    return (f"Machine: {m.get('platform', '?')}, {m.get('cpus', '?')} CPUs; MLX {m.get('mlx', '?')}, "
            f"mlx-lm {m.get('mlx_lm', '?')}, Python {m.get('python', '?')}"
            f"{', OpenBLAS preloaded' if m.get('ld_preload') else ''}{load_text}.")


def profile_block(profile: dict, image: str) -> str:
    """Markdown of an analyzed profile: command, machine, summary, tables, fit, the plot."""
    from benchmarks.profile_report import markdown_profile

    return "\n\n".join([f"Command: `{profile.get('command', 'mlx-pd profile')}`", _machine_line(profile),
                        markdown_profile(profile).rstrip("\n"), f"![prefill curve with its fit, decode tokens/s]({image})"])


def compare_block(result: dict, images: Sequence[str]) -> str:
    """Markdown of a comparison: command, machine, the runs table (with ratios), memory, the plots."""
    from benchmarks.report import markdown_compare

    slo = result.get("slo_s") or {}
    slo_text = (" Goodput SLOs: " + ", ".join(f"{k[:-2].upper()} <= {1000 * v:g} ms" for k, v in slo.items()) + "."
                if slo else "")
    parts = [f"Command: `{result.get('command', 'mlx-pd bench --compare')}`",
             _machine_line(result) + f" Workload `{result.get('workload', 'chat')}`, {result['max_tokens']} output "
             f"tokens per request, latencies in ms.{slo_text}",
             markdown_compare(result).rstrip("\n")]
    parts += [f"![{Path(i).stem}]({i})" for i in images]
    return "\n\n".join(parts)


def chips_block() -> str:
    """The Apple chip table of benchmarks/chips.py as Markdown (refreshed on every run)."""
    from benchmarks.chips import table_rows
    from benchmarks.report import markdown_table

    rows = [[r["chip"], str(r["gpu_cores"]), f"{r['bandwidth_gbs']:g}", f"~{r['fp32_tflops']:.1f}"] for r in table_rows()]
    return markdown_table(["chip", "GPU cores", "memory bandwidth GB/s (Apple)", "GPU FP32 TFLOPS (approx.)"], rows)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.doc_blocks", description=__doc__.split("\n\n")[0])
    p.add_argument("doc", help="the Markdown file to update, e.g. docs/BENCHMARKS.md")
    p.add_argument("--profile", help="an `mlx-pd profile --json` file: fills block 'profile'")
    p.add_argument("--profile-image", default="img/profile.png", help="path of its plot, relative to the doc")
    p.add_argument("--compare", help="an `mlx-pd bench --compare --out` file: fills block 'compare'")
    p.add_argument("--compare-images", default="img/compare-latency-cdf.png,img/compare-throughput.png",
                   help="comma-separated plot paths for the compare block, relative to the doc")
    args = p.parse_args(list(argv))
    doc = Path(args.doc)
    text = doc.read_text(encoding="utf-8")
    try:
        if BEGIN.format(name="chips") in text:
            text = replace_block(text, "chips", chips_block())
        if args.profile:
            text = replace_block(text, "profile", profile_block(json.loads(Path(args.profile).read_text()),
                                                                args.profile_image))
        if args.compare:
            images = [i for i in args.compare_images.split(",") if i and (doc.parent / i).exists()]
            text = replace_block(text, "compare", compare_block(json.loads(Path(args.compare).read_text()), images))
    except ValueError as exc:
        print(f"doc_blocks: error: {exc}", file=sys.stderr)
        return 2
    doc.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
