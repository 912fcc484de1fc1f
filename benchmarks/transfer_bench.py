"""KV transfer: mlx-pd shipping a prompt's KV over loopback against raw pyzmq, bytes per format, and a projection.

    mlx-pd bench transfer                                  # 4,096 tokens, 5 rounds per format (~20 s)
    mlx-pd bench transfer --rounds 9 --json transfer.json
    mlx-pd bench transfer --mlx-cache-limit-gb 4           # diagnostic: MLX's buffer cache raised (see below)

**Shipping.** The default model's KV geometry (SmolLM2-135M: 30 layers, 3 KV heads x 64; only its
config.json is read, no weights) in each format: float32, bfloat16, 8-bit and 4-bit with group 64, and
4-bit with group 32 (quantized formats keep bfloat16 scales and biases, as on a Mac). The sender's
`KVStore` holds one prompt's blocks, filled with random data once; the receiver has its own `BlockPool`
and `KVStore`. A `KVSender` in the main thread ships the blocks to a `KVReceiver` polled by its own
thread (each builds and uses its objects only on its thread) over tcp://127.0.0.1, block size 32, default
`TransferConfig` (64 blocks per message). One round = wall time from `open` (the offer) to the sender
seeing the `ack`, with every block marked computed up front (pure shipping, no prefill to overlap).
Each round uses a new `cache_salt`, so the receiver's prefix cache never holds the prompt; the receiver
frees the blocks after each round.

**Raw baseline**, same run, same ZeroMQ context: a DEALER in the main thread sends to a ROUTER on its
own thread exactly the frames the mlx-pd sender sent that format's prompt (recorded in the warm-up round:
same messages, same frame sizes, headers included) from preallocated NumPy buffers with `copy=False`.
The receiver takes each message with `copy=False`, copies every frame into one preallocated NumPy
array (`np.frombuffer` + slice assignment), and answers a one-frame ack after the last message. No
handshake, no hashing, no header parsing: what minimal code moving the same bytes does. Rounds alternate
ABBA (mlx-pd, raw, raw, mlx-pd, ...) after one unmeasured warm-up round of each. Throughput = KV payload
bytes / wall seconds (GB = 1e9 bytes); ratio = mlx-pd / raw median.

`--mlx-cache-limit-gb` calls `mx.set_cache_limit` first (MLX's CPU backend caches freed buffers only up to
32 MiB). Since KV travels as NumPy arrays (one `np.take` out of the sender's pool, zero-copy frames, one
assignment into the receiver's pool), the transfer path allocates no MLX memory, so this only matters for
comparing with older runs; the workers run with MLX's default, so the default measurement does too.

**Bytes on the wire**: the receiver's `TransferMetrics` payload counter per transfer (cross-checked
against `kv_bytes_per_block`), and every frame the sender handed to ZeroMQ (headers and the offer too).

**Projection** (arithmetic, no measurement): benchmarks/transfer_projection.py (`Projection` holds every
constant and its source); the result holds its constants and rows, printed as the last table.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from benchmarks.transfer_projection import Projection, projection_rows

# (label, dtype of values or of scales/biases, kv_bits, kv_group_size)
FORMATS = (("float32", "float32", None, 64), ("bfloat16", "bfloat16", None, 64), ("8-bit g64", "bfloat16", 8, 64),
           ("4-bit g64", "bfloat16", 4, 64), ("4-bit g32", "bfloat16", 4, 32))
_POLL_S = 0.05


# --- shipping over loopback ---------------------------------------------------------------------------


def _filled_store(spec, num_blocks: int, block_size: int, dtype: str, kv_bits, group_size: int):
    """A KVStore whose blocks 1..num_blocks-1 hold random KV (quantized: mx.quantize of random values)."""
    import mlx.core as mx

    from cluster.kv.store import KVStore

    store = KVStore(spec, num_blocks, block_size, dtype, kv_bits, group_size)
    mx.random.seed(0)
    shape = (spec.num_layers, (num_blocks - 1) * block_size, spec.num_kv_heads, spec.head_dim)
    arrays = []
    for _ in "kv":
        x = mx.random.normal(shape).astype(getattr(mx, dtype))
        arrays += [x] if kv_bits is None else list(mx.quantize(x, group_size=group_size, bits=kv_bits))
    words = [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a) for a in arrays]  # as read_blocks gives
    store.write_blocks(list(range(1, num_blocks)), range(spec.num_layers), words)
    return store


class _Owner(threading.Thread):
    """Builds an object with `make()` on its own thread, then calls `step(obj, self.events)` until stopped,
    then `close(obj)`: the object is only ever touched by this thread (after `ready` says it exists)."""

    def __init__(self, make: Callable, step: Callable, close: Callable):
        super().__init__(daemon=True)
        self._make, self._step, self._close = make, step, close
        self._halt = threading.Event()
        self.ready: "queue.Queue" = queue.Queue()
        self.events: "queue.Queue" = queue.Queue()
        self.obj = None

    def run(self) -> None:
        try:
            self.obj = self._make()
        except BaseException as exc:  # re-raised in the main thread by _start
            self.ready.put(exc)
            return
        self.ready.put(None)
        try:
            while not self._halt.is_set():
                self._step(self.obj, self.events)
        finally:
            self._close(self.obj)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def _start(owner: _Owner) -> _Owner:
    owner.start()
    err = owner.ready.get(timeout=120)
    if err is not None:
        raise err
    return owner


def _counting_sender(fmt, store, config, ctx):
    """A KVSender that also records the frame sizes of every message it queues, in `.messages` (the raw
    baseline replays them). Hooks KVSender._enqueue, the one place every outgoing message passes."""
    from kv_transfer.sender import KVSender

    class CountingSender(KVSender):
        def _enqueue(self, peer, frames):
            self.messages.append([memoryview(f).nbytes for f in frames])
            super()._enqueue(peer, frames)

    sender = CountingSender(fmt, store, config=config, ctx=ctx)
    sender.messages = []
    return sender


def _rx_step(rx, events) -> None:
    from kv_transfer.receiver import ReceivedSequence

    for ev in rx.poll(_POLL_S):
        if isinstance(ev, ReceivedSequence):
            rx.kv.release(ev.request_id)
        events.put(ev)


def _raw_step(state, events) -> None:
    """The raw receiver: copy every frame of every message into `dest`; ack after `state.num_messages`."""
    import zmq

    if not state.sock.poll(int(_POLL_S * 1000), zmq.POLLIN):
        return
    frames = state.sock.recv_multipart(copy=False)
    for f in frames[1:]:
        buf = np.frombuffer(f.buffer, dtype=np.uint8)
        state.dest[state.offset:state.offset + buf.size] = buf
        state.offset += buf.size
    state.received += 1
    if state.received == state.num_messages:
        state.sock.send_multipart([frames[0].bytes, b"ack"])
        state.received = state.offset = 0


@dataclass
class _RawState:
    sock: object
    dest: np.ndarray
    num_messages: int
    endpoint: str = ""
    received: int = 0
    offset: int = 0


def ship_format(spec, *, dtype: str, kv_bits: Optional[int], group_size: int, tokens: int, rounds: int,
                block_size: int = 32, config=None, raw: bool = True, log=lambda m: None) -> dict:
    """Ship `tokens` tokens of KV in one format `rounds` times (plus one warm-up), interleaved ABBA with
    the raw pyzmq baseline (`raw`). Returns seconds per round, bytes and throughputs (see the module doc)."""
    import mlx.core as mx
    import zmq

    from cluster.kv.block_pool import BlockPool
    from cluster.kv.manager import KVManager
    from cluster.config import TransferConfig
    from cluster.kv.store import KVStore, kv_bytes_per_block
    from cluster.transport import LOOPBACK, client_socket, server_socket
    from kv_transfer.handshake import KVFormat
    from kv_transfer.receiver import KVReceiver, ReceivedSequence

    config = config or TransferConfig()
    num_blocks = -(-tokens // block_size)
    fmt = KVFormat(model_id=spec.model_id, revision=spec.revision, dtype=dtype, kv_bits=kv_bits,
                   kv_group_size=group_size, block_size=block_size, num_layers=spec.num_layers,
                   num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)
    ctx = zmq.Context.instance()
    store = _filled_store(spec, num_blocks + 1, block_size, dtype, kv_bits, group_size)
    sender = _counting_sender(fmt, store, config, ctx)
    token_ids = [int(t) for t in np.random.default_rng(0).integers(0, 2**15, tokens)]
    table = list(range(1, num_blocks + 1))

    def make_rx():
        store = KVStore(spec, num_blocks + 1, block_size, dtype, kv_bits, group_size)
        return KVReceiver(fmt, KVManager.over(BlockPool(num_blocks + 1), store), max_prompt_len=tokens + 1,
                          config=config, ctx=ctx)

    rx = _start(_Owner(make_rx, _rx_step, lambda r: r.close()))
    payload = kv_bytes_per_block(spec, block_size, dtype, kv_bits, group_size) * num_blocks
    seq = iter(range(10**9))
    result = {"dtype": dtype, "kv_bits": kv_bits, "kv_group_size": group_size if kv_bits else None,
              "tokens": tokens, "blocks": num_blocks, "payload_bytes_formula": payload}

    def mlx_round() -> float:
        rid = f"bench-{next(seq):06d}"  # fixed width: every round's headers have the same size
        t0 = time.perf_counter()
        sender.open(rid, rx.obj.endpoint, token_ids, cache_salt=rid)
        sender.blocks_ready(rid, table, tokens)
        sender.finish(rid, 0)
        while True:
            done = sender.poll(_POLL_S)
            if done:
                break
        seconds = time.perf_counter() - t0
        ev = rx.events.get(timeout=30)
        sent, sender.messages = sender.messages, []
        first = result.setdefault("wire_frames", sent)
        # headers may differ by a byte (msgpack sizes ints such as the epoch by value); the KV frames may not
        if [len(m) for m in first] != [len(m) for m in sent] or [m[1:] for m in first] != [m[1:] for m in sent]:
            raise RuntimeError("the sender's messages changed between rounds; the raw baseline would differ")
        if not done[0].ok or not isinstance(ev, ReceivedSequence):
            raise RuntimeError(f"transfer failed: {done[0]} / {ev}")
        return seconds

    times: dict[str, list[float]] = {"mlx-pd": [], "raw": []}
    raw_rx = raw_tx = None
    try:
        mlx_round()  # warm-up; also records the frames the raw baseline replays
        frames = result["wire_frames"]
        result["wire_bytes_sender"] = sum(map(sum, frames))
        if raw:
            rng = np.random.default_rng(1)
            bufs = [[np.frombuffer(bytearray(rng.bytes(n)), np.uint8) for n in msg] for msg in frames]

            def make_raw():
                sock, endpoint = server_socket(ctx, zmq.ROUTER, LOOPBACK, 0)
                return _RawState(sock, np.zeros(result["wire_bytes_sender"], np.uint8), len(frames), endpoint)

            raw_rx = _start(_Owner(make_raw, _raw_step, lambda st: st.sock.close(linger=0)))
            raw_tx = client_socket(ctx, zmq.DEALER, raw_rx.obj.endpoint)
            raw_tx.rcvtimeo = int(config.timeout_s * 1000)

        def raw_round() -> float:
            t0 = time.perf_counter()
            for msg in bufs:
                raw_tx.send_multipart(msg, copy=False)
            try:
                raw_tx.recv()
            except zmq.Again:
                raise RuntimeError(f"the raw baseline's receiver sent no ack within {config.timeout_s:g} s") from None
            return time.perf_counter() - t0

        if raw:
            raw_round()  # warm-up
        for r in range(rounds):
            order = ["mlx-pd", "raw"] if r % 2 == 0 else ["raw", "mlx-pd"]  # ABBA across rounds
            for name in order if raw else ["mlx-pd"]:
                times[name].append(mlx_round() if name == "mlx-pd" else raw_round())
            log(f"  round {r + 1}/{rounds}: mlx-pd {times['mlx-pd'][-1] * 1e3:.1f} ms"
                + (f", raw {times['raw'][-1] * 1e3:.1f} ms" if raw else ""))
    finally:
        if raw_tx is not None:
            raw_tx.close(linger=0)
        if raw_rx is not None:
            raw_rx.stop()
        sender.close()
        rx.stop()
    received = rx.obj.metrics.value("bytes_total")
    result["payload_bytes_received"] = received / (rounds + 1)
    result["seconds"] = times
    for name, ts in times.items():
        if ts:
            result[name] = {"median_s": statistics.median(ts), "gb_per_s": payload / statistics.median(ts) / 1e9,
                            "all_gb_per_s": [payload / t / 1e9 for t in ts]}
    if raw:
        result["ratio"] = result["mlx-pd"]["gb_per_s"] / result["raw"]["gb_per_s"]
    del store, sender
    mx.clear_cache()
    return result


# --- the command --------------------------------------------------------------------------------------


def add_transfer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="mlx-lm model folder whose KV geometry to ship (default: the "
                                                 "imported SmolLM2; only config.json is read)")
    p.add_argument("--tokens", type=int, default=4096, help="prompt tokens whose KV is shipped")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds per format (each side)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--no-raw", action="store_true", help="skip the raw pyzmq baseline")
    p.add_argument("--mlx-cache-limit-gb", type=float, default=None,
                   help="diagnostic: mx.set_cache_limit before shipping (default: MLX's own, as the workers run)")
    p.add_argument("--json", "--out", dest="out", metavar="PATH", default=None,
                   help="write the full results as JSON")
    p.add_argument("--markdown", default=None, help="also write the tables as Markdown here")


def run_transfer(args, log=None) -> dict:
    """`mlx-pd bench transfer`: returns the JSON-ready result (its tables are printed as Markdown)."""
    from benchmarks.compare import machine_info
    from cluster.model import read_model_spec, resolve_model_path

    if args.tokens < 1 or args.rounds < 1:
        raise ValueError("--tokens and --rounds must be >= 1")
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    model_dir = Path(args.model) if args.model else resolve_model_path(None, dtype="float32")
    spec = read_model_spec(Path(model_dir))
    result = {"kind": "transfer", "machine": machine_info(), "model_dir": str(model_dir),
              "spec": {"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim},
              "tokens": args.tokens, "rounds": args.rounds, "block_size": args.block_size, "formats": {}}
    if args.mlx_cache_limit_gb is not None:
        import mlx.core as mx

        result["mlx_cache_limit_bytes"] = int(args.mlx_cache_limit_gb * 2**30)
        result["mlx_cache_limit_default"] = mx.set_cache_limit(result["mlx_cache_limit_bytes"])
    t0 = time.perf_counter()
    for label, dtype, bits, gs in FORMATS:
        log(f"{label}: shipping {args.tokens} tokens x {args.rounds} rounds")
        result["formats"][label] = ship_format(spec, dtype=dtype, kv_bits=bits, group_size=gs, tokens=args.tokens,
                                               rounds=args.rounds, block_size=args.block_size,
                                               raw=not args.no_raw, log=log)
    result["wall_s"] = time.perf_counter() - t0
    result["machine"]["loadavg_end"] = os.getloadavg()
    proj = Projection()
    result["projection"] = {"constants": {**asdict(proj), "matmul_params": proj.matmul_params,
                                          "kv_bytes_per_token": {"bf16": proj.kv_bytes_per_token(None),
                                                                 "4-bit": proj.kv_bytes_per_token(4)}},
                            "rows": projection_rows(proj)}
    print(markdown(transfer_tables(result)))
    return result


def transfer_tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    fmts = result["formats"]
    bf16 = fmts.get("bfloat16", {}).get("payload_bytes_received")
    h1 = ["format", "mlx-pd GB/s (median)", "mlx-pd GB/s (all rounds)", "raw pyzmq GB/s (median)",
          "mlx-pd / raw", "median ms (mlx-pd / raw)"]
    r1 = []
    for label, f in fmts.items():
        ours, raw = f["mlx-pd"], f.get("raw")
        r1.append([label, f"{ours['gb_per_s']:.2f}", " ".join(f"{g:.2f}" for g in ours["all_gb_per_s"]),
                   f"{raw['gb_per_s']:.2f}" if raw else "-", f"{f['ratio']:.2f}x" if raw else "-",
                   f"{ours['median_s'] * 1e3:.1f} / {raw['median_s'] * 1e3:.1f}" if raw else "-"])
    h2 = ["format", "payload bytes (receiver)", "formula", "all frames sent", "messages", "vs bfloat16"]
    r2 = [[label, f"{f['payload_bytes_received']:,.0f}", f"{f['payload_bytes_formula']:,}",
           f"{f['wire_bytes_sender']:,}", str(len(f["wire_frames"])),
           f"{f['payload_bytes_received'] / bf16:.3f}x" if bf16 else "-"] for label, f in fmts.items()]
    s = result["spec"]
    tables = [(f"Shipping the KV of a {result['tokens']}-token prompt over tcp://127.0.0.1 ({s['num_layers']} layers, "
               f"{s['num_kv_heads']} KV heads x {s['head_dim']}, block {result['block_size']}, "
               f"{result['rounds']} rounds ABBA)", h1, r1),
              ("Bytes on the wire per prompt", h2, r2)]
    if "projection" in result:
        c = result["projection"]["constants"]
        h3 = ["prompt tokens", "link", "KV format", "KV MB", "prefill s (M3 Ultra)", "transfer s",
              "transfer <= prefill", "exposed after prefill s"]
        r3 = [[f"{r['tokens']:,}", r["link"], r["format"], f"{r['kv_bytes'] / 1e6:,.1f}", f"{r['prefill_s']:.2f}",
               f"{r['transfer_s']:.3f}", "yes" if r["hidden"] else "no", f"{r['exposed_s']:.3f}"]
              for r in result["projection"]["rows"]]
        tables.append((f"Projection: {c['model']} KV ({c['kv_bytes_per_token']['bf16']:,} B/token bf16, "
                       f"{c['kv_bytes_per_token']['4-bit']:,} 4-bit g{c['group_size']}), {c['chunk_tokens']}-token "
                       f"chunks, prefill at {c['peak_flops'] / 1e12:.0f} TFLOP/s x MFU {c['mfu']}", h3, r3))
    return tables


def markdown(tables) -> str:
    from benchmarks.report import markdown_table

    return "\n\n".join(f"{title}:\n\n{markdown_table(h, r)}" for title, h, r in tables) + "\n"
