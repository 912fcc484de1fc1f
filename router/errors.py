"""Errors: one exception type, the body shape of each API, and the handlers that guarantee it.

Every non-2xx answer of the router has the body `{"error": {"message", "type", "param", "code"}}` (OpenAI's),
except on Anthropic's Messages endpoints (`/v1/messages` and below), where it is
`{"type": "error", "error": {"type", "message"}}` with Anthropic's type for the status (`anthropic_error_type`);
the status codes are the same. Invalid requests (bad JSON, schema, values) are 400 with `param` naming the
field and a message saying what to change; FastAPI's own 422 for schema errors is turned into the same 400.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.anthropic.output import AnthropicErrorInfo, AnthropicErrorResponse
from router.openai.request import CONTEXT_LENGTH_EXCEEDED, ErrorInfo, ErrorResponse
from router.request_model import UNKNOWN_FIELD

logger = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's "client closed request": logged and counted, never seen by the client
ANTHROPIC_PATH = "/v1/messages"  # this path and the paths below it answer errors in Anthropic's shape


def error_type(status: int) -> str:
    """OpenAI's `type` for an HTTP status."""
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status < 500:
        return "invalid_request_error"
    return "server_error"


def anthropic_error_type(status: int) -> str:
    """Anthropic's error `type` for an HTTP status (the `anthropic` SDK's `ErrorType`)."""
    known = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
             429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error", 504: "timeout_error"}
    if status in known:
        return known[status]
    return "invalid_request_error" if status < 500 else "api_error"


def is_anthropic_path(path: Optional[str]) -> bool:
    """True for the paths whose errors take Anthropic's shape (ANTHROPIC_PATH and below)."""
    return bool(path) and (path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"))


class APIError(Exception):
    """An answer other than 2xx; raised anywhere in a handler, rendered by the app's handler."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None,
                 code: Optional[Union[str, int]] = None, type: Optional[str] = None,
                 headers: Optional[Mapping[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(status)
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The `{"error": {...}}` dict."""
        return error_body(self.message, self.type, self.param, self.code)

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's `{"type": "error", "error": {"type", "message"}}` dict."""
        info = AnthropicErrorInfo(type=anthropic_error_type(self.status), message=self.message)
        return AnthropicErrorResponse(error=info).model_dump()

    def response(self, path: Optional[str] = None) -> JSONResponse:
        """This error as a JSONResponse with its status and headers, in the shape of the API that serves
        `path` (OpenAI's unless `is_anthropic_path(path)`)."""
        body = self.anthropic_body() if is_anthropic_path(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: Optional[str] = None,
               code: Optional[Union[str, int]] = None) -> dict[str, Any]:
    """OpenAI's error object as a plain dict."""
    info = ErrorInfo(message=message, type=type, param=param, code=code)
    return ErrorResponse(error=info).model_dump()


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    """A 400 `invalid_request_error`."""
    return APIError(400, message, param=param)


def engine_unavailable(message: str, retry_after: Optional[float]) -> APIError:
    """A 503 for an engine that cannot take the request; with `Retry-After` when it is transient."""
    headers = {}
    if retry_after is not None and math.isfinite(retry_after):
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    code = "engine_overloaded" if headers else "engine_unavailable"
    return APIError(503, message, code=code, headers=headers)


def _loc(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out


def describe_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, Optional[str]]:
    """("field: what is wrong; ...", first field) from pydantic's error list."""
    if not errors:
        return "invalid request", None
    messages, first_param = [], None
    for err in errors[:3]:
        loc = tuple(err.get("loc", ()))
        if err.get("type") == UNKNOWN_FIELD:  # a refused unknown key: name it, not the object holding it
            loc += ((err.get("ctx") or {}).get("field", ""),)
        where = _loc(loc)
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            messages.append(f"the body is not valid JSON: {ctx.get('error', err.get('msg'))}")
            continue
        msg = str(err.get("msg", "invalid"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if err.get("type") == "missing":
            msg = "this field is required"
        first_param = first_param or where or None
        messages.append(f"{where}: {msg}" if where else msg)
    if len(errors) > 3:
        messages.append(f"and {len(errors) - 3} more")
    return "; ".join(messages), first_param


def from_validation_error(exc: Union[ValidationError, RequestValidationError]) -> APIError:
    """A 400 whose message names each invalid field (code context_length_exceeded for a prompt too long)."""
    errors = list(exc.errors())
    message, param = describe_validation_errors(errors)
    code = CONTEXT_LENGTH_EXCEEDED if any(e.get("type") == CONTEXT_LENGTH_EXCEEDED for e in errors) else None
    return APIError(400, message, param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app can produce an error object of the API its path belongs to."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        return APIError(exc.status_code, message, headers=exc.headers).response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                        code="internal_error").response(request.url.path)
