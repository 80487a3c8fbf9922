"""The divergence page: run a divergence experiment (app/lab/divergence.py) from the browser and
read its record: both texts with the fork marked, the logits at the fork, a chart of max
|Δlogit| and each side's top-2 margin token by token, and the contamination timeline (which
step wrote each cached position on each side, and where the keys/values first differ).

    GET  /divergence            the form, recent experiments, and ?id=... one experiment
    POST /divergence            start one (303 to its page; the JSON twin answers 202)
    GET  /divergence.json       the same context as JSON (?id=... includes the full record)

The server's own engine is busy serving, so experiments run in one worker thread with engines
of their own (they load the same model: fine on this machine), one experiment at a time.
Queued and running experiments live in memory on app.state (the Lab). A finished or failed one
is written to the runs database by the worker thread (app/db/experiments.py: the record, and
its two sides as runs with their tokens, shown on /runs and /compare), then dropped from memory:
the page lists and loads it from the database, so it survives a restart. Without a database
(or when writing fails) finished experiments stay in memory, the latest MAX_KEEP, and the page
says so.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from app.charts import Panel, Point, Scale, Series, Svg
from app.db import experiments as store
from app.lab.divergence import DivergenceRunner, SideConfig, timeline
from app.web.api.routes import error_body
from app.web.render import error_response, html_response, page_response, read_form, wants_json
from engine.config import POLICIES, WEIGHT_FORMATS

log = logging.getLogger("batchscope.divergence")

MAX_KEEP = 32  # finished experiments kept in memory (without a database)
MAX_LISTED = 100  # saved experiments listed on the page
MAX_PENDING = 4  # queued or running; more get a 503
MAX_PROMPT_CHARS = 4000
MAX_TOKENS_LIMIT = 256
MAX_PROGRESS = 50
DEFAULT_FORM = {
    "prompt": "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "max_tokens": "64", "top_k": "5", "chat": "",
    "a_weights": "f32", "a_policy": "auto", "a_threshold": "1", "a_alongside": "",
    "a_join": "0", "a_others_tokens": "16", "a_matmul": "auto",
    "b_weights": "f32", "b_policy": "auto", "b_threshold": "1", "b_alongside": "120,60,30",
    "b_join": "0", "b_others_tokens": "16", "b_matmul": "auto",
}
# Decode matmul choices offered on the form: the native kernel where it applies, or MLX's.
MATMUL_CHOICES = ("auto", "mlx")


class LabBusy(RuntimeError):
    pass


class Lab:
    """Experiments by id (queued, running; finished ones without a database) and the worker
    thread that runs them and saves what finishes into `database` (None: memory only)."""

    def __init__(self, model: str = "embedded", loader: Any = None, database: Any = None):
        self.model = model
        self.loader = loader  # weights -> LoadedModel; None: the engine's loader (tests: tiny)
        self.database = database
        self._items: OrderedDict[str, dict] = OrderedDict()
        self._lock = threading.Lock()
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._ids = itertools.count(1)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker (the app's lifespan does, at shutdown): it ends after the experiment
        it is running; one still running after `timeout` is left to finish on its daemon
        thread, and its result is not saved."""
        self._closed = True
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    def submit(self, params: dict) -> str:
        with self._lock:
            if self._closed:
                raise LabBusy("the server is shutting down")
            pending = sum(1 for e in self._items.values() if e["status"] in ("queued", "running"))
            if pending >= MAX_PENDING:
                raise LabBusy(f"{pending} experiments are queued or running; try again later")
            exp_id = self._new_id()
            self._items[exp_id] = _entry(exp_id, "queued", params)
            self._trim()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="batchscope-divergence",
                                                daemon=True)
                self._thread.start()
        self._queue.put(exp_id)
        return exp_id

    def add_record(self, record: dict, params: dict | None = None) -> str:
        """Keep an already finished record (tests, or a record computed elsewhere)."""
        with self._lock:
            exp_id = self._new_id()
            now = time.time()
            self._items[exp_id] = _entry(exp_id, "done", params or {}, started=now,
                                         finished=now, record=record)
        self._finished(exp_id)
        return exp_id

    def get(self, exp_id: str) -> dict | None:
        """An experiment held in memory (not one already saved: see store.get_experiment)."""
        with self._lock:
            entry = self._items.get(exp_id)
            return None if entry is None else {**entry, "progress": list(entry["progress"])}

    def recent(self) -> list[dict]:
        with self._lock:
            entries = list(self._items.values())
        return [_summary(e) for e in reversed(entries)]

    def _finished(self, exp_id: str) -> None:
        """Save a finished or failed experiment, then let the database hold it; kept in memory
        when there is no database or the write fails (the page shows why)."""
        if self.database is not None:
            entry = self.get(exp_id)
            try:
                store.save_experiment(self.database, entry)
            except Exception as e:  # kept in memory instead; the worker carries on
                log.error("divergence experiment %s not saved: %s", exp_id, e)
                self._update(exp_id, save_error=str(e))
            else:
                # Dropped only once committed: a reader finds it in memory or in the database.
                with self._lock:
                    self._items.pop(exp_id, None)
                return
        with self._lock:
            self._trim()

    def _new_id(self) -> str:
        return f"div-{next(self._ids)}-{uuid.uuid4().hex[:6]}"

    def _trim(self) -> None:
        done = [k for k, e in self._items.items() if e["status"] in ("done", "error")]
        for k in done[:max(0, len(done) - MAX_KEEP)]:
            del self._items[k]

    def _update(self, exp_id: str, **changes: Any) -> None:
        with self._lock:
            entry = self._items.get(exp_id)
            if entry is not None:
                entry.update(changes)

    def _work(self) -> None:
        while True:
            exp_id = self._queue.get()
            if exp_id is None:  # close()
                return
            entry = self.get(exp_id)
            if entry is None:
                continue
            self._update(exp_id, status="running", started=time.time())

            def progress(message: str, exp_id: str = exp_id) -> None:
                with self._lock:
                    log = self._items.get(exp_id, {}).get("progress")
                    if log is not None and len(log) < MAX_PROGRESS:
                        log.append(message)

            p = entry["params"]
            try:
                with DivergenceRunner(self.loader, self.model, progress) as runner:
                    record = runner.run(p["prompt"], SideConfig.from_dict(p["a"]),
                                        SideConfig.from_dict(p["b"]), p["max_tokens"],
                                        top_k=p["top_k"], chat=p["chat"])
                self._update(exp_id, status="done", finished=time.time(), record=record)
            except Exception as e:  # shown on the page; the worker carries on
                self._update(exp_id, status="error", finished=time.time(),
                             error=f"{type(e).__name__}: {e}")
            self._finished(exp_id)


def _entry(exp_id: str, status: str, params: dict, **fields: Any) -> dict:
    """An experiment as the Lab holds it (store.get_experiment returns the same shape)."""
    return {"id": exp_id, "status": status, "created": time.time(), "started": None,
            "finished": None, "params": params, "progress": [], "record": None, "error": None,
            "source": "web", "runs": None, "saved": False, "save_error": None, **fields}


def _summary(e: dict) -> dict:
    params, record = e["params"], e["record"] or {}
    sides = record.get("sides", {})

    def label(s: str) -> str | None:
        return params.get(s, {}).get("label") or sides.get(s, {}).get("label")

    return {"id": e["id"], "status": e["status"], "created": e["created"], "source": "web",
            "prompt": (params.get("prompt") or record.get("prompt") or "")[:store.PROMPT_PREVIEW],
            "a": label("a"), "b": label("b"),
            "verdict": record.get("verdict") or e["error"],
            "verdict_kind": store.verdict_kind(record) if e["record"] else None,
            "fork_token_index": (record.get("fork") or {}).get("token_index"), "runs": None,
            "saved": False}


def lab_for(app: Any) -> Lab:
    """The app's Lab (made and closed by the lifespan: app/web/app.py)."""
    return app.state.divergence_lab


# ---- the form ------------------------------------------------------------------------------
def parse_form(form: dict[str, str]) -> tuple[dict | None, dict[str, str]]:
    """(params, {}) or (None, {field: message})."""
    errors: dict[str, str] = {}
    prompt = form.get("prompt", "")
    if not prompt.strip():
        errors["prompt"] = "prompt must not be empty"
    elif len(prompt) > MAX_PROMPT_CHARS:
        errors["prompt"] = f"prompt must be at most {MAX_PROMPT_CHARS} characters"

    def number(name: str, label: str, lo: int, hi: int) -> int | None:
        raw = form.get(name, "").strip() or DEFAULT_FORM.get(name, "")
        try:
            value = int(raw)
        except ValueError:
            errors[name] = f"{label} must be a whole number, got {raw[:40]!r}"
            return None
        if not lo <= value <= hi:
            errors[name] = f"{label} must be from {lo} to {hi}, got {value}"
            return None
        return value

    max_tokens = number("max_tokens", "max tokens", 1, MAX_TOKENS_LIMIT)
    top_k = number("top_k", "top-k", 1, 20)
    sides = {}
    for s in ("a", "b"):
        weights = form.get(f"{s}_weights", "f32")
        policy = form.get(f"{s}_policy", "gemm")
        if weights not in WEIGHT_FORMATS:
            errors[f"{s}_weights"] = f"weights must be one of {', '.join(WEIGHT_FORMATS)}"
        if policy not in POLICIES:
            errors[f"{s}_policy"] = f"kernel policy must be one of {', '.join(POLICIES)}"
        matmul = form.get(f"{s}_matmul", "auto")
        if matmul not in MATMUL_CHOICES:
            errors[f"{s}_matmul"] = f"decode matmul must be one of {', '.join(MATMUL_CHOICES)}"
        threshold = number(f"{s}_threshold", "threshold", 0, 100_000)
        join = number(f"{s}_join", "join at", 0, MAX_TOKENS_LIMIT)
        others_tokens = number(f"{s}_others_tokens", "tokens of the others", 1, MAX_TOKENS_LIMIT)
        try:
            spec = form.get(f"{s}_alongside", "").replace(" ", "")
            alongside = SideConfig.parse(f"alongside={spec}").alongside
        except ValueError as e:
            errors[f"{s}_alongside"] = str(e)
            continue
        if any(k.startswith(f"{s}_") for k in errors):
            continue
        try:
            sides[s] = SideConfig(weights=weights, kernel_policy=policy,
                                  kernel_threshold=threshold, alongside=alongside,
                                  join_at=join, alongside_max_tokens=others_tokens,
                                  decode_matmul=matmul)
        except ValueError as e:
            errors[f"{s}_alongside"] = str(e)
    if errors:
        return None, errors
    return {"prompt": prompt, "max_tokens": max_tokens, "top_k": top_k,
            "chat": form.get("chat", "") not in ("", "0", "off"),
            "a": sides["a"].to_dict(), "b": sides["b"].to_dict()}, {}


def form_values(params: dict) -> dict:
    """An experiment's parameters back as form fields (to rerun it with changes)."""
    values = {"prompt": params["prompt"], "max_tokens": str(params["max_tokens"]),
              "top_k": str(params["top_k"]), "chat": "1" if params.get("chat") else ""}
    for s in ("a", "b"):
        c = params[s]
        values.update({f"{s}_weights": c["weights"], f"{s}_policy": c["kernel_policy"],
                       f"{s}_threshold": str(c["kernel_threshold"]),
                       f"{s}_alongside": ",".join(str(n) for n in c["alongside"]),
                       f"{s}_join": str(c["join_at"]),
                       f"{s}_others_tokens": str(c["alongside_max_tokens"]),
                       f"{s}_matmul": c.get("decode_matmul", "auto")})
    return values


# ---- the result ----------------------------------------------------------------------------
CHART_W, CHART_H, PAD_L, PAD_R, PAD_T, PAD_B = 720, 240, 56, 12, 12, 28


def chart_svg(record: dict) -> str | None:
    """max |Δlogit| and the top-2 margins per output token on one log axis (zeros on a floor
    line): where Δ climbs to the margin, a greedy choice can flip. Styled by the page's CSS
    (.div-chart); its legend is the page's."""
    rows = record["logits"]["per_token"]
    if not rows:
        return None
    values = [v for p in rows for v in (p["max_abs_delta"], p["margin_a"], p["margin_b"])
              if v and v > 0 and math.isfinite(v)]
    lo_exp = math.floor(math.log10(min(values))) if values else -6
    hi_exp = math.ceil(math.log10(max(values))) if values else 1
    hi_exp = max(hi_exp, lo_exp + 1)
    zero_y = CHART_H - PAD_B
    top, bottom = PAD_T, CHART_H - PAD_B - 14  # the floor line sits below the lowest decade
    n = len(rows)
    panel = Panel(PAD_L, top, CHART_W - PAD_R, zero_y,
                  x=Scale(0, max(1, n - 1), PAD_L, CHART_W - PAD_R),
                  y=Scale(10.0 ** lo_exp, 10.0 ** hi_exp, bottom, top, log=10, floor=zero_y))
    svg = Svg(CHART_W, CHART_H, css_class="div-chart", font_size=None, background=None,
              label="max |Δlogit| and top-2 margins per output token")
    decades = {10.0 ** e: f"1e{e}" for e in range(lo_exp, hi_exp + 1)}
    svg.grid_y(panel, [*decades, 0.0], lambda v: decades.get(v, "0"), gap=4, class_="grid")
    step = max(1, math.ceil(n / 12))
    svg.ticks_x(panel, range(0, n, step), str, mark=0, gap=CHART_H - 6 - zero_y)
    marks = []
    fork = record["fork"]
    if fork is not None and fork["token_index"] < n:
        marks.append((fork["token_index"], "fork", "fork"))
    first = record["logits"]["first_difference"]
    if first is not None:
        marks.append((first, "first Δlogit", "dlogit"))
    kv_first = record["kv"]["first_difference"]
    if kv_first is not None and kv_first["b"] is not None:
        # The sampled token of the step that wrote the first differing keys/values.
        hit = next((p["index"] for p in rows if p["step_b"] == kv_first["b"]["step"]), None)
        if hit is not None:
            marks.append((hit, "first ΔKV", "kv"))
    for i, (index, label, kind) in enumerate(marks):  # labels stacked: marks may coincide
        svg.vline(panel.x(index), top, zero_y, label, label_y=top + 10 + i * 12, tip=label,
                  class_=f"mark mark-{kind}")
    for key, css in (("margin_a", "margin-a"), ("margin_b", "margin-b")):
        svg.series(panel, Series(key, [(p["index"], p[key]) for p in rows], width=None,
                                 line_attrs={"class_": css}))
    dots = [Point(p["index"], p["max_abs_delta"],
                  tip=f"token {p['index']}: max |Δlogit| {p['max_abs_delta']:.3g}, "
                      f"margin A {p['margin_a']:.4g}, B {p['margin_b']:.4g}") for p in rows]
    svg.series(panel, Series("max_abs_delta", dots, width=None, marker=3,
                             line_attrs={"class_": "delta"}, dot_attrs={"class_": "dot"}))
    return svg.render()


def result_view(record: dict) -> dict:
    """What the page shows of a finished record (the record itself goes to the JSON twin)."""
    a, b = record["sides"]["a"], record["sides"]["b"]
    fork = record["fork"]
    texts = {}
    for s, side in (("a", a), ("b", b)):
        if fork is None:
            texts[s] = {"shared": side["text"], "rest": ""}
        else:
            texts[s] = {"shared": fork["shared_text"], "rest": fork[f"continuation_{s}"]}
    first = record["kv"]["first_difference"]
    rows = []
    for row in timeline(record):
        rows.append({**row, "has_first": bool(first and row["first"] <= first["position"]
                                              <= row["last"]),
                     "what": _what(row["first"], row["last"], record["prompt_tokens"])})
    return {"texts": texts, "timeline": rows,
            "fork_token": fork["token_index"] if fork else None}


def _what(first: int, last: int, prompt_tokens: int) -> str:
    if last < prompt_tokens:
        return "prompt"
    lo = max(first, prompt_tokens) - prompt_tokens
    hi = last - prompt_tokens
    fed = f"output #{lo}" if lo == hi else f"output #{lo}–#{hi}"
    return ("prompt + " if first < prompt_tokens else "") + fed


# ---- views ---------------------------------------------------------------------------------
async def _context(request: Request, form: dict, errors: dict, entry: dict | None) -> dict:
    lab = lab_for(request.app)
    experiments = lab.recent()
    total_saved = None
    if lab.database is not None:
        saved = await anyio.to_thread.run_sync(store.list_experiments, lab.database, MAX_LISTED)
        total_saved = saved["total"]
        held = {e["id"] for e in experiments}  # just saved, not yet dropped from memory
        experiments += [e for e in saved["experiments"] if e["id"] not in held]
        experiments.sort(key=lambda e: e["created"], reverse=True)
    context: dict[str, Any] = {
        "form": form, "errors": errors, "weights_choices": list(WEIGHT_FORMATS),
        "policies": list(POLICIES), "matmul_choices": list(MATMUL_CHOICES),
        "max_tokens_limit": MAX_TOKENS_LIMIT,
        "persisted": lab.database is not None, "saved_total": total_saved,
        "max_keep": MAX_KEEP, "experiments": experiments, "experiment": None, "view": None}
    if entry is not None:
        context["experiment"] = entry
        if entry["record"] is not None:
            context["view"] = result_view(entry["record"])
    return context


async def divergence(request: Request) -> Response:
    exp_id = request.query_params.get("id", "").strip()
    entry = None
    form = dict(DEFAULT_FORM)
    if exp_id:
        lab = lab_for(request.app)
        entry = lab.get(exp_id)  # queued, running, or kept in memory
        if entry is None and lab.database is not None:
            entry = await anyio.to_thread.run_sync(store.get_experiment, lab.database, exp_id)
        if entry is None:
            where = ("" if lab.database is not None else " (no database: results are kept in "
                     "memory only, and a restarted server has none)")
            return error_response(request, 404, f"no divergence experiment {exp_id[:100]!r}{where}",
                          "id", "not_found")
        if entry["params"]:
            form = form_values(entry["params"])
    context = await _context(request, form, {}, entry)
    if context["view"] is not None and not wants_json(request):
        # The chart is markup for the page only; the JSON twin has its numbers in the record.
        context["view"]["chart"] = chart_svg(entry["record"])
    return page_response(request, "divergence.html", context)


async def start_divergence(request: Request) -> Response:
    form = await read_form(request)
    if isinstance(form, Response):
        return form
    params, errors = parse_form(form)
    if params is None:
        if wants_json(request):
            name, message = next(iter(errors.items()))
            return JSONResponse(error_body(message, param=name, code="invalid_value"), 400)
        values = {**DEFAULT_FORM, **{k: v for k, v in form.items() if k in DEFAULT_FORM}}
        context = await _context(request, values, errors, None)
        return html_response(request, "divergence.html", context, 400)
    try:
        exp_id = lab_for(request.app).submit(params)
    except LabBusy as e:
        return error_response(request, 503, str(e), None, "busy")
    if wants_json(request):
        return JSONResponse({"id": exp_id, "status": "queued",
                             "url": f"/divergence.json?id={exp_id}"}, status_code=202)
    return RedirectResponse(f"/divergence?id={exp_id}", status_code=303)


routes = [
    Route("/divergence", divergence, methods=["GET"]),
    Route("/divergence", start_divergence, methods=["POST"]),
    Route("/divergence.json", divergence, methods=["GET"]),
    Route("/divergence.json", start_divergence, methods=["POST"]),
]
