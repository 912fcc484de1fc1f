"""The KV wire: one ZeroMQ multipart message = a msgpack header frame + raw array frames.

Frame 0 is a msgpack map validated into one of the message models below (explicit type registry, no
pickle); its `version` must equal `WIRE_VERSION`. Only `blocks` and `done` messages carry further frames: one
raw frame per array named in the header, in header order, sent with `copy=False` (blocks straight from the
pool's gather). A `done` of a model with recurrent layers carries the sequence's state after the whole
prompt (`state_frames`: per recurrent layer its arrays [1, *shape] in the model's dtype, named state.L.I, as
the format's `state` lists them); for any other model it carries none.

    blocks  header {version: 1, type: "blocks", request_id: "r1", epoch: 7,
                    block_start: 2, num_blocks: 64, block_hashes: [<64 uint64>],
                    layer_start: 0, num_layers: 30, kv_bits: null, kv_group_size: 64,
                    arrays: [{name: "k", dtype: "float32", shape: [30, 2048, 3, 64]}, {name: "v", ...}]}
            frame 1: k bytes (30 * 2048 * 3 * 64 * 4 = 47,185,920), frame 2: v bytes (same)

Array shapes are [layers, num_blocks * block_size, kv_heads, d] (see cluster.kv.store.KVStore.read_blocks);
quantized KV travels as its (packed uint32, scales, biases) arrays per K and V, never dequantized.
bfloat16 travels as its raw 16-bit words (NumPy has no bfloat16). Arrays are NumPy views both ways: the
sender's one copy gathers whole blocks out of the pool, the receiver's one copy scatters them into it.

Message flow (S = sender, the prefill worker; R = receiver, the decode worker):
S->R offer; R->S reserved | refused | busy; S->R blocks*, done; R->S ack; either way: abort.
`decode` rejects anything malformed with `WireError` (a ValueError) and never touches KV memory.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, Optional, Sequence, Union

import mlx.core as mx
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from cluster.protocol import pack, unpack
from kv_transfer.handshake import KVFormat

WIRE_VERSION = 1
_WIRE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "uint32": np.uint32}
_MAX_TOKENS = 2**22


class WireError(ValueError):
    """A message that does not follow the wire format; the text says what is wrong."""


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    version: Literal[1] = WIRE_VERSION
    request_id: str = Field(min_length=1, max_length=256)


class ArraySpec(BaseModel):
    """One payload frame: array `name` (cluster.kv.store.KVStore.array_names), dtype and shape."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    name: str = Field(max_length=32)
    dtype: Literal["float32", "float16", "bfloat16", "uint32"]
    shape: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(min_length=1, max_length=8)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(_WIRE_DTYPES[self.dtype]).itemsize


class Offer(_Message):
    """S->R: open a transfer of the KV of `token_ids` (hashed with `cache_salt`) in `format`; `block_hashes`:
    the chained hashes of their leading full blocks under `format`'s first-block key, as far as the sender
    has them (the receiver hashes the rest)."""

    type: Literal["offer"] = "offer"
    format: KVFormat
    token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(max_length=_MAX_TOKENS)
    cache_salt: Optional[str] = Field(default=None, max_length=1024)
    block_hashes: list[Annotated[int, Field(ge=0, lt=2**64)]] = Field(default=[], max_length=_MAX_TOKENS)


class Reserved(_Message):
    """R->S: blocks reserved; send blocks from index `num_cached_blocks` to `num_blocks` - 1."""

    type: Literal["reserved"] = "reserved"
    epoch: int = Field(ge=0, lt=2**63)
    num_cached_blocks: int = Field(ge=0)
    num_blocks: int = Field(ge=1)


class Refused(_Message):
    type: Literal["refused"] = "refused"
    reason: str = Field(max_length=4096)


class BusyAnswer(_Message):
    type: Literal["busy"] = "busy"
    retry_after_s: float = Field(ge=0, le=60)


class Blocks(_Message):
    """S->R: KV of blocks [block_start, block_start + num_blocks) of the prompt, layers
    [layer_start, layer_start + num_layers) of the KV cache group numbered `group` (its index among the
    worker's groups, cluster/kv/groups.py; each group's blocks are sent from the first one the decode worker's
    next query needs); `block_hashes` of those that are full."""

    type: Literal["blocks"] = "blocks"
    epoch: int = Field(ge=0, lt=2**63)
    block_start: int = Field(ge=0)
    num_blocks: int = Field(ge=1)
    block_hashes: list[Annotated[int, Field(ge=0, lt=2**64)]] = Field(max_length=_MAX_TOKENS)
    layer_start: int = Field(ge=0)
    num_layers: int = Field(ge=1)
    group: int = Field(default=0, ge=0, le=15)
    kv_bits: Optional[int] = None
    kv_group_size: int
    arrays: list[ArraySpec] = Field(max_length=6)


class Done(_Message):
    """S->R: every block is sent; the first token sampled from the prompt's last logits; `arrays`: the
    recurrent state after the prompt (`state_specs`), empty for a model without recurrent layers."""

    type: Literal["done"] = "done"
    epoch: int = Field(ge=0, lt=2**63)
    first_token: int = Field(ge=0, lt=2**31)
    first_logprob: Optional[float] = None
    arrays: list[ArraySpec] = Field(default=[], max_length=4096)


class Ack(_Message):
    """R->S: the transfer is complete and the receiver owns the sequence."""

    type: Literal["ack"] = "ack"
    epoch: int = Field(ge=0, lt=2**63)


class Abort(_Message):
    """Either way: stop the transfer and free its blocks (`epoch` None: before any reservation)."""

    type: Literal["abort"] = "abort"
    epoch: Optional[int] = Field(default=None, ge=0, lt=2**63)
    reason: str = Field(max_length=4096)


Message = Union[Offer, Reserved, Refused, BusyAnswer, Blocks, Done, Ack, Abort]
_ADAPTER: TypeAdapter = TypeAdapter(Annotated[Message, Field(discriminator="type")])


def state_specs(fmt: KVFormat) -> list[ArraySpec]:
    """The array frames of a `done` message in format `fmt`: each recurrent layer's state arrays [1, *shape]."""
    return [ArraySpec(name=f"state.{layer}.{i}", dtype=a.dtype, shape=[1, *a.shape])
            for layer, arrays in enumerate(fmt.state) for i, a in enumerate(arrays)]


def state_frames(state) -> list[np.ndarray]:
    """A sequence's recurrent state (per layer, a tuple of evaluated MLX arrays [1, *shape]) as contiguous
    NumPy arrays in `state_specs` order (bfloat16 as its 16-bit words). It is small beside the KV (one
    fixed-size state per sequence), so it is copied out of MLX rather than viewed."""
    return [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a) for layer in state for a in layer]


def state_from_frames(fmt: KVFormat, arrays: Sequence[np.ndarray]) -> tuple:
    """The state `state_frames` sent, as MLX arrays grouped by layer (copied out of the frames)."""
    flat = iter(arrays)
    return tuple(tuple(mx.array(next(flat)).view(mx.bfloat16) if a.dtype == "bfloat16" else mx.array(next(flat))
                       for a in layer) for layer in fmt.state)


def encode(msg: Message, arrays: Sequence[np.ndarray] = ()) -> list:
    """Frames for `msg`: the msgpack header, then each array (C-contiguous NumPy, or an evaluated MLX array)
    as a zero-copy memoryview."""
    frames: list = [pack(msg)]
    for a in arrays:
        if isinstance(a, mx.array) and a.dtype == mx.bfloat16:
            a = a.view(mx.uint16)
        frames.append(memoryview(a))
    return frames


def decode_header(frame) -> Message:
    """Parse and validate frame 0. Raises WireError for anything but a valid header of a known type and
    version."""
    return unpack(frame, _ADAPTER, WIRE_VERSION, WireError)


def decode_arrays(msg: Message, payload: Sequence) -> list[np.ndarray]:
    """The arrays of a `blocks` or `done` message as zero-copy NumPy views of its payload frames (bfloat16 as
    uint16 words), valid while the frames live. Raises WireError when the frame count or a frame's size does
    not match the header."""
    specs = msg.arrays if isinstance(msg, (Blocks, Done)) else []
    if len(payload) != len(specs):
        raise WireError(f"{msg.type} message has {len(payload)} array frames but its header names {len(specs)}")
    out = []
    for spec, frame in zip(specs, payload):
        buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
        if buf.nbytes != spec.nbytes:
            raise WireError(f"array {spec.name!r} frame has {buf.nbytes} bytes but shape {spec.shape} of "
                            f"{spec.dtype} needs {spec.nbytes}")
        try:
            out.append(np.frombuffer(buf, dtype=_WIRE_DTYPES[spec.dtype]).reshape(spec.shape))
        except ValueError as exc:  # e.g. a zero-size array with an absurd shape
            raise WireError(f"array {spec.name!r} of shape {spec.shape} cannot be built: {exc}") from None
    return out


def decode(frames: Sequence) -> tuple[Message, list[np.ndarray]]:
    """Header and arrays of one whole message (tests and tools; workers check the header first)."""
    if not frames:
        raise WireError("empty message")
    msg = decode_header(frames[0])
    return msg, decode_arrays(msg, frames[1:])
