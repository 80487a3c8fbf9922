"""Inline SVG plots for /benchmarks, drawn server-side from recorded runs: what to plot is chosen
here, the drawing (and the escaping of every string: the SVG is inserted as markup) is
app/charts.py's."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from app.charts import PALETTE, Point, Series, ecdf, line_chart

COLORS = PALETTE  # one color per plotted run: the page caps the runs it plots at this many


def run_name(run: Mapping) -> str:
    label = run.get("label")
    return f"#{run['id']} {label}" if label else f"#{run['id']}"


def sweep_name(run: Mapping, with_host: bool = True) -> str:
    """What runs must share to be points of one throughput-vs-concurrency curve (as a legend
    label: endpoint, dataset x prompts, length caps, and the server unless all share one)."""
    config = run.get("config") or {}
    caps = [f"{name}≤{config[key]}" for key, name in (("max_tokens_cap", "out"),
                                                      ("input_len_cap", "in"))
            if config.get(key)]
    parts = [str(run.get("endpoint", "")), f"{run.get('dataset')}×{run.get('num_prompts')}",
             *caps]
    if with_host:
        parts.insert(0, str(run.get("url", "")).split("://", 1)[-1])
    return " ".join(parts)


def latency_values(run: Mapping, metric: str) -> list[float]:
    """A run's per-request values in ms (successful requests): ttft, tpot or latency (E2E)."""
    values = []
    for r in run.get("requests") or []:
        v = r.get(metric) if r.get("success") else None
        if isinstance(v, int | float) and math.isfinite(v):
            values.append(v * 1000.0)
    return sorted(values)


def latency_cdf_svg(runs: Sequence[Mapping], metric: str, title: str) -> str:
    """The empirical CDF of one latency (ms) per run: the share of requests at or below x."""
    series = []
    for run in runs:
        values = latency_values(run, metric)
        name = run_name(run)
        series.append(Series(name, ecdf(values),
                             line_attrs={"data_run": name, "data_n": len(values)}))
    return line_chart(title, f"{title} (ms)", "share of requests", series,
                      css_class=f"bench-plot cdf-{metric}", x_headroom=1.05,
                      y_ticks=[0, 0.25, 0.5, 0.75, 1.0], empty="no successful requests")


def throughput_svg(runs: Sequence[Mapping]) -> str:
    """Output tokens/s against measured peak concurrency, one point per run."""
    points = []
    for run in runs:
        s = run.get("summary") or {}
        c, tps = s.get("peak_concurrency"), s.get("output_throughput")
        if isinstance(c, int | float) and isinstance(tps, int | float):
            points.append((c, tps, run))
    # Runs of one sweep (same server, model, endpoint and workload) are joined by a line.
    hosts = {str(p[2].get("url")) for p in points}
    sweeps: dict[str, list] = {}
    for p in points:
        sweeps.setdefault(sweep_name(p[2], with_host=len(hosts) > 1), []).append(p)
    series = []
    for name, group in sweeps.items():
        group.sort(key=lambda p: p[0])
        series.append(Series(
            name, [Point(c, t, tip=f"{run_name(run)}: {t:.1f} tok/s at peak concurrency {c}",
                         label=f"#{run['id']}", attrs={"data_run": run["id"]})
                   for c, t, run in group],
            width=1, dash="3 3", marker=4, joined=len(group) > 1))
    return line_chart("Output throughput against concurrency",
                      "peak concurrent requests (measured)", "output tokens/s", series,
                      css_class="bench-plot throughput", empty="no runs")
