"""/calibration and its JSON twin: the saved GEMV-vs-GEMM calibration for what is being served.

    GET /calibration       the table, the plot, the chosen T, when and where it was measured;
                           or, without a calibration, how to run `batchscope calibrate`
    GET /calibration.json  the same context (without the inline SVG markup)
"""

from __future__ import annotations

import shlex
from typing import Any

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import Response

from app.lab.calibration import (
    backend_key,
    calibration_path,
    choose_threshold,
    describe_paths,
    load_calibration,
    one_row_same_call,
    render_svg,
)
from app.web.render import page_response, view_routes
from app.web.views import Calibration, CalibrationFile
from engine.platform import backend_info


def calibrate_command(engine: Any) -> str:
    """The command that calibrates what this server runs."""
    weights = engine.loaded.weights
    weights = weights if weights in ("f32", "bf16") else "q4"  # q4 = as shipped
    return (f"batchscope calibrate --model {shlex.quote(engine.config.model)} "
            f"--weights {weights}")


def _summary_row(row: dict) -> dict:
    """A table row without the per-run detail."""
    return {k: v for k, v in row.items() if k != "detail"}


def calibration_context(engine: Any, found: dict | None, backend: str) -> Calibration:
    policy = getattr(engine, "kernel_policy", None)
    saved = None
    if found is not None:
        rows = [_summary_row(r) for r in found["rows"] if isinstance(r, dict)]
        saved = CalibrationFile(
            threshold=found["threshold"],
            # Recomputed from the rows: says whether the file's T still follows from its data.
            threshold_from_rows=(choose_threshold(rows, one_row_same_call(found)) if rows
                                 else None),
            decode_paths=describe_paths(found),
            threshold_basis=found.get("threshold_basis"),
            date=found.get("date"), host=found.get("host"),
            cpu_count=found.get("cpu_count"), mlx_version=found.get("mlx_version"),
            backend_info=found.get("backend_info"), max_tokens=found.get("max_tokens"),
            repeats=found.get("repeats"), elapsed_s=found.get("elapsed_s"),
            path=found["path"], plot_path=found["plot_path"], rows=rows)
    return Calibration(
        model=engine.loaded.name, weights=engine.loaded.weights, backend=backend,
        kernel_policy=policy.describe() if policy is not None else None,
        # Set by the engine when it resolves the "auto" threshold (flag, calibration, default).
        threshold_source=getattr(engine, "kernel_threshold_source", None),
        command=calibrate_command(engine),
        expected_path=str(calibration_path(engine.loaded.name, engine.loaded.weights,
                                           backend)),
        calibration=saved)


async def calibration_page(request: Request) -> Response:
    engine = request.app.state.engine
    backend = backend_key(backend_info())
    found = await anyio.to_thread.run_sync(load_calibration, engine.loaded.name,
                                           engine.loaded.weights, backend)
    context = calibration_context(engine, found, backend)
    return page_response(request, "calibration.html", context,
                         page_only=lambda: {"plot_svg": _plot(found)})


def _plot(found: dict | None) -> str | None:
    """The plot, drawn from the JSON (numbers only; text escaped), not read from the .svg."""
    if found is None:
        return None
    try:
        return render_svg(found)
    except (KeyError, TypeError, ValueError):
        return None  # a hand-edited file: show the table without the plot


routes = view_routes("/calibration", calibration_page)
