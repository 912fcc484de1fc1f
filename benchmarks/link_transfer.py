"""KV transfer between two hosts of the lab over a shaped link, as a ratio to the link's rate.

    mlx-pd bench link-transfer --sender-ns mlxpd-lab-studio --receiver-ns mlxpd-lab-mini-1 \\
        --receiver-host 10.77.0.11 --link-gbit 1

Root on Linux, with the lab's network namespaces up (`scripts/lab up`, benchmarks/lab/). For each KV format
(float32; 8-bit and 4-bit with group 64 and bfloat16 scales and biases, as on a Mac) the receiver runs as its
own process in `--receiver-ns` (`ip netns exec`): a `KVReceiver` bound to `--receiver-host`, with its own block
pool and store, releasing each prompt's blocks once received. The sender runs in `--sender-ns`: a `KVSender`
whose `KVStore` holds one prompt's blocks of the default model's KV geometry (SmolLM2-135M: 30 layers, 3 KV
heads x 64; only its config.json is read), filled with random data, ships them one round after another, every
block marked computed up front (pure shipping, no prefill to overlap). With `--keys-dir` both sides use the
lab's CurveZMQ keys, so the KV is encrypted on the wire as the workers ship it. The prompt is at least `--tokens` long
and long enough that one round moves at least `--min-mb` MB of KV payload. One round = wall time from `open`
(the offer) to the sender seeing the receiver's `ack`; one unmeasured warm-up round first.

    throughput = KV payload bytes / round seconds          (payload: cluster.kv.store.kv_bytes_per_block)
    ratio      = throughput x 8 / (--link-gbit x 1e9)      (the tbf rate of the link the KV crosses)

Headers, the offer and TCP/IP framing are not payload, so a link carrying only KV at its rate reads a little
under 1.0x.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

LINK_FORMATS = (("float32", "float32", None, 64), ("8-bit g64", "bfloat16", 8, 64), ("4-bit g64", "bfloat16", 4, 64))
READY_TIMEOUT_S = 120.0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sender-ns", required=True, help="network namespace of the sending host (the prefill side)")
    p.add_argument("--receiver-ns", required=True, help="network namespace of the receiving host (a decode side)")
    p.add_argument("--receiver-host", required=True, help="the receiving host's address inside its namespace")
    p.add_argument("--link-gbit", type=float, required=True, help="the link's shaped rate, Gbit/s (for the ratio)")
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens per round at least (default 2048)")
    p.add_argument("--min-mb", type=float, default=100.0, help="KV payload per round at least, MB (default 100)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per format (default 3)")
    p.add_argument("--keys-dir", default=None,
                   help="CurveZMQ keys (`mlx-pd keys DIR`): both sides encrypt and authenticate, as a lab's "
                        "workers do (default: none)")
    p.add_argument("--layers-per-message", type=int, default=None,
                   help="the sender's [transfer] layers_per_message (default: the workers' default)")
    p.add_argument("--round-timeout-s", type=float, default=300.0, help="one format's sender at most (default 300)")
    p.add_argument("--out", default=None, help="write the results as JSON")
    p.add_argument("--markdown", default=None, help="also write the table as Markdown")


def _spec():
    from cluster.model import read_model_spec, resolve_model_path

    return read_model_spec(Path(resolve_model_path(None, dtype="float32")))


def _fmt(spec, dtype: str, kv_bits: Optional[int], group_size: int, block_size: int = 32):
    from kv_transfer.handshake import KVFormat

    return KVFormat(model_id=spec.model_id, revision=spec.revision, dtype=dtype, kv_bits=kv_bits,
                    kv_group_size=group_size, block_size=block_size, num_layers=spec.num_layers,
                    num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)


def tokens_for(spec, dtype: str, kv_bits: Optional[int], group_size: int, tokens: int, min_mb: float,
               block_size: int = 32) -> int:
    """Prompt tokens of a round: at least `tokens` and at least `min_mb` MB of payload, in whole blocks."""
    from cluster.kv.store import kv_bytes_per_block

    per_block = kv_bytes_per_block(spec, block_size, dtype, kv_bits, group_size)
    blocks = max(-(-tokens // block_size), math.ceil(min_mb * 1e6 / per_block))
    return blocks * block_size


def _keys(keys_dir: Optional[str]):
    from cluster.transport import CurveKeys

    return CurveKeys.load(keys_dir) if keys_dir else None


def receive(host: str, dtype: str, kv_bits: Optional[int], group_size: int, tokens: int, count: int,
            deadline_s: float, keys_dir: Optional[str] = None) -> int:
    """The receiving side (its own process): print {"endpoint"} once bound, then {"received": id} per prompt;
    exits after `count` prompts, at the deadline, or when stdin closes (the orchestrator is gone)."""
    from cluster.kv.block_pool import BlockPool
    from cluster.kv.manager import KVManager
    from cluster.kv.store import KVStore
    from kv_transfer.receiver import KVReceiver, ReceivedSequence

    spec, block_size = _spec(), 32
    num_blocks = -(-tokens // block_size) + 1
    store = KVStore(spec, num_blocks, block_size, dtype, kv_bits, group_size)
    rx = KVReceiver(_fmt(spec, dtype, kv_bits, group_size), KVManager.over(BlockPool(num_blocks), store),
                    max_prompt_len=tokens + 1, host=host, keys=_keys(keys_dir))
    print(json.dumps({"endpoint": rx.endpoint}), flush=True)
    got, end = 0, time.monotonic() + deadline_s
    try:
        while got < count and time.monotonic() < end:
            if select.select([sys.stdin], [], [], 0)[0] and not sys.stdin.readline():
                return 1  # stdin closed: the orchestrator is gone
            for ev in rx.poll(0.05):
                if isinstance(ev, ReceivedSequence):
                    rx.kv.release(ev.request_id)
                    got += 1
                    print(json.dumps({"received": ev.request_id}), flush=True)
    finally:
        rx.close()
    return 0 if got == count else 1


def send(endpoint: str, dtype: str, kv_bits: Optional[int], group_size: int, tokens: int, rounds: int,
         keys_dir: Optional[str] = None, layers_per_message: Optional[int] = None) -> int:
    """The sending side (its own process): a warm-up round, then `rounds` measured ones; prints {"seconds":
    [...], "payload_bytes": n}. Exit 1 when a transfer fails."""
    from benchmarks.transfer_bench import _filled_store
    from cluster.kv.store import kv_bytes_per_block
    from kv_transfer.sender import KVSender

    spec, block_size = _spec(), 32
    num_blocks = -(-tokens // block_size)
    store = _filled_store(spec, num_blocks + 1, block_size, dtype, kv_bits, group_size)
    from cluster.config import TransferConfig

    sender = KVSender(_fmt(spec, dtype, kv_bits, group_size), store, keys=_keys(keys_dir),
                      config=TransferConfig(layers_per_message=layers_per_message))
    token_ids = [int(t) for t in np.random.default_rng(0).integers(0, 2**15, tokens)]
    table = list(range(1, num_blocks + 1))
    seconds = []
    try:
        for r in range(rounds + 1):
            rid = f"link-{r:04d}"
            t0 = time.perf_counter()
            sender.open(rid, endpoint, token_ids, cache_salt=rid)
            sender.blocks_ready(rid, table, tokens)
            sender.finish(rid, 0)
            done = []
            while not done:
                done = sender.poll(0.05)
            if not done[0].ok:
                print(json.dumps({"error": f"{done[0].kind}: {done[0].reason}"}), flush=True)
                return 1
            if r:
                seconds.append(time.perf_counter() - t0)
    finally:
        sender.close()
    payload = kv_bytes_per_block(spec, block_size, dtype, kv_bits, group_size) * num_blocks
    print(json.dumps({"seconds": seconds, "payload_bytes": payload}), flush=True)
    return 0


def _in_ns(ns: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


def _side(kind: str, label_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "benchmarks.link_transfer", kind, *label_args]


def ship_over_link(args, dtype: str, kv_bits: Optional[int], group_size: int, log) -> dict:
    """One format: the receiver in its namespace, the sender in its own; the rounds' figures."""
    spec = _spec()
    tokens = tokens_for(spec, dtype, kv_bits, group_size, args.tokens, args.min_mb)
    common = ["--dtype", dtype, "--group-size", str(group_size), "--tokens", str(tokens)]
    common += ["--kv-bits", str(kv_bits)] if kv_bits else []
    common += ["--keys-dir", args.keys_dir] if args.keys_dir else []
    sender_only = ["--layers-per-message", str(args.layers_per_message)] if args.layers_per_message else []
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    rx = subprocess.Popen(_in_ns(args.receiver_ns, _side("receive", common + [
        "--host", args.receiver_host, "--count", str(args.rounds + 1), "--deadline-s", str(args.round_timeout_s)])),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        ready, _, _ = select.select([rx.stdout], [], [], READY_TIMEOUT_S)
        line = rx.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the receiver in {args.receiver_ns} did not start within {READY_TIMEOUT_S:g} s")
        endpoint = json.loads(line)["endpoint"]
        log(f"  {tokens} tokens a round to {endpoint}")
        out = subprocess.run(_in_ns(args.sender_ns, _side("send", common + [
            "--endpoint", endpoint, "--rounds", str(args.rounds), *sender_only])), capture_output=True, text=True, env=env,
            timeout=args.round_timeout_s)
        last = (out.stdout.strip().splitlines() or ["{}"])[-1]
        res = json.loads(last)
        if out.returncode or "seconds" not in res:
            raise RuntimeError(f"the sender failed ({out.returncode}): {res.get('error') or out.stderr[-800:]}")
    finally:
        rx.stdin.close()
        try:
            rx.wait(30)
        except subprocess.TimeoutExpired:
            rx.kill()
    rates = [res["payload_bytes"] / s for s in res["seconds"]]
    med = statistics.median(rates)
    return {"tokens": tokens, "payload_bytes": res["payload_bytes"], "seconds": res["seconds"],
            "mb_per_s": med / 1e6, "gbit_per_s": med * 8 / 1e9, "ratio_to_link": med * 8 / (args.link_gbit * 1e9),
            "all_gbit_per_s": [r * 8 / 1e9 for r in rates]}


def run(args, log=None) -> dict:
    """`mlx-pd bench link-transfer`: every format over the link; JSON-ready result."""
    from benchmarks.compare import machine_info

    if args.rounds < 1 or args.tokens < 1 or args.link_gbit <= 0:
        raise ValueError("--rounds and --tokens must be >= 1 and --link-gbit > 0")
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    result = {"kind": "link-transfer", "machine": machine_info(), "link_gbit": args.link_gbit,
              "curve": bool(args.keys_dir),
              "sender_ns": args.sender_ns, "receiver_ns": args.receiver_ns, "rounds": args.rounds, "formats": {}}
    for label, dtype, bits, gs in LINK_FORMATS:
        log(f"{label}: {args.rounds} rounds over the {args.link_gbit:g} Gbit/s link")
        result["formats"][label] = ship_over_link(args, dtype, bits, gs, log)
        f = result["formats"][label]
        log(f"  {f['gbit_per_s']:.3f} Gbit/s of KV payload = {f['ratio_to_link']:.2f}x the link")
    from benchmarks.prefix_report import markdown

    print(markdown(tables(result)))
    return result


def tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    rows = [[label, f"{f['tokens']:,}", f"{f['payload_bytes'] / 1e6:.1f}", f"{f['mb_per_s']:.1f}",
             f"{f['gbit_per_s']:.3f}", f"{f['ratio_to_link']:.2f}x",
             ", ".join(f"{g:.3f}" for g in f["all_gbit_per_s"])] for label, f in result["formats"].items()]
    title = (f"KV transfer over a {result['link_gbit']:g} Gbit/s link, {result['sender_ns']} -> "
             f"{result['receiver_ns']}{', CurveZMQ' if result.get('curve') else ''} (medians of "
             f"{result['rounds']} rounds)")
    return [(title, ["format", "tokens a round", "MB a round", "MB/s", "Gbit/s", "ratio to the link",
                     "rounds Gbit/s"], rows)]


def _side_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.link_transfer")
    p.add_argument("kind", choices=["receive", "send"])
    p.add_argument("--dtype", required=True)
    p.add_argument("--kv-bits", type=int, default=None)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--deadline-s", type=float, default=300.0)
    p.add_argument("--endpoint", default=None)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--keys-dir", default=None)
    p.add_argument("--layers-per-message", type=int, default=None)
    a = p.parse_args(argv)
    if a.kind == "receive":
        return receive(a.host, a.dtype, a.kv_bits, a.group_size, a.tokens, a.count, a.deadline_s, a.keys_dir)
    return send(a.endpoint, a.dtype, a.kv_bits, a.group_size, a.tokens, a.rounds, a.keys_dir, a.layers_per_message)


if __name__ == "__main__":
    sys.exit(_side_main(sys.argv[1:]))
