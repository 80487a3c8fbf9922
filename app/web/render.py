"""HTML pages and their JSON twins: playground, runs list, run detail, compare.

Each view builds one context dict and renders it as HTML (templates/) or as JSON (the `.json`
twin, or `Accept: application/json`), so scripts and tests read the numbers people see.

Starting, streaming and stopping playground runs (the live result panels over SSE) is in
app/web/pages/playground.py; the form it reads and the rendering helpers it uses are here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, urlencode

import anyio.to_thread
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from app.assets import static_dir, templates_dir
from app.db import runs as queries
from app.json_safe import json_safe
from app.runs import RunService
from app.web.api.routes import MAX_STOP, error_body
from engine.sampling import SamplingParams

TEMPLATES_DIR = templates_dir()
STATIC_DIR = static_dir()

MAX_COPIES = 8
MAX_STOP_CHARS = 200
PLAYGROUND_LOGPROBS = 5  # alternatives kept per token, shown on hover
DEFAULTS = {"mode": "chat", "temperature": 0.0, "top_p": 1.0, "max_tokens": 64, "seed": None,
            "stop": "", "copies": 1, "ignore_eos": False}
NO_DATABASE = ("no database: this server was started without one, so runs are not recorded "
               "(the playground still works)")


# ---- formatting (templates and tests share these, so a shown number equals its JSON value) ---
def fmt_ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1000:.1f} ms"


def fmt_rate(per_s: float | None) -> str:
    return "—" if per_s is None else f"{per_s:.1f}"


def fmt_lp(logprob: float | None) -> str:
    return "—" if logprob is None else f"{logprob:.3f}"


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
    env.filters.update(ms=fmt_ms, rate=fmt_rate, lp=fmt_lp, ts=fmt_time, visible=visible,
                       json=as_json)
    return env


def _templates(request: Request) -> Environment:
    return request.app.state.templates


def _database(request: Request) -> Any:
    """The runs database behind the recorder, or None when runs are not recorded."""
    recorder = getattr(request.app.state, "recorder", None)
    return getattr(recorder, "database", None)


def _service(request: Request) -> RunService:
    return request.app.state.runs


def _decoder(request: Request, model: str | None) -> Callable[[int], str | None]:
    """Token id -> text with the served tokenizer, only for runs of the served model."""
    service = getattr(request.app.state, "runs", None)
    if service is None or model != service.model_name:
        return lambda token_id: None
    return service.token_text


# ---- rendering -----------------------------------------------------------------------------
def _wants_json(request: Request) -> bool:
    if request.url.path.endswith(".json"):
        return True
    accept = request.headers.get("accept", "")
    return "application/json" in accept and "text/html" not in accept


def _html(request: Request, template: str, context: dict, status: int = 200) -> HTMLResponse:
    return HTMLResponse(_render(request, template, context), status_code=status)


def _render(request: Request, template: str, context: dict) -> str:
    service = getattr(request.app.state, "runs", None)
    extras = {"served_model": service.model_name if service else None,
              "path": request.url.path,
              "auth": request.scope.get("batchscope.auth")}  # "session": show "log out"
    return _templates(request).get_template(template).render({**extras, **context})


def _page(request: Request, template: str, context: dict, status: int = 200) -> Response:
    """One context, two renderings: the template, or the context itself as JSON."""
    if _wants_json(request):
        return JSONResponse(json_safe(context), status_code=status)
    return _html(request, template, context, status)


def _error(request: Request, status: int, message: str, param: str | None = None,
           code: str | None = None, fragment: bool = False) -> Response:
    if _wants_json(request):
        kind = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse(error_body(message, kind, param, code), status_code=status)
    template = "_error.html" if fragment else "error.html"
    return _html(request, template, {"status": status, "message": message, "param": param},
                 status)


async def _read(request: Request, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A database read off the event loop."""
    db = _database(request)
    return await anyio.to_thread.run_sync(lambda: fn(db, *args, **kwargs))


# ---- playground ----------------------------------------------------------------------------
@dataclass
class PlaygroundInput:
    mode: str
    system: str
    prompt: str
    params: SamplingParams
    copies: int


def _form_number(form: dict[str, str], name: str, label: str, errors: dict[str, str],
                 lo: float, hi: float, *, integer: bool = False, lo_open: bool = False,
                 optional: bool = False) -> Any:
    raw = form.get(name, "").strip()
    if not raw:
        if optional:
            return None
        if name in DEFAULTS and DEFAULTS[name] is not None:
            return DEFAULTS[name]
        errors[name] = f"{label} is required"
        return None
    try:
        value: float = int(raw) if integer else float(raw)
    except ValueError:
        errors[name] = f"{label} must be {'a whole number' if integer else 'a number'}, " \
                       f"got {raw[:40]!r}"
        return None
    low_ok = value > lo if lo_open else value >= lo
    if not math.isfinite(value) or not low_ok or value > hi:
        shown = (str(int(lo)), str(int(hi))) if integer else (f"{lo:g}", f"{hi:g}")
        errors[name] = f"{label} must be {'above' if lo_open else 'at least'} {shown[0]} and " \
                       f"at most {shown[1]}, got {raw[:40]}"
        return None
    return value


def parse_playground(form: dict[str, str], max_tokens_limit: int) -> tuple[PlaygroundInput | None,
                                                                             dict[str, str]]:
    """The playground form checked field by field: (input, {}) or (None, {field: message})."""
    errors: dict[str, str] = {}
    mode = form.get("mode", DEFAULTS["mode"])
    if mode not in ("chat", "raw"):
        errors["mode"] = f"prompt mode must be chat or raw, got {mode[:40]!r}"
    prompt = form.get("prompt", "")
    if not prompt.strip():
        errors["prompt"] = "prompt must not be empty"
    system = form.get("system", "") if mode == "chat" else ""
    temperature = _form_number(form, "temperature", "temperature", errors, 0.0, 2.0)
    top_p = _form_number(form, "top_p", "top-p", errors, 0.0, 1.0, lo_open=True)
    max_tokens = _form_number(form, "max_tokens", "max tokens", errors, 1, max_tokens_limit,
                              integer=True)
    seed = _form_number(form, "seed", "seed", errors, 0, 2**63 - 1, integer=True,
                        optional=True)
    copies = _form_number(form, "copies", "copies", errors, 1, MAX_COPIES, integer=True)
    # Stop strings: one per line, or comma separated on a line.
    stops = [s.strip() for line in form.get("stop", "").splitlines() for s in line.split(",")]
    stops = [s for s in stops if s]
    if len(stops) > MAX_STOP:
        errors["stop"] = f"at most {MAX_STOP} stop strings, got {len(stops)}"
    elif any(len(s) > MAX_STOP_CHARS for s in stops):
        errors["stop"] = f"stop strings must be at most {MAX_STOP_CHARS} characters"
    if errors:
        return None, errors
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            seed=seed, stop=tuple(stops), logprobs=PLAYGROUND_LOGPROBS,
                            ignore_eos=form.get("ignore_eos", "") not in ("", "0", "off"))
    return PlaygroundInput(mode, system, prompt, params, copies), {}


async def _read_form(request: Request) -> dict[str, str] | Response:
    """An urlencoded body (what htmx sends), size-capped; a 400/413 fragment otherwise."""
    limit: int = request.app.state.settings.max_body_bytes
    if "multipart/" in request.headers.get("content-type", ""):
        return _error(request, 400, "send the form urlencoded, not as multipart",
                      fragment=True)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return _error(request, 413, f"the form is larger than {limit} bytes",
                          fragment=True)
    try:
        pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=False)
    except (UnicodeDecodeError, ValueError):
        return _error(request, 400, "could not read the form", fragment=True)
    return dict(pairs)


async def playground(request: Request) -> Response:
    service = _service(request)
    context = {"model": service.model_name, "max_model_len": service.max_model_len,
               "max_tokens_limit": service.max_context_tokens(), "max_copies": MAX_COPIES,
               "max_stop": MAX_STOP, "defaults": DEFAULTS,
               "database": _database(request) is not None}
    return _page(request, "playground.html", context)


def _form_errors(request: Request, errors: dict[str, str]) -> Response:
    if _wants_json(request):
        name, message = next(iter(errors.items()))
        return JSONResponse(error_body(message, param=name, code="invalid_value"),
                            status_code=400)
    return _html(request, "_form_errors.html", {"errors": errors}, 400)


# ---- tokens --------------------------------------------------------------------------------
def token_view(idx: int, token_id: int, text: str | None, logprob: float | None,
               top: list | None, t: float | None, queued_at: float | None, step: int | None,
               decode: Callable[[int], str | None]) -> dict:
    """One output token as pages and JSON show it; alternatives decoded when possible."""
    return {
        "idx": idx, "token_id": token_id, "text": text, "logprob": logprob,
        "offset": None if t is None or queued_at is None else t - queued_at, "step": step,
        "alternatives": [{"token_id": tid, "text": decode(tid), "logprob": lp}
                         for tid, lp in (top or [])],
    }


# ---- runs list -----------------------------------------------------------------------------
FILTERS = ("model", "kernel_policy", "finish_reason", "q")


def _int_param(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, got {raw[:40]!r}") from None


def _runs_url(filters: dict, page: int, per_page: int, json: bool = False) -> str:
    query = {k: v for k, v in filters.items() if v}
    if page != 1:
        query["page"] = page
    if per_page != 50:
        query["per_page"] = per_page
    return ("/runs.json" if json else "/runs") + (f"?{urlencode(query)}" if query else "")


async def runs_list(request: Request) -> Response:
    if _database(request) is None:
        return _error(request, 503, NO_DATABASE, None, "no_database")
    filters = {k: request.query_params.get(k, "").strip() for k in FILTERS}
    try:
        page = _int_param(request, "page", 1)
        per_page = _int_param(request, "per_page", 50)
        listing = await _read(request, queries.list_runs, page=page, per_page=per_page,
                              **{k: v or None for k, v in filters.items()})
    except ValueError as e:
        return _error(request, 400, str(e), str(e).split(" ", 1)[0], "invalid_value")
    options = await _read(request, queries.distinct_values)
    pages = max(1, math.ceil(listing["total"] / per_page))
    window = range(max(1, page - 3), min(pages, page + 3) + 1)
    context = {
        **listing, "pages": pages, "filters": filters, "options": options,
        "links": {
            "prev": _runs_url(filters, page - 1, per_page) if page > 1 else None,
            "next": _runs_url(filters, page + 1, per_page) if page < pages else None,
            "pages": [{"page": p, "url": _runs_url(filters, p, per_page)} for p in window],
            "json": _runs_url(filters, page, per_page, json=True),
        },
    }
    return _page(request, "runs.html", context)


# ---- one run -------------------------------------------------------------------------------
def run_context(record: dict, decode: Callable[[int], str | None]) -> dict:
    """A saved run (queries.get_run) with decoded tokens, time offsets and decode speed."""
    queued = record["queued_at"]
    tokens = []
    previous: float | None = None
    for t in record["tokens"]:
        view = token_view(t["idx"], t["token_id"], t["text"], t["logprob"], t["top_logprobs"],
                          t["t"], queued, t["step"], decode)
        view["gap"] = None if previous is None or t["t"] is None else t["t"] - previous
        previous = t["t"]
        tokens.append(view)
    steps = [{**s, "offset": s["started_at"] - queued if queued else None}
             for s in record["steps"]]
    metrics = {**record["metrics"], "tokens_per_s": tokens_per_s(record["metrics"]["tpot"])}
    # Text released only with the finish (held back for a stop string, or a partial character).
    released = "".join(t["text"] or "" for t in tokens)
    output = record["output_text"] or ""
    tail = output[len(released):] if output.startswith(released) else ""
    return {**record, "tokens": tokens, "text_tail": tail, "steps": steps, "metrics": metrics}


async def run_detail(request: Request) -> Response:
    run_id = request.path_params["run_id"]
    if _database(request) is None:
        return _error(request, 503, NO_DATABASE, None, "no_database")
    record = await _read(request, queries.get_run, run_id)
    if record is None:
        # The playground's live runs (app/web/pages/playground.py keeps them on app.state).
        registry = getattr(request.app.state, "live_runs", None)
        live = registry.get(run_id) if registry is not None else None
        if live is not None:  # the recorder has not written its row yet
            context = {"id": run_id, "status": "running" if live.finish is None else "saving",
                       "message": f"run {run_id} is not in the database yet; this page "
                                  "reloads until it is"}
            return _page(request, "pending.html", context, 202)
        return _error(request, 404, f"no run {run_id!r}", "run_id", "not_found")
    return _page(request, "run.html", run_context(record, _decoder(request, record["model"])))


# ---- compare -------------------------------------------------------------------------------
def compare_context(a: dict, b: dict) -> dict:
    """Two saved runs (run_context shapes): parameter differences and outputs by token."""
    fields = [("model", a["model"], b["model"]), ("weights", a["weights"], b["weights"]),
              ("kernel_policy", a["kernel_policy"], b["kernel_policy"]),
              ("source", a["source"], b["source"]), ("endpoint", a["endpoint"], b["endpoint"]),
              ("prompt", a["prompt_text"], b["prompt_text"])]
    names = list(dict.fromkeys([*(a["params"] or {}), *(b["params"] or {})]))
    fields += [(n, (a["params"] or {}).get(n), (b["params"] or {}).get(n)) for n in names]
    params = [{"name": n, "a": va, "b": vb, "differs": va != vb} for n, va, vb in fields]
    rows = []
    first: int | None = None
    for i in range(max(len(a["tokens"]), len(b["tokens"]))):
        ta = a["tokens"][i] if i < len(a["tokens"]) else None
        tb = b["tokens"][i] if i < len(b["tokens"]) else None
        same = ta is not None and tb is not None and ta["token_id"] == tb["token_id"]
        if not same and first is None:
            first = i
        both = ta is not None and tb is not None
        lp_diff = (tb["logprob"] - ta["logprob"]
                   if both and ta["logprob"] is not None and tb["logprob"] is not None
                   else None)
        rows.append({"idx": i, "a": ta, "b": tb, "same": same, "logprob_diff": lp_diff})

    def side(r: dict) -> dict:
        keys = ("id", "created_at", "model", "status", "finish_reason", "prompt_tokens",
                "completion_tokens", "output_text", "text_tail")
        return {**{k: r[k] for k in keys}, "metrics": r["metrics"]}

    return {"a": side(a), "b": side(b), "params": params,
            "params_differing": [p["name"] for p in params if p["differs"]],
            "tokens": rows, "first_difference": first,
            "same_tokens": sum(1 for r in rows if r["same"])}


async def compare(request: Request) -> Response:
    if _database(request) is None:
        return _error(request, 503, NO_DATABASE, None, "no_database")
    records = {}
    for side in ("a", "b"):
        run_id = request.query_params.get(side, "").strip()
        if not run_id:
            return _error(request, 400, f"{side} is missing: compare takes two run ids, as in "
                                        "/compare?a=RUN_ID&b=RUN_ID", side, "missing")
        record = await _read(request, queries.get_run, run_id)
        if record is None:
            return _error(request, 400, f"{side}: there is no run with id {run_id!r}", side,
                          "not_found")
        records[side] = run_context(record, _decoder(request, record["model"]))
    return _page(request, "compare.html", compare_context(records["a"], records["b"]))


routes = [
    Route("/", playground, methods=["GET"]),
    Route("/runs", runs_list, methods=["GET"]),
    Route("/runs.json", runs_list, methods=["GET"]),
    Route("/runs/{run_id}.json", run_detail, methods=["GET"]),
    Route("/runs/{run_id}", run_detail, methods=["GET"]),
    Route("/compare", compare, methods=["GET"]),
    Route("/compare.json", compare, methods=["GET"]),
    Mount("/static", app=StaticFiles(directory=STATIC_DIR), name="static"),
]
