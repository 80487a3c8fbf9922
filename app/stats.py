"""Percentiles for the run pages and the serving benchmark (a leaf: imports nothing of the
project, so every layer may use it)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np


def percentile(values: Sequence[float], pct: float,
               method: Literal["numpy", "lerp"] = "numpy") -> float | None:
    """The pct-th percentile (0-100) by linear interpolation between the closest ranks; None
    when there are no values.

    Both methods are that definition (numpy's default), in different arithmetic that can differ
    in the last bit: "numpy" is numpy.percentile's (the serving benchmark's figures); "lerp" is
    lo + (hi - lo) * fraction on the sorted values (the run pages' latency figures).
    """
    if len(values) == 0:
        return None
    if method == "numpy":
        return float(np.percentile(np.asarray(values, dtype=float), pct))
    ordered = sorted(values)
    pos = (len(ordered) - 1) * pct / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
