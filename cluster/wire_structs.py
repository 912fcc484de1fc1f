"""Request-level dataclasses (cluster/request.py) as msgspec Structs: `wire_struct` builds a Struct mirroring a
dataclass field for field (what msgspec decodes a wire map into, with unknown keys and inexact types refused, as
cluster/protocol.py's `from_wire` refuses them) and `from_wire_struct` the function that rebuilds the dataclass
from it. The per-token `output` message (cluster/protocol.py) decodes through them."""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Union

import msgspec


@functools.lru_cache(maxsize=None)
def wire_struct(cls: type) -> type:
    """The msgspec Struct mirroring the request-level dataclass `cls` field for field (same names, order,
    defaults; a nested dataclass by its own mirror): what msgspec decodes the wire map into, with unknown keys
    and inexact types refused as `from_wire` refuses them. Built once per class."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        tp = _wire_type(hints[f.name])
        if f.default is not dataclasses.MISSING:
            fields.append((f.name, tp, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            fields.append((f.name, tp, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, tp))
    return msgspec.defstruct(f"{cls.__name__}Wire", fields, frozen=True, forbid_unknown_fields=True, gc=False)


def _wire_type(tp: Any) -> Any:
    """`tp` with each request-level dataclass in it replaced by its `wire_struct`."""
    if dataclasses.is_dataclass(tp):
        return wire_struct(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        return Union[tuple(_wire_type(a) for a in args)]
    if origin is tuple:
        return tuple[tuple(a if a is Ellipsis else _wire_type(a) for a in args)]
    return tp


@functools.lru_cache(maxsize=None)
def from_wire_struct(cls: type):
    """The function that rebuilds a `cls` (a request-level dataclass) from its decoded `wire_struct`. A class
    without `__post_init__` (nothing left to check) is filled straight from the Struct's fields, which costs
    half of its generated `__init__` (frozen: one `object.__setattr__` per field); nested dataclasses are
    rebuilt the same way."""
    hints = typing.get_type_hints(cls)
    nested = {}
    for f in dataclasses.fields(cls):
        inner = _nested(hints[f.name])
        if inner is not None:
            nested[f.name] = inner
    plain = not hasattr(cls, "__post_init__") and not hasattr(cls, "__slots__")
    asdict, new, setattr_ = msgspec.structs.asdict, object.__new__, object.__setattr__

    def rebuild(wire):
        values = asdict(wire)
        for name, conv in nested.items():
            if values[name] is not None:
                values[name] = conv(values[name])
        if not plain:
            return cls(**values)
        value = new(cls)
        setattr_(value, "__dict__", values)
        return value
    return rebuild


def _nested(tp: Any):
    """The converter of a field of type `tp` that holds request-level dataclasses (None: nothing to rebuild)."""
    if dataclasses.is_dataclass(tp):
        return from_wire_struct(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        inner = [_nested(a) for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"from_wire_struct cannot rebuild {tp!r}")
        return inner[0]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _nested(args[0])
        return None if item is None else (lambda seq: tuple(map(item, seq)))
    if origin is tuple and any(_nested(a) is not None for a in args):
        raise TypeError(f"from_wire_struct cannot rebuild {tp!r}")
    return None
