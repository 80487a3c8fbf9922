"""Calibrate `--kernel-policy auto`: measure where row-wise GEMV stops beating batched GEMM.

For N concurrent requests (same short prompts, greedy, ignore_eos, max_tokens each) three modes
run on this machine, model and weight format:

    unbatched  the N requests one at a time (max_num_seqs=1)
    gemm       batched, one call per linear layer over all rows (kernel_policy="gemm")
    gemv       batched, one call per row (kernel_policy="gemv")

The modes are kernel policies; what their steps ran on is measured too (`decode_paths`, from the
step records): where the native kernels take every layer, the gemm policy's steps are `native`
(each row computed alone), not one shared GEMM call.

Two rates per run: aggregate output tokens/s (all tokens over the wall time, prefill included:
what a user sees) and decode-only tokens/s from the step records (only decode steps holding
exactly N rows, so the rate belongs to one row count). The threshold T is picked from the
decode-only ratio because the policy switches on a step's rows and in decode steps rows == N;
the aggregate of the gemv mode also pays for row-wise prefill, which "auto" never does.

Results go to `calibration-<model>-<weights>-<backend>.json` (plus an .svg plot) under
$BATCHSCOPE_CALIBRATION_DIR or ~/.cache/batchscope; `saved_thresholds` reads them back into
the table the engine is given (engine/thresholds.py).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import platform
import re
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from app.charts import INK, Panel, Point, Scale, Series, Svg, extent, nice_ticks
from engine.thresholds import ThresholdTable, backend_key

log = logging.getLogger("batchscope.calibration")

ENV_DIR = "BATCHSCOPE_CALIBRATION_DIR"
DEFAULT_CONCURRENCY = (1, 2, 3, 4, 5, 6, 7, 8, 16)
MODES = ("unbatched", "gemm", "gemv")
FORMAT_VERSION = 1
THRESHOLD_BASIS = "decode-only tokens/s (decode steps holding exactly N rows)"
PROMPT_BOUND = 96  # tokens: the KV pool and step budget are sized before the tokenizer loads

# Short, varied prompts with distinct openings (prefix caching is off anyway).
PROMPTS = (
    "The capital of France is",
    "Write a haiku about autumn leaves.",
    "List three uses for a paperclip:",
    "Explain in one sentence why the sky is blue.",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "Translate to Spanish: good morning, my friend.",
    "The three primary colors are",
    "Q: What is 12 times 7?\nA:",
    "A short recipe for pancakes:",
    "Summarize the plot of a detective story in two lines.",
    "My favourite programming language is",
    "Here is a limerick about a cat who loved to sleep:",
    "The most important rule of safe cycling is",
    "Dear team, this week we shipped",
    "In physics, momentum is defined as",
)

Progress = Callable[[str], None]


class CalibrationError(RuntimeError):
    pass


# ---- where calibrations live ----------------------------------------------------------------
def calibration_dir(directory: str | Path | None = None) -> Path:
    if directory is not None:
        return Path(directory).expanduser()
    env = os.environ.get(ENV_DIR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "batchscope"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("._") or "unnamed"


def calibration_path(model_name: str, weights: str, backend: Mapping[str, Any] | str,
                     directory: str | Path | None = None) -> Path:
    name = f"calibration-{_slug(model_name)}-{_slug(weights)}-{_slug(backend_key(backend))}.json"
    return calibration_dir(directory) / name


def load_calibration(model_name: str, weights: str, backend: Mapping[str, Any] | str,
                     directory: str | Path | None = None) -> dict | None:
    """The saved calibration for this model/weights/backend, or None (missing or unreadable)."""
    path = calibration_path(model_name, weights, backend, directory)
    return _read(path) if path.is_file() else None


def _read(path: Path) -> dict | None:
    """A calibration file's contents, or None (logged) when it is unreadable or invalid."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable calibration %s: %s", path, e)
        return None
    threshold = data.get("threshold") if isinstance(data, dict) else None
    if (not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0
            or not isinstance(data.get("rows"), list)):
        log.warning("ignoring calibration %s: no valid threshold and rows", path)
        return None
    data["path"] = str(path)  # where it was found, even if the file was moved
    data["plot_path"] = str(path.with_suffix(".svg"))
    return data


def saved_thresholds(directory: str | Path | None = None) -> ThresholdTable:
    """Every valid calibration in the directory, as the table an Engine is given:
    (model, weights, backend) -> (threshold, "calibration <path>")."""
    table = {}
    folder = calibration_dir(directory)
    for path in sorted(folder.glob("calibration-*.json")) if folder.is_dir() else []:
        data = _read(path)
        if data is not None and all(isinstance(data.get(k), str)
                                    for k in ("model", "weights", "backend")):
            table[(data["model"], data["weights"], data["backend"])] = (
                data["threshold"], f"calibration {path} (measured {data.get('date', '?')})")
    return table


# ---- the threshold ------------------------------------------------------------------------
def ratio_of(row: Mapping[str, Any]) -> float | None:
    """GEMV/GEMM of a row: decode-only when measured, else aggregate."""
    ratio = row.get("gemv_over_gemm_decode")
    return ratio if ratio is not None else row.get("gemv_over_gemm")


def one_row_same_call(result: Mapping[str, Any]) -> bool:
    """Whether a calibration's 1-row steps made the same calls under both policies (see
    choose_threshold); a file from before it said so: unless its gemm steps took the native
    kernels."""
    same = result.get("one_row_same_call")
    return same if isinstance(same, bool) else not result.get("native_gemm", False)


def same_call_at_one_row(native_gemm: bool, rows: list[dict]) -> bool:
    """Both policies' 1-row steps make the same calls: MLX's everywhere (no native kernel on
    gemm steps, and a 1-row batched call is the row-wise one), or the native kernels everywhere
    (both policies' 1-row decode steps were recorded `native`)."""
    one = next((r["detail"] for r in rows if r["concurrency"] == 1), None)
    native = one is not None and all(one[mode]["decode_paths"] == ["native"]
                                     for mode in ("gemm", "gemv"))
    return not native_gemm or native


def choose_threshold(rows: Iterable[Mapping[str, Any]], one_row_same_call: bool = True) -> int:
    """Largest N such that GEMV >= GEMM at every measured n <= N; 0 if GEMM wins at the first.

    One row is exempt where both policies make the very same call there (MLX's kernels,
    kernels.apply_linear), so its ratio is noise around 100%. Where the native kernels take
    `gemm` steps (one_row_same_call=False) a 1-row GEMV step is MLX's call and a GEMM step
    the native one: that row is measured like the others.
    """
    threshold = 0
    for row in sorted(rows, key=lambda r: r["concurrency"]):
        n, ratio = row["concurrency"], ratio_of(row)
        if (n == 1 and one_row_same_call) or (ratio is not None and ratio >= 1.0):
            threshold = n
        else:
            break
    return threshold


# ---- measuring ----------------------------------------------------------------------------
def calibration_prompts(encode: Callable[[str], list[int]], n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = PROMPTS[i % len(PROMPTS)]
        out.append(list(encode(text if i < len(PROMPTS) else f"{i}. {text}")))
    return out


def _measure(eng: Any, prompts: list[list[int]], max_tokens: int, decode_rows: int) -> dict:
    """Run the prompts at once; rates over the wall time and over decode steps of decode_rows."""
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)  # greedy by default
    first_step = eng.step_count + 1  # read while idle: nothing runs between measurements
    t0 = time.perf_counter()
    handles = [eng.submit(ids, params) for ids in prompts]
    results = [h.result() for h in handles]
    wall = time.perf_counter() - t0
    bad = [r for r in results if r.reason != "length" or r.completion_tokens != max_tokens]
    if bad:
        raise CalibrationError(f"request {bad[0].request_id} ended with {bad[0].reason!r} after "
                               f"{bad[0].completion_tokens} tokens: {bad[0].error or ''}")
    steps = [r for r in eng.steps.recent() if r.step >= first_step]
    # Steps with other row counts (a request that joined one step late) are left out.
    decode = [r for r in steps if not r.prefill_rows and r.decode_rows == decode_rows]
    tokens = sum(r.completion_tokens for r in results)
    decode_tokens = sum(r.decode_rows for r in decode)
    decode_time = sum(r.wall_time for r in decode)
    return {"tokens": tokens, "wall_s": wall, "tps": tokens / wall,
            "decode_tokens": decode_tokens, "decode_time_s": decode_time,
            "decode_tps": decode_tokens / decode_time if decode_time > 0 else None,
            "decode_steps": len(decode), "other_steps": len(steps) - len(decode),
            "decode_paths": sorted({r.kernel_path for r in decode})}


def _best(runs: list[dict]) -> dict:
    """Best of repeats, each rate on its own: background load only ever slows a run down."""
    best = max(runs, key=lambda m: m["tps"])
    decode = [m["decode_tps"] for m in runs if m["decode_tps"] is not None]
    return {**best, "decode_tps": max(decode) if decode else None,
            "tps_runs": [m["tps"] for m in runs], "decode_tps_runs": decode}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _engine_config(model: str, weights: str, mode: str, max_seqs: int, max_tokens: int) -> Any:
    from engine.config import EngineConfig

    block_size = 16
    per_request = -(-(PROMPT_BOUND + max_tokens) // block_size) + 1
    # Same pool and budget in every mode; only the batching and the kernel path differ. The
    # budget lets all prompts prefill in one step, so every decode step then holds N rows.
    return EngineConfig(
        model=model, weights=weights, max_num_seqs=1 if mode == "unbatched" else max_seqs,
        max_num_batched_tokens=max(512, PROMPT_BOUND * max_seqs), block_size=block_size,
        num_kv_blocks=max(64, 2 * per_request * max_seqs), enable_prefix_caching=False,
        step_history=max(2048, 2 * max_seqs * (max_tokens + 1)),
        kernel_policy="gemv" if mode == "gemv" else "gemm")


def _check_args(concurrency: Iterable[int], max_tokens: int, repeats: int) -> list[int]:
    levels = sorted(set(concurrency))
    if not levels or any(not isinstance(n, int) or n < 1 for n in levels):
        raise ValueError(f"concurrency must be positive integers, got {list(concurrency)!r}")
    if not isinstance(max_tokens, int) or max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2 (decode steps), got {max_tokens!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    return levels


def calibrate(model: str = "embedded", weights: str = "auto",
              concurrency: Iterable[int] = DEFAULT_CONCURRENCY, max_tokens: int = 32,
              progress: Progress | None = None, *, loader: Callable[[], Any] | None = None,
              repeats: int = 1, out_dir: str | Path | None = None, save: bool = True) -> dict:
    """Measure the three modes at each concurrency, pick T, and save JSON + SVG (if `save`).

    One engine per mode (per round, with `repeats` > 1), started once and reused across
    concurrencies; only one is alive at a time. Each measurement keeps the best of `repeats`
    runs. `loader` replaces the model loader (tests pass engine.testing.tiny_model).
    """
    from engine.engine import Engine
    from engine.platform import backend_info

    levels = _check_args(concurrency, max_tokens, repeats)
    say = progress or (lambda line: None)
    max_seqs = max(levels)
    started = time.time()
    runs: dict[str, dict[int, list[dict]]] = {mode: {n: [] for n in levels} for mode in MODES}
    name = fmt = None
    native_gemm = False
    prompt_lengths: list[int] = []
    # With repeats, each round runs every mode (in alternating order), so each mode samples the
    # machine's background load over the whole calibration, not one window of it.
    for round_ in range(repeats):
        for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
            tag = f"[{mode}]" if repeats == 1 else f"[{mode} {round_ + 1}/{repeats}]"
            eng = Engine(_engine_config(model, weights, mode, max_seqs, max_tokens),
                         loader=loader)
            say(f"{tag} loading {model} ({weights} weights)...")
            eng.start()
            try:
                name, fmt = eng.loaded.name, eng.loaded.weights
                if mode == "gemm":  # does a 1-row gemm step make the gemv step's call?
                    runner = eng.runner
                    native_gemm = runner.native_matmul_applies or runner.native_quantized_applies
                prompts = calibration_prompts(eng.encode, max_seqs)
                prompt_lengths = [len(p) for p in prompts]
                if max(prompt_lengths) > PROMPT_BOUND:
                    raise CalibrationError(f"calibration prompts exceed {PROMPT_BOUND} tokens")
                warm = min(max_seqs, 4)
                _measure(eng, prompts[:warm], 4, 1 if mode == "unbatched" else warm)
                for n in levels:
                    m = _measure(eng, prompts[:n], max_tokens, 1 if mode == "unbatched" else n)
                    runs[mode][n].append(m)
                    decode = "—" if m["decode_tps"] is None else f"{m['decode_tps']:.1f}"
                    say(f"{tag} {n:>3} requests: {m['tps']:7.1f} tok/s aggregate, {decode:>7} "
                        f"tok/s decode-only ({m['tokens']} tokens in {m['wall_s']:.2f} s; "
                        f"decode steps {'/'.join(m['decode_paths']) or '—'})")
            finally:
                eng.stop()
                del eng
                gc.collect()  # free this engine's weights before the next one loads its own
    measured = {mode: {n: _best(runs[mode][n]) for n in levels} for mode in MODES}

    rows = []
    for n in levels:
        u, g, v = (measured[mode][n] for mode in MODES)
        rows.append({
            "concurrency": n,
            "unbatched_tps": u["tps"], "gemm_tps": g["tps"], "gemv_tps": v["tps"],
            "gemv_over_gemm": _ratio(v["tps"], g["tps"]),
            "unbatched_decode_tps": u["decode_tps"], "gemm_decode_tps": g["decode_tps"],
            "gemv_decode_tps": v["decode_tps"],
            "gemv_over_gemm_decode": _ratio(v["decode_tps"], g["decode_tps"]),
            "detail": {mode: measured[mode][n] for mode in MODES},
        })
    info = backend_info()
    same_call = same_call_at_one_row(native_gemm, rows)
    result = {
        "format": FORMAT_VERSION, "model": name, "model_source": model, "weights": fmt,
        "requested_weights": weights, "backend": backend_key(info), "backend_info": info,
        "mlx_version": info.get("mlx_version"),
        "date": datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds"),
        "measured_at": started, "elapsed_s": time.time() - started,
        "host": platform.node(), "cpu_count": os.cpu_count(),
        "max_tokens": max_tokens, "repeats": repeats, "concurrency": levels,
        "prompt_tokens": prompt_lengths,
        "threshold": choose_threshold(rows, one_row_same_call=same_call),
        "native_gemm": native_gemm, "one_row_same_call": same_call,
        # What each policy's decode steps ran on (native: every call on the native kernels).
        "decode_paths": {mode: sorted({p for m in measured[mode].values()
                                       for p in m["decode_paths"]}) for mode in MODES},
        "threshold_basis": THRESHOLD_BASIS, "rows": rows,
    }
    if save:
        save_calibration(result, out_dir)
    return result


def save_calibration(result: dict, directory: str | Path | None = None) -> dict:
    """Write the JSON and the SVG plot next to it; sets result["path"] and ["plot_path"]."""
    path = calibration_path(result["model"], result["weights"], result["backend"], directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    result["path"], result["plot_path"] = str(path), str(path.with_suffix(".svg"))
    tmp = path.with_suffix(".json.tmp")  # never leave a half-written file for the engine
    tmp.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    path.with_suffix(".svg").write_text(render_svg(result), encoding="utf-8")
    return result


# ---- reporting ----------------------------------------------------------------------------
def _pct(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio * 100:.1f}%"


def _rate(tps: float | None) -> str:
    return "—" if tps is None else f"{tps:.1f}"


def render_table(result: Mapping[str, Any]) -> str:
    """The mini-vllm-rs write-up's table (aggregate output tokens/s), plus the decode-only rates
    T is based on."""
    lines = [
        "| concurrency | unbatched | batched GEMM | batched GEMV | GEMV/GEMM "
        "| decode-only: unbatched | GEMM | GEMV | GEMV/GEMM |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['concurrency']} | {_rate(r['unbatched_tps'])} | {_rate(r['gemm_tps'])} | "
            f"{_rate(r['gemv_tps'])} | {_pct(r['gemv_over_gemm'])} | "
            f"{_rate(r['unbatched_decode_tps'])} | {_rate(r['gemm_decode_tps'])} | "
            f"{_rate(r['gemv_decode_tps'])} | {_pct(r['gemv_over_gemm_decode'])} |")
    return "\n".join(lines)


def describe_paths(result: Mapping[str, Any]) -> str | None:
    """The kernel paths each policy's decode steps were recorded on (native: every call on
    the native kernels, each row alone), in words; None for a file from before they were."""
    paths = result.get("decode_paths")
    if not isinstance(paths, dict):
        return None
    return "decode steps ran on: " + " · ".join(
        f"{mode} {'/'.join(paths.get(mode) or ['—'])}" for mode in MODES)


def describe(result: Mapping[str, Any]) -> str:
    return (f"{result['model']}, {result['weights']} weights, {result['backend']} "
            f"(MLX {result.get('mlx_version')}), {result['max_tokens']} tokens per request, "
            f"greedy; aggregate output tokens/s")


# ---- the plot (app/charts.py) ---------------------------------------------------------------
COLORS = {"unbatched": "#6b7280", "gemm": "#2563eb", "gemv": "#ea580c", "ratio": "#7c3aed"}
LABELS = {"unbatched": "unbatched", "gemm": "batched GEMM", "gemv": "batched row-wise GEMV"}
CHOSEN = "#16a34a"  # the threshold's mark


def render_svg(result: Mapping[str, Any]) -> str:
    """Tokens/s vs concurrency for the three modes, and the GEMV/GEMM ratio with T marked."""
    rows = sorted(result["rows"], key=lambda r: r["concurrency"])
    left, right = 64, 560  # plot area; the legend sits right of it
    ns = [r["concurrency"] for r in rows] or [1]  # an empty calibration still draws its axes
    # log2 axis: 1, 2, 4, 8, 16 evenly spaced; points kept off the frame.
    x = Scale(min(ns), max(ns), left + 16, right - 16, log=2)
    tps = [r[f"{m}_tps"] for r in rows for m in MODES if r.get(f"{m}_tps") is not None]
    tps_ticks, tps_max = extent(tps, 1.08)
    ratios = [100 * v for r in rows for v in (r.get("gemv_over_gemm_decode"),
                                              r.get("gemv_over_gemm")) if v is not None]
    r_lo = min([50.0, *ratios]) * 0.95
    r_hi = max([150.0, *ratios]) * 1.05
    throughput = Panel(left, 48, right, 300, x, Scale(0, tps_max, 300, 48))
    ratio = Panel(left, 350, right, 500, x, Scale(r_lo, r_hi, 500, 350))

    threshold = result["threshold"]
    svg = Svg(760, 540, css_class="calibration-plot", font_size=12,
              title=f"{describe(result)}; chosen T = {threshold}")
    svg.heading(f"{result['model']} · {result['weights']} · {result['backend']} · "
                f"{result['max_tokens']} tokens/request", x=left, y=22, size=14)
    svg.add("text", "aggregate output tokens/s", x=left, y=throughput.top - 8, fill=INK)
    svg.add("text", "GEMV / GEMM (%): solid decode-only, dashed aggregate", x=left,
            y=ratio.top - 8, fill=INK)
    svg.grid_y(throughput, tps_ticks)
    svg.grid_y(ratio, nice_ticks(r_lo, r_hi, 4))
    svg.frame(throughput)
    svg.frame(ratio)
    svg.ticks_x(ratio, ns, str, gap=17)
    svg.add("text", "concurrent requests (= rows per decode step)", x=(left + right) / 2,
            y=ratio.bottom + 34, text_anchor="middle", fill=INK)
    svg.hline(ratio, 100, stroke="#111827", stroke_width=1)
    if threshold >= min(ns):
        with svg.group(class_="threshold", data_threshold=threshold):
            svg.vline(x(threshold), throughput.top, ratio.bottom, f"T = {threshold}",
                      label_y=throughput.top + 14, dx=4, label_attrs={"fill": CHOSEN},
                      stroke=CHOSEN, stroke_dasharray="5 4", stroke_width=1.5)

    def series(key: str, panel: Panel, values: list[tuple[int, float | None]], color: str,
               label: str, unit: str, dashed: bool = False) -> None:
        points = [Point(n, v, tip=f"{label}, {n} requests: {v:.1f}{unit}")
                  for n, v in values if v is not None]
        with svg.group(class_="series", data_series=key):
            svg.series(panel, Series(label, points, color=color, width=2,
                                     dash="6 4" if dashed else None, marker=3.5))

    for mode in MODES:
        series(mode, throughput, [(r["concurrency"], r.get(f"{mode}_tps")) for r in rows],
               COLORS[mode], LABELS[mode], " tok/s")
    pct = [(r["concurrency"], r.get("gemv_over_gemm_decode")) for r in rows]
    series("gemv_over_gemm_decode", ratio,
           [(n, v * 100 if v is not None else None) for n, v in pct],
           COLORS["ratio"], "GEMV/GEMM decode-only", "%")
    pct = [(r["concurrency"], r.get("gemv_over_gemm")) for r in rows]
    series("gemv_over_gemm", ratio, [(n, v * 100 if v is not None else None) for n, v in pct],
           COLORS["ratio"], "GEMV/GEMM aggregate", "%", dashed=True)
    lx, ly = right + 20, throughput.top + 10
    svg.legend(lx, ly, [(LABELS.get(m, "GEMV/GEMM ratio"), COLORS[m]) for m in [*MODES, "ratio"]],
               swatch=22, row=20)
    svg.add("text", f"chosen T = {threshold} rows", x=lx, y=ly + 100, fill=CHOSEN)
    svg.add("text", str(result.get("date", "")), x=lx, y=ly + 118, fill=INK)
    paths = result.get("decode_paths")
    if isinstance(paths, dict):  # what each policy's steps ran on (native: the native kernels)
        with svg.group(class_="decode-paths"):
            svg.add("text", "decode steps ran on", x=lx, y=ly + 146, fill=INK)
            for i, mode in enumerate(MODES):
                svg.add("text", f"{mode}: {'/'.join(paths.get(mode) or ['—'])}", x=lx,
                        y=ly + 164 + 18 * i, fill=COLORS[mode])
    return svg.render()
