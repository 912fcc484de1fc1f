"""KV transfer between a sender and a receiver on loopback: round trips, the handshake, backpressure, aborts,
deadlines and CurveZMQ, at library level."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest

from cluster.kv.block_pool import BlockPool
from cluster.kv.manager import KVManager
from cluster.config import EngineConfig, TransferConfig
from cluster.kv.store import KVStore
from cluster.model import ModelSpec
from cluster.transport import client_socket, generate_keys
from kv_transfer.handshake import KVFormat
from kv_transfer.receiver import KVReceiver, ReceivedSequence, TransferFailed
from kv_transfer.sender import KVSender
from kv_transfer.wire import Offer, decode_header, encode

SPEC = ModelSpec("tiny", "r0", 3, 4, 2, 64, 97, 4096, (1,))
BS = 4


class Side:
    """One worker's pool, store and KV format."""

    def __init__(self, num_blocks=64, dtype="float32", kv_bits=None, kv_group_size=32, spec=SPEC, **fmt):
        cfg = EngineConfig(dtype=dtype, kv_bits=kv_bits, kv_group_size=kv_group_size, block_size=BS)
        self.pool = BlockPool(num_blocks)
        self.store = KVStore(spec, num_blocks, BS, dtype, kv_bits, kv_group_size)
        self.kv = KVManager.over(self.pool, self.store)  # the receiver side's block owner
        self.fmt = KVFormat.of(spec, cfg).model_copy(update=fmt)
        self.baseline = self.pool.num_free_blocks

    def randomize(self, seed=0):
        """Fill every KV array with random bits (uint32 packed values too)."""
        mx.random.seed(seed)

        def rnd(a):
            if a.dtype == mx.uint32:
                return mx.random.randint(0, 2**31, a.shape).astype(mx.uint32)
            return mx.random.normal(a.shape).astype(a.dtype)

        for arrays in (self.store.keys, self.store.values):
            for i, x in enumerate(arrays):
                arrays[i] = tuple(rnd(p) for p in x) if isinstance(x, tuple) else rnd(x)
        mx.eval(self.store.keys, self.store.values)
        return self


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


class Link:
    """A sender on side `a` and a receiver on side `b`, pumped from the test's thread."""

    def __init__(self, a: Side, b: Side, config=TransferConfig(max_blocks_per_message=3), rx_config=None, **kw):
        self.a, self.b = a, b
        self.rx = KVReceiver(b.fmt, b.kv, max_prompt_len=SPEC.max_model_len,
                             config=rx_config or config, **kw.get("rx", {}))
        self.tx = KVSender(a.fmt, a.store, config=config, **kw.get("tx", {}))
        self.results, self.events = {}, {}

    def pump(self, until, timeout=10.0):
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, "transfer did not finish"
            for r in self.tx.poll(0.005):
                self.results[r.request_id] = r
            for e in self.rx.poll(0.005):
                self.events[e.request_id] = e

    def ship(self, rid, tokens, table, **kw):
        """Offer, mark everything computed, finish, and pump until both ends report."""
        self.tx.open(rid, self.rx.endpoint, tokens, on_release=lambda: self.a.pool.free(table), **kw)
        self.tx.blocks_ready(rid, table, len(tokens))
        self.tx.finish(rid, 7, -0.25)
        self.pump(lambda: rid in self.results and rid in self.events)
        return self.results[rid], self.events[rid]

    def close(self):
        self.tx.close()
        self.rx.close()


@pytest.fixture
def links():
    made = []
    yield lambda *a, **k: made.append(Link(*a, **k)) or made[-1]
    for link in made:
        link.close()


@pytest.mark.parametrize("dtype,kv_bits,group", [("float32", None, 64), ("bfloat16", None, 64),
                                                  ("float16", None, 64), ("float32", 8, 32), ("bfloat16", 4, 64)])
def test_round_trip_is_bit_exact_and_reuses_the_receivers_prefix_cache(links, dtype, kv_bits, group):
    a, b = Side(dtype=dtype, kv_bits=kv_bits, kv_group_size=group).randomize(), Side(dtype=dtype, kv_bits=kv_bits,
                                                                                     kv_group_size=group)
    link = links(a, b)
    tokens = list(range(1, 31))  # 7 full blocks + 2 tokens
    table = a.pool.allocate(8)
    sent, got = link.ship("r1", tokens, table)
    assert sent.ok and isinstance(got, ReceivedSequence)
    assert (got.token_ids, got.first_token, got.first_logprob, got.num_cached_tokens) == (tokens, 7, -0.25, 0)
    for x, y in zip(a.store.read_blocks(table, range(3)), b.store.read_blocks(got.block_table, range(3))):
        assert same_bits(x, y)
    moved = link.rx.metrics.value("bytes_total")
    assert moved == link.tx.metrics.value("bytes_total") > 0
    assert a.pool.num_free_blocks == a.baseline  # released by on_release

    # The same prefix again (the receiver cached 7 full blocks): only the last, partial block moves.
    b.kv.release(got.request_id)
    table2 = a.pool.allocate(8)
    sent2, got2 = link.ship("r2", tokens, table2)
    assert sent2.num_cached_blocks == 7 and got2.num_cached_tokens == 28
    assert got2.block_table[:7] == got.block_table[:7]
    assert link.rx.metrics.value("bytes_total") == pytest.approx(moved * 9 / 8)


@pytest.mark.parametrize("field,value", [("dtype", "bfloat16"), ("kv_bits", 8), ("kv_group_size", 128),
                                         ("revision", "r1"), ("model_id", "other"), ("block_size", 8),
                                         ("num_layers", 4), ("num_kv_heads", 1), ("head_dim", 32),
                                         ("speculative_kv", True)])
def test_mismatched_formats_are_refused_naming_the_field(links, field, value):
    """Sides with different KV formats: refused at the handshake with a message naming the mismatch; nothing
    reserved."""
    a, b = Side(**{field: value}), Side()
    link = links(a, b)
    link.tx.open("r", link.rx.endpoint, list(range(10)))
    link.pump(lambda: "r" in link.results)
    res = link.results["r"]
    assert res.kind == "refused" and field in res.reason and "mismatch" in res.reason
    assert b.pool.num_free_blocks == b.baseline and not link.rx.live
    assert link.rx.metrics.value("reservations_total", outcome="refused") == 1


def test_prompt_longer_than_the_context_is_refused_before_any_transfer(links):
    a, b = Side(), Side()
    link = links(a, b)
    link.rx.max_prompt_len = 20
    link.tx.open("long", link.rx.endpoint, list(range(20)))
    link.pump(lambda: "long" in link.results)
    assert link.results["long"].kind == "refused" and "context limit is 20" in link.results["long"].reason
    assert b.pool.num_free_blocks == b.baseline and link.rx.metrics.value("bytes_total") == 0


def test_blocks_stream_while_the_prompt_is_still_computing(links):
    """Blocks go out as chunks finish, before `finish`; `done` waits for the first token."""
    a, b = Side().randomize(), Side()
    link = links(a, b)
    tokens, table = list(range(40)), a.pool.allocate(10)
    link.tx.open("r", link.rx.endpoint, tokens, on_release=lambda: a.pool.free(table))
    link.tx.blocks_ready("r", table, 17)  # a first chunk: 4 full blocks
    link.pump(lambda: link.rx.live.get("r") is not None and link.rx.live["r"].received[0][:4].all())
    assert not link.rx.live["r"].received[0][4:].any() and "r" not in link.events
    link.tx.blocks_ready("r", table, 40)
    link.pump(lambda: link.rx.live["r"].received[0].all())
    assert "r" not in link.events  # no first token yet
    link.tx.finish("r", 3)
    link.pump(lambda: "r" in link.events and "r" in link.results)
    assert link.events["r"].first_token == 3 and link.results["r"].ok


@pytest.mark.parametrize("when", ["before_reservation", "mid_transfer"])
def test_sender_abort_frees_blocks_on_both_sides(links, when):
    """A client leaving mid-transfer: the decode side learns by an abort message."""
    a, b = Side().randomize(), Side()
    link = links(a, b)
    table = a.pool.allocate(10)
    link.tx.open("r", link.rx.endpoint, list(range(40)), on_release=lambda: a.pool.free(table))
    if when == "mid_transfer":
        link.tx.blocks_ready("r", table, 20)
        link.pump(lambda: "r" in link.rx.live and link.rx.live["r"].received[0][:5].all())
        assert b.pool.num_free_blocks == b.baseline - 10
    assert link.tx.abort("r", "client disconnected")
    assert a.pool.num_free_blocks == a.baseline and link.results == {}
    link.pump(lambda: "r" in link.events)
    ev = link.events["r"]
    assert isinstance(ev, TransferFailed) and ev.kind == "aborted" and "client disconnected" in ev.reason
    assert b.pool.num_free_blocks == b.baseline and not link.rx.live and not link.tx.transfers


def test_receiver_abort_reaches_the_sender_which_releases(links):
    a, b = Side().randomize(), Side()
    link = links(a, b)
    table = a.pool.allocate(10)
    link.tx.open("r", link.rx.endpoint, list(range(40)), on_release=lambda: a.pool.free(table))
    link.pump(lambda: "r" in link.rx.live)
    assert link.rx.abort("r", "the client left")
    link.pump(lambda: "r" in link.results)
    assert link.results["r"].kind == "aborted" and "the client left" in link.results["r"].reason
    assert a.pool.num_free_blocks == a.baseline and b.pool.num_free_blocks == b.baseline


def test_full_receiver_applies_backpressure_and_every_transfer_finishes(links):
    """A full receiver, at library level: room for 8 prompts of 64 tokens, 24 concurrent offers. Blocks are
    reserved before a transfer is accepted, the rest wait ("busy") and retry; all 24 finish; the receiver's
    blocks in use never exceed its pool; every queue drains to 0."""
    a, b = Side(num_blocks=24 * 16 + 1).randomize(), Side(num_blocks=8 * 16 + 1)
    link = links(a, b, TransferConfig(max_blocks_per_message=8, timeout_s=30))
    tables = {}
    for i in range(24):
        rid, tokens = f"r{i}", [i + 1] * 64  # distinct prompts: no prefix sharing
        tables[rid] = a.pool.allocate(16)
        link.tx.open(rid, link.rx.endpoint, tokens, on_release=lambda t=tables[rid]: a.pool.free(t))
        link.tx.blocks_ready(rid, tables[rid], 64)
        link.tx.finish(rid, i)
    peak, finished, held = 0, [], []
    deadline = time.monotonic() + 60
    while len(finished) < 24:
        assert time.monotonic() < deadline
        link.tx.poll(0.002)
        for ev in link.rx.poll(0.002):
            assert isinstance(ev, ReceivedSequence)
            finished.append(ev)
            held.append(ev.request_id)
        peak = max(peak, b.pool.num_usable_blocks - b.pool.num_free_blocks)
        while len(held) > 4:  # the decode worker finishes its oldest sequences
            b.kv.release(held.pop(0))
    link.pump(lambda: len(link.tx.transfers) == 0)
    for rid in held:
        b.kv.release(rid)
    assert sorted(ev.request_id for ev in finished) == sorted(tables)
    assert peak <= 8 * 16
    assert link.rx.metrics.value("reservations_total", outcome="busy") > 0
    assert link.rx.metrics.value("inflight") == 0 and not link.rx.live
    assert a.pool.num_free_blocks == a.baseline and b.pool.num_free_blocks == b.baseline


def test_dead_receiver_gives_an_error_within_the_deadline(links):
    a = Side()
    tx = KVSender(a.fmt, a.store, config=TransferConfig(timeout_s=0.5))
    released = []
    tx.open("r", "tcp://127.0.0.1:1", list(range(10)), on_release=lambda: released.append(1))
    t0, results = time.monotonic(), []
    while not results and time.monotonic() - t0 < 5:
        results += tx.poll(0.05)
    tx.close()
    assert results[0].kind == "timeout" and released == [1] and time.monotonic() - t0 < 1.5


def test_receiver_dying_after_reservation_times_out_the_sender(links):
    a, b = Side().randomize(), Side()
    link = links(a, b, TransferConfig(timeout_s=0.5))
    table = a.pool.allocate(3)
    link.tx.open("r", link.rx.endpoint, list(range(10)), on_release=lambda: a.pool.free(table))
    link.pump(lambda: "r" in link.rx.live)
    link.rx.sock.close(linger=0)  # the decode worker dies without a word
    link.tx.blocks_ready("r", table, 10)
    link.tx.finish("r", 1)
    t0 = time.monotonic()
    while "r" not in link.results:
        assert time.monotonic() - t0 < 3
        for r in link.tx.poll(0.05):
            link.results[r.request_id] = r
    assert link.results["r"].kind == "timeout" and a.pool.num_free_blocks == a.baseline


def test_sender_vanishing_mid_transfer_frees_the_receivers_blocks(links):
    a, b = Side(), Side()
    link = links(a, b, TransferConfig(timeout_s=0.4))
    raw = client_socket(link.rx.ctx, 5, link.rx.endpoint)  # zmq.DEALER: a peer that never finishes
    raw.send_multipart(encode(Offer(request_id="r", format=b.fmt, token_ids=list(range(10)))))
    link.pump(lambda: "r" in link.rx.live)
    assert raw.poll(2000)
    assert decode_header(raw.recv_multipart()[0]).type == "reserved"
    assert b.pool.num_free_blocks == b.baseline - 3
    t0 = time.monotonic()
    link.pump(lambda: "r" in link.events, timeout=3)
    raw.close(linger=0)
    assert link.events["r"].kind == "timeout" and time.monotonic() - t0 < 1.5
    assert b.pool.num_free_blocks == b.baseline and link.rx.metrics.value("timeouts_total") == 1


def test_curve_keys_are_required_when_configured(links, tmp_path):
    keys = generate_keys(tmp_path / "keys")
    a, b = Side().randomize(), Side()
    secure = links(a, b, rx={"keys": keys}, tx={"keys": keys})
    table = a.pool.allocate(3)
    sent, got = secure.ship("r", list(range(10)), table)
    assert sent.ok and isinstance(got, ReceivedSequence)

    # A sender without the keys is never answered: its offer times out, nothing is reserved.
    intruder = KVSender(a.fmt, a.store, config=TransferConfig(timeout_s=0.5))
    intruder.open("x", secure.rx.endpoint, list(range(10)))
    t0, results = time.monotonic(), []
    while not results and time.monotonic() - t0 < 5:
        results += intruder.poll(0.05)
        secure.rx.poll(0)
    intruder.close()
    assert results[0].kind == "timeout" and "x" not in secure.rx.live


def test_lost_done_message_times_out_both_sides(links):
    """The 'transfer done' message is lost. The sender's wait for the ack and the receiver's wait
    for the next message both end at their deadline; both free their blocks; nothing hangs."""
    a, b = Side().randomize(), Side()
    link = links(a, b, TransferConfig(timeout_s=0.5))
    enqueue = link.tx._enqueue

    def lossy(peer, frames):  # the network eats every `done`
        if decode_header(frames[0]).type != "done":
            enqueue(peer, frames)

    link.tx._enqueue = lossy
    table = a.pool.allocate(3)
    link.tx.open("r", link.rx.endpoint, list(range(10)), on_release=lambda: a.pool.free(table))
    link.tx.blocks_ready("r", table, 10)
    link.tx.finish("r", 1)
    t0 = time.monotonic()
    link.pump(lambda: "r" in link.results and "r" in link.events, timeout=5)
    # Both deadlines are 0.5 s: whichever side expires first tells the other with an abort.
    sent, got = link.results["r"], link.events["r"]
    assert "timeout" in (sent.kind, got.kind)
    assert sent.kind == "timeout" or "deadline" in sent.reason
    assert got.kind == "timeout" or "timed out" in got.reason
    assert time.monotonic() - t0 < 2.0
    assert a.pool.num_free_blocks == a.baseline and b.pool.num_free_blocks == b.baseline


def ship_eight_blocks_intact(link, a, b, rid: str) -> None:
    """Ship 8 of `a`'s blocks (30 tokens) over `link`; they arrive in `b` bit for bit, every layer."""
    table = a.pool.allocate(8)
    sent, got = link.ship(rid, list(range(1, 31)), table)
    assert sent.ok and isinstance(got, ReceivedSequence)
    for x, y in zip(a.store.read_blocks(table, range(3)), b.store.read_blocks(got.block_table, range(3))):
        assert same_bits(x, y)


def test_messages_are_split_to_fit_the_receivers_frame_limit(links):
    """The receiver's ZeroMQ socket drops a connection that sends a frame over `max_frame_bytes` (every
    transfer on it would stall): the sender splits messages by layers, then blocks, so each frame fits.
    Here one block of one layer is 2,048 bytes per array and the limit is 4,096."""
    config = TransferConfig(max_blocks_per_message=8, max_frame_bytes=4096)
    a, b = Side().randomize(3), Side()
    link = links(a, b, config)
    assert (link.tx.blocks_per_message, link.tx.layers_per_message) == (2, 1)
    ship_eight_blocks_intact(link, a, b, "split")
    with pytest.raises(ValueError, match="max_frame_bytes"):
        KVSender(a.fmt, a.store, config=TransferConfig(max_frame_bytes=1024))


def test_messages_are_split_to_bound_their_bytes_so_their_steps_overlap(links):
    """A message is encrypted, sent, received and decrypted whole, so the sender keeps each message's KV
    within `max_message_bytes`: layers first, then blocks, never below one block of one layer. Here one block
    of one layer is 4,096 bytes (keys and values); 8 blocks of 3 layers would be 98,304."""
    a, b = Side().randomize(3), Side()
    link = links(a, b, TransferConfig(max_blocks_per_message=8, max_message_bytes=20_000))
    assert (link.tx.blocks_per_message, link.tx.layers_per_message) == (4, 1)  # 16,384 bytes
    ship_eight_blocks_intact(link, a, b, "bounded")
    tiny = KVSender(a.fmt, a.store, config=TransferConfig(max_message_bytes=1024))
    assert (tiny.blocks_per_message, tiny.layers_per_message) == (1, 1)  # one block of one layer still goes
    tiny.close()
