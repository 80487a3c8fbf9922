"""Axis ticks for the hand-written SVG plots (calibration here, benchmarks in app/bench)."""

from __future__ import annotations

import math


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
