"""Every chart the server draws, as SVG: the /benchmarks plots
(app/web/pages/benchmark_plots.py), the chart on the divergence page, the calibration plot
saved next to its JSON, and benchmarks/peers.py's files. The live dashboard draws its own
charts in the browser (static/dashboard.js).

Callers pass numbers and plain strings; every text and attribute value is escaped here, since
labels come from users (run labels, model names) and the SVG is inserted into pages as markup.

    line_chart(...)  one plot area with title, axes, ticks, legend and series: lines, steps
                     (ecdf), dots with tooltips and labels; a note when there is nothing to draw
    Svg              the builder under it, for layouts of their own (two panels, log axes,
                     vertical marks, styling by CSS class)

A leaf module: it imports nothing from the app or the engine.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from html import escape
from typing import Any

SVG_NS = "http://www.w3.org/2000/svg"
PALETTE = ("#2357c6", "#c2410c", "#1f7a3f", "#7c3aed", "#b3261e", "#0e7490", "#a16207",
           "#be185d")
GRID = "#e5e7eb"  # grid lines
AXIS = "#9ca3af"  # frames and tick marks
INK = "#444"  # axis labels and captions
MUTED = "#6a7180"  # the note of an empty chart

# line_chart's layout: the plot area (left, top, right, bottom); the legend sits right of it.
WIDTH, HEIGHT = 700, 300
LEFT, TOP, RIGHT, BOTTOM = 64, 36, 430, 250


# ---- ticks ---------------------------------------------------------------------------------
def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round tick values (steps of 1, 2 or 5 x 10^k) from lo up to hi."""
    span = max(hi - lo, 1e-9)
    raw = span / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def tick_label(v: float) -> str:
    return f"{v:g}" if abs(v) < 1e5 else f"{v:.2g}"


def extent(values: Iterable[float], headroom: float = 1.1) -> tuple[list[float], float]:
    """Ticks from 0 and the axis maximum for values >= 0, with `headroom` above the largest.
    Without a positive finite value the axis runs 0..1 (nothing to divide by zero)."""
    hi = max((v for v in values if math.isfinite(v)), default=0.0)
    hi = (hi if hi > 0 else 1.0) * headroom
    ticks = nice_ticks(0, hi)
    return ticks, max(ticks[-1], hi)


# ---- scales, panels, series ----------------------------------------------------------------
@dataclass(frozen=True)
class Scale:
    """Data values lo..hi onto pixels start..end: linear, or logarithmic with base `log`.

    On a log axis zero, negative and NaN values go to `floor` (a line drawn under the lowest
    decade; `start` without one). With lo == hi every value sits in the middle."""

    lo: float
    hi: float
    start: float
    end: float
    log: float | None = None
    floor: float | None = None

    def __call__(self, v: float) -> float:
        a, b = self.lo, self.hi
        if self.log:
            if not v > 0:
                return self.start if self.floor is None else self.floor
            a, b, v = (math.log(t, self.log) for t in (a, b, v))
        if b == a:
            return (self.start + self.end) / 2
        return self.start + (v - a) / (b - a) * (self.end - self.start)


@dataclass(frozen=True)
class Panel:
    """A plot area in pixels and the scales that place values in it."""

    left: float
    top: float
    right: float
    bottom: float
    x: Scale
    y: Scale

    @classmethod
    def linear(cls, left: float, top: float, right: float, bottom: float,
               x: tuple[float, float], y: tuple[float, float]) -> Panel:
        """x lo..hi left to right, y lo..hi bottom to top."""
        return cls(left, top, right, bottom, Scale(*x, left, right), Scale(*y, bottom, top))

    @property
    def center(self) -> tuple[float, float]:
        return (self.left + self.right) / 2, (self.top + self.bottom) / 2


@dataclass(frozen=True)
class Point:
    x: float
    y: float
    tip: str | None = None  # the tooltip (<title>) of its dot
    label: str | None = None  # a short text drawn beside it
    attrs: Mapping[str, Any] = field(default_factory=dict)  # of its dot (data-*, say)


@dataclass(frozen=True)
class Series:
    """One legend entry: a line through its points, with an optional dot at each."""

    name: str
    points: Sequence[Point | tuple[float, float]]
    color: str | None = None  # None: line_chart's palette; in Svg.series, left to CSS
    width: float | None = 1.6  # of the line (None: left to CSS)
    dash: str | None = None  # stroke-dasharray
    marker: float = 0  # radius of the dot at each point; 0: no dots
    joined: bool = True  # False: dots only (a run that belongs to no sweep)
    line_attrs: Mapping[str, Any] = field(default_factory=dict)  # class, data-*
    dot_attrs: Mapping[str, Any] = field(default_factory=dict)


def ecdf(values: Iterable[float]) -> list[tuple[float, float]]:
    """The empirical CDF as a step line from (0, 0): up by 1/n at each value."""
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        return []
    points = [(0.0, 0.0), (ordered[0], 0.0)]
    for k, v in enumerate(ordered, 1):
        points += [(v, (k - 1) / n), (v, k / n)]
    return points


# ---- markup --------------------------------------------------------------------------------
# Characters XML 1.0 does not allow even escaped (control codes in a label would make the whole
# document unreadable): shown as the replacement character.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _text(s: str, quote: bool = False) -> str:
    return escape(_NOT_XML.sub("\ufffd", s), quote=quote)


def _value(v: Any) -> str:
    """Floats are pixels: to 0.1 (no trailing ".0"); everything else is escaped text."""
    if isinstance(v, float):
        text = f"{v:.1f}"
        return text[:-2] if text.endswith(".0") else text
    return _text(str(v), quote=True)


def _attrs(attrs: Mapping[str, Any]) -> str:
    # Python names to SVG ones: class_ -> class, stroke_width -> stroke-width; None: left out.
    return "".join(f' {k.rstrip("_").replace("_", "-")}="{_value(v)}"'
                   for k, v in attrs.items() if v is not None)


class Svg:
    """An SVG document built element by element; render() closes it."""

    def __init__(self, width: int, height: int, *, css_class: str, title: str | None = None,
                 label: str | None = None, fluid: bool = False, font_size: int | None = 11,
                 background: str | None = "#ffffff") -> None:
        """`fluid`: as wide as its container, up to `width`. `font_size` None leaves fonts to
        the page's CSS; `label` is the aria-label of a chart without a title."""
        self.width, self.height = width, height
        size = ({"width": "100%", "style": f"max-width: {width}px"} if fluid
                else {"width": width, "height": height})
        font = {"font_family": "sans-serif", "font_size": font_size} if font_size else {}
        root = {"xmlns": SVG_NS, "viewBox": f"0 0 {width} {height}", **size, **font,
                "class_": css_class, "role": "img", "aria_label": label}
        self._out = [f"<svg{_attrs(root)}>"]
        if title is not None:
            self.add("title", title)
        if background is not None:
            self.add("rect", width=width, height=height, fill=background)

    def add(self, tag: str, text: str | None = None, *, tip: str | None = None,
            **attrs: Any) -> None:
        """One element: `text` its content, `tip` a <title> child (a tooltip)."""
        inner = (_text(text) if text is not None else "") + (
            f"<title>{_text(tip)}</title>" if tip is not None else "")
        self._out.append(f"<{tag}{_attrs(attrs)}>{inner}</{tag}>" if inner
                         else f"<{tag}{_attrs(attrs)}/>")

    @contextmanager
    def group(self, **attrs: Any) -> Iterator[None]:
        """A <g> around what is added inside the `with`."""
        self._out.append(f"<g{_attrs(attrs)}>")
        try:
            yield
        finally:
            self._out.append("</g>")

    def render(self) -> str:
        return "\n".join([*self._out, "</svg>"]) + "\n"

    # ---- chart parts ----
    def heading(self, text: str, x: float, y: float = 20, size: int = 13) -> None:
        self.add("text", text, x=x, y=y, font_size=size, font_weight="bold")

    def hline(self, panel: Panel, value: float, **attrs: Any) -> None:
        """A line across the panel at y = value."""
        y = panel.y(value)
        self.add("line", x1=panel.left, y1=y, x2=panel.right, y2=y, **attrs)

    def vline(self, x: float, top: float, bottom: float, label: str | None = None, *,
              label_y: float | None = None, dx: float = 3, tip: str | None = None,
              label_attrs: Mapping[str, Any] | None = None, **attrs: Any) -> None:
        """A vertical mark at pixel x, its label right of it near the top."""
        self.add("line", tip=tip, x1=x, y1=top, x2=x, y2=bottom, **attrs)
        if label is not None:
            self.add("text", label, x=x + dx, y=top + 10 if label_y is None else label_y,
                     **(label_attrs or {}))

    def grid_y(self, panel: Panel, ticks: Iterable[float],
               label: Callable[[float], str] = tick_label, *, gap: float = 6,
               **attrs: Any) -> None:
        """A grid line across the panel and a label left of it at each y tick (attrs: of the
        lines; a light grey without any)."""
        for v in ticks:
            self.hline(panel, v, **(attrs or {"stroke": GRID}))
            self.add("text", label(v), x=panel.left - gap, y=panel.y(v) + 4, text_anchor="end")

    def ticks_x(self, panel: Panel, ticks: Iterable[float],
                label: Callable[[float], str] = tick_label, *, mark: float = 4,
                gap: float = 16) -> None:
        """A tick mark `mark` px long under the panel (0: none) and a label `gap` px below its
        bottom at each x tick."""
        for v in ticks:
            x = panel.x(v)
            if mark:
                self.add("line", x1=x, y1=panel.bottom, x2=x, y2=panel.bottom + mark,
                         stroke=AXIS)
            self.add("text", label(v), x=x, y=panel.bottom + gap, text_anchor="middle")

    def frame(self, panel: Panel) -> None:
        self.add("rect", x=panel.left, y=panel.top, width=panel.right - panel.left,
                 height=panel.bottom - panel.top, fill="none", stroke=AXIS)

    def axis_labels(self, panel: Panel, x_label: str, y_label: str) -> None:
        """x centred under the panel's tick labels, y turned up along the left edge."""
        mid_x, mid_y = panel.center
        self.add("text", x_label, x=mid_x, y=self.height - 12, text_anchor="middle", fill=INK)
        self.add("text", y_label, x=14, y=mid_y, text_anchor="middle", fill=INK,
                 transform=f"rotate(-90 14 {_value(mid_y)})")

    def series(self, panel: Panel, s: Series) -> None:
        """The line, then each point's dot and label; points that cannot be placed (NaN,
        infinite) are left out."""
        placed = []
        for p in s.points:
            p = p if isinstance(p, Point) else Point(*p)
            x, y = panel.x(p.x), panel.y(p.y)
            if math.isfinite(x) and math.isfinite(y):
                placed.append((p, x, y))
        if s.joined and placed:
            path = " ".join(f"{x:.1f},{y:.1f}" for _, x, y in placed)
            self.add("polyline", points=path, fill="none", stroke=s.color, stroke_width=s.width,
                     stroke_dasharray=s.dash, **s.line_attrs)
        for p, x, y in placed:
            if s.marker:
                self.add("circle", tip=p.tip, cx=x, cy=y, r=s.marker, fill=s.color,
                         **{**s.dot_attrs, **p.attrs})
            if p.label is not None:
                self.add("text", p.label, x=x + 6, y=y - 6, font_size=10)

    def legend(self, x: float, y: float, entries: Iterable[tuple[str, str | None]], *,
               swatch: float = 20, row: float = 18, max_chars: int = 40) -> None:
        """(name, color) entries from (x, y) down: a short line in the color, then the name."""
        for i, (name, color) in enumerate(entries):
            yy = y + i * row
            self.add("line", x1=x, y1=yy, x2=x + swatch, y2=yy, stroke=color, stroke_width=2)
            self.add("text", name[:max_chars], x=x + swatch + 6, y=yy + 4)

    def note(self, panel: Panel, text: str) -> None:
        """A message in the middle of the panel (an empty chart)."""
        x, y = panel.center
        self.add("text", text, x=x, y=y, text_anchor="middle", fill=MUTED)


# ---- the one-call chart --------------------------------------------------------------------
def line_chart(title: str, x_label: str, y_label: str, series: Sequence[Series], *,
               css_class: str, x_headroom: float = 1.1, y_headroom: float = 1.1,
               y_ticks: Sequence[float] | None = None, empty: str | None = "no data") -> str:
    """Series over one plot area, both axes from 0, the legend right of it (every series, in
    order, colored from PALETTE unless it has a color). `y_ticks` fixes the y axis (0 to the
    last tick; a share, say); `empty` is shown when no series has a point."""
    xs = [p.x if isinstance(p, Point) else p[0] for s in series for p in s.points]
    ys = [p.y if isinstance(p, Point) else p[1] for s in series for p in s.points]
    x_ticks, x_max = extent(xs, x_headroom)
    if y_ticks is None:
        y_ticks, y_max = extent(ys, y_headroom)
    else:
        y_max = y_ticks[-1]
    panel = Panel.linear(LEFT, TOP, RIGHT, BOTTOM, (0, x_max), (0, y_max))
    colored = [s if s.color else replace(s, color=PALETTE[i % len(PALETTE)])
               for i, s in enumerate(series)]
    svg = Svg(WIDTH, HEIGHT, css_class=css_class, title=title, fluid=True)
    svg.heading(title, x=LEFT)
    svg.grid_y(panel, y_ticks)
    svg.ticks_x(panel, x_ticks)
    svg.frame(panel)
    svg.axis_labels(panel, x_label, y_label)
    for s in colored:
        svg.series(panel, s)
    svg.legend(RIGHT + 14, TOP + 8, [(s.name, s.color) for s in colored])
    if empty is not None and not xs:
        svg.note(panel, empty)
    return svg.render()
