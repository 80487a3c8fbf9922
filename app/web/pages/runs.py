"""The runs pages and their JSON twins: the list (filters, search, pages), one run (output,
per-token timeline, the steps it shared), and two runs compared token by token."""

from __future__ import annotations

import math
from collections.abc import Callable
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import Response

from app.db import runs as queries
from app.web.api.tool_calls import parse, parser
from app.web.render import (
    NO_DATABASE,
    database,
    error_response,
    in_thread,
    page_response,
    token_decoder,
    token_view,
    tokens_per_s,
    view_routes,
)
from app.web.views import (
    Comparison,
    FilterOptions,
    PageLink,
    ParamRow,
    Run,
    RunList,
    RunListLinks,
    RunMetrics,
    RunPending,
    RunSide,
    RunStep,
    RunToken,
    Speculation,
    TokenPair,
)

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
    if database(request) is None:
        return error_response(request, 503, NO_DATABASE, None, "no_database")
    filters = {k: request.query_params.get(k, "").strip() for k in FILTERS}
    try:
        page = _int_param(request, "page", 1)
        per_page = _int_param(request, "per_page", 50)
        listing = await in_thread(request, queries.list_runs, page=page, per_page=per_page,
                              **{k: v or None for k, v in filters.items()})
    except ValueError as e:
        return error_response(request, 400, str(e), str(e).split(" ", 1)[0], "invalid_value")
    options = await in_thread(request, queries.distinct_values)
    pages = max(1, math.ceil(listing["total"] / per_page))
    window = range(max(1, page - 3), min(pages, page + 3) + 1)
    context = RunList(
        **listing, pages=pages, filters=filters, options=FilterOptions(**options),
        links=RunListLinks(
            prev=_runs_url(filters, page - 1, per_page) if page > 1 else None,
            next=_runs_url(filters, page + 1, per_page) if page < pages else None,
            pages=[PageLink(page=p, url=_runs_url(filters, p, per_page)) for p in window],
            json=_runs_url(filters, page, per_page, json=True),
        ),
    )
    return page_response(request, "runs.html", context)


# ---- one run -------------------------------------------------------------------------------
def run_context(record: dict, decode: Callable[[int], str | None]) -> Run:
    """A saved run (queries.get_run) with decoded tokens, time offsets and decode speed."""
    queued = record["queued_at"]
    tokens = []
    previous: float | None = None
    for t in record["tokens"]:
        view = token_view(t["idx"], t["token_id"], t["text"], t["logprob"], t["top_logprobs"],
                          t["t"], queued, t["step"], decode, t.get("drafted", False))
        gap = None if previous is None or t["t"] is None else t["t"] - previous
        previous = t["t"]
        tokens.append(RunToken(**view, gap=gap))
    steps = [RunStep(**s, offset=s["started_at"] - queued if queued else None)
             for s in record["steps"]]
    metrics = RunMetrics(**record["metrics"],
                         tokens_per_s=tokens_per_s(record["metrics"]["tpot"]))
    # Text released only with the finish (held back for a stop string, or a partial character).
    released = "".join(t.text or "" for t in tokens)
    output = record["output_text"] or ""
    tail = output[len(released):] if output.startswith(released) else ""
    # Drafted tokens among the output (the rest of the summary comes from the step entries).
    speculation = Speculation(**record.get("speculation", {}),
                              drafted_tokens=sum(1 for t in tokens if t.drafted))
    return Run(**{**record, "tokens": tokens, "steps": steps, "metrics": metrics,
                  "speculation": speculation}, text_tail=tail,
               tool_calls=_tool_calls(record["params"], output))


def _tool_calls(params: dict | None, output: str) -> list[dict[str, str]] | None:
    """The calls in a run's output, read as its stream was (the recorded parser), or None for
    a run without tools recorded."""
    name = (params or {}).get("tool_parser")
    if not name:
        return None
    return [{"name": c.name, "arguments": c.arguments}
            for c in parse(parser(name, None), output)[1]]


async def run_detail(request: Request) -> Response:
    run_id = request.path_params["run_id"]
    if database(request) is None:
        return error_response(request, 503, NO_DATABASE, None, "no_database")
    record = await in_thread(request, queries.get_run, run_id)
    if record is None:
        # The playground's live runs (app/web/pages/playground.py keeps them on app.state).
        registry = getattr(request.app.state, "live_runs", None)
        live = registry.get(run_id) if registry is not None else None
        if live is not None:  # the recorder has not written its row yet
            context = RunPending(
                id=run_id, status="running" if live.finish is None else "saving",
                message=f"run {run_id} is not in the database yet; this page reloads until "
                        "it is")
            return page_response(request, "pending.html", context, 202)
        return error_response(request, 404, f"no run {run_id!r}", "run_id", "not_found")
    return page_response(request, "run.html",
                         run_context(record, token_decoder(request, record["model"])))


# ---- compare -------------------------------------------------------------------------------
def compare_context(a: Run, b: Run) -> Comparison:
    """Two saved runs (run_context): parameter differences and outputs by token."""
    fields = [("model", a.model, b.model), ("weights", a.weights, b.weights),
              ("kernel_policy", a.kernel_policy, b.kernel_policy),
              ("source", a.source, b.source), ("endpoint", a.endpoint, b.endpoint),
              ("prompt", a.prompt_text, b.prompt_text)]
    names = list(dict.fromkeys([*(a.params or {}), *(b.params or {})]))
    fields += [(n, (a.params or {}).get(n), (b.params or {}).get(n)) for n in names]
    params = [ParamRow(name=n, a=va, b=vb, differs=va != vb) for n, va, vb in fields]
    rows = []
    first: int | None = None
    for i in range(max(len(a.tokens), len(b.tokens))):
        ta = a.tokens[i] if i < len(a.tokens) else None
        tb = b.tokens[i] if i < len(b.tokens) else None
        same = ta is not None and tb is not None and ta.token_id == tb.token_id
        if not same and first is None:
            first = i
        both = ta is not None and tb is not None
        lp_diff = (tb.logprob - ta.logprob
                   if both and ta.logprob is not None and tb.logprob is not None else None)
        rows.append(TokenPair(idx=i, a=ta, b=tb, same=same, logprob_diff=lp_diff))

    def side(r: Run) -> RunSide:
        return RunSide(**{name: getattr(r, name) for name in RunSide.model_fields})

    return Comparison(a=side(a), b=side(b), params=params,
                      params_differing=[p.name for p in params if p.differs],
                      tokens=rows, first_difference=first,
                      same_tokens=sum(1 for r in rows if r.same))


async def compare(request: Request) -> Response:
    if database(request) is None:
        return error_response(request, 503, NO_DATABASE, None, "no_database")
    records = {}
    for side in ("a", "b"):
        run_id = request.query_params.get(side, "").strip()
        if not run_id:
            return error_response(request, 400, f"{side} is missing: compare takes two run ids, "
                                  "as in /compare?a=RUN_ID&b=RUN_ID", side, "missing")
        record = await in_thread(request, queries.get_run, run_id)
        if record is None:
            return error_response(request, 400, f"{side}: there is no run with id {run_id!r}", side,
                          "not_found")
        records[side] = run_context(record, token_decoder(request, record["model"]))
    return page_response(request, "compare.html", compare_context(records["a"], records["b"]))


routes = [*view_routes("/runs", runs_list), *view_routes("/runs/{run_id}", run_detail),
          *view_routes("/compare", compare)]
