"""Rendering for every page: one context dict, shown as HTML (templates/) or as its JSON twin
(the `.json` URL, or `Accept: application/json`), so scripts and tests read the numbers people
see; the formatting filters the templates and the JSON share; errors as an HTML page, a form
fragment or OpenAI-shaped JSON; the per-app objects pages use (app/web/app.py makes them)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl

import anyio.to_thread
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from app.assets import static_dir, templates_dir
from app.json_safe import json_safe
from app.runs import RunService
from app.web.api.routes import error_body
from app.web.views import View

TEMPLATES_DIR = templates_dir()
STATIC_DIR = static_dir()

NO_DATABASE = ("no database: this server was started without one, so runs are not recorded "
               "(the playground still works)")


# ---- formatting (templates and tests share these, so a shown number equals its JSON value) ---
def fmt_ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1000:.1f} ms"


def fmt_rate(per_s: float | None) -> str:
    return "—" if per_s is None else f"{per_s:.1f}"


def fmt_lp(logprob: float | None) -> str:
    return "—" if logprob is None else f"{logprob:.3f}"


def fmt_pct(fraction: float | None) -> str:
    return "—" if fraction is None else f"{fraction * 100:.1f}%"


def fmt_bytes(n: int) -> str:
    """Bytes in binary units, one decimal (static/dashboard.js: bytes())."""
    if n < 1024:
        return f"{n} B"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


def fmt_time(epoch: float | None) -> str:
    if epoch is None:
        return "—"
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def as_json(value: Any) -> str:
    """A value as JSON text for a page, non-ASCII kept as is (autoescape escapes the HTML)."""
    return json.dumps(value, ensure_ascii=False)


def visible(text: str | None) -> str:
    """Whitespace and control characters made visible, for single-token cells."""
    if text is None:
        return ""
    out = []
    for ch in text:
        if ch == " ":
            out.append("␣")
        elif ch == "\n":
            out.append("↵")
        elif ch == "\t":
            out.append("⇥")
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def tokens_per_s(tpot: float | None) -> float | None:
    """Decode speed: one over the mean gap between output tokens."""
    return 1.0 / tpot if tpot else None


# ---- per-app state -------------------------------------------------------------------------
def make_templates() -> Environment:
    """The pages' Jinja environment (one per app, made by the lifespan). Autoescape everywhere:
    prompts and outputs are untrusted; a missing variable is an error."""
    env = Environment(loader=FileSystemLoader(TEMPLATES_DIR), autoescape=True,
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(ms=fmt_ms, rate=fmt_rate, lp=fmt_lp, pct=fmt_pct, ts=fmt_time,
                       bytes=fmt_bytes, visible=visible,
                       json=as_json)
    return env


def page_templates(request: Request) -> Environment:
    return request.app.state.templates


def database(request: Request) -> Any:
    """The runs database behind the recorder, or None when runs are not recorded."""
    recorder = getattr(request.app.state, "recorder", None)
    return getattr(recorder, "database", None)


def run_service(request: Request) -> RunService:
    return request.app.state.runs


def token_decoder(request: Request, model: str | None) -> Callable[[int], str | None]:
    """Token id -> text with the served tokenizer, only for runs of the served model."""
    service = getattr(request.app.state, "runs", None)
    if service is None or model != service.model_name:
        return lambda token_id: None
    return service.token_text


# ---- rendering -----------------------------------------------------------------------------
def wants_json(request: Request) -> bool:
    if request.url.path.endswith(".json"):
        return True
    accept = request.headers.get("accept", "")
    return "application/json" in accept and "text/html" not in accept


def html_response(request: Request, template: str, context: dict,
                  status: int = 200) -> HTMLResponse:
    return HTMLResponse(render_template(request, template, context), status_code=status)


def render_template(request: Request, template: str, context: dict) -> str:
    service = getattr(request.app.state, "runs", None)
    extras = {"served_model": service.model_name if service else None,
              "path": request.url.path,
              "auth": request.scope.get("batchscope.auth")}  # "session": show "log out"
    return page_templates(request).get_template(template).render({**extras, **context})


def page_response(request: Request, template: str, context: View | dict, status: int = 200,
                  page_only: Callable[[], dict] | None = None) -> Response:
    """One context, two renderings: the template, or the context itself as JSON.
    page_only: what only the page shows (an inline plot), made only when the page is."""
    if isinstance(context, View):
        if wants_json(request):
            return JSONResponse(context.model_dump(mode="json"), status_code=status)
        context = context.model_dump()
    elif wants_json(request):
        return JSONResponse(json_safe(context), status_code=status)
    return html_response(request, template, {**context, **(page_only() if page_only else {})},
                         status)


def view_routes(path: str, endpoint: Callable[[Request], Awaitable[Response]],
                methods: tuple[str, ...] = ("GET",)) -> list[Route]:
    """A page and its JSON twin (`path` + ".json") served by one endpoint, which renders
    either (page_response). The twin comes first: a `{param}` at the end of `path` would
    otherwise take "x.json" as its value."""
    return [Route(f"{path}.json", endpoint, methods=list(methods)),
            Route(path, endpoint, methods=list(methods))]


def error_response(request: Request, status: int, message: str, param: str | None = None,
           code: str | None = None, fragment: bool = False) -> Response:
    if wants_json(request):
        kind = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse(error_body(message, kind, param, code), status_code=status)
    template = "_error.html" if fragment else "error.html"
    return html_response(request, template, {"status": status, "message": message, "param": param},
                 status)


async def in_thread(request: Request, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A database read off the event loop."""
    db = database(request)
    return await anyio.to_thread.run_sync(lambda: fn(db, *args, **kwargs))


# ---- tokens --------------------------------------------------------------------------------
def token_view(idx: int, token_id: int, text: str | None, logprob: float | None,
               top: list | None, t: float | None, queued_at: float | None, step: int | None,
               decode: Callable[[int], str | None], drafted: bool = False) -> dict:
    """One output token as pages and JSON show it; alternatives decoded when possible.
    drafted: proposed by speculative decoding and accepted by the target model."""
    return {
        "idx": idx, "token_id": token_id, "text": text, "logprob": logprob,
        "offset": None if t is None or queued_at is None else t - queued_at, "step": step,
        "drafted": drafted,
        "alternatives": [{"token_id": tid, "text": decode(tid), "logprob": lp}
                         for tid, lp in (top or [])],
    }


# ---- forms -------------------------------------------------------------------------------
async def read_form(request: Request) -> dict[str, str] | Response:
    """An urlencoded body (what htmx sends), size-capped; a 400/413 fragment otherwise."""
    limit: int = request.app.state.settings.max_body_bytes
    if "multipart/" in request.headers.get("content-type", ""):
        return error_response(request, 400, "send the form urlencoded, not as multipart",
                      fragment=True)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return error_response(request, 413, f"the form is larger than {limit} bytes",
                          fragment=True)
    try:
        pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=False)
    except (UnicodeDecodeError, ValueError):
        return error_response(request, 400, "could not read the form", fragment=True)
    return dict(pairs)


def form_errors(request: Request, errors: dict[str, str]) -> Response:
    if wants_json(request):
        name, message = next(iter(errors.items()))
        return JSONResponse(error_body(message, param=name, code="invalid_value"),
                            status_code=400)
    return html_response(request, "_form_errors.html", {"errors": errors}, 400)
