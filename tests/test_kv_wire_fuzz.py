"""Fuzzing the KV wire codec (kv_transfer/wire.py) with hypothesis.

What must hold, whatever a peer sends: `wire.decode` returns a valid message or raises `WireError` with a
message (never another exception), and a valid message of any type round-trips to an equal header and
bit-equal arrays (bfloat16, uint32 too), through plain bytes and through zmq frames received without copies.

The strategies here (valid messages of every type, `mp_values`, and `mutated` copies of messages) are also
what tests/test_kv_receiver_fuzz.py aims at a live KVReceiver.
"""

from __future__ import annotations

import copy
from typing import Optional

import mlx.core as mx
import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_transfer.handshake import KVFormat
from kv_transfer.wire import (Abort, Ack, ArraySpec, Blocks, BusyAnswer, Done, Offer, Refused, Reserved, WireError,
                              decode, encode)
from tests.kv_fakes import NP_DTYPES, bits, dtype_name, to_mx

MESSAGE_TYPES = (Offer, Reserved, Refused, BusyAnswer, Blocks, Done, Ack, Abort)
TYPE_NAMES = tuple(m.model_fields["type"].default for m in MESSAGE_TYPES)
FIELD_NAMES = tuple(sorted({f for m in MESSAGE_TYPES for f in m.model_fields}))
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- strategies: valid messages ----------------------------------------------------------------------------------

rids = st.text(min_size=1, max_size=16)
u63 = st.integers(0, 2**63 - 1)
u64 = st.integers(0, 2**64 - 1)
formats = st.builds(
    KVFormat, model_id=st.text(max_size=12), revision=st.text(max_size=12),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]), kv_bits=st.sampled_from([None, 4, 8]),
    kv_group_size=st.integers(32, 128), block_size=st.integers(1, 1024), num_layers=st.integers(1, 1024),
    num_kv_heads=st.integers(1, 1024), head_dim=st.integers(1, 4096), speculative_kv=st.booleans())


@st.composite
def payloads(draw) -> tuple[list[ArraySpec], list[mx.array]]:
    """0-3 arrays of any wire dtype and small shape (zero-sized ones too), with random bits."""
    specs, arrays = [], []
    for _ in range(draw(st.integers(0, 3))):
        dtype = draw(st.sampled_from(list(NP_DTYPES)))
        shape = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4))
        size = int(np.prod(shape)) * np.dtype(NP_DTYPES[dtype]).itemsize
        raw = draw(st.binary(min_size=size, max_size=size))
        specs.append(ArraySpec(name=draw(st.text(max_size=8)), dtype=dtype, shape=shape))
        arrays.append(to_mx(raw, dtype, shape))
    return specs, arrays


@st.composite
def blocks_messages(draw) -> tuple[Blocks, list[mx.array]]:
    specs, arrays = draw(payloads())
    msg = Blocks(request_id=draw(rids), epoch=draw(u63), block_start=draw(u63), num_blocks=draw(st.integers(1, 2**63)),
                 block_hashes=draw(st.lists(u64, max_size=8)), layer_start=draw(u63),
                 num_layers=draw(st.integers(1, 2**63)), kv_bits=draw(st.none() | st.integers(-2**63, 2**63 - 1)),
                 kv_group_size=draw(st.integers(-2**63, 2**63 - 1)), arrays=specs)
    return msg, arrays


def _alone(strategy):
    return strategy.map(lambda m: (m, []))


messages = st.one_of(
    _alone(st.builds(Offer, request_id=rids, format=formats, token_ids=st.lists(st.integers(0, 2**31 - 1),
                                                                                 max_size=40),
                     cache_salt=st.none() | st.text(max_size=16))),
    _alone(st.builds(Reserved, request_id=rids, epoch=u63, num_cached_blocks=st.integers(0, 2**64 - 1),
                     num_blocks=st.integers(1, 2**64 - 1))),
    _alone(st.builds(Refused, request_id=rids, reason=st.text(max_size=40))),
    _alone(st.builds(BusyAnswer, request_id=rids, retry_after_s=st.floats(0, 60))),
    blocks_messages(),
    _alone(st.builds(Done, request_id=rids, epoch=u63, first_token=st.integers(0, 2**31 - 1),
                     first_logprob=st.none() | st.floats(allow_nan=False))),
    _alone(st.builds(Ack, request_id=rids, epoch=u63)),
    _alone(st.builds(Abort, request_id=rids, epoch=st.none() | u63, reason=st.text(max_size=40))),
)

# -- strategies: mutations ----------------------------------------------------------------------------------------

mp_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=8),
                       st.binary(max_size=8))
mp_values = st.recursive(
    mp_scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
        st.text(max_size=6) | st.binary(max_size=4) | st.integers(-3, 3), kids, max_size=3), max_leaves=8)
HEADER_OPS = ("field", "drop_field", "version", "type", "spec", "not_a_map")
FRAME_OPS = ("truncate", "flip", "drop", "dup", "append", "swap", "replace", "empty")


@st.composite
def mutated(draw, header: dict, frames: list) -> list[bytes]:
    """1-3 mutations of a message given as its header dict and frames: header fields given wrong types or
    out-of-range values, removed or added, the version or type changed, an array's shape or dtype changed;
    frames truncated, bit-flipped, dropped, duplicated, appended, swapped or replaced."""
    header, frames = copy.deepcopy(header), [bytes(f) for f in frames]
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(HEADER_OPS + FRAME_OPS))
        if op in HEADER_OPS:
            if op == "field":
                header[draw(st.sampled_from(sorted(header) + list(FIELD_NAMES) + ["bogus"]))] = draw(mp_values)
            elif op == "drop_field" and header:
                del header[draw(st.sampled_from(sorted(header)))]
            elif op == "version":
                header["version"] = draw(st.integers(-1, 3) | mp_scalars)
            elif op == "type":
                header["type"] = draw(st.sampled_from(TYPE_NAMES) | st.text(max_size=8) | mp_scalars)
            elif op == "spec" and isinstance(header.get("arrays"), list) and header["arrays"]:
                spec = header["arrays"][draw(st.integers(0, len(header["arrays"]) - 1))]
                if not isinstance(spec, dict):
                    spec = header["arrays"][0] = {}
                what = draw(st.sampled_from(["shape", "dtype", "name", "bogus"]))
                if what == "shape":
                    dim = st.sampled_from([0, 1, 2, 3, 2**16, 2**30, 2**31 - 1, 2**31, -1]) | st.integers(0, 9)
                    spec["shape"] = draw(st.lists(dim, max_size=9))
                elif what == "dtype":
                    spec["dtype"] = draw(st.sampled_from(list(NP_DTYPES) + ["int8", "float64", ""]) | mp_scalars)
                else:
                    spec[what] = draw(mp_values)
            packed = msgpack.packb(draw(mp_values) if op == "not_a_map" else header,
                                   use_bin_type=draw(st.booleans()))
            frames = [packed] + frames[1:]
            continue
        if op == "append":
            frames.append(draw(st.binary(max_size=64)))
            continue
        if not frames:
            continue
        i = draw(st.integers(0, len(frames) - 1))
        if op == "truncate":
            frames[i] = frames[i][:draw(st.integers(0, max(0, len(frames[i]) - 1)))]
        elif op == "flip" and frames[i]:
            pos = draw(st.integers(0, len(frames[i]) - 1))
            flipped = frames[i][pos] ^ draw(st.integers(1, 255))
            frames[i] = frames[i][:pos] + bytes([flipped]) + frames[i][pos + 1:]
        elif op == "drop":
            del frames[i]
        elif op == "dup":
            frames.insert(i, frames[i])
        elif op == "swap":
            j = draw(st.integers(0, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
        elif op == "replace":
            frames[i] = draw(st.binary(max_size=64))
        elif op == "empty":
            frames.insert(i, b"")
    return frames


def check_decode(frames) -> Optional[tuple]:
    """decode(frames) gives a message consistent with its arrays, or None after a WireError with a message."""
    try:
        msg, arrays = decode(frames)
    except WireError as exc:
        assert str(exc)
        return None
    assert isinstance(msg, MESSAGE_TYPES)
    specs = msg.arrays if isinstance(msg, Blocks) else []
    assert len(arrays) == len(specs) == len(frames) - 1
    for spec, a in zip(specs, arrays):
        assert list(a.shape) == spec.shape and a.dtype.type == NP_DTYPES[spec.dtype]
    return msg, arrays


# -- the wire alone -------------------------------------------------------------------------------------------------

def test_empty_message_and_oversized_header_are_wire_errors():
    with pytest.raises(WireError, match="empty"):
        decode([])
    with pytest.raises(WireError, match="exceeds"):
        decode([b"\x00" * (16 * 2**20 + 1)])


@settings(FUZZ, max_examples=400)
@given(st.lists(st.binary(max_size=96) | mp_values.map(msgpack.packb), max_size=5))
def test_random_frames_decode_or_raise_wire_error(frames):
    check_decode(frames)


@settings(FUZZ, max_examples=300)
@given(messages)
def test_every_message_type_round_trips_with_bit_equal_arrays(pair):
    msg, arrays = pair
    frames = encode(msg, arrays)
    for as_sent in (frames, [bytes(f) for f in frames]):  # memoryviews as encoded, and plain bytes
        got, out = decode(as_sent)
        assert type(got) is type(msg) and got == msg
        assert [(a.dtype.type, a.shape) for a in out] == [(NP_DTYPES[dtype_name(a)], a.shape) for a in arrays]
        assert [bits(a) for a in out] == [bits(a) for a in arrays]


@settings(FUZZ, max_examples=1000)
@given(messages, st.data())
def test_mutated_messages_decode_or_raise_wire_error(pair, data):
    msg, arrays = pair
    check_decode(data.draw(mutated(msg.model_dump(), encode(msg, arrays))))


def _blocks_header(*shapes) -> Blocks:
    return Blocks(request_id="r", epoch=1, block_start=0, num_blocks=1, block_hashes=[], layer_start=0, num_layers=1,
                  kv_group_size=64, arrays=[ArraySpec(name=f"a{i}", dtype="float16", shape=list(s))
                                            for i, s in enumerate(shapes)])


@pytest.mark.parametrize("frames,error", [
    ([msgpack.packb({**Ack(request_id="r", epoch=1).model_dump(), "version": 2})], "unsupported version 2"),
    ([msgpack.packb({"version": 1, "type": "bogus", "request_id": "r"})], "bogus"),
    ([msgpack.packb({**Ack(request_id="r", epoch=1).model_dump(), "epoch": -1})], "'ack' message at ack.epoch"),
    ([msgpack.packb({**Ack(request_id="r", epoch=1).model_dump(), "epoch": "7"})], "'ack' message at ack.epoch"),
    ([encode(Ack(request_id="r", epoch=1))[0][:-2]], "not valid msgpack"),
    ([msgpack.packb([1, "ack"])], "must be a msgpack map"),
    ([encode(Ack(request_id="r", epoch=1))[0], b"x"], "1 array frames but its header names 0"),
    ([encode(_blocks_header([2, 3], [4]))[0], bytes(12)], "1 array frames but its header names 2"),
    ([encode(_blocks_header([2, 3]))[0], bytes(11)], "frame has 11 bytes but shape \\[2, 3\\] of float16 needs 12"),
    ([encode(_blocks_header([2, 3]))[0], bytes(13)], "frame has 13 bytes"),
], ids=["version", "unknown-type", "out-of-range", "wrong-type", "truncated-header", "not-a-map",
        "frames-on-ack", "missing-frame", "short-frame", "long-frame"])
def test_each_malformation_is_a_wire_error_that_says_what_is_wrong(frames, error):
    with pytest.raises(WireError, match=error):
        decode(frames)


def test_a_message_round_trips_through_zmq_frames_without_copies():
    """Frames received with copy=False are zmq.Frame objects; decode reads their buffers."""
    k = to_mx(np.arange(2 * 4 * 3, dtype=np.uint16).tobytes(), "bfloat16", [2, 4, 3])
    packed = mx.array(np.arange(8, dtype=np.uint32) * 0x01010101).reshape(2, 4)
    msg = Blocks(request_id="r", epoch=3, block_start=0, num_blocks=1, block_hashes=[2**64 - 1], layer_start=0,
                 num_layers=2, kv_bits=4, kv_group_size=32,
                 arrays=[ArraySpec(name="k", dtype="bfloat16", shape=[2, 4, 3]),
                         ArraySpec(name="k.packed", dtype="uint32", shape=[2, 4])])
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://wire-fuzz")
        b.connect("inproc://wire-fuzz")
        a.send_multipart(encode(msg, [k, packed]), copy=False)
        assert b.poll(5000, zmq.POLLIN)
        got, (k2, p2) = decode(b.recv_multipart(copy=False))
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()
    assert got == msg and k2.dtype == np.uint16 and p2.dtype == np.uint32  # bfloat16 arrives as its words
    assert bits(k2) == bits(k) and bits(p2) == bits(packed)


@pytest.mark.parametrize("shape", [[2**30, 2**30, 16], [0, 2**31 - 1, 2**31 - 1]])
def test_shapes_whose_size_overflows_are_wire_errors(shape):
    """A shape whose element count is beyond int64 or beyond what NumPy can allocate, against an empty frame, is
    a WireError, never a plain ValueError from the reshape (the size is computed in Python integers, so it
    cannot wrap to 0 and match the empty frame)."""
    header = Blocks(request_id="r", epoch=1, block_start=0, num_blocks=1, block_hashes=[], layer_start=0,
                    num_layers=1, kv_group_size=64, arrays=[ArraySpec(name="k", dtype="float32", shape=shape)])
    with pytest.raises(WireError):
        decode([encode(header)[0], b""])
