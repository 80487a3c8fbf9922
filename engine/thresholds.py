"""The kernel threshold `--kernel-policy auto` runs with.

The engine is given the calibrated thresholds as a table (what `batchscope calibrate` measured
and saved, loaded by the caller: app.lab.calibration.saved_thresholds); it reads no file
itself. Precedence: --kernel-threshold > the table's entry for the loaded model, weights and
backend (only for kernel_policy "auto") > DEFAULT_THRESHOLD.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("batchscope.engine")

DEFAULT_THRESHOLD = 1  # without a calibration: row-wise only where it changes nothing (1 row)

# (model name, weights, backend key) -> (threshold, where it came from)
ThresholdTable = Mapping[tuple[str, str, str], tuple[int, str]]


def backend_key(info: Mapping[str, Any] | str) -> str:
    """Short backend name for calibrations: "metal", "cuda", "cpu-openblas", "cpu"...

    The CPU BLAS is part of the key: OpenBLAS makes f32 GEMM far faster than the bundled
    reference BLAS (benchmarks/weights_speed.py, with and without it), which moves the
    crossing entirely.
    """
    if isinstance(info, str):
        return info
    backend = str(info.get("backend") or "cpu")
    if backend != "cpu":
        return backend
    if info.get("blas"):
        return "cpu-openblas"
    return "cpu-accelerate" if info.get("platform") == "darwin" else "cpu"


def resolve_threshold(config: Any, model_name: str, weights: str,
                      backend: Mapping[str, Any] | str,
                      table: ThresholdTable | None = None) -> tuple[int, str]:
    """The "auto" threshold to run with, and where it came from: "flag", "calibration <path>"
    or "default"."""
    if config.kernel_threshold is not None:
        return int(config.kernel_threshold), "flag"
    if config.kernel_policy != "auto":
        return DEFAULT_THRESHOLD, "default"  # the threshold is unused outside "auto"
    found = (table or {}).get((model_name, weights, backend_key(backend)))
    if found is not None:
        log.info("kernel policy auto: threshold %d rows from %s", found[0], found[1])
        return found
    plain = weights if weights in ("f32", "bf16") else "q4"
    log.info("kernel policy auto is uncalibrated for %s (%s weights) on %s: threshold %d row(s). "
             "Measure it with: batchscope calibrate --model %s --weights %s (or pass "
             "--kernel-threshold)", model_name, weights, backend_key(backend), DEFAULT_THRESHOLD,
             getattr(config, "model", "embedded"), plain)
    return DEFAULT_THRESHOLD, "default"
