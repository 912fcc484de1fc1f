"""Fuzzing a live KVReceiver (kv_transfer/receiver.py) with misbehaving peers, using hypothesis.

What must hold, whatever a peer sends: `KVReceiver.poll` never raises; a message whose (request_id, epoch,
sender identity) is not live changes nothing (no KV byte, no live transfer, no deadline) and is counted as
dropped; blocks outside every live reservation are never written; free blocks plus the live reservations'
blocks are always the whole pool, so once the live transfers expire the free count is back at its baseline;
a completed transfer holds exactly what its sender sent; and a genuine transfer from a real `KVSender` still
completes bit-exactly.

Each fuzzed example gets a fresh receiver and two raw DEALER peers (tests/kv_fakes.Rig), plays 1-2 offers
and 1-10 drawn moves (garbage, offers, well-formed or mutated blocks/done/abort/answers aimed at live, past
or made-up reservations from either peer, whole transfers, local aborts, clock ticks), checking after each.
Messages are mutated with the wire fuzzer's strategies (tests/test_kv_wire_fuzz.py). Late frames after an
abort or a timeout, and blocks from the wrong peer, are also checked by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import msgpack
import pytest
import zmq
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kv_transfer.receiver import ReceivedSequence, TransferFailed
from kv_transfer.wire import Abort, Ack, BusyAnswer, Done, Offer, Refused, Reserved, encode
from tests.kv_fakes import BS, SPEC, TIMEOUT_S, Reservation, Rig, bits, genuine_transfer, random_arrays
from tests.test_kv_wire_fuzz import FUZZ, mp_values, mutated, u63


# -- a live receiver (tests/kv_fakes.Rig) -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)  # every test closes its sockets; this only guards against a hang


@pytest.fixture
def rig(zctx):
    r = Rig(zctx)
    yield r
    r.close()


# -- the fuzzed peer's moves --------------------------------------------------------------------------------------

RIDS = ("a", "b", "c")
STEPS = ("garbage", "offer", "offer", "blocks", "blocks", "blocks", "complete", "complete", "done", "abort", "answer",
         "answer", "local_abort", "tick")  # repeats weigh the draw


def draw_target(data, rig: Rig) -> Reservation:
    """A reservation to aim at: a past or live one, or a made-up one for a request the receiver never saw."""
    made_up = st.builds(Reservation, request_id=st.sampled_from(RIDS + ("ghost",)), peer=st.integers(0, 1),
                        epoch=u63 | st.integers(0, 5), tokens=st.lists(st.integers(0, 96), min_size=1, max_size=24),
                        salt=st.none(), num_cached_blocks=st.just(0), num_blocks=st.integers(1, 6))
    if rig.history and data.draw(st.integers(0, 3)):
        return data.draw(st.sampled_from(rig.history))
    r = data.draw(made_up)
    r.num_blocks = -(-len(r.tokens) // BS)
    return r


def draw_epoch(data, rig: Rig, r: Reservation) -> int:
    seen = sorted({h.epoch for h in rig.history})
    choice = data.draw(st.sampled_from(["own", "own", "own", "seen", "random"]))
    if choice == "seen" and seen:
        return data.draw(st.sampled_from(seen))
    return data.draw(u63) if choice == "random" else r.epoch


def draw_peer(data, r: Reservation) -> int:
    return data.draw(st.sampled_from([r.peer, r.peer, r.peer, 1 - r.peer]))


def draw_range(data, r: Reservation) -> tuple[int, int, range]:
    if data.draw(st.integers(0, 4)) and r.num_cached_blocks < r.num_blocks:
        start = data.draw(st.integers(r.num_cached_blocks, r.num_blocks - 1))
        stop = data.draw(st.integers(start + 1, r.num_blocks))
        l0 = data.draw(st.integers(0, SPEC.num_layers - 1))
        return start, stop, range(l0, data.draw(st.integers(l0 + 1, SPEC.num_layers)))
    start, n = data.draw(st.integers(0, 8)), data.draw(st.integers(1, 4))
    l0 = data.draw(st.integers(0, 3))
    return start, start + n, range(l0, l0 + data.draw(st.integers(1, 3)))


@dataclass
class Move:
    """What one fuzzed move sends: (peer, frames) messages; `completes` (reservation, [(start, stop, arrays)],
    block_table) when they are a whole transfer for a live reservation, which must then complete."""

    sent: list = field(default_factory=list)
    completes: Optional[tuple] = None


def draw_move(data, rig: Rig, kind: str) -> Move:
    move = Move()
    if kind == "garbage":
        frames = data.draw(st.lists(st.binary(max_size=48) | mp_values.map(msgpack.packb), min_size=1, max_size=4))
        move.sent.append((data.draw(st.integers(0, 1)), frames))
    elif kind == "offer":
        tokens = data.draw(st.lists(st.integers(0, 96), min_size=0, max_size=30)
                           | st.integers(SPEC.max_model_len - 2, SPEC.max_model_len + 2).map(lambda n: [3] * n))
        if rig.history and not data.draw(st.integers(0, 2)):  # a known prompt again: prefix-cache hits
            tokens = data.draw(st.sampled_from(rig.history)).tokens + tokens[:data.draw(st.integers(0, 6))]
        fmt = rig.fmt
        if not data.draw(st.integers(0, 5)):
            fmt = fmt.model_copy(update=dict([data.draw(st.sampled_from(
                [("kv_bits", 8), ("block_size", 8), ("revision", "r1"), ("num_layers", 3), ("dtype", "float16")]))]))
        offer = Offer(request_id=data.draw(st.sampled_from(RIDS)), format=fmt, token_ids=tokens,
                      cache_salt=data.draw(st.sampled_from([None, "s"])))
        extra = [b"extra"] if not data.draw(st.integers(0, 7)) else []
        move.sent.append((data.draw(st.integers(0, 1)), encode(offer) + extra))
    elif kind in ("blocks", "done", "abort", "answer"):
        r = draw_target(data, rig)
        epoch = draw_epoch(data, rig, r)
        arrays: list = []
        if kind == "blocks":
            start, stop, layers = draw_range(data, r)
            msg, arrays = rig.blocks(r, epoch, start, stop, layers, data.draw(st.integers(0, 2**32 - 1)))
        elif kind == "done":
            msg = Done(request_id=r.request_id, epoch=epoch, first_token=data.draw(st.integers(0, 96)))
        elif kind == "abort":
            msg = Abort(request_id=r.request_id, epoch=data.draw(st.sampled_from([epoch, None])), reason="fuzz")
        else:  # messages a sender never sends
            msg = data.draw(st.sampled_from([
                Reserved(request_id=r.request_id, epoch=epoch, num_cached_blocks=0, num_blocks=1),
                Ack(request_id=r.request_id, epoch=epoch),
                Refused(request_id=r.request_id, reason="fuzz"),
                BusyAnswer(request_id=r.request_id, retry_after_s=0.1),
                Offer(request_id=r.request_id, format=rig.fmt, token_ids=r.tokens)]))
        frames = encode(msg, arrays)
        if not data.draw(st.integers(0, 2)):
            frames = data.draw(mutated(msg.model_dump(), frames))
        move.sent.append((draw_peer(data, r), frames))
    elif kind == "complete":  # every block of a reservation from its peer with its epoch, then done
        r = draw_target(data, rig)
        seed, payload = data.draw(st.integers(0, 2**32 - 1)), []
        for start in range(r.num_cached_blocks, r.num_blocks, 2):
            stop = min(r.num_blocks, start + 2)
            msg, arrays = rig.blocks(r, r.epoch, start, stop, range(SPEC.num_layers), seed + start)
            move.sent.append((r.peer, encode(msg, arrays)))
            payload.append((start, stop, arrays))
        move.sent.append((r.peer, encode(Done(request_id=r.request_id, epoch=r.epoch, first_token=4))))
        t = rig.receiver.live.get(r.request_id)
        if t is not None and (t.epoch, t.identity, t.offer.token_ids, t.offer.cache_salt) == \
                (r.epoch, rig.identity[r.peer], r.tokens, r.salt):
            move.completes = (r, payload, list(t.block_table))
    elif kind == "local_abort":
        rid = data.draw(st.sampled_from(RIDS))
        was_live = rid in rig.receiver.live
        assert rig.receiver.abort(rid) == was_live
    elif kind == "tick":
        rig.now += data.draw(st.sampled_from([0.5, TIMEOUT_S / 2, TIMEOUT_S + 0.5]))
    return move


def step(data, rig: Rig, kind: Optional[str] = None) -> None:
    """One fuzzed move (of `kind`, or drawn), and what must hold after it."""
    kind = kind or data.draw(st.sampled_from(STEPS), label="step")
    move = draw_move(data, rig, kind)
    everything = range(1, rig.pool.num_blocks)
    untouched = set(everything) - rig.live_blocks()
    untouched_bits, all_bits = rig.block_bits(untouched), rig.block_bits(everything)
    late = rig.is_late(*move.sent[0]) if len(move.sent) == 1 else False
    live_before, dropped_before = rig.live_state(), rig.dropped()
    for peer, frames in move.sent:
        rig.send(peer, frames)
    events = rig.sync() if move.sent else rig.poll()

    for e in events:
        event(f"receiver: {type(e).__name__} {getattr(e, 'kind', '')}")
    event(f"{kind}: " + {True: "late", None: "invalid header", False: "live or new"}[late])
    rig.check_accounting()
    assert rig.block_bits(untouched) == untouched_bits, "a block outside every reservation was written"
    if late is not False:  # late (True) or malformed header (None): dropped without any effect
        assert rig.live_state() == live_before and rig.block_bits(everything) == all_bits
        late_n, invalid_n = rig.dropped()
        assert (late_n - dropped_before[0], invalid_n - dropped_before[1]) == ((1, 0) if late else (0, 1))
    for e in events:
        if isinstance(e, TransferFailed) and e.kind == "error":  # the sender hears why
            owner = next(h.peer for h in reversed(rig.history) if h.request_id == e.request_id)
            told = [m for m in rig.heard[owner] if isinstance(m, Abort) and m.request_id == e.request_id]
            assert told and told[-1].reason == e.reason
    if move.completes is not None:  # what the peer sent is what the blocks hold
        r, payload, table = move.completes
        seq = [e for e in events if e.request_id == r.request_id]
        assert len(seq) == 1 and isinstance(seq[0], ReceivedSequence) and seq[0].block_table == table, seq
        for start, stop, arrays in payload:
            held = rig.store.read_blocks(table[start:stop], range(SPEC.num_layers))
            assert [bits(x) for x in held] == [bits(x) for x in arrays]


def run_fuzzed_peers(zctx, fmt_name: str, data) -> None:
    rig = Rig(zctx, fmt_name)
    try:
        for _ in range(data.draw(st.integers(1, 2), label="offers")):
            step(data, rig, "offer")
        for _ in range(data.draw(st.integers(1, 10), label="steps")):
            step(data, rig)
        rig.expire()
        assert not rig.receiver.live and rig.pool.num_free_blocks == rig.baseline
        genuine_transfer(rig, data.draw(st.integers(1, 30), label="genuine tokens"))
    finally:
        rig.close()


@settings(FUZZ, max_examples=400)
@given(data=st.data())
def test_fuzzed_peers_never_break_the_receiver_float32(zctx, data):
    run_fuzzed_peers(zctx, "float32", data)


@settings(FUZZ, max_examples=120)
@given(data=st.data())
def test_fuzzed_peers_never_break_the_receiver_bfloat16_4bit(zctx, data):
    run_fuzzed_peers(zctx, "bfloat16-4bit", data)


# -- late frames after an abort and a reassignment ------------------------------------------------------------------

def offer_and_reserve(rig: Rig, peer: int, rid: str, tokens: list) -> Reservation:
    rig.send(peer, encode(Offer(request_id=rid, format=rig.fmt, token_ids=tokens)))
    rig.sync()
    r = rig.history[-1]
    assert (r.request_id, r.peer) == (rid, peer) and rig.receiver.live[rid].epoch == r.epoch
    return r


def ship(rig: Rig, r: Reservation, arrays: list, epoch: Optional[int] = None, peer: Optional[int] = None) -> None:
    """All of reservation r's blocks in one message, carrying `arrays`."""
    msg, _ = rig.blocks(r, r.epoch if epoch is None else epoch, 0, r.num_blocks, range(SPEC.num_layers), 0)
    rig.send(r.peer if peer is None else peer, encode(msg, arrays))


@pytest.mark.parametrize("same_request_id", [False, True], ids=["new-request", "retried-request"])
@pytest.mark.parametrize("ended_by", ["sender-abort", "receiver-abort", "timeout"])
def test_late_frames_after_reassignment_never_touch_the_new_owners_blocks(rig, ended_by, same_request_id):
    """Reservation A (epoch e1) ends; request B reserves the very same blocks (epoch e2). Blocks, done and
    abort messages for A's epoch, and B's request id with epoch e1, arrive before and after B's own blocks:
    all are dropped as late, and B's blocks hold B's data bit-exactly."""
    n = rig.baseline  # every block of the pool, so B must get A's blocks back
    tokens_a, tokens_b = [5] * (n * BS - 1), [6] * (n * BS - 2)
    a = offer_and_reserve(rig, 0, "A", tokens_a)
    table_a = list(rig.receiver.live["A"].block_table)
    assert rig.pool.num_free_blocks == 0
    if ended_by == "sender-abort":
        rig.send(0, encode(Abort(request_id="A", epoch=a.epoch, reason="client left")))
        rig.sync()
    elif ended_by == "receiver-abort":
        assert rig.receiver.abort("A")
        rig.sync()
    else:
        rig.expire()
    assert [(e.request_id, e.kind) for e in rig.events] == \
        [("A", "timeout" if ended_by == "timeout" else "aborted")]
    assert rig.pool.num_free_blocks == n

    b = offer_and_reserve(rig, 0, "A" if same_request_id else "B", tokens_b)
    table_b = list(rig.receiver.live[b.request_id].block_table)
    assert sorted(table_b) == sorted(table_a) and b.epoch != a.epoch
    specs = rig.store.block_array_specs(n, SPEC.num_layers)
    data_b = random_arrays(rig.store, n, range(SPEC.num_layers), seed=2)
    junk = [random_arrays(rig.store, n, range(SPEC.num_layers), seed=s) for s in (3, 4, 5, 6)]
    assert all(list(x.shape) == list(s) for x, (_, _, s) in zip(data_b, specs))
    late0 = rig.metrics.value("dropped_messages_total", reason="late")

    stale_a = Reservation("A", 0, a.epoch, tokens_a, None, 0, n)
    b_with_e1 = Reservation(b.request_id, 0, a.epoch, tokens_b, None, 0, n)
    ship(rig, stale_a, junk[0])                                  # before B's data
    ship(rig, b_with_e1, junk[1])
    ship(rig, b, data_b)
    ship(rig, stale_a, junk[2])                                  # after it
    ship(rig, b_with_e1, junk[3])
    for msg in (Done(request_id="A", epoch=a.epoch, first_token=1),
                Abort(request_id="A", epoch=a.epoch, reason="stale"),
                Abort(request_id=b.request_id, epoch=a.epoch, reason="stale")):
        rig.send(0, encode(msg))
    assert rig.sync() == [] and b.request_id in rig.receiver.live
    assert rig.metrics.value("dropped_messages_total", reason="late") - late0 == 7

    rig.send(0, encode(Done(request_id=b.request_id, epoch=b.epoch, first_token=9)))
    (got,) = rig.sync()
    assert isinstance(got, ReceivedSequence) and got.block_table == table_b and got.first_token == 9
    assert [bits(x) for x in rig.store.read_blocks(table_b, range(SPEC.num_layers))] == [bits(x) for x in data_b]
    assert rig.pool.num_free_blocks == rig.baseline  # (sync freed the received sequence)


def test_blocks_from_another_peer_for_a_live_reservation_are_dropped(rig):
    """Peer 1 knows peer 0's request id and epoch; its blocks and done are still not peer 0's transfer."""
    r = offer_and_reserve(rig, 0, "a", list(range(10)))
    mine = random_arrays(rig.store, r.num_blocks, range(SPEC.num_layers), seed=1)
    theirs = random_arrays(rig.store, r.num_blocks, range(SPEC.num_layers), seed=2)
    table = list(rig.receiver.live["a"].block_table)
    ship(rig, r, mine)
    ship(rig, r, theirs, peer=1)
    rig.send(1, encode(Done(request_id="a", epoch=r.epoch, first_token=1)))
    rig.send(1, encode(Abort(request_id="a", epoch=r.epoch, reason="not yours")))
    assert rig.sync() == [] and "a" in rig.receiver.live
    assert rig.metrics.value("dropped_messages_total", reason="late") == 3
    rig.send(0, encode(Done(request_id="a", epoch=r.epoch, first_token=2)))
    (got,) = rig.sync()
    assert isinstance(got, ReceivedSequence) and got.first_token == 2
    assert [bits(x) for x in rig.store.read_blocks(table, range(SPEC.num_layers))] == [bits(x) for x in mine]


@pytest.mark.parametrize("answer", [Refused(request_id="a", reason="x"), BusyAnswer(request_id="a", retry_after_s=1.0)],
                         ids=["refused", "busy"])
def test_an_answer_type_from_the_sender_does_not_crash_poll(rig, answer):
    """A `refused` or `busy` message (answer types, without an `epoch`) naming a live transfer, from that
    transfer's own sender, is dropped like any other unexpected message: poll() does not raise, the transfer's
    blocks are freed when it expires, and a genuine transfer after it goes through."""
    offer_and_reserve(rig, 0, "a", list(range(10)))
    rig.send(0, encode(answer))
    rig.sync()
    rig.expire()
    assert rig.pool.num_free_blocks == rig.baseline
    genuine_transfer(rig, 9)
