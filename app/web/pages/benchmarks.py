"""/benchmarks: the recorded `batchscope bench serve` runs, with plots; JSON twins.

    GET /benchmarks          table of runs (newest first), latency CDFs of the plotted runs,
                             output throughput against measured peak concurrency
                             ?runs=3,5,8 picks the runs in the CDFs (default: the newest 6)
    GET /benchmarks.json     the same context, without the SVG markup
    GET /benchmarks/{id}     one run: every number of its report and its requests
    GET /benchmarks/{id}.json
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from app.bench.metrics import METRIC_TITLES, METRICS
from app.db import benchmarks as store
from app.web.pages import benchmark_plots as plots
from app.web.render import (
    NO_DATABASE,
    database,
    error_response,
    in_thread,
    page_response,
    view_routes,
)
from app.web.views import Benchmark, Benchmarks

LIST_LIMIT = 200
DEFAULT_PLOTTED = 6
MAX_PLOTTED = len(plots.COLORS)
CDF_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("latency", "E2E latency"))


def _plotted_ids(request: Request, runs: list[dict]) -> list[int]:
    raw = request.query_params.get("runs", "").strip()
    if not raw:
        return [r["id"] for r in runs[:DEFAULT_PLOTTED]]
    ids = []
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            ids.append(int(part))
        except ValueError:
            raise ValueError(f"runs must be run ids separated by commas, got {part[:40]!r}"
                             ) from None
    return list(dict.fromkeys(ids))[:MAX_PLOTTED]


def _view(run: dict) -> dict:
    """A run with the name the plots' legends give it."""
    return {**run, "name": plots.run_name(run)}


async def benchmarks(request: Request) -> Response:
    if database(request) is None:
        return error_response(request, 503, NO_DATABASE, None, "no_database")
    listing = await in_thread(request, store.list_runs, LIST_LIMIT)
    runs = [_view(r) for r in listing["runs"]]
    try:
        ids = _plotted_ids(request, runs)
    except ValueError as e:
        return error_response(request, 400, str(e), "runs", "invalid_value")
    plotted = []
    for run_id in ids:
        run = await in_thread(request, store.get_run, run_id)
        if run is None:
            return error_response(request, 404, f"no benchmark run {run_id}", "runs", "not_found")
        plotted.append(run)
    context = Benchmarks(total=listing["total"], runs=runs, plotted=[r["id"] for r in plotted],
                         metrics=list(METRICS), metric_titles=METRIC_TITLES)

    def page_only() -> dict:
        svgs = {"throughput": plots.throughput_svg(listing["runs"])}
        if plotted:
            for metric, title in CDF_METRICS:
                svgs[metric] = plots.latency_cdf_svg(plotted, metric, title)
        return {"svgs": svgs}

    return page_response(request, "benchmarks.html", context, page_only=page_only)


async def benchmark_detail(request: Request) -> Response:
    if database(request) is None:
        return error_response(request, 503, NO_DATABASE, None, "no_database")
    raw = request.path_params["run_id"]
    try:
        run_id = int(raw)
    except ValueError:
        return error_response(request, 404, f"no benchmark run {raw!r}", "run_id", "not_found")
    run = await in_thread(request, store.get_run, run_id)
    if run is None:
        return error_response(request, 404, f"no benchmark run {run_id}", "run_id", "not_found")
    context = Benchmark(**_view(run), metrics=list(METRICS), metric_titles=METRIC_TITLES)
    return page_response(request, "benchmark.html", context, page_only=lambda: {"svgs": {
        metric: plots.latency_cdf_svg([run], metric, title) for metric, title in CDF_METRICS}})


routes = [*view_routes("/benchmarks", benchmarks),
          *view_routes("/benchmarks/{run_id}", benchmark_detail)]
