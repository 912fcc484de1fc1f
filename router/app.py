"""The OpenAI-compatible HTTP API of mlx-pd (FastAPI), over any `EngineClient`.

    POST /v1/completions        POST /v1/chat/completions     (JSON or SSE with "stream": true)
    GET  /v1/models             GET  /v1/models/{model}
    GET  /health                200 while engine.is_healthy(), else 503
    GET  /metrics               Prometheus text (registry per app)
    POST /reset_prefix_cache    engine.clear_prefix_cache() (vLLM's name)

Each completion request: read JSON -> validate (400 naming the field) -> check the model name (404) ->
tokenize -> check the prompt length -> clamp max_tokens -> n GenerateRequests -> run them concurrently
-> answer whole or stream. With `api_key` set, every endpoint but /health and /metrics needs
`Authorization: Bearer <api_key>` (401 otherwise).
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from typing import Any, Optional, Type, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from cluster.engine_client import EngineClient, EngineError
from router.errors import (APIError, bad_request, engine_unavailable, from_validation_error,
                           install_error_handlers)
from router.metrics import MetricsMiddleware, RouterMetrics
from router.openapi import install_openapi
from router.openai_schema import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from router.params import prepare_chat, prepare_completion
from router.responses import ChatFormatter, CompletionFormatter
from router.serving import serve_prepared
from router.tokenizer import RouterTokenizer

M = TypeVar("M", bound=BaseModel)

MAX_BODY_BYTES = 32 * 1024 * 1024
AUTH_EXEMPT = ("/health", "/metrics")


class BearerAuthMiddleware:
    """Pure ASGI middleware: 401 unless `Authorization: Bearer <key>` matches (constant-time compare)."""

    def __init__(self, app: Any, api_key: str, exempt: tuple[str, ...] = AUTH_EXEMPT):
        self.app = app
        self._expected = api_key.encode("utf-8")
        self._exempt = exempt

    def _authorized(self, scope: dict) -> bool:
        header = b""
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                header = value
                break
        scheme, _, token = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._expected)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in self._exempt or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        err = APIError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await err.response()(scope, receive, send)


async def read_json(request: Request) -> Any:
    """The request body parsed as JSON (any content type); 400 for bad JSON, 413 for a huge body."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("the body is empty: send a JSON object")

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(raw, parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"the body is not valid JSON: {exc}") from None


def parse_body(model: Type[M], body: Any) -> M:
    """Validate a JSON body against `model`; 400 naming the bad fields."""
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, not {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def create_app(engine: EngineClient, tokenizer: RouterTokenizer, *, served_model_names: list[str],
               api_key: Optional[str] = None, request_timeout_s: float = 600.0,
               metrics: Optional[RouterMetrics] = None) -> FastAPI:
    """The router's FastAPI app serving `engine` under the names `served_model_names` (first = default).

    `api_key`: require this bearer key (None = open). `request_timeout_s`: a request whose engine
    produces nothing for this long ends with an error and is aborted. `metrics`: share a RouterMetrics
    (default: a new one with its own registry).
    """
    if not served_model_names:
        raise ValueError("served_model_names must name at least one model")
    if request_timeout_s <= 0:
        raise ValueError(f"request_timeout_s={request_timeout_s!r} must be > 0")
    names = list(served_model_names)
    created = int(time.time())
    metrics = metrics or RouterMetrics(engine)
    app = FastAPI(title="mlx-pd", summary="OpenAI-compatible API of mlx-pd", docs_url=None, redoc_url=None)
    app.state.engine, app.state.tokenizer, app.state.metrics = engine, tokenizer, metrics
    install_error_handlers(app)
    install_openapi(app)
    if api_key:
        app.add_middleware(BearerAuthMiddleware, api_key=api_key)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # added last = outermost: counts 401s too

    def resolve_model(requested: Optional[str]) -> str:
        if requested is None or requested == "":
            return names[0]
        if requested not in names:
            raise APIError(404, f"the model {requested!r} does not exist: this server serves "
                                f"{', '.join(repr(n) for n in names)}", param="model", code="model_not_found")
        return requested

    async def run(request: Request, kind: str) -> Response:
        arrival, arrival_wall = time.monotonic(), time.time()
        body = await read_json(request)
        if kind == "chat":
            req: Any = parse_body(ChatCompletionRequest, body)
            prepare, formatter_cls, prefix = prepare_chat, ChatFormatter, "chatcmpl-"
        else:
            req = parse_body(CompletionRequest, body)
            prepare, formatter_cls, prefix = prepare_completion, CompletionFormatter, "cmpl-"
        model = resolve_model(req.model)
        prepared = await prepare(req, tokenizer, request_id=prefix + uuid.uuid4().hex, model=model,
                                 max_model_len=engine.max_model_len, arrival_time=arrival_wall)
        capacity = getattr(engine, "max_sequences", None)
        if capacity and prepared.n > capacity:
            raise APIError(400, f"n={prepared.n} asks for more sequences than this server holds running and "
                                f"queued at once ({capacity}); lower n", param="n")
        formatter = formatter_cls(prepared, tokenizer, int(arrival_wall))
        return await serve_prepared(request, prepared, formatter, engine=engine, metrics=metrics,
                                    stall_timeout_s=request_timeout_s, arrival=arrival)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """OpenAI's legacy completions (text or token-id prompt, echo, legacy logprobs)."""
        return await run(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """OpenAI's chat completions (the model's chat template renders the messages)."""
        return await run(request, "chat")

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        """The served model names."""
        return ModelList(data=[ModelCard(id=n, created=created, max_model_len=engine.max_model_len)
                               for n in names])

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> ModelCard:
        """One served model; 404 for others."""
        return ModelCard(id=resolve_model(model), created=created, max_model_len=engine.max_model_len)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine is alive, else 503."""
        try:
            healthy = bool(engine.is_healthy())
        except Exception:
            healthy = False
        if healthy:
            return JSONResponse({"status": "ok"})
        return APIError(503, "the engine is not running", code="engine_unavailable").response()

    @app.get("/metrics")
    async def prometheus() -> Response:
        """Prometheus text exposition of this app's registry."""
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        """Drop every unreferenced cached KV block of the engine."""
        try:
            dropped = await engine.clear_prefix_cache()
        except EngineError as exc:
            raise engine_unavailable(f"the engine cannot clear its prefix cache now: {exc}",
                                     exc.retry_after) from exc
        return JSONResponse({"status": "ok", "dropped_blocks": int(dropped)})

    return app
