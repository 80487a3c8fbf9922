"""Authentication (an optional API key), CSRF protection and security headers.

One ASGI middleware in front of every route, so routes added later are covered too.

Authentication, only when the server has a key (`--api-key` or $BATCHSCOPE_API_KEY):
  - `/v1/*` (the OpenAI API) takes `Authorization: Bearer KEY` only; anything else is a 401 in
    OpenAI's error shape.
  - Everything else except `/static/*` and `/login` (pages, their JSON twins, the SSE streams,
    `/metrics`) takes the same Bearer header (scripts, Prometheus) or the session cookie that
    `/login` sets (browsers). Without either: a page request (GET asking for HTML) is sent to
    `/login`; anything else gets the JSON 401.
  Keys and session tokens are compared in constant time; sessions live in memory (a restart
  logs everyone out).

CSRF, always (with or without a key: a web page can post to a loopback server too), for every
method but GET/HEAD/OPTIONS, on every path. See `csrf_problem` for the rule.

DNS rebinding, when `allowed_hosts` is set (`batchscope serve` sets it for a keyless server on
loopback): the Host header must name a loopback address or one of the allowed names. Otherwise
a page on a domain that its owner points at 127.0.0.1 is "same-origin" with this server in the
browser, and could read the pages and pass the CSRF check.

Without a key the server is open to whoever can reach it: keep it on loopback (the default);
`batchscope serve` warns when it binds elsewhere without a key.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import secrets
import time
from collections import OrderedDict
from typing import Any
from urllib.parse import quote, urlsplit

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.web.api.routes import error_body
from app.web.render import html_response, read_form

COOKIE = "batchscope_session"
SESSION_TTL_S = 12 * 3600
MAX_SESSIONS = 1000  # oldest dropped beyond this
FAILED_LOGIN_DELAY_S = 0.5  # slows guessing; asyncio.sleep, so nobody else waits
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
PUBLIC_PREFIXES = ("/static/",)
PUBLIC_PATHS = frozenset({"/login"})
# Browsers send these content types cross-site without a CORS preflight ("simple requests").
SIMPLE_CONTENT_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data", "text/plain")
# Defence in depth behind the templates' escaping: no inline or foreign scripts, no framing.
# (Inline styles are allowed: the templates and htmx use them.)
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
       "img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'self'; "
       "frame-ancestors 'none'")
HEADERS = [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
           (b"referrer-policy", b"same-origin"), (b"content-security-policy", CSP.encode())]


def host_check(host: str, api_key: str | None, extra: list[str]) -> tuple[str, ...] | None:
    """The Host names a server accepts besides loopback ones, or None for no check.

    A keyless server on loopback checks (a page on a domain that resolves to 127.0.0.1 could
    otherwise read it: DNS rebinding); with a key, the key protects it; a keyless server bound
    elsewhere was warned about and serves whatever names reach it, unless --allowed-host."""
    names = tuple(name.strip().lower() for name in extra if name.strip())
    if names:
        return names
    if api_key is None and is_loopback(host):
        return ()
    return None


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may well resolve to a public address


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning `batchscope serve` logs when it binds beyond loopback without a key."""
    if api_key or is_loopback(host):
        return None
    return (f"binding to {host} without an API key: anyone who can reach this address can "
            "use the API and the pages (run prompts, read every recorded run). Set "
            "--api-key or $BATCHSCOPE_API_KEY, or bind to 127.0.0.1.")


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Security:
    """The key and the live sessions of one app (`app.state.security`)."""

    def __init__(self, api_key: str | None, allowed_hosts: tuple[str, ...] | None = None):
        if api_key is not None and not api_key.strip():
            raise ValueError("the API key must not be empty")
        self.api_key = api_key
        self.allowed_hosts = allowed_hosts
        # sha256(token) -> expiry: a lookup by the digest leaks nothing about the token.
        self._sessions: OrderedDict[str, float] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.api_key is not None

    def key_matches(self, candidate: str) -> bool:
        """Constant time, the length included (digests of equal size are compared)."""
        assert self.api_key is not None
        return hmac.compare_digest(hashlib.sha256(candidate.encode()).digest(),
                                   hashlib.sha256(self.api_key.encode()).digest())

    def new_session(self) -> str:
        token = secrets.token_urlsafe(32)
        self._sessions[_digest(token)] = time.time() + SESSION_TTL_S
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return token

    def session_valid(self, token: str | None) -> bool:
        if not token:
            return False
        digest = _digest(token)
        expiry = self._sessions.get(digest)
        if expiry is None:
            return False
        if expiry < time.time():
            del self._sessions[digest]
            return False
        return True

    def end_session(self, token: str | None) -> None:
        if token:
            self._sessions.pop(_digest(token), None)


# ---- the rules -------------------------------------------------------------------------------
def _bearer(headers: Headers) -> str | None:
    """The token of an `Authorization: Bearer ...` header; "" for any other Authorization."""
    value = headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _netloc(url: str) -> str | None:
    """scheme://host[:port] -> host[:port], default port dropped, lowercase; None if unusable."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    host = parts.hostname.lower()
    host = f"[{host}]" if ":" in host else host
    default = {"http": 80, "https": 443}[parts.scheme]
    return host if port in (None, default) else f"{host}:{port}"


def _own_netloc(scope: Scope, headers: Headers) -> str | None:
    host = headers.get("host")
    if not host:
        return None
    return _netloc(f"{scope.get('scheme', 'http')}://{host}")


def csrf_problem(scope: Scope, headers: Headers) -> str | None:
    """Why a state-changing request may be a cross-site forgery, or None when it is fine.

    The rule, for every method but GET/HEAD/OPTIONS (GET routes change nothing):
      1. A request with an Authorization header passes: it is not authenticated by a cookie
         (so a forgery gains nothing from the victim's browser), and a browser only sends that
         header cross-site after a CORS preflight, which this server never grants. This is what
         exempts the `/v1` API with its Bearer key (and OpenAI clients, which always send one).
      2. Otherwise, if there is an Origin header, it must name this server (its host and port,
         as in the Host header); "null" does not.
      3. Otherwise, if there is a Referer header, its origin must name this server.
      4. Otherwise (neither: not a current browser, which sends Origin with every POST, but
         an old one may post a form with neither) the request passes only if it is not a form:
         its content type is none of the three a page may send cross-site without a CORS
         preflight (urlencoded, multipart, text/plain). Scripts send JSON (or no body), or add
         an Origin header to post a form.
    """
    if headers.get("authorization") is not None:
        return None
    own = _own_netloc(scope, headers)
    origin = headers.get("origin")
    if origin is not None:
        if own is not None and _netloc(origin) == own:
            return None
        return f"cross-origin request refused: Origin {origin[:100]!r} is not this server"
    referer = headers.get("referer")
    if referer is not None:
        if own is not None and _netloc(referer) == own:
            return None
        return "cross-origin request refused: the Referer is not this server"
    content_type = headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in SIMPLE_CONTENT_TYPES:
        return None
    return ("cross-origin check failed: a form post needs an Origin or Referer header naming "
            "this server (browsers send one); scripts send JSON, or an Origin header")


def host_problem(headers: Headers, allowed: tuple[str, ...]) -> str | None:
    """Why the Host header is refused (DNS rebinding protection), or None."""
    netloc = _netloc(f"http://{headers.get('host', '')}")
    name = None if netloc is None else urlsplit(f"http://{netloc}").hostname
    if name is not None and (is_loopback(name) or name in allowed):
        return None
    shown = headers.get("host", "")[:100]
    return (f"Host {shown!r} is not allowed: this server answers to loopback names only "
            "(protection against DNS rebinding); serve with --allowed-host NAME, or with "
            "--api-key")


def _is_api(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def _is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def _wants_page(method: str, path: str, headers: Headers) -> bool:
    """A browser navigating to a page (sent to the login form rather than given a 401)."""
    return (method in ("GET", "HEAD") and not _is_api(path) and not path.endswith(".json")
            and "text/html" in headers.get("accept", ""))


def safe_next(target: str | None) -> str:
    """Where to go after logging in: a path on this server only (no open redirect)."""
    if not target or not target.startswith("/") or target.startswith(("//", "/\\")):
        return "/"
    if any(ord(c) < 32 for c in target):
        return "/"
    return target


def _session_cookie(headers: Headers) -> str | None:
    for part in headers.get("cookie", "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            return value
    return None


# ---- the middleware --------------------------------------------------------------------------
class SecurityMiddleware:
    def __init__(self, app: ASGIApp, security: Security):
        self.app = app
        self.security = security

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        method, path = scope["method"], scope["path"]
        response = self._check(scope, headers, method, path)
        if response is not None:
            await self._with_headers(response)(scope, receive, send)
            return
        await self.app(scope, receive, self._with_headers(send))

    def _check(self, scope: Scope, headers: Headers, method: str, path: str) -> Response | None:
        security = self.security
        bearer = _bearer(headers)
        scope["batchscope.auth"] = None
        if security.allowed_hosts is not None:
            problem = host_problem(headers, security.allowed_hosts)
            if problem is not None:
                return _forbidden(problem, scope, headers, code="host_not_allowed")
        if security.enabled and not _is_public(path):
            if bearer is not None:  # an Authorization header: it alone decides
                if not (bearer and security.key_matches(bearer)):
                    return _unauthorized("invalid API key in the Authorization header",
                                         "invalid_api_key")
                scope["batchscope.auth"] = "bearer"
            elif not _is_api(path) and security.session_valid(_session_cookie(headers)):
                scope["batchscope.auth"] = "session"
            elif _wants_page(method, path, headers):
                target = path + (f"?{scope['query_string'].decode('latin-1')}"
                                 if scope.get("query_string") else "")
                return RedirectResponse(f"/login?next={quote(target, safe='')}", 303)
            else:
                message = ("this server needs an API key: send `Authorization: Bearer KEY`"
                           + ("" if _is_api(path) else ", or log in at /login"))
                response = _unauthorized(message, "missing_api_key")
                if headers.get("hx-request"):  # htmx: send the whole page to the login form
                    response.headers["HX-Redirect"] = "/login"
                return response
        if method not in SAFE_METHODS:
            problem = csrf_problem(scope, headers)
            if problem is not None:
                return _forbidden(problem, scope, headers)
        return None

    @staticmethod
    def _with_headers(send: Any) -> Any:
        """`send` (or a Response) with the security headers added to the response start."""
        if isinstance(send, Response):
            for name, value in HEADERS:
                send.headers.setdefault(name.decode(), value.decode())
            return send

        async def sender(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in HEADERS if k not in present]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        return sender


def _unauthorized(message: str, code: str) -> Response:
    return JSONResponse(error_body(message, "invalid_request_error", None, code),
                        status_code=401, headers={"WWW-Authenticate": "Bearer"})


def _forbidden(message: str, scope: Scope, headers: Headers,
               code: str = "csrf_failed") -> Response:
    """A page for browsers (they ask for HTML), OpenAI-shaped JSON for everyone else."""
    path = scope["path"]
    if not ("text/html" in headers.get("accept", "") and not _is_api(path)
            and not path.endswith(".json")):
        return JSONResponse(error_body(message, "invalid_request_error", None, code),
                            status_code=403)
    return html_response(Request(scope), "forbidden.html", {"message": message}, 403)


# ---- /login and /logout ----------------------------------------------------------------------
def _login_page(request: Request, next_url: str, error: str | None = None,
                status: int = 200) -> Response:
    return html_response(request, "login.html", {"next_url": next_url, "error": error}, status)


def _security(request: Request) -> Security:
    return request.app.state.security


async def login_form(request: Request) -> Response:
    next_url = safe_next(request.query_params.get("next"))
    if not _security(request).enabled:
        return RedirectResponse(next_url, 303)  # nothing to log in to
    return _login_page(request, next_url)


async def login(request: Request) -> Response:
    security = _security(request)
    form = await read_form(request)
    if isinstance(form, Response):
        return form
    next_url = safe_next(form.get("next"))
    if not security.enabled:
        return RedirectResponse(next_url, 303)
    if not security.key_matches(form.get("key", "")):
        await asyncio.sleep(FAILED_LOGIN_DELAY_S)
        return _login_page(request, next_url, "wrong key", 401)
    response = RedirectResponse(next_url, 303)
    response.set_cookie(COOKIE, security.new_session(), max_age=SESSION_TTL_S, path="/",
                        httponly=True, samesite="lax", secure=request.url.scheme == "https")
    return response


async def logout_form(request: Request) -> Response:
    return html_response(request, "logout.html", {})


async def logout(request: Request) -> Response:
    _security(request).end_session(request.cookies.get(COOKIE))
    response = RedirectResponse("/login", 303)
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="lax")
    return response


routes = [
    Route("/login", login_form, methods=["GET"]),
    Route("/login", login, methods=["POST"]),
    Route("/logout", logout_form, methods=["GET"]),
    Route("/logout", logout, methods=["POST"]),
]


def install(app: Any, api_key: str | None,
            allowed_hosts: tuple[str, ...] | None = None) -> Security:
    """Put the middleware in front of `app` (a Starlette app, before it starts) and add the
    login routes."""
    security = Security(api_key, allowed_hosts)
    app.state.security = security
    app.router.routes.extend(routes)
    app.add_middleware(SecurityMiddleware, security=security)
    return security
