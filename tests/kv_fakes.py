"""Test doubles for KV transfer: a live KVReceiver driven by raw DEALER peers (tests/test_kv_receiver_fuzz.py).

`Rig` is a receiver on loopback with an injected clock (`rig.now`) and two raw DEALER sockets (`peers` 0 and
1) that send whatever a test builds. `rig.sync()` makes "everything sent so far has been handled" exact:
each peer sends an offer in a format the receiver refuses, and since a DEALER's messages arrive in order and
the receiver answers in order, that refusal coming back means every earlier message was processed.
`rig.history` lists every reservation the receiver made (request id, peer, epoch, tokens), read from
`receiver.live` after each sync, so tests can aim well-formed messages at live or long-gone transfers.
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np
import zmq

from cluster.kv.block_pool import BlockPool
from cluster.kv.manager import KVManager
from cluster.config import TransferConfig
from cluster.kv.store import KVStore
from cluster.model import ModelSpec
from cluster.transport import client_socket
from kv_transfer.handshake import KVFormat
from kv_transfer.receiver import KVReceiver, ReceivedSequence, TransferFailed
from kv_transfer.sender import KVSender
from kv_transfer.wire import ArraySpec, Blocks, Offer, Refused, WireError, decode_header, encode

SPEC = ModelSpec("tiny", "r0", 2, 4, 2, 64, 97, 512, (1,))
BS = 4
TIMEOUT_S = 2.0
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "uint32": np.uint32}


def to_mx(raw: bytes, dtype: str, shape) -> mx.array:
    a = mx.array(np.frombuffer(raw, dtype=NP_DTYPES[dtype]).reshape(shape))
    return a.view(mx.bfloat16) if dtype == "bfloat16" else a


def bits(a) -> bytes:
    """The raw bytes of an MLX or NumPy array (bfloat16 as its 16-bit words)."""
    if isinstance(a, np.ndarray):
        return a.tobytes()
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


def dtype_name(a: mx.array) -> str:
    return str(a.dtype).removeprefix("mlx.core.")


FORMATS = {"float32": ("float32", None, 64), "bfloat16-4bit": ("bfloat16", 4, 32)}


def kv_format(dtype: str, kv_bits: Optional[int], group: int) -> KVFormat:
    return KVFormat(model_id=SPEC.model_id, revision=SPEC.revision, dtype=dtype, kv_bits=kv_bits,
                    kv_group_size=group, block_size=BS, num_layers=SPEC.num_layers, num_kv_heads=SPEC.num_kv_heads,
                    head_dim=SPEC.head_dim)


def random_arrays(store: KVStore, num_blocks: int, layers: range, seed: int) -> list[np.ndarray]:
    """Random bits shaped and typed as store.read_blocks returns them (bfloat16 as uint16 words)."""
    rng = np.random.default_rng(seed)
    out = []
    for _, dtype, shape in store.block_array_specs(num_blocks, len(layers)):
        raw = rng.integers(0, 256, int(np.prod(shape)) * np.dtype(NP_DTYPES[dtype]).itemsize, dtype=np.uint8).tobytes()
        out.append(np.frombuffer(raw, dtype=NP_DTYPES[dtype]).reshape(shape))
    return out


@dataclass
class Reservation:
    """What the test knows of one reservation the receiver made (live or long gone)."""

    request_id: str
    peer: int
    epoch: int
    tokens: list
    salt: Optional[str]
    num_cached_blocks: int
    num_blocks: int


class Rig:
    """A KVReceiver (pool of `num_blocks`, clock `now`) and two raw DEALER peers, all on one Context."""

    def __init__(self, ctx: zmq.Context, fmt_name: str = "float32", num_blocks: int = 17):
        self.ctx, self.now, self.fmt_name = ctx, 1000.0, fmt_name
        dtype, kv_bits, group = FORMATS[fmt_name]
        self.fmt = kv_format(dtype, kv_bits, group)
        self.probe_fmt = self.fmt.model_copy(update={"model_id": "probe"})
        self.pool = BlockPool(num_blocks)
        self.store = KVStore(SPEC, num_blocks, BS, dtype, kv_bits, group)
        self.kv = KVManager.over(self.pool, self.store)
        self.receiver = KVReceiver(self.fmt, self.kv, max_prompt_len=SPEC.max_model_len,
                                   config=TransferConfig(timeout_s=TIMEOUT_S), ctx=ctx, clock=lambda: self.now)
        self.metrics = self.receiver.metrics
        self.baseline = self.pool.num_free_blocks
        self.peers = [client_socket(ctx, zmq.DEALER, self.receiver.endpoint) for _ in range(2)]
        self.heard: list[list] = [[], []]  # headers each peer received, probe answers left out
        self.events: list = []
        self.history: list[Reservation] = []  # every reservation the receiver made, in order
        self._probes = 0
        # Learn each peer's identity at the receiver from one reservation, aborted at once.
        self.identity: dict[int, bytes] = {}
        for i, sock in enumerate(self.peers):
            sock.send_multipart(encode(Offer(request_id=f"hello-{i}", format=self.fmt, token_ids=[1])))
        self.sync()
        for i in (0, 1):
            self.identity[i] = self.receiver.live[f"hello-{i}"].identity
            assert self.receiver.abort(f"hello-{i}")
        self.receiver.poll()
        self.heard, self.events, self.history = [[], []], [], []
        assert self.pool.num_free_blocks == self.baseline

    def close(self) -> None:
        self.receiver.close()
        for sock in self.peers:
            sock.close(linger=0)

    # -- driving -------------------------------------------------------------------------------------------------

    def send(self, peer: int, frames) -> None:
        self.peers[peer].send_multipart(list(frames) or [b""], copy=False)

    def sync(self, timeout_s: float = 5.0) -> list:
        """Poll the receiver until it has handled everything both peers sent; returns its new events.
        A ReceivedSequence's blocks are freed at once (as the decode worker does when the sequence ends)."""
        waiting = {}
        for i, sock in enumerate(self.peers):
            self._probes += 1
            waiting[i] = f"probe-{self._probes}"
            sock.send_multipart(encode(Offer(request_id=waiting[i], format=self.probe_fmt, token_ids=[1])))
        before = dict(self.receiver.live)
        events = []
        deadline = time.monotonic() + timeout_s
        while waiting:
            assert time.monotonic() < deadline, "the receiver stopped answering"
            events += self.receiver.poll(0.002)
            for i in list(waiting):
                while self.peers[i].poll(0, zmq.POLLIN):
                    msg = decode_header(self.peers[i].recv_multipart()[0])
                    if msg.request_id == waiting[i]:
                        assert isinstance(msg, Refused) and "model_id" in msg.reason
                        del waiting[i]
                        break
                    self.heard[i].append(msg)
        self._learn(before)
        return self._settle(events)

    def poll(self) -> list:
        """One receiver poll (no wait): its events, settled as in `sync`."""
        return self._settle(self.receiver.poll())

    def expire(self) -> list:
        """Let every live transfer's deadline pass."""
        self.now += TIMEOUT_S + 1
        return self.poll()

    def _learn(self, before: dict) -> None:
        peer_of = {v: k for k, v in self.identity.items()}
        for rid, t in self.receiver.live.items():
            if before.get(rid) is not t and t.identity in peer_of:
                self.history.append(Reservation(rid, peer_of[t.identity], t.epoch, list(t.offer.token_ids),
                                                t.offer.cache_salt, t.num_cached_blocks, len(t.block_table)))

    def _settle(self, events: list) -> list:
        for e in events:
            assert isinstance(e, (ReceivedSequence, TransferFailed))
            if isinstance(e, ReceivedSequence):
                self.kv.release(e.request_id)
        self.events += events
        return events

    # -- building messages ---------------------------------------------------------------------------------------

    def blocks(self, r: Reservation, epoch: int, start: int, stop: int, layers: range, seed: int):
        """A well-formed `blocks` message for reservation `r` (its hashes, this format's array specs)."""
        hashes = self.fmt.block_hashes(r.tokens, r.salt)
        arrays = random_arrays(self.store, stop - start, layers, seed)
        specs = [ArraySpec(name=n, dtype=d, shape=list(s))
                 for n, d, s in self.store.block_array_specs(stop - start, len(layers))]
        msg = Blocks(request_id=r.request_id, epoch=epoch, block_start=start, num_blocks=stop - start,
                     block_hashes=hashes[start:min(stop, len(hashes))], layer_start=layers.start,
                     num_layers=len(layers), kv_bits=self.fmt.kv_bits, kv_group_size=self.fmt.kv_group_size,
                     arrays=specs)
        return msg, arrays

    # -- observing -----------------------------------------------------------------------------------------------

    def live_state(self) -> dict:
        return {rid: (t.identity, t.epoch, t.deadline, list(t.block_table), b"".join(r.tobytes() for r in t.received))
                for rid, t in self.receiver.live.items()}

    def block_bits(self, block_ids) -> list[bytes]:
        ids = sorted(block_ids)
        return [bits(a) for a in self.store.read_blocks(ids, range(SPEC.num_layers))] if ids else []

    def live_blocks(self) -> set[int]:
        return {b for t in self.receiver.live.values() for b in t.block_table}

    def dropped(self) -> tuple[float, float]:
        return (self.metrics.value("dropped_messages_total", reason="late"),
                self.metrics.value("dropped_messages_total", reason="invalid"))

    def check_accounting(self) -> None:
        """Free blocks plus the live reservations' blocks are the whole pool (nothing leaked or double-held)."""
        assert self.pool.num_free_blocks + len(self.live_blocks()) == self.baseline
        for t in self.receiver.live.values():
            assert all(self.pool.blocks[b].ref_cnt >= 1 for b in t.block_table)

    def is_late(self, peer: int, frames) -> Optional[bool]:
        """Whether the receiver must drop `frames` from `peer` without effect: True when its header names no
        live transfer of that peer's, or one with another epoch; None when its header is invalid."""
        try:
            msg = decode_header(frames[0] if frames else b"")
        except WireError:
            return None
        if isinstance(msg, Offer):
            return False
        t = self.receiver.live.get(msg.request_id)
        epoch = getattr(msg, "epoch", None)
        return (t is None or self.identity.get(peer) != t.identity
                or (epoch is not None and epoch != t.epoch))


@functools.cache
def source(fmt_name: str) -> tuple[KVFormat, KVStore]:
    """A sender's format and KV store, blocks 1..8 full of random bits (the genuine transfers' data)."""
    dtype, kv_bits, group = FORMATS[fmt_name]
    store = KVStore(SPEC, 9, BS, dtype, kv_bits, group)
    ids = list(range(1, 9))
    store.write_blocks(ids, range(SPEC.num_layers), random_arrays(store, len(ids), range(SPEC.num_layers), 7))
    return kv_format(dtype, kv_bits, group), store


_genuine = itertools.count()


def genuine_transfer(rig: Rig, num_tokens: int) -> None:
    """A real KVSender ships `num_tokens` tokens' KV (unique cache salt: no prefix hits); the receiver gets it
    bit-exactly, and once the sequence is freed the pool is back at its baseline."""
    (fmt, src), n = source(rig.fmt_name), next(_genuine)
    rid, salt, table = f"genuine-{n}", f"genuine-{n}", list(range(1, 1 + -(-num_tokens // BS)))
    tokens = [(7 * n + i) % SPEC.vocab_size for i in range(num_tokens)]
    sender = KVSender(fmt, src, config=TransferConfig(timeout_s=5, max_blocks_per_message=3), ctx=rig.ctx)
    results, got = [], []
    try:
        sender.open(rid, rig.receiver.endpoint, tokens, cache_salt=salt)
        sender.blocks_ready(rid, table, num_tokens)
        sender.finish(rid, 5, -0.5)
        deadline = time.monotonic() + 10
        while not (results and got):
            assert time.monotonic() < deadline, "the genuine transfer did not finish"
            results += sender.poll(0.002)
            got += [e for e in rig.receiver.poll(0.002) if e.request_id == rid]
    finally:
        sender.close()
    assert results[0].ok, results[0]
    seq = got[0]
    assert isinstance(seq, ReceivedSequence), seq
    assert (seq.token_ids, seq.first_token, seq.first_logprob, seq.num_cached_tokens) == (tokens, 5, -0.5, 0)
    layers = range(SPEC.num_layers)
    assert [bits(a) for a in rig.store.read_blocks(list(seq.block_table), layers)] == \
        [bits(a) for a in src.read_blocks(table, layers)]
    rig.kv.release(seq.request_id)
    assert rig.pool.num_free_blocks == rig.baseline and not rig.receiver.live
