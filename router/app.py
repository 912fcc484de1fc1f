"""The OpenAI-compatible HTTP API of mlx-pd (FastAPI), over any `EngineClient`.

    POST /v1/completions        POST /v1/chat/completions     (JSON or SSE with "stream": true)
    POST /v1/responses          OpenAI's Responses API, stateless (router/responses/endpoints.py)
    POST /v1/messages           Anthropic's Messages API (router/anthropic/endpoints.py), and
    POST /v1/messages/count_tokens   its prompt's token count
    GET  /v1/models             GET  /v1/models/{model}   (each with the checks its workers passed at load)
    GET  /health                200 while engine.is_healthy(), else 503
    GET  /metrics               Prometheus text (registry per app)
    POST /reset_prefix_cache    engine.clear_prefix_cache() (vLLM's name)
    GET  /dashboard             the live cluster page, its JSON and login (router/dashboard_web.py)

Each completion request: read the body (413 past `max_body_bytes`, router/body.py) -> parse JSON and check
that all its text is Unicode (400 naming the field) -> validate (400 naming the field) -> check the model
name (404) -> tokenize, refusing a prompt over the context after bounded work -> clamp max_tokens -> n
GenerateRequests -> run them concurrently -> answer whole or stream. Every endpoint with a JSON body reads
it through `router.body.read_request`. With `api_key` set, every endpoint but /health and /metrics needs
`Authorization: Bearer <api_key>` or `x-api-key: <api_key>` (401 otherwise); the dashboard's paths check it
themselves, accepting its login cookie too. Errors on /v1/messages take Anthropic's shape (router/errors.py).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hmac
import inspect
import time
from typing import Any, Optional, Sequence

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from cluster.engine_client import EngineClient, EngineError
from router.anthropic.endpoints import install_anthropic_api
from router.body import default_max_body_bytes
from router.dashboard_web import DASHBOARD_PATHS, install_dashboard
from router.errors import APIError, engine_unavailable, install_error_handlers
from router.metrics import MetricsMiddleware, RouterMetrics
from router.openapi import install_openapi
from router.openai.endpoints import install_openai_api
from router.openai.output import ModelCard, ModelList, ModelLoadCheck, ServeLayout
from router.responses.endpoints import install_responses_api
from router.serving import ServingContext
from router.tokenizer import RouterTokenizer

AUTH_EXEMPT = ("/health", "/metrics")


def carries_key(scope: dict, expected: bytes) -> bool:
    """The ASGI request `scope` carries `expected` as `x-api-key` or `Authorization: Bearer` (constant time)."""
    header, api_key = b"", None
    for name, value in scope.get("headers", ()):
        name = name.lower()
        if name == b"authorization" and not header:
            header = value
        elif name == b"x-api-key" and api_key is None:
            api_key = value
    if api_key is not None and hmac.compare_digest(api_key.strip(), expected):
        return True
    scheme, _, token = header.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), expected)


class BearerAuthMiddleware:
    """Pure ASGI middleware: 401 unless `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's
    header) matches (constant-time compare); the 401 takes the shape of the API the path belongs to."""

    def __init__(self, app: Any, api_key: str, exempt: tuple[str, ...] = AUTH_EXEMPT):
        self.app = app
        self._expected = api_key.encode("utf-8")
        self._exempt = exempt

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in self._exempt or carries_key(scope, self._expected):
            await self.app(scope, receive, send)
            return
        err = APIError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>' "
                            "(or 'x-api-key: <key>')", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await err.response(scope.get("path"))(scope, receive, send)


def resolves(requested: str, names: list[str]) -> bool:
    """`requested` is one of `names` or matches one of them that is a shell-style glob (`claude-*`)."""
    return requested in names or any(fnmatch.fnmatchcase(requested, n) for n in names if _is_glob(n))


def _is_glob(name: str) -> bool:
    return any(c in name for c in "*?[")


def load_checks(engine: EngineClient) -> Optional[list[ModelLoadCheck]]:
    """Each worker's load check from its latest report (the engine client's `worker_stats()`: the single-node
    worker's own, or each live cluster worker's last pong), in the client's worker order; None when no worker
    reports one (an engine client without `worker_stats`, engines built without a check, no report yet)."""
    reports = getattr(engine, "worker_stats", None)
    if reports is None:
        return None
    found = [ModelLoadCheck(worker=str(r.get("name", "?")), **r["load_check"])
             for r in reports() if r.get("load_check") is not None]
    return found or None


def create_app(engine: EngineClient, tokenizer: RouterTokenizer, *, served_model_names: list[str],
               api_key: Optional[str] = None, request_timeout_s: float = 600.0,
               metrics: Optional[RouterMetrics] = None, max_body_bytes: Optional[int] = None,
               layout: Optional[dict] = None) -> FastAPI:
    """The router's FastAPI app serving `engine` under the names `served_model_names` (first = default; the
    others are aliases, each a name or a shell-style glob such as `claude-*`; a request's `model` is echoed in
    its answer; `GET /v1/models` lists the names that are not globs).

    `api_key`: require this bearer key (None = open). `request_timeout_s`: a request whose engine
    produces nothing for this long ends with an error and is aborted. `metrics`: share a RouterMetrics
    (default: a new one with its own registry). `max_body_bytes`: a larger request body is refused with 413
    before it is read whole (None = sized to the context: max(4 MiB, 256 bytes * engine.max_model_len),
    `router.body.default_max_body_bytes`). `layout`: how `mlx-pd serve` laid out its processes ({"name",
    "reason", "router_pid", "engine_pid"}), shown by `GET /v1/models` (None: a cluster's router).
    """
    if not served_model_names:
        raise ValueError("served_model_names must name at least one model")
    if request_timeout_s <= 0:
        raise ValueError(f"request_timeout_s={request_timeout_s!r} must be > 0")
    if max_body_bytes is not None and (isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int)
                                       or max_body_bytes <= 0):
        raise ValueError(f"max_body_bytes={max_body_bytes!r} must be an integer > 0 (None = sized to the context)")
    names = list(served_model_names)
    created = int(time.time())
    metrics = metrics or RouterMetrics(engine)
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        close = getattr(engine, "close", None)  # an engine client's sockets close on the loop that used them
        if inspect.iscoroutinefunction(close):
            await close()

    app = FastAPI(title="mlx-pd", summary="OpenAI-compatible API of mlx-pd", docs_url=None, redoc_url=None,
                  lifespan=lifespan)
    app.state.engine, app.state.tokenizer, app.state.metrics = engine, tokenizer, metrics
    install_error_handlers(app)
    install_openapi(app)
    if api_key:
        app.add_middleware(BearerAuthMiddleware, api_key=api_key, exempt=AUTH_EXEMPT + DASHBOARD_PATHS)
    key = (api_key or "").encode("utf-8")
    install_dashboard(app, engine, metrics, api_key=api_key,
                      header_auth=lambda request: bool(key) and carries_key(request.scope, key))
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # added last = outermost: counts 401s too

    def resolve_model(requested: Optional[str]) -> str:
        if requested is None or requested == "":
            return names[0]
        if not resolves(requested, names):
            raise APIError(404, f"the model {requested!r} does not exist: this server serves "
                                f"{', '.join(repr(n) for n in names)} (add more names with "
                                "--served-model-name NAME ALIAS..., or [model] aliases in the topology)",
                           param="model", code="model_not_found")
        return requested

    def body_limit() -> int:
        return max_body_bytes or default_max_body_bytes(engine.max_model_len)

    ctx = ServingContext(engine=engine, tokenizer=tokenizer, metrics=metrics, resolve_model=resolve_model,
                         body_limit=body_limit, request_timeout_s=request_timeout_s)
    install_openai_api(app, ctx)
    install_responses_api(app, ctx)
    install_anthropic_api(app, ctx)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        """The served model names, each with its context length and the checks its workers passed at load."""
        checks = load_checks(engine)
        return ModelList(data=[ModelCard(id=n, created=created, max_model_len=engine.max_model_len,
                                         load_checks=checks)
                               for n in names if not _is_glob(n)],
                         layout=ServeLayout(**layout) if layout else None)

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> ModelCard:
        """One served model; 404 for others."""
        return ModelCard(id=resolve_model(model), created=created, max_model_len=engine.max_model_len,
                         load_checks=load_checks(engine))

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


def create_app_for_model(engine: EngineClient, model_path, api_key: Optional[str] = None,
                         request_timeout_s: float = 600.0, max_body_bytes: Optional[int] = None,
                         aliases: Sequence[str] = (), layout: Optional[dict] = None) -> FastAPI:
    """`create_app` for a served model folder: its tokenizer and chat template from `model_path`, the engine's
    `model_name` as the served name and `aliases` as more names (single-node `serve`, `mlx-pd router` and the
    cluster's router actor).

    `api_key` None or "" leaves it open; `max_body_bytes` None sizes the body limit to the context; `layout`
    as `create_app` takes it."""
    names = [engine.model_name, *[a for a in aliases if a != engine.model_name]]
    return create_app(engine, RouterTokenizer.from_path(model_path), served_model_names=names,
                      api_key=api_key or None, request_timeout_s=request_timeout_s, max_body_bytes=max_body_bytes,
                      layout=layout)
