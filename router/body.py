"""The one path every JSON request body takes: size limit, JSON, text that is Unicode, then the model.

    read_json(request, max_bytes)   413 past `max_bytes` (the declared Content-Length first, then while
                                    reading, so a huge body is never buffered whole); 400 for an empty body
                                    or bad JSON; 400 naming the field for text that is not Unicode
    parse_body(model, body, ctx)    the pydantic model (validated with the context `ctx`, e.g. the model's
                                    max_model_len), or 400 naming the bad fields

Text that is not Unicode: JSON's `\\ud800` escape (and, through Python's json module, the raw bytes of an
encoded surrogate, which it decodes with "surrogatepass") yields a lone surrogate, a `str` that cannot be
encoded as UTF-8; the tokenizer, the logs and the answer's JSON all fail on it. `check_text` walks every
string and every key of the parsed body once, before any model sees it, so every endpoint and every field
is covered, the ones the router ignores too. The error names the field by its JSON path
(`messages[0].content`, `stop[1]`, `tools[0].function.name`).

The default body limit is sized to the context (`default_max_body_bytes`):

    max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len) = max(4 MiB, 256 B * max_model_len)

A token takes a few bytes of JSON: about 4 characters of text (at most 6 bytes each when escaped as
`\\uXXXX`), or an id such as `12345, `. 256 bytes per token leaves ten times that for message structure,
stop strings and fields the router ignores; the 4 MiB floor covers small contexts with a large
`logit_bias`. So no body that can fit the context is refused, and one far over it (8 MB against an
8192-token context) is refused before it is parsed.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional, Type, TypeVar

from pydantic import BaseModel, ValidationError

from router.errors import APIError, bad_request, from_validation_error

M = TypeVar("M", bound=BaseModel)

MIN_BODY_BYTES = 4 * 1024 * 1024
BODY_BYTES_PER_TOKEN = 256
# In a UTF-8 body only these put a surrogate into the parsed text: a \uD800-\uDFFF escape, or the UTF-8 form
# of a surrogate (ED A0..BF xx), which json.loads decodes with "surrogatepass". Bodies without either skip
# the walk; UTF-16/32 bodies (which json.loads also takes) are always walked.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def default_max_body_bytes(max_model_len: int) -> int:
    """The body limit for a context of `max_model_len` tokens (formula in the module docstring)."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


def _path(parts: tuple[Any, ...]) -> str:
    """`messages[0].content` from ("messages", 0, "content"); keys shown with their bad characters escaped."""
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            key = p.encode("utf-8", "backslashreplace").decode("utf-8")
            out += f".{key}" if out else key
    return out


def _bad_char(text: str) -> Optional[int]:
    """The index of the first character of `text` that UTF-8 cannot encode (a lone surrogate), else None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def check_text(body: Any) -> None:
    """400 naming the first string or key anywhere in `body` that is not Unicode (cannot be UTF-8 encoded)."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(body, ())]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            at = _bad_char(value)
            if at is not None:
                raise _not_unicode(where, value, at, key=False)
        elif isinstance(value, dict):
            for key, item in value.items():
                at = _bad_char(key)
                if at is not None:
                    raise _not_unicode(where + (key,), key, at, key=True)
                if isinstance(item, (str, dict, list)):
                    stack.append((item, where + (key,)))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, (str, dict, list)):
                    stack.append((item, where + (i,)))


def _not_unicode(where: tuple[Any, ...], text: str, at: int, *, key: bool) -> APIError:
    field = _path(where) or None
    what = "this key" if key else "the text"
    message = (f"{what} is not valid Unicode: character {at} is a lone surrogate (U+{ord(text[at]):04X}), "
               f"which cannot be encoded as UTF-8; send UTF-8 text (a \\uD800-\\uDFFF escape must be one "
               f"half of a surrogate pair)")
    return bad_request(f"{field}: {message}" if field else message, field)


async def read_json(request: Any, max_bytes: int) -> Any:
    """The request body parsed as JSON (any content type), every string in it Unicode; 400 for bad JSON or
    text, 413 for a body over `max_bytes`."""
    too_large = APIError(413, f"the body is larger than {max_bytes} bytes, this server's limit (its "
                              f"max_body_bytes, by default sized to the model's context): shorten the request")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("the body is empty: send a JSON object")

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if json.detect_encoding(raw) != "utf-8" or _MAYBE_SURROGATE.search(raw) is not None:
        check_text(body)
    return body


def parse_body(model: Type[M], body: Any, context: Optional[dict[str, Any]] = None) -> M:
    """Validate a JSON body against `model` (with pydantic's validation `context`); 400 naming the bad fields."""
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, not {type(body).__name__}")
    try:
        return model.model_validate(body, context=context)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def read_request(request: Any, model: Type[M], max_bytes: int,
                       context: Optional[dict[str, Any]] = None) -> M:
    """`read_json` then `parse_body`: what an endpoint with a JSON body calls."""
    return parse_body(model, await read_json(request, max_bytes), context)
