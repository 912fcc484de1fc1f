"""The fault table on the lab: `python -m benchmarks.lab.faults [--rows a,b] [--out F.json] [--markdown F.md]`
(or `scripts/lab faults ...`).

One lab (benchmarks/lab: a studio that prefills and serves the router, two minis that decode, a client host;
1 Gbit/s links; the fast random-weight model; `[ray] max_restarts = 2`) with a short liveness deadline: a ping
every 0.5 s, a worker silent for 3 s is dead (ZeroMQ's heartbeat timeout on the router's sockets is the same
3 s). The faults, each against what must happen (`MUST`; the rows are benchmarks/lab/fault_rows.py), run in
the order a, b, c, f, e, d, g:

  a  a mini's cable out for 1.5 s while streams decode on it
  b  every mini's cable out while streams decode and new requests arrive; then one mini's cable out past the
     deadline while streams decode on it
  c  that cable plugged back, then new requests
  f  the prefill worker's process killed (SIGKILL) while long prompts are being prefilled, before their first
     token (Ray restarts it)
  e  the router's process killed (SIGKILL; Ray restarts the actor)
  d  a mini's Ray node killed (its `ray start --block` process group, SIGKILL, as the lab recorded it): that
     mini stays down
  g  the router's process killed again, while d's mini is gone (`--rows g` runs d too)

Before each row (but c, which follows b's cut) every cable is plugged back and every worker must be alive in the
router's view (but d's). Requests come from the client host (benchmarks/lab/fault_client.py): greedy
completions with `ignore_eos`, so a complete answer has exactly `max_tokens` tokens. A last row checks every
error any client saw: a 503 with Retry-After before the answer started, else an SSE error event; never a 500,
never a dropped connection or a hang. Exit code 0 when every row held, 1 when one did not, 2 for bad arguments
or a lab that did not come up. Linux, root, iproute2 (as the lab).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.lab.fault_client import Client, Watch, wait_until
from benchmarks.lab.fault_rows import BLIP_S, DEAD_AFTER_S, HEARTBEAT_S, ROW_ORDER, ROWS, Row, Run, settle
from benchmarks.lab.lab import Lab, check_platform
from benchmarks.lab.net import LabError

FAULT = {"a": f"a mini's cable out for {BLIP_S:g} s (under the {DEAD_AFTER_S:g} s deadline) while streams decode on it",
         "b": "every mini's cable out while streams decode and new requests come; then one mini's cable out "
              "past the deadline while streams decode on it",
         "c": "that mini's cable plugged back (the partition heals), then new requests",
         "d": "a mini's Ray node killed (its `ray start --block` process group, SIGKILL) while streams decode on it",
         "e": "the router's process killed (SIGKILL; Ray restarts the actor: max_restarts = 2)",
         "g": "the router's process killed again, while row d's mini is gone",
         "f": "the prefill worker's process killed (SIGKILL) while long prompts are prefilled, before their first "
              "token",
         "errors": "every error a client saw in these rows"}
MUST = {"a": "the streams continue and complete; nothing fails; the worker stays alive in the router's view",
        "b": "all minis out: a clear error, no hang (503 + Retry-After before the answer started, else an SSE "
             "error event); one mini out: the router marks it dead and its streams complete on the other mini",
        "c": "the worker is alive again in the router's view and new requests run on it",
        "d": "its streams move to the other mini and complete; `mlx-pd status` shows its worker not alive",
        "e": "the router comes back, every worker is alive in its view, requests succeed (time to recover)",
        "g": "the router comes back and serves with the workers left: requests succeed",
        "f": "the request is re-run (prefilled by its decode worker): complete, no error, a longer TTFT",
        "errors": "503 with Retry-After before the answer started, else an SSE error event; never a 500, a "
                  "dropped connection or a hang"}


def errors_row(records: list[dict]) -> dict:
    """The last row: every error any client saw (see the module docstring)."""
    row = Row("errors")
    bad = [r for r in records if r["exception"] or (r["status"] not in (200, 503)) or
           (r["status"] == 503 and not r["retry_after"]) or any(e["code"] == "engine_error" for e in r["errors"])]
    n503 = sum(r["status"] == 503 for r in records)
    sse = sum(bool(r["errors"]) for r in records if r["status"] == 200)
    row.check("only 503 + Retry-After or SSE error events", not bad, json.dumps(bad[:3]))
    row.happened.append(f"{len(records)} requests: {n503} got 503 with Retry-After, {sse} streams ended with an "
                        f"SSE error event, {len(bad)} anything else" + "".join(
                            f"; {r['tag']}: {r['exception'] or r['status']}" for r in bad[:3]))
    return {**row.result(), "fault": FAULT["errors"], "must": MUST["errors"]}


def run_faults(rows: str, root: Path, prefix: str, model: str, tokens: int, command: str, echo=print) -> dict:
    """Bring the lab up, run `rows` (letters of ROW_ORDER) in ROW_ORDER, tear it down; the result dict
    (`command`: how it was run, for the table's heading). LabError when the lab does not come up."""
    t0 = time.monotonic()
    lab = Lab(root, prefix=prefix, minis=2, rate="1gbit", model=model, max_restarts=2,
              routing={"heartbeat_s": HEARTBEAT_S, "dead_after_s": DEAD_AFTER_S}, echo=echo)
    results, records = [], []
    with lab:
        lab.up(timeout_s=600)
        up_s = time.monotonic() - t0
        client = Client(lab.state.host("client").ns, lab.endpoint.removesuffix("/v1"), lab.api_key,
                        lab.state.served_name)
        watch = Watch(client).start()
        run = Run(lab, client, watch, tokens)
        try:
            wait_until(lambda: len(watch.alive) == 1 + len(lab.minis), 30.0)
            for key in (k for k in ROW_ORDER if k in rows):
                echo(f"faults: row {key}: {FAULT[key]}")
                row, t = Row(key), time.monotonic()
                try:
                    if not (key == "c" and run.cut):
                        settle(run)
                    ROWS[key](run, row)
                except Exception as exc:  # noqa: BLE001 - the row fails, saying why; the others still run
                    row.check("ran to its end", False, "".join(traceback.format_exception_only(exc)).strip())
                    row.happened.append(f"stopped: {type(exc).__name__}: {exc}")
                results.append({**row.result(), "fault": FAULT[key], "must": MUST[key],
                                "wall_s": round(time.monotonic() - t, 1)})
                echo(f"faults: row {key}: {results[-1]['verdict']} ({results[-1]['happened']})")
        finally:
            watch.stop()
            client.close()
            records = client.records
    results.sort(key=lambda r: r["row"])
    results.append(errors_row(records))
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
            "command": command, "lab_up_s": round(up_s, 1),
            "wall_s": round(time.monotonic() - t0, 1), "settings": {"heartbeat_s": HEARTBEAT_S,
            "dead_after_s": DEAD_AFTER_S, "rate": "1gbit", "model": model, "stream_tokens": tokens},
            "rows": results, "watch_changes": watch.changes, "requests": records}


def machine() -> str:
    """This machine, in words, for the table's heading."""
    return (f"{os.cpu_count()}-core Linux {platform.machine()} ({platform.release()}), network namespaces, "
            "1 Gbit/s tbf links")


def render_markdown(result: dict) -> str:
    """The table (fault | what must happen | what happened | verdict) with the run's line above it."""
    cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = [f"Run: `{result['command']}` on {result['machine']}, {result['date']}, {result['wall_s'] / 60:.1f} min "
             f"(the lab up in {result['lab_up_s']:.0f} s).", "",
             "| row | fault | what must happen | what happened | verdict |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['row']} | {cell(r['fault'])} | {cell(r['must'])} | {cell(r['happened'])} | **{r['verdict']}** |"
              for r in result["rows"]]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="faults", description="the fault table on a lab of namespaces")
    parser.add_argument("--rows", default=ROW_ORDER,
                        help=f"which rows, e.g. a,b (default all: {','.join(sorted(ROW_ORDER))})")
    parser.add_argument("--out", type=Path, help="write the whole result as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the table as Markdown here")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mlxpd-faults"), help="the lab's folder")
    parser.add_argument("--prefix", default="mlxpd-flt-", help="the lab's namespace prefix")
    parser.add_argument("--model", default="fast", help='"fast" (default), "default" or a model source')
    parser.add_argument("--tokens", type=int, default=1500, help="tokens of each stream a fault cuts (default 1500)")
    return parser


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m benchmarks.lab.faults") -> int:
    """Entry point: run the rows, print the table, write --out / --markdown; 0 all held, 1 not, 2 error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    rows = set(args.rows.replace(",", "")) | ({"d"} if "g" in args.rows else set())  # g follows d
    if not rows or rows - set(ROW_ORDER) or args.tokens < 16:
        print(f"faults: error: --rows takes letters of {ROW_ORDER} and --tokens at least 16", file=sys.stderr)
        return 2
    try:
        check_platform()
        result = run_faults("".join(rows), args.dir, args.prefix, args.model, args.tokens, " ".join([prog, *argv]),
                            echo=lambda line: print(line, file=sys.stderr, flush=True))
    except (LabError, ValueError) as exc:
        print(f"faults: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("faults: interrupted (the lab is torn down)", file=sys.stderr)
        return 130
    text = render_markdown(result)
    print(text)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    if args.markdown:
        args.markdown.write_text(text)
    return 0 if all(r["verdict"] == "pass" for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
