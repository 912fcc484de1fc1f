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
    kv_snapshot_reply {seq, boot_id, last_event_seq, block_hashes}
Worker -> anyone subscribed (its PUB socket, `events_port`):
    kv_events {worker, boot_id, events: [{seq, kind, block_hashes}, ...]}   kind: stored | removed | cleared
              sequence numbers are consecutive per boot; a gap or a new boot_id means resync from a snapshot

`GenerateRequest` and `RequestOutput` travel as maps of built-in values (`request_to_wire` and friends).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal, Optional, Union

import msgpack
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from cluster.engine_client import EngineError
from cluster.request import FinishReason, GenerateRequest, RequestOutput, SamplingParams, TokenLogprob

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 16 * 2**20


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the text says what is wrong."""


def pack(msg: BaseModel) -> bytes:
    """The msgpack frame of a message model."""
    return msgpack.packb(msg.model_dump(), use_bin_type=True)


def unpack(frame, adapter: TypeAdapter, version: int, error: type[ValueError] = ProtocolError):
    """Validate one msgpack frame (bytes, memoryview or zmq.Frame) into a message model of `adapter`.
    Raises `error` (a ValueError) naming the problem: too large, not msgpack, wrong version, bad field."""
    data = frame.buffer if hasattr(frame, "buffer") else frame
    if len(data) > MAX_HEADER_BYTES:
        raise error(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for garbage
        raise error(f"header is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(raw, dict):
        raise error("header must be a msgpack map")
    if type(raw.get("version")) is not int or raw["version"] != version:
        raise error(f"unsupported version {raw.get('version')!r} (this worker speaks {version})")
    try:
        return adapter.validate_python(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "header"
        raise error(f"invalid {raw.get('type')!r} message at {where}: {first['msg']}") from None


# -- requests and outputs as built-in values ---------------------------------------------------------------

def request_to_wire(request: GenerateRequest) -> dict:
    return dataclasses.asdict(request)


def request_from_wire(data: Any) -> GenerateRequest:
    """Rebuild a GenerateRequest; raises ProtocolError for anything that is not a valid one."""
    try:
        d = dict(data)
        s = dict(d.pop("sampling"))
        s["logit_bias"] = tuple((int(t), float(b)) for t, b in s.get("logit_bias", ()))
        for key in ("stop", "stop_token_ids"):
            s[key] = tuple(s.get(key, ()))
        return GenerateRequest(prompt_token_ids=tuple(d.pop("prompt_token_ids")), sampling=SamplingParams(**s), **d)
    except (TypeError, ValueError, KeyError) as exc:
        raise ProtocolError(f"invalid request: {exc}") from None


def output_to_wire(output: RequestOutput) -> dict:
    d = dataclasses.asdict(output)
    d["finish_reason"] = output.finish_reason.value if output.finish_reason else None
    return d


def _logprobs(items) -> Optional[tuple[TokenLogprob, ...]]:
    if items is None:
        return None
    return tuple(TokenLogprob(int(x["token_id"]), float(x["logprob"]), tuple((int(t), float(p)) for t, p in x["top"]))
                 for x in items)


def output_from_wire(data: Any) -> RequestOutput:
    """Rebuild a RequestOutput; raises ProtocolError for anything that is not a valid one."""
    try:
        d = dict(data)
        reason = d.pop("finish_reason")
        return RequestOutput(token_ids=tuple(d.pop("token_ids")), logprobs=_logprobs(d.pop("logprobs")),
                             prompt_logprobs=_logprobs(d.pop("prompt_logprobs")),
                             finish_reason=FinishReason(reason) if reason is not None else None, **d)
    except (TypeError, ValueError, KeyError) as exc:
        raise ProtocolError(f"invalid output: {exc}") from None


# -- the control messages -----------------------------------------------------------------------------------

class _Message(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    version: Literal[1] = PROTOCOL_VERSION


class Generate(_Message):
    type: Literal["generate"] = "generate"
    request: dict
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


class Output(_Message):
    type: Literal["output"] = "output"
    output: dict


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
    stats: dict


class ResetDone(_Message):
    type: Literal["reset_done"] = "reset_done"
    seq: int = Field(ge=0)
    count: int = Field(ge=0)


class SnapshotRequest(_Message):
    type: Literal["kv_snapshot"] = "kv_snapshot"
    seq: int = Field(ge=0)


class Snapshot(_Message):
    type: Literal["kv_snapshot_reply"] = "kv_snapshot_reply"
    seq: int = Field(ge=0)
    boot_id: str = Field(max_length=64)
    last_event_seq: int = Field(ge=0)
    block_hashes: list[Annotated[int, Field(ge=0, lt=2**64)]]


class KVEvent(BaseModel):
    """One change to a worker's cached set (cluster.block_pool.KVEvent on the wire)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    seq: int = Field(ge=1)
    kind: Literal["stored", "removed", "cleared"]
    block_hashes: list[Annotated[int, Field(ge=0, lt=2**64)]] = []


class KVEvents(_Message):
    type: Literal["kv_events"] = "kv_events"
    worker: str = Field(max_length=256)
    boot_id: str = Field(max_length=64)
    events: list[KVEvent]


ToWorker = Union[Generate, AbortRequest, Ping, ResetPrefixCache, SnapshotRequest]
ToRouter = Union[Output, Rejected, Pong, ResetDone, Snapshot]
TO_WORKER: TypeAdapter = TypeAdapter(Annotated[ToWorker, Field(discriminator="type")])
TO_ROUTER: TypeAdapter = TypeAdapter(Annotated[ToRouter, Field(discriminator="type")])
KV_EVENTS: TypeAdapter = TypeAdapter(KVEvents)
