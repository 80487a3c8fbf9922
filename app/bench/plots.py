"""Inline SVG plots for /benchmarks, drawn server-side from recorded runs (numbers only come
from the runs; every string is escaped here, since the SVG is inserted as markup)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape

from app.charts import nice_ticks, tick_label

COLORS = ("#2357c6", "#c2410c", "#1f7a3f", "#7c3aed", "#b3261e", "#0e7490", "#a16207",
          "#be185d")
WIDTH, HEIGHT = 700, 300
LEFT, RIGHT, TOP, BOTTOM = 64, 430, 36, 250  # plot area; the legend sits right of it


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


def _frame(title: str, x_label: str, y_label: str, x_ticks: list[float],
           y_ticks: list[float], x, y, css_class: str) -> list[str]:
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
           f'width="100%" style="max-width: {WIDTH}px" font-family="sans-serif" font-size="11" '
           f'class="{css_class}" role="img">',
           f"<title>{escape(title)}</title>",
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>',
           f'<text x="{LEFT}" y="20" font-size="13" font-weight="bold">{escape(title)}</text>']
    for v in y_ticks:
        yy = y(v)
        out.append(f'<line x1="{LEFT}" y1="{yy:.1f}" x2="{RIGHT}" y2="{yy:.1f}" '
                   'stroke="#e5e7eb"/>')
        out.append(f'<text x="{LEFT - 6}" y="{yy + 4:.1f}" text-anchor="end">'
                   f'{tick_label(v)}</text>')
    for v in x_ticks:
        xx = x(v)
        out.append(f'<line x1="{xx:.1f}" y1="{BOTTOM}" x2="{xx:.1f}" y2="{BOTTOM + 4}" '
                   'stroke="#9ca3af"/>')
        out.append(f'<text x="{xx:.1f}" y="{BOTTOM + 16}" text-anchor="middle">'
                   f"{tick_label(v)}</text>")
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{RIGHT - LEFT}" height="{BOTTOM - TOP}" '
               'fill="none" stroke="#9ca3af"/>')
    out.append(f'<text x="{(LEFT + RIGHT) / 2}" y="{HEIGHT - 12}" text-anchor="middle" '
               f'fill="#444">{escape(x_label)}</text>')
    out.append(f'<text x="14" y="{(TOP + BOTTOM) / 2}" text-anchor="middle" fill="#444" '
               f'transform="rotate(-90 14 {(TOP + BOTTOM) / 2})">{escape(y_label)}</text>')
    return out


def _legend(names: Sequence[str]) -> list[str]:
    out = []
    for i, name in enumerate(names):
        yy = TOP + 8 + i * 18
        color = COLORS[i % len(COLORS)]
        out.append(f'<line x1="{RIGHT + 14}" y1="{yy}" x2="{RIGHT + 34}" y2="{yy}" '
                   f'stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{RIGHT + 40}" y="{yy + 4}">{escape(name[:40])}</text>')
    return out


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
    series = [(run_name(run), latency_values(run, metric)) for run in runs]
    hi = max([v[-1] for _, v in series if v] or [1.0])
    x_ticks = nice_ticks(0, hi * 1.05)
    x_max = max(x_ticks[-1], hi * 1.05)

    def x(v: float) -> float:
        return LEFT + v / x_max * (RIGHT - LEFT)

    def y(f: float) -> float:
        return BOTTOM - f * (BOTTOM - TOP)

    out = _frame(title, f"{title} (ms)", "share of requests", x_ticks,
                 [0, 0.25, 0.5, 0.75, 1.0], x, y, f"bench-plot cdf-{metric}")
    for i, (name, values) in enumerate(series):
        if not values:
            continue
        n = len(values)
        points = [(x(0), y(0)), (x(values[0]), y(0))]
        for k, v in enumerate(values, 1):  # a step up at each sample
            points.append((x(v), y((k - 1) / n)))
            points.append((x(v), y(k / n)))
        path = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
        out.append(f'<polyline points="{path}" fill="none" stroke="{COLORS[i % len(COLORS)]}" '
                   f'stroke-width="1.6" data-run="{escape(str(name))}" data-n="{n}"/>')
    out += _legend([name for name, _ in series])
    if not any(v for _, v in series):
        out.append(f'<text x="{(LEFT + RIGHT) / 2}" y="{(TOP + BOTTOM) / 2}" '
                   'text-anchor="middle" fill="#6a7180">no successful requests</text>')
    out.append("</svg>")
    return "\n".join(out)


def throughput_svg(runs: Sequence[Mapping]) -> str:
    """Output tokens/s against measured peak concurrency, one point per run."""
    points = []
    for run in runs:
        s = run.get("summary") or {}
        c, tps = s.get("peak_concurrency"), s.get("output_throughput")
        if isinstance(c, int | float) and isinstance(tps, int | float):
            points.append((c, tps, run))
    x_hi = max([p[0] for p in points] or [1])
    y_hi = max([p[1] for p in points] or [1.0])
    x_ticks = nice_ticks(0, x_hi * 1.1 + 1e-9)
    x_max = max(x_ticks[-1], x_hi * 1.1, 1)
    y_ticks = nice_ticks(0, y_hi * 1.1)
    y_max = max(y_ticks[-1], y_hi * 1.1)

    def x(v: float) -> float:
        return LEFT + v / x_max * (RIGHT - LEFT)

    def y(v: float) -> float:
        return BOTTOM - v / y_max * (BOTTOM - TOP)

    title = "Output throughput against concurrency"
    out = _frame(title, "peak concurrent requests (measured)", "output tokens/s", x_ticks,
                 y_ticks, x, y, "bench-plot throughput")
    # Runs of one sweep (same server, model, endpoint and workload) are joined by a line.
    hosts = {str(p[2].get("url")) for p in points}
    series: dict[str, list] = {}
    for p in points:
        series.setdefault(sweep_name(p[2], with_host=len(hosts) > 1), []).append(p)
    for i, group in enumerate(series.values()):
        color = COLORS[i % len(COLORS)]
        group.sort(key=lambda p: p[0])
        if len(group) > 1:
            path = " ".join(f"{x(c):.1f},{y(t):.1f}" for c, t, _ in group)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" '
                       'stroke-width="1" stroke-dasharray="3 3"/>')
        for c, t, run in group:
            out.append(f'<circle cx="{x(c):.1f}" cy="{y(t):.1f}" r="4" fill="{color}" '
                       f'data-run="{run["id"]}"><title>{escape(run_name(run))}: {t:.1f} tok/s '
                       f"at peak concurrency {c}</title></circle>")
            out.append(f'<text x="{x(c) + 6:.1f}" y="{y(t) - 6:.1f}" font-size="10">'
                       f'#{run["id"]}</text>')
    out += _legend(list(series))
    if not points:
        out.append(f'<text x="{(LEFT + RIGHT) / 2}" y="{(TOP + BOTTOM) / 2}" '
                   'text-anchor="middle" fill="#6a7180">no runs</text>')
    out.append("</svg>")
    return "\n".join(out)
