"""The base of every request model: unknown fields are ignored, a misspelled known field is refused.

Every API's request models (router/openai/request.py and tools.py, router/responses/request.py,
router/anthropic/request.py) derive from `RequestModel`. A key the model does not know is ignored, as OpenAI-compatible
servers do, so clients that send another vendor's extensions keep working; but a key that is a near miss of
a field the model knows is a 400 naming it and the field it resembles, because ignoring it would silently
drop what the client asked for (`max_token`, `respone_format`, a json_schema's `schmea`):

    near miss    the key, lowercased with '-' read as '_', is the known name, or is within edit distance 1
                 (a key of 4 to 6 characters) or 2 (longer) of it; edits are insertions, deletions,
                 substitutions and swaps of adjacent characters (optimal string alignment distance);
                 keys under 4 characters are never near misses
    moved        `MOVED` maps a key that belongs to another API to what this API calls it (`max_tokens`
                 sent to the Responses API: use `max_output_tokens`), also a 400

The error is pydantic's, of type `UNKNOWN_FIELD` with the key in its context, so `router.errors` names the
key by its full JSON path (`response_format.json_schema.schmea`).

A field that every API audits (each API's `fields.py`: honoured, metadata, or refused) is refused through a
`Refusal`: `check_field` lets the values through that ask for nothing the server lacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Optional

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

UNKNOWN_FIELD = "unknown_field"  # the pydantic error type of a refused unknown key (its ctx names the key)
MIN_NEAR_MISS_CHARS = 4


def edit_distance(a: str, b: str) -> int:
    """The optimal string alignment distance between `a` and `b` (Levenshtein plus swaps of adjacent
    characters; Damerau 1964), by the usual dynamic program over prefixes."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[len(b)]


def near_miss(key: str, known: Iterable[str]) -> Optional[str]:
    """The known name `key` most likely misspells (rules in the module docstring), or None."""
    if len(key) < MIN_NEAR_MISS_CHARS:
        return None
    norm = key.lower().replace("-", "_")
    best, best_distance = None, None
    for name in known:
        limit = 1 if len(name) <= 6 else 2
        distance = edit_distance(norm, name.lower())
        if distance <= limit and (best_distance is None or distance < best_distance):
            best, best_distance = name, distance
    return best


class RequestModel(BaseModel):
    """A request model (see the module docstring): extra keys ignored unless near misses or `MOVED`."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    MOVED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _unknown_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        for key in data:
            if not isinstance(key, str) or key in known:
                continue
            if key in cls.MOVED:
                raise PydanticCustomError(UNKNOWN_FIELD, "this API has no field '{field}': {instead}",
                                          {"field": key, "instead": cls.MOVED[key]})
            close = near_miss(key, known)
            if close is not None:
                raise PydanticCustomError(
                    UNKNOWN_FIELD, "'{field}' is not a field of this request, and it is close to '{close}': "
                    "correct its name, or leave it out", {"field": key, "close": close})
        return data


@dataclass(frozen=True)
class Refusal:
    """A refused field: `allowed(value)` is True for the values that ask for nothing the router lacks;
    `advice` says what to do instead (the 400's message after the field name)."""

    allowed: Callable[[Any], bool]
    advice: str



def check_field(table: dict[str, Refusal], field: str, value: Any) -> Any:
    """`value` when `field` may have it; ValueError with the field's advice otherwise (pydantic puts the
    field's name in front)."""
    refusal = table.get(field)
    if refusal is not None and not refusal.allowed(value):
        raise ValueError(refusal.advice)
    return value


def absent(value: Any) -> bool:
    """A `Refusal.allowed` for fields that may only be left out (or null)."""
    return value is None


def one_of(*values: Any) -> Callable[[Any], bool]:
    """A `Refusal.allowed` for fields left out or equal to one of `values` (of the same JSON type)."""
    return lambda value: value is None or any(value == v and type(value) is type(v) for v in values)
