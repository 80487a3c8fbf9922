"""The divergence page: run a divergence experiment (app/lab/divergence/) from the browser and
read its record: both texts with the fork marked, the logits at the fork, a chart of max
|Δlogit| and each side's top-2 margin token by token, and the contamination timeline (which
step wrote each cached position on each side, and where the keys/values first differ).

    GET  /divergence            the form, recent experiments, and ?id=... one experiment
    POST /divergence            start one (303 to its page; the JSON twin answers 202)
    GET  /divergence.json       the same context as JSON (?id=... includes the full record)

The server's own engine is busy serving, so experiments run in one worker thread with engines
of their own (they load the same model: fine on this machine), one experiment at a time.
The queue of experiments is the Lab (app/web/divergence_lab.py): a finished or failed one is
saved in the runs database and listed from there, so it survives a restart; without a database
finished experiments stay in memory, the latest MAX_KEEP, and the page says so.
"""

from __future__ import annotations

import math

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from app.charts import Panel, Point, Scale, Series, Svg
from app.db import experiments as store
from app.lab.divergence import DivergenceRecord, SideConfig
from app.lab.divergence.report import result_view
from app.web.divergence_lab import MAX_KEEP, LabBusy, lab_for
from app.web.render import (
    error_response,
    form_errors,
    page_response,
    read_form,
    view_routes,
    wants_json,
)
from app.web.views import Divergence, DivergenceResult, HeldExperiment, SavedExperiment
from engine.config import POLICIES, WEIGHT_FORMATS

MAX_LISTED = 100  # saved experiments listed on the page
MAX_PROMPT_CHARS = 4000
MAX_TOKENS_LIMIT = 256
DEFAULT_FORM = {
    "prompt": "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "max_tokens": "64", "top_k": "5", "chat": "",
    "a_weights": "f32", "a_policy": "auto", "a_threshold": "1", "a_alongside": "",
    "a_join": "0", "a_others_tokens": "16", "a_matmul": "auto",
    "b_weights": "f32", "b_policy": "auto", "b_threshold": "1", "b_alongside": "120,60,30",
    "b_join": "0", "b_others_tokens": "16", "b_matmul": "auto",
}
# Row kernels offered on the form (fields a_matmul, b_matmul, their names of old): the native
# kernels where they apply, or MLX's own ops.
ROW_KERNEL_CHOICES = ("auto", "mlx")


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
        kernels = form.get(f"{s}_matmul", "auto")
        if kernels not in ROW_KERNEL_CHOICES:
            errors[f"{s}_matmul"] = (f"row kernels must be one of "
                                     f"{', '.join(ROW_KERNEL_CHOICES)}")
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
                                  row_kernels=kernels)
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
                       f"{s}_matmul": SideConfig.from_dict(c).row_kernels})
    return values


# ---- the result ----------------------------------------------------------------------------
CHART_W, CHART_H, PAD_L, PAD_R, PAD_T, PAD_B = 720, 240, 56, 12, 12, 28


def chart_svg(record: DivergenceRecord) -> str | None:
    """max |Δlogit| and the top-2 margins per output token on one log axis (zeros on a floor
    line): where Δ climbs to the margin, a greedy choice can flip. Styled by the page's CSS
    (.div-chart); its legend is the page's."""
    rows = record.logits.per_token
    if not rows:
        return None
    values = [v for p in rows for v in (p.max_abs_delta, p.margin_a, p.margin_b)
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
    fork = record.fork
    if fork is not None and fork.token_index < n:
        marks.append((fork.token_index, "fork", "fork"))
    first = record.logits.first_difference
    if first is not None:
        marks.append((first, "first Δlogit", "dlogit"))
    kv_first = record.kv.first_difference
    if kv_first is not None and kv_first.b is not None:
        # The sampled token of the step that wrote the first differing keys/values.
        hit = next((p.index for p in rows if p.step_b == kv_first.b.step), None)
        if hit is not None:
            marks.append((hit, "first ΔKV", "kv"))
    for i, (index, label, kind) in enumerate(marks):  # labels stacked: marks may coincide
        svg.vline(panel.x(index), top, zero_y, label, label_y=top + 10 + i * 12, tip=label,
                  class_=f"mark mark-{kind}")
    for key, css in (("margin_a", "margin-a"), ("margin_b", "margin-b")):
        svg.series(panel, Series(key, [(p.index, getattr(p, key)) for p in rows], width=None,
                                 line_attrs={"class_": css}))
    dots = [Point(p.index, p.max_abs_delta,
                  tip=f"token {p.index}: max |Δlogit| {p.max_abs_delta:.3g}, "
                      f"margin A {p.margin_a:.4g}, B {p.margin_b:.4g}") for p in rows]
    svg.series(panel, Series("max_abs_delta", dots, width=None, marker=3,
                             line_attrs={"class_": "delta"}, dot_attrs={"class_": "dot"}))
    return svg.render()


# ---- views ---------------------------------------------------------------------------------
def _experiment(entry: dict) -> SavedExperiment | HeldExperiment:
    """An entry (the Lab's or the database's: their keys differ) with its record as to_dict()."""
    record = entry["record"]
    fields = {**entry, "record": None if record is None else record.to_dict()}
    return (SavedExperiment if entry["saved"] else HeldExperiment).model_validate(fields)


async def _context(request: Request, form: dict, errors: dict, entry: dict | None) -> Divergence:
    lab = lab_for(request.app)
    experiments = lab.recent()
    total_saved = None
    if lab.database is not None:
        saved = await anyio.to_thread.run_sync(store.list_experiments, lab.database, MAX_LISTED)
        total_saved = saved["total"]
        held = {e["id"] for e in experiments}  # just saved, not yet dropped from memory
        experiments += [e for e in saved["experiments"] if e["id"] not in held]
        experiments.sort(key=lambda e: e["created"], reverse=True)
    record = entry["record"] if entry is not None else None
    return Divergence(
        form=form, errors=errors, weights_choices=list(WEIGHT_FORMATS), policies=list(POLICIES),
        matmul_choices=list(ROW_KERNEL_CHOICES), max_tokens_limit=MAX_TOKENS_LIMIT,
        persisted=lab.database is not None, saved_total=total_saved, max_keep=MAX_KEEP,
        experiments=experiments, experiment=_experiment(entry) if entry is not None else None,
        view=(DivergenceResult.model_validate(result_view(record).to_dict())
              if record is not None else None))


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

    def page_only() -> dict:
        # The chart is markup for the page only; the JSON twin has its numbers in the record.
        if entry is None or context.view is None:
            return {}
        return {"view": {**context.view.model_dump(), "chart": chart_svg(entry["record"])}}

    return page_response(request, "divergence.html", context, page_only=page_only)


async def start_divergence(request: Request) -> Response:
    form = await read_form(request)
    if isinstance(form, Response):
        return form
    params, errors = parse_form(form)
    if params is None:
        if wants_json(request):
            return form_errors(request, errors)
        values = {**DEFAULT_FORM, **{k: v for k, v in form.items() if k in DEFAULT_FORM}}
        context = await _context(request, values, errors, None)
        return page_response(request, "divergence.html", context, 400)
    try:
        exp_id = lab_for(request.app).submit(params)
    except LabBusy as e:
        return error_response(request, 503, str(e), None, "busy")
    if wants_json(request):
        return JSONResponse({"id": exp_id, "status": "queued",
                             "url": f"/divergence.json?id={exp_id}"}, status_code=202)
    return RedirectResponse(f"/divergence?id={exp_id}", status_code=303)


# The page and its JSON twin: GET shows, POST starts an experiment.
routes = [*view_routes("/divergence", divergence),
          *view_routes("/divergence", start_divergence, methods=("POST",))]
