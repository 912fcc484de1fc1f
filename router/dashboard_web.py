"""The dashboard's routes and its login.

    GET  /dashboard            the page (router/static/dashboard.html: inline CSS and JS, nothing fetched but
                               the state below); without a login, a redirect (303) to /dashboard/login
    GET  /dashboard/api/state  the state JSON (router/dashboard.py); `?since=T` keeps the history samples after
                               T (seconds since the epoch); 401 without a login
    GET  /dashboard/login      a form asking for the API key
    POST /dashboard/login      form field `api_key`: right, a session cookie and a redirect (303) to /dashboard;
                               wrong, 401 and the form again with a message

Without an API key the router is open and so is the dashboard (the login redirects to it). With one, a request is
logged in when it carries the key as every API request does (`Authorization: Bearer`, `x-api-key`), or the
session cookie: HttpOnly, SameSite=Strict, path /dashboard, holding HMAC-SHA256(the key) under a secret drawn at
start, so the cookie is not the key and a restarted router asks for the key again. Keys and cookies are compared
in constant time. The page's Content-Security-Policy allows its own inline script and style (by hash) and
requests to this origin only.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import html
import importlib.resources
import re
import secrets
import time
from typing import Any, Callable, Optional
from urllib.parse import parse_qsl

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from router.dashboard import build_state, worker_reports
from router.dashboard_history import DashboardHistory
from router.errors import APIError

DASHBOARD_PATHS = ("/dashboard", "/dashboard/api/state", "/dashboard/login")
COOKIE = "mlxpd_dashboard"
MAX_FORM_BYTES = 4096

_LOGIN = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>mlx-pd dashboard: log in</title>
<style>
body{font:15px system-ui,sans-serif;background:#101418;color:#e6e6e6;display:flex;justify-content:center;
margin-top:12vh}form{background:#182029;padding:24px 28px;border-radius:8px;min-width:320px}
h1{font-size:18px;margin:0 0 14px}label{display:block;margin-bottom:6px;color:#9aa7b3}
input{width:100%;box-sizing:border-box;padding:8px;border-radius:4px;border:1px solid #34414e;background:#0c1014;
color:#e6e6e6;margin-bottom:14px}button{padding:8px 16px;border:0;border-radius:4px;background:#2f7dd1;color:#fff}
.error{color:#ff8080;margin:0 0 12px}
</style></head><body>
<form method="post" action="/dashboard/login" id="login">
<h1>mlx-pd dashboard</h1>
{message}<label for="api_key">API key of this router</label>
<input type="password" id="api_key" name="api_key" autocomplete="current-password" autofocus required>
<button type="submit">Log in</button>
</form></body></html>
"""


def _csp(page: str) -> str:
    """A Content-Security-Policy allowing exactly `page`'s inline scripts and styles (by SHA-256) and requests
    to this origin."""
    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", page, flags=re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'"
                        for b in blocks) or "'none'"
    return (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
            "connect-src 'self'; img-src 'self' data:; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")


def load_page() -> str:
    """The page's HTML (router/static/dashboard.html, shipped as package data)."""
    return importlib.resources.files("router").joinpath("static/dashboard.html").read_text(encoding="utf-8")


class DashboardAuth:
    """Who may see the dashboard: everyone without `api_key`; with it, requests carrying the key in a header
    (`header_auth(request)`) or the session cookie."""

    def __init__(self, api_key: Optional[str], header_auth: Callable[[Request], bool]):
        self._key = api_key.encode("utf-8") if api_key else None
        self._header_auth = header_auth
        secret = secrets.token_bytes(32)
        self.token = hmac.new(secret, self._key or b"", hashlib.sha256).hexdigest()

    @property
    def required(self) -> bool:
        """True when the router has an API key."""
        return self._key is not None

    def key_matches(self, candidate: str) -> bool:
        """`candidate` is the API key (constant time)."""
        return self._key is not None and hmac.compare_digest(candidate.encode("utf-8"), self._key)

    def authorized(self, request: Request) -> bool:
        """The request may see the dashboard."""
        if self._key is None or self._header_auth(request):
            return True
        cookie = request.cookies.get(COOKIE)
        return cookie is not None and hmac.compare_digest(cookie.encode("utf-8", "replace"), self.token.encode())


async def _read_form(request: Request) -> dict[str, str]:
    """The url-encoded form of the request (at most MAX_FORM_BYTES; 413 past it, 415 for another content
    type, 400 for a field given twice)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/x-www-form-urlencoded":
        raise APIError(415, "send the login as a form (application/x-www-form-urlencoded) with the field api_key")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise APIError(413, f"the login form is over {MAX_FORM_BYTES} bytes")
    try:
        pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=bool(body))
    except (UnicodeDecodeError, ValueError) as exc:
        raise APIError(400, f"the login form is not a valid url-encoded form: {exc}") from exc
    form: dict[str, str] = {}
    for key, value in pairs:
        if key in form:
            raise APIError(400, f"the form field {key!r} is given twice", param=key)
        form[key] = value
    return form


def _check_query(request: Request, allowed: tuple[str, ...] = ()) -> None:
    """400 naming the first query parameter the path does not take."""
    unknown = [k for k in request.query_params if k not in allowed]
    if unknown:
        takes = f"the only one is {allowed[0]!r}" if allowed else "it takes none"
        raise APIError(400, f"unknown query parameter {unknown[0]!r} for {request.url.path}: {takes}",
                       param=unknown[0])


def _login_page(message: str = "", status: int = 200) -> HTMLResponse:
    note = f'<p class="error" id="login-error">{html.escape(message)}</p>\n' if message else ""
    page = _LOGIN.replace("{message}", note)
    return HTMLResponse(page, status_code=status, headers={"Content-Security-Policy": _csp(page),
                                                           "Cache-Control": "no-store"})


def install_dashboard(app: FastAPI, engine: Any, metrics: Any, *, api_key: Optional[str],
                      header_auth: Callable[[Request], bool], interval_s: float = 2.0,
                      span_s: float = 600.0) -> DashboardHistory:
    """Register the dashboard routes on `app` and start its history on `metrics` (a RouterMetrics; one it
    already carries is kept). `header_auth(request)` says whether the request carries the API key in a
    header. The routes check the login themselves: the app's key middleware must let DASHBOARD_PATHS through."""
    history = metrics.history
    if history is None:
        history = metrics.history = DashboardHistory(interval_s, span_s, worker_reports=lambda: worker_reports(engine))
    auth = DashboardAuth(api_key, header_auth)
    page = load_page()
    page_headers = {"Content-Security-Policy": _csp(page), "Cache-Control": "no-store",
                    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
    started = time.time()

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request) -> Response:
        """The live cluster page (a redirect to the login without one)."""
        _check_query(request)
        if not auth.authorized(request):
            return RedirectResponse("/dashboard/login", status_code=303)
        return HTMLResponse(page, headers=page_headers)

    @app.get("/dashboard/api/state", include_in_schema=False)
    async def dashboard_state(request: Request) -> JSONResponse:
        """The dashboard's state (router/dashboard.py)."""
        if not auth.authorized(request):
            raise APIError(401, "log in at /dashboard/login, or send 'Authorization: Bearer <key>' (or "
                                "'x-api-key: <key>')", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        _check_query(request, ("since",))
        since = None
        if "since" in request.query_params:
            try:
                since = float(request.query_params["since"])
            except ValueError:
                since = float("nan")
            if since != since or since in (float("inf"), float("-inf")):
                raise APIError(400, "since must be a finite number (seconds since the epoch)", param="since")
        return JSONResponse(build_state(engine, history, started=started, since=since),
                            headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/login", include_in_schema=False)
    async def login_form(request: Request) -> Response:
        """The login form (a redirect to the page when no key is needed or the request is logged in)."""
        _check_query(request)
        if not auth.required or auth.authorized(request):
            return RedirectResponse("/dashboard", status_code=303)
        return _login_page()

    @app.post("/dashboard/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        """Check the form's api_key: a session cookie and a redirect to the page, or 401 with the form."""
        _check_query(request)
        form = await _read_form(request)
        extra = [k for k in form if k != "api_key"]
        if extra:
            return _login_page(f"unknown form field {extra[0]!r}: the form has only api_key", 400)
        if "api_key" not in form:
            return _login_page("the form field api_key is missing", 400)
        if not auth.required:
            return RedirectResponse("/dashboard", status_code=303)
        if not auth.key_matches(form["api_key"]):
            return _login_page("wrong API key", 401)
        response = RedirectResponse("/dashboard", status_code=303)
        response.set_cookie(COOKIE, auth.token, path="/dashboard", httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")
        return response

    return history
