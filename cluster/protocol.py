"""The control protocol between the router and the workers, and the msgpack framing every wire shares.

A message is one msgpack map validated into a pydantic model chosen by its `type` field (an explicit
registry: a discriminated union; no pickle between hosts), with `version` = `PROTOCOL_VERSION`. KV blocks
use the same header framing with their own message set (kv_transfer/wire.py).

Router -> worker (the worker's ROUTER control socket; one DEALER per worker at the router):
    generate  {request, decode_endpoint?, prefilled}   run a request: a prefill worker prefills it and ships
              its KV to `decode_endpoint`; a decode worker either waits for that KV (`prefilled`) or
              prefills the prompt itself
    abort     {request_id}                             stop it wherever it is (queue, transfer, batch)
    ping      {seq}                                    heartbeat; the answer carries the worker's stats
    reset_prefix_cache {seq}
    kv_snapshot {seq}                                  every block hash its prefix cache holds (resync)
Worker -> router:
    output    {output}                                 a RequestOutput delta (cluster/request.py)
    rejected  {request_id, reason, status, retry_after?}  the request never ran here (400: it never can,
                                                       503: not now); nothing of it is left on the worker
    pong      {seq, stats}
    reset_done {seq, count}
    kv_snapshot_reply {seq, boot_id, last_event_seq, groups: [{group, reach_tokens, block_hashes}, ...]}
              every KV cache group of the worker's prefix cache (cluster/kv/index_view.py), the main pool's
              as group 0: its number, its reach (positions before a prefix hit's end it must hold for the hit
              to be usable; null: every position) and the block hashes it holds
Worker -> anyone subscribed (its PUB socket, `events_port`):
    kv_events {worker, boot_id, events: [{seq, kind, block_hashes, group}, ...]}   kind: stored | removed |
              cleared, each of one group's cached set (`group` as in the snapshot reply)
              sequence numbers are consecutive per boot; a gap or a new boot_id means resync from a snapshot

`generate.request` is a `GenerateRequest`, `output.output` a `RequestOutput` and `pong.stats` a `WorkerStats`
(cluster/stats.py; its KV cache groups a list of records, its load check a record or null): typed in the
message models, validated with the message in one pass (`from_wire`, exact types) and packed as maps of built-in values (`to_wire`). In-process (single-node mode) the same models carry the objects unconverted.

`output`, the one message sent per token, is not a pydantic model: `Output` is a msgspec Struct, packed by
msgspec's encoder (`pack_output`) and decoded by a msgspec decoder built once (`TO_ROUTER`'s fast path), into
a Struct mirror of `RequestOutput` that forbids unknown keys and checks every type exactly (no coercion, as
`from_wire`), then rebuilt as the `RequestOutput` itself. The bytes are the same msgpack map as before.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

import msgpack
import msgspec
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, TypeAdapter, ValidationError
from pydantic import field_validator

from cluster.engine_client import EngineError
from cluster.request import GenerateRequest, RequestOutput
from cluster.stats import WorkerStats
from cluster.wire_structs import from_wire_struct, wire_struct

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 16 * 2**20


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the text says what is wrong."""


def pack(msg) -> bytes:
    """The msgpack frame of a message (a pydantic message model, or `Output`)."""
    if type(msg) is Output:
        return pack_output(msg.output)
    return msgpack.packb(msg.model_dump(), use_bin_type=True)


def unpack(frame, adapter, version: int, error: type[ValueError] = ProtocolError):
    """Validate one msgpack frame (bytes, memoryview or zmq.Frame) into a message of `adapter` (a pydantic
    TypeAdapter, or a `MessageSet` whose msgspec messages are tried first, in one C pass).
    Raises `error` (a ValueError) naming the problem: too large, not msgpack, wrong version, bad field."""
    data = frame.buffer if hasattr(frame, "buffer") else frame
    if len(data) > MAX_HEADER_BYTES:
        raise error(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    if isinstance(adapter, MessageSet):
        try:
            wire = adapter.decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass  # not one of the fast messages, or not valid: the general path below says what is wrong
        else:
            if wire.version != version:
                raise error(f"unsupported version {wire.version!r} (this worker speaks {version})")
            return adapter.make[type(wire)](wire)
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for garbage
        raise error(f"header is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(raw, dict):
        raise error("header must be a msgpack map")
    if type(raw.get("version")) is not int or raw["version"] != version:
        raise error(f"unsupported version {raw.get('version')!r} (this worker speaks {version})")
    if isinstance(adapter, MessageSet):
        wire_type = adapter.wire_types.get(raw.get("type")) if isinstance(raw.get("type"), str) else None
        if wire_type is not None:
            try:
                wire = msgspec.convert(raw, wire_type, strict=True)
            except msgspec.ValidationError as exc:
                message, at, where = str(exc).rpartition(" - at `")  # msgspec's "<what> - at `$.a.b[0]`"
                where = where.rstrip("`").removeprefix("$").removeprefix(".") if at else ""
                raise error(f"invalid {raw['type']!r} message at {where or 'header'}: {message or exc}") from None
            return adapter.make[wire_type](wire)
        adapter = adapter.adapter
    try:
        return adapter.validate_python(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "header"
        message = first["msg"].removeprefix("Value error, ")  # a field validator's own ProtocolError text
        raise error(f"invalid {raw.get('type')!r} message at {where}: {message}") from None


# -- request-level values on the wire --------------------------------------------------------------------

def to_wire(value: Any) -> Any:
    """The msgpack-ready form of a request-level value (cluster/request.py): a dataclass becomes a map of its
    fields, an enum its value, a tuple a list; built-in values stay as they are."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [to_wire(v) for v in value]
    return value


def from_wire(tp: Any, data: Any, where: str = "") -> Any:
    """Rebuild a value of type `tp` (a request-level dataclass, or a type its fields use: int, float, str,
    bool, an enum, Optional[...], tuple[X, ...], a fixed-size tuple) from its wire form, checking every type
    exactly on the way (no coercion: "1" is not an int, True is not a number, unknown keys are errors); the
    dataclass's own checks (`SamplingParams.__post_init__`, ...) then apply. Raises ProtocolError naming the
    field."""
    return _converter(tp)(data, where or getattr(tp, "__name__", str(tp)))


@functools.lru_cache(maxsize=None)
def _converter(tp: Any):
    """The function (data, where) -> value that `from_wire` uses for `tp`, built once per type."""
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = {f.name: _converter(hints[f.name]) for f in dataclasses.fields(tp)}

        def dataclass_value(data, name):
            if not isinstance(data, dict):
                raise ProtocolError(f"{name} must be a map")
            unknown = [str(k) for k in data if k not in fields]
            if unknown:
                raise ProtocolError(f"{name}: unknown field(s) {', '.join(sorted(unknown))}")
            values = {k: fields[k](v, f"{name}.{k}") for k, v in data.items()}
            try:
                return tp(**values)
            except (TypeError, ValueError) as exc:
                raise ProtocolError(f"invalid {name}: {exc}") from None
        return dataclass_value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        inner = _converter(next(a for a in args if a is not type(None)))
        return lambda data, name: None if data is None else inner(data, name)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            item = _converter(args[0])

            def array(data, name):
                if not isinstance(data, (list, tuple)):
                    raise ProtocolError(f"{name} must be an array")
                return tuple(item(v, f"{name}[{i}]") for i, v in enumerate(data))
            return array
        items = [_converter(a) for a in args]

        def fixed(data, name):
            if not isinstance(data, (list, tuple)) or len(data) != len(items):
                raise ProtocolError(f"{name} must be an array of {len(items)} items")
            return tuple(conv(v, f"{name}[{i}]") for i, (conv, v) in enumerate(zip(items, data)))
        return fixed
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        def member(data, name):
            try:
                return tp(data)
            except ValueError:
                raise ProtocolError(f"{name}={data!r} is not one of {', '.join(str(m.value) for m in tp)}") from None
        return member
    if tp is float:
        def number(data, name):
            if type(data) is not float and type(data) is not int:
                raise ProtocolError(f"{name} must be a number")
            return float(data)
        return number
    if tp in (int, str, bool):
        kind = {int: "an integer", str: "a string", bool: "a boolean"}[tp]

        def exact(data, name):
            if type(data) is not tp:
                raise ProtocolError(f"{name} must be {kind}")
            return data
        return exact
    raise TypeError(f"from_wire cannot rebuild {tp!r}")  # a field type this function does not know: a bug


def _typed(cls: type):
    """A message field of the request-level type `cls`: built from a `cls` instance as it is (in-process) or
    validated from its wire map by `from_wire` (from a socket), packed by `to_wire`."""
    def validate(value):
        return value if type(value) is cls else from_wire(cls, value)

    return Annotated[cls, PlainValidator(validate), PlainSerializer(to_wire)]


WireRequest = _typed(GenerateRequest)
WireStats = _typed(WorkerStats)


# -- the per-token message, on msgspec ------------------------------------------------------------------

class Output(msgspec.Struct, frozen=True, gc=False):
    """Worker -> router: one `RequestOutput` delta, the message sent per token (packed by `pack_output`)."""

    type: ClassVar[str] = "output"
    output: RequestOutput
    version: int = PROTOCOL_VERSION


_RequestOutputWire = wire_struct(RequestOutput)


class _OutputWire(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False, tag_field="type",
                  tag="output"):
    """What an `output` frame decodes into: its version (checked by `unpack`) and the `RequestOutput` mirror."""

    version: int
    output: _RequestOutputWire


_OUTPUT_ENCODER = msgspec.msgpack.Encoder()
_rebuild_output = from_wire_struct(RequestOutput)


def pack_output(output: RequestOutput) -> bytes:
    """The msgpack frame of the `output` message carrying `output`: the map
    {version, type: "output", output: {every field of RequestOutput}} (enums as their values, tuples as arrays)."""
    return _OUTPUT_ENCODER.encode({"version": PROTOCOL_VERSION, "type": "output", "output": output})


class MessageSet:
    """The messages one socket reads: the msgspec ones (`fast`: `type` -> Struct decoded from the frame and the
    function making the message of it), decoded by one decoder built here, and the pydantic ones of `adapter`
    (a TypeAdapter discriminated by `type`), tried when the frame is not a valid fast message."""

    def __init__(self, adapter: TypeAdapter, fast: dict[str, tuple[type, Any]]):
        self.adapter = adapter
        self.wire_types = {name: wire for name, (wire, _) in fast.items()}
        self.make = {wire: make for wire, make in fast.values()}
        types = tuple(self.wire_types.values())
        self.decoder = msgspec.msgpack.Decoder(types[0] if len(types) == 1 else Union[types])


def generate_request_id(frame) -> Optional[str]:
    """The request id a `generate` frame names, when it names one (a string), whatever else is wrong with it:
    so a generate that cannot be validated can still be refused by id. None for anything else."""
    data = frame.buffer if hasattr(frame, "buffer") else frame
    if len(data) > MAX_HEADER_BYTES:
        return None
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:
        return None
    request = raw.get("request") if isinstance(raw, dict) and raw.get("type") == "generate" else None
    rid = request.get("request_id") if isinstance(request, dict) else None
    return rid[:256] if isinstance(rid, str) and rid else None


# -- the control messages -----------------------------------------------------------------------------------

class _Message(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    version: Literal[1] = PROTOCOL_VERSION


class Generate(_Message):
    type: Literal["generate"] = "generate"
    request: WireRequest
    decode_endpoint: Optional[str] = Field(default=None, max_length=512)
    prefilled: bool = False


class AbortRequest(_Message):
    type: Literal["abort"] = "abort"
    request_id: str = Field(min_length=1, max_length=256)


class Ping(_Message):
    type: Literal["ping"] = "ping"
    seq: int = Field(ge=0)


class ResetPrefixCache(_Message):
    type: Literal["reset_prefix_cache"] = "reset_prefix_cache"
    seq: int = Field(ge=0)


class Rejected(_Message):
    type: Literal["rejected"] = "rejected"
    request_id: str = Field(min_length=1, max_length=256)
    reason: str = Field(max_length=4096)
    status: int = Field(ge=400, le=599)
    retry_after: Optional[float] = None

    def error(self) -> Exception:
        """What an `EngineClient.generate` raises for this refusal: `EngineError` (the router's 503, with
        Retry-After when `retry_after` is set) for a status of 500 and up, `ValueError` (its 400) below."""
        return EngineError(self.reason, retry_after=self.retry_after) if self.status >= 500 else ValueError(self.reason)


class Pong(_Message):
    type: Literal["pong"] = "pong"
    seq: int = Field(ge=0)
    stats: WireStats


class ResetDone(_Message):
    type: Literal["reset_done"] = "reset_done"
    seq: int = Field(ge=0)
    count: int = Field(ge=0)


class SnapshotRequest(_Message):
    type: Literal["kv_snapshot"] = "kv_snapshot"
    seq: int = Field(ge=0)


MAX_KV_GROUPS = 16


class CacheGroupEntries(BaseModel):
    """One KV cache group of a worker's prefix cache in a `PrefixIndexSnapshot`: its number (the `group` of
    its KV events), its reach (positions before a prefix hit's end it must hold for the hit to be usable;
    None: every position from 0) and the block hashes it holds (cluster/kv/index_view.py)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    group: int = Field(ge=0, lt=MAX_KV_GROUPS)
    reach_tokens: Optional[int] = Field(ge=0)
    block_hashes: list[Annotated[int, Field(ge=0, lt=2**64)]]


class PrefixIndexSnapshot(_Message):
    """Every block hash a worker's prefix cache holds, by KV cache group, as of its event `last_event_seq`."""

    type: Literal["kv_snapshot_reply"] = "kv_snapshot_reply"
    seq: int = Field(ge=0)
    boot_id: str = Field(max_length=64)
    last_event_seq: int = Field(ge=0)
    groups: list[CacheGroupEntries] = Field(max_length=MAX_KV_GROUPS)

    @field_validator("groups")
    @classmethod
    def _distinct_groups(cls, groups: list[CacheGroupEntries]) -> list[CacheGroupEntries]:
        if len({g.group for g in groups}) != len(groups):
            raise ValueError("a KV cache group is listed twice")
        return groups


class KVEvent(BaseModel):
    """One change to a worker's cached set (cluster.kv.block_pool.KVEvent on the wire)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    seq: int = Field(ge=1)
    kind: Literal["stored", "removed", "cleared"]
    block_hashes: list[Annotated[int, Field(ge=0, lt=2**64)]] = []
    group: int = Field(default=0, ge=0, lt=MAX_KV_GROUPS)


class KVEvents(_Message):
    type: Literal["kv_events"] = "kv_events"
    worker: str = Field(max_length=256)
    boot_id: str = Field(max_length=64)
    events: list[KVEvent]


ToWorker = Union[Generate, AbortRequest, Ping, ResetPrefixCache, SnapshotRequest]
ToRouter = Union[Output, Rejected, Pong, ResetDone, PrefixIndexSnapshot]
TO_WORKER: TypeAdapter = TypeAdapter(Annotated[ToWorker, Field(discriminator="type")])
TO_ROUTER = MessageSet(
    TypeAdapter(Annotated[Union[Rejected, Pong, ResetDone, PrefixIndexSnapshot], Field(discriminator="type")]),
    {"output": (_OutputWire, lambda wire: Output(output=_rebuild_output(wire.output), version=wire.version))})
KV_EVENTS: TypeAdapter = TypeAdapter(KVEvents)
