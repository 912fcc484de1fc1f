"""`scripts/lab` (`python -m benchmarks.lab`): up, down, exec, link, status of a lab of Macs in namespaces.

    sudo ./scripts/lab up [--minis 2] [--rate 10gbit] [--model fast|default|SOURCE] [--detach]
    sudo ./scripts/lab exec client -- sh -c 'curl -s $OPENAI_BASE_URL/models -H "Authorization: Bearer $MLX_PD_API_KEY"'
    sudo ./scripts/lab link mini-1 down        # pull mini-1's cable; `up` plugs it back
    sudo ./scripts/lab status
    sudo ./scripts/lab down
    sudo ./scripts/lab faults [--rows a,b] [--out F.json] [--markdown F.md]   # the fault table, on a lab of its own

`up` stays in the foreground and tears the lab down on Ctrl-C (or SIGTERM); with --detach it returns and
`down` tears it down later. Exit codes: 0 done, 1 the lab failed (one line says why), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.lab.lab import DEFAULT_PREFIX, DEFAULT_ROOT, Lab, check_platform
from benchmarks.lab.net import LabError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lab", description="A lab of Macs (a studio, minis, a client) as network "
                                     "namespaces of this Linux machine, with mlx-pd on Ray across them")
    parser.add_argument("--dir", type=Path, default=DEFAULT_ROOT, help=f"the lab's folder (default {DEFAULT_ROOT})")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="create the hosts, start Ray on them and `mlx-pd up` the lab topology")
    up.add_argument("--minis", type=int, default=2, help="decode hosts beside the studio (default 2)")
    up.add_argument("--rate", default="10gbit", help="each host's link, in tc's units (default 10gbit; e.g. 1gbit)")
    up.add_argument("--model", default="fast", help='"fast" (a random-weight 2-layer model, the default), '
                    '"default" (SmolLM2-135M), or a model folder / .gguf / repo id')
    up.add_argument("--heartbeat", type=float, default=None, help="the router's ping interval, s (default 1)")
    up.add_argument("--dead-after", type=float, default=None,
                    help="a worker silent this long is dead and its streams migrate, s (default 60)")
    up.add_argument("--kv-bits", type=int, choices=[4, 8], default=None,
                    help="KV blocks stored and shipped 4- or 8-bit (default: the model's dtype, float32)")
    up.add_argument("--prefix", default=DEFAULT_PREFIX, help=f"namespace name prefix (default {DEFAULT_PREFIX})")
    up.add_argument("--timeout", type=float, default=600.0, help="seconds `mlx-pd up` may take (default 600)")
    up.add_argument("--detach", action="store_true", help="return once up; `lab down` tears it down")
    sub.add_parser("down", help="stop Ray on every host and delete the lab's namespaces")
    ex = sub.add_parser("exec", help="run a command in a host (`lab exec HOST -- CMD ...`)")
    ex.add_argument("host", help="studio, mini-N or client")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    link = sub.add_parser("link", help="pull a host's cable (down) or plug it back (up)")
    link.add_argument("host")
    link.add_argument("state", choices=["down", "up"])
    sub.add_parser("status", help="the hosts, their links and Ray, then `mlx-pd status` of the lab")
    sub.add_parser("faults", add_help=False, help="run the fault table on a lab of its own (benchmarks/lab/faults.py; "
                   "its options follow: `lab faults --help`)")
    return parser


def cmd_up(args: argparse.Namespace) -> int:
    routing = {k: v for k, v in (("heartbeat_s", args.heartbeat), ("dead_after_s", args.dead_after)) if v is not None}
    engine = {"kv_bits": args.kv_bits} if args.kv_bits else {}
    lab = Lab(args.dir, prefix=args.prefix, minis=args.minis, rate=args.rate, model=args.model, routing=routing,
              engine=engine)
    signal.signal(signal.SIGTERM, _interrupt)  # a `kill` tears the lab down as Ctrl-C does
    lab.up(timeout_s=args.timeout)
    print(_summary(lab))
    if args.detach:
        return 0
    print(f"lab: up; Ctrl-C tears it down (or run `{_me()} down` from another shell)", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    print("lab: tearing down ...", file=sys.stderr, flush=True)
    problems = Lab.load(args.dir).down()
    for line in problems:
        print(f"lab: {line}", file=sys.stderr)
    return 1 if problems else 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _summary(lab: Lab) -> str:
    roles = {"studio": "prefill-0, router", "client": "clients"}
    roles.update({m.name: f"decode-{i}" for i, m in enumerate(lab.minis)})
    lines = [f"  {h.name:<8} {h.ip:<12} {h.ns:<22} {roles[h.name]}" for h in lab.state.hosts]
    return "\n".join([f"lab: hosts (links {lab.state.rate_bps / 1e9:g} Gbit/s):", *lines,
                      f"  OpenAI API: {lab.endpoint}  (from any host; key in {lab.root / 'api_key'})",
                      f"  topology:   {lab.state.topology}",
                      f"  try: {_me()} exec client -- sh -c 'curl -s $OPENAI_BASE_URL/models "
                      "-H \"Authorization: Bearer $MLX_PD_API_KEY\"'"])


def cmd_down(args: argparse.Namespace) -> int:
    problems = Lab.load(args.dir).down()
    for line in problems:
        print(f"lab: {line}", file=sys.stderr)
    print("lab: down" if not problems else "lab: some of it is still up (see above)", file=sys.stderr)
    return 1 if problems else 0


def cmd_exec(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise ValueError("exec needs a command: lab exec HOST -- CMD ...")
    lab = Lab.load(args.dir)
    lab.require_up()
    lab.state.host(args.host)
    return lab.run(args.host, cmd, timeout_s=None).returncode


def cmd_link(args: argparse.Namespace) -> int:
    lab = Lab.load(args.dir)
    lab.require_up()
    lab.link(args.host, args.state == "up")
    print(f"lab: {args.host}'s link is {args.state}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    lab = Lab.load(args.dir)
    lab.require_up()
    rows = lab.status()
    cols = ("host", "ns", "ip", "link", "rate", "resource", "ray")
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    for line in [dict(zip(cols, (c.upper() for c in cols))), *rows]:
        print("  ".join(str(line[c]).ljust(w) for c, w in zip(cols, widths)).rstrip())
    if not lab.state.topology or rows[0]["ray"] != "running":
        return 1
    from benchmarks.lab.ray_hosts import mlx_pd_cli

    print(flush=True)
    return lab.run("studio", [mlx_pd_cli(), "status", lab.state.topology], timeout_s=120).returncode


def _me() -> str:
    return "./scripts/lab"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `scripts/lab`."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "faults":
        from benchmarks.lab.faults import main as faults_main

        return faults_main(extra, prog=f"{_me()} faults")
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        check_platform()
        return {"up": cmd_up, "down": cmd_down, "exec": cmd_exec, "link": cmd_link,
                "status": cmd_status}[args.command](args)
    except LabError as exc:
        print(f"lab: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"lab: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lab: interrupted (what was started is torn down)", file=sys.stderr)
        return 130
