"""The per-token `output` message on msgspec: the same msgpack map as the generic codec packs, decoded back into
the same `RequestOutput`, with the generic codec's strictness (exact types, unknown keys refused, the version
checked) and errors that name the field."""

from __future__ import annotations

import dataclasses
import math
import re

import msgpack
import msgspec
import pytest

from cluster.protocol import (MAX_HEADER_BYTES, PROTOCOL_VERSION, TO_ROUTER, Output, Pong, ProtocolError, Rejected,
                              pack, pack_output, to_wire, unpack)
from cluster.request import FinishReason, RequestOutput, TokenLogprob
from cluster.wire_structs import wire_struct
from cluster.stats import WorkerStats

DELTAS = [
    RequestOutput("r"),
    RequestOutput("req-1", (1234,), " hello", num_prompt_tokens=100, num_output_tokens=1),
    RequestOutput("req-2", (1, 2, 3), "é\"\\\n😀", logprobs=(TokenLogprob(1, -0.5, ((1, -0.5), (7, -2.0))),
                                                         TokenLogprob(2, -math.inf), TokenLogprob(3, 0.0, ((3, 0.0),))),
                  num_output_tokens=3),
    RequestOutput("req-3", (), "", prompt_logprobs=(TokenLogprob(5, -1.25),), num_prompt_tokens=2, num_cached_tokens=16),
    RequestOutput("req-4", (9,), "end", finish_reason=FinishReason.STOP, stop_string="\n\n", num_output_tokens=9),
    RequestOutput("req-5", finish_reason=FinishReason.ERROR, error="the engine failed"),
    RequestOutput("req-6", (4,), "answer", reasoning_text="thinking", num_reasoning_tokens=12,
                  finish_reason=FinishReason.LENGTH),
]


def _frame(**fields) -> bytes:
    return msgpack.packb({"version": PROTOCOL_VERSION, "type": "output", **fields}, use_bin_type=True)


def _output(**fields) -> bytes:
    return _frame(output={"request_id": "r", **fields})


@pytest.mark.parametrize("delta", DELTAS)
def test_an_output_delta_round_trips_and_its_map_is_the_generic_one(delta):
    frame = pack(Output(output=delta))
    assert frame == pack_output(delta)
    got = unpack(frame, TO_ROUTER, PROTOCOL_VERSION)
    assert isinstance(got, Output) and got.type == "output" and got.output == delta
    assert type(got.output) is RequestOutput and all(type(e) is TokenLogprob for e in got.output.logprobs or ())
    assert got.output.finished == delta.finished and dataclasses.replace(got.output, text="x").text == "x"
    # the wire is unchanged: the same map the generic codec (to_wire + msgpack) makes, so either side reads the other
    generic = msgpack.packb({"version": PROTOCOL_VERSION, "type": "output", "output": to_wire(delta)}, use_bin_type=True)
    assert msgpack.unpackb(frame) == msgpack.unpackb(generic)
    assert unpack(generic, TO_ROUTER, PROTOCOL_VERSION).output == delta


def test_the_mirror_struct_has_the_dataclass_fields_in_order_with_their_defaults():
    for cls in (RequestOutput, TokenLogprob):
        mirror = wire_struct(cls)
        assert mirror.__struct_fields__ == tuple(f.name for f in dataclasses.fields(cls))
        defaults = {f.name: f.default for f in msgspec.structs.fields(mirror)}
        assert defaults == {f.name: f.default if f.default is not dataclasses.MISSING else msgspec.NODEFAULT
                            for f in dataclasses.fields(cls)}


def test_numbers_are_checked_exactly_and_an_integer_logprob_becomes_a_float():
    got = unpack(_output(logprobs=[{"token_id": 1, "logprob": -1}]), TO_ROUTER, PROTOCOL_VERSION).output
    assert got.logprobs[0].logprob == -1.0 and type(got.logprobs[0].logprob) is float


@pytest.mark.parametrize("fields, where", [
    ({"token_ids": ["1"]}, "output.token_ids[0]"),
    ({"token_ids": [True]}, "output.token_ids[0]"),
    ({"token_ids": [1.0]}, "output.token_ids[0]"),
    ({"text": b"bytes"}, "output.text"),
    ({"text": None}, "output.text"),
    ({"num_output_tokens": "2"}, "output.num_output_tokens"),
    ({"finish_reason": "done"}, "output.finish_reason"),
    ({"logprobs": [{"token_id": 1, "logprob": True}]}, "output.logprobs[0].logprob"),
    ({"logprobs": [{"token_id": 1, "logprob": -1.0, "top": [[1, -1.0, 3]]}]}, "output.logprobs[0].top[0]"),
    ({"logprobs": [{"token_id": 1, "logprob": -1.0, "rank": 1}]}, "output.logprobs[0]"),
    ({"extra": 1}, "output"),
])
def test_a_bad_output_field_is_a_protocol_error_naming_it(fields, where):
    with pytest.raises(ProtocolError, match=f"invalid 'output' message at {re.escape(where)}:"):
        unpack(_output(**fields), TO_ROUTER, PROTOCOL_VERSION)


def test_the_message_itself_is_checked_as_every_other_one():
    with pytest.raises(ProtocolError, match="output.*missing required field `request_id`"):
        unpack(_frame(output={}), TO_ROUTER, PROTOCOL_VERSION)
    with pytest.raises(ProtocolError, match="at header: .*missing required field `output`"):
        unpack(_frame(), TO_ROUTER, PROTOCOL_VERSION)
    with pytest.raises(ProtocolError, match="at header: .*unknown field `extra`"):
        unpack(_frame(output={"request_id": "r"}, extra=1), TO_ROUTER, PROTOCOL_VERSION)
    for version in (0, 2, True, "1", None):
        frame = msgpack.packb({"version": version, "type": "output", "output": {"request_id": "r"}})
        with pytest.raises(ProtocolError, match="unsupported version"):
            unpack(frame, TO_ROUTER, PROTOCOL_VERSION)
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        unpack(_output()[:-3], TO_ROUTER, PROTOCOL_VERSION)
    with pytest.raises(ProtocolError, match="exceeds"):
        unpack(_output(text="x" * MAX_HEADER_BYTES), TO_ROUTER, PROTOCOL_VERSION)
    with pytest.raises(ProtocolError, match="must be a msgpack map"):
        unpack(msgpack.packb([1, "output"]), TO_ROUTER, PROTOCOL_VERSION)


def test_the_other_router_messages_still_decode_beside_it():
    pong = Pong(seq=3, stats=WorkerStats())
    assert unpack(pack(pong), TO_ROUTER, PROTOCOL_VERSION) == pong
    rejected = Rejected(request_id="r", reason="no", status=400)
    assert unpack(pack(rejected), TO_ROUTER, PROTOCOL_VERSION) == rejected
    with pytest.raises(ProtocolError, match="pong"):
        unpack(msgpack.packb({"version": 1, "type": "pong", "seq": "3"}), TO_ROUTER, PROTOCOL_VERSION)
    with pytest.raises(ProtocolError):
        unpack(msgpack.packb({"version": 1, "type": "launch"}), TO_ROUTER, PROTOCOL_VERSION)
