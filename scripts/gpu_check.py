"""The Python steps of scripts/gpu-check.sh and its report (docs/gpu.md). Each subcommand reads
and writes files in the check's output folder OUT:

    python scripts/gpu_check.py device OUT [--require-gpu]   # device.json (numerics too)
    python scripts/gpu_check.py serve OUT [--quick]          # serve.json
    python scripts/gpu_check.py report OUT --mode cpu|gpu    # report.json, report.md

`report` reads what the steps left (steps.tsv, their JSON, tests.xml) and imports no MLX, so
it runs after a failed install too; its exit code is 0 only when every step passed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STREAMS = 8  # the serving comparison's concurrent streams
REPORT_VERSION = 1
STEPS = ("install", "device", "tests", "calibrate", "diverge", "batching", "serve")
PACKAGES = ("batchscope", "mlx", "mlx-cpu", "mlx-cuda-12", "mlx-cuda-13", "mlx-metal", "mlx-lm")


# ---------------------------------------------------------------------------------------------
# device


def cmd_device(args: argparse.Namespace) -> int:
    """What MLX sees and what the engine's `auto` settings pick there (the engine's own
    start-up description), on the embedded model."""
    # isort: off
    import engine  # noqa: F401  (binds MLX to the optimized BLAS: before mlx is imported)
    import mlx.core as mx
    import mlx_lm
    # isort: on

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.platform import backend_info, blas_name

    device = mx.default_device()
    cuda = getattr(mx, "cuda", None)
    info = backend_info()
    found = {
        "default_device": str(device),
        "device_type": "gpu" if device.type == mx.gpu else "cpu",
        "metal_available": bool(mx.metal.is_available()),
        "cuda_available": bool(cuda is not None and cuda.is_available()),
        "device_info": _device_info(mx),
        "backend": info["backend"], "blas": blas_name(info.get("blas")),
        "float32_matmuls": info["float32_matmuls"],
        "mlx_version": mx.__version__, "mlx_lm_version": mlx_lm.__version__,
    }
    # Printed before the engine starts: a GPU's first run compiles kernels for a while.
    for key in ("default_device", "backend", "metal_available", "cuda_available", "device_info",
                "float32_matmuls", "mlx_version", "mlx_lm_version"):
        print(f"{key}: {found[key]}", flush=True)
    found["numerics"] = numerics(mx)
    print(f"numerics: {found['numerics']}", flush=True)
    with Engine(EngineConfig(num_kv_blocks=64)).start() as eng:
        found["auto"] = {"weights": eng.loaded.weights, "attention": eng.attention,
                         "row_kernels": eng.row_kernels,
                         "kernel_policy": eng.kernel_policy.describe(),
                         "kernel_threshold_source": eng.kernel_threshold_source}
    # Loaded only when a setting reached for a native op: on a GPU `auto` must not.
    found["native_kernels_loaded"] = "engine.native._kernels" in sys.modules
    problems = []
    if args.require_gpu:
        if found["device_type"] != "gpu":
            problems.append(f"MLX's default device is {device}, not a GPU")
        if found["backend"] != "cuda":
            problems.append(f"the engine sees backend {found['backend']}, not cuda")
        if found["native_kernels_loaded"]:
            problems.append("the native CPU kernels were loaded on a GPU backend")
    found["problems"] = problems
    _write_json(Path(args.out) / "device.json", found)
    print(f"native_kernels_loaded: {found['native_kernels_loaded']}")
    for key, value in found["auto"].items():
        print(f"auto {key}: {value}")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


# A row's result alone, or among this many rows, against the same row among ROWS_ALL.
ROWS_AMONG, ROWS_ALL = (1, 2, 4, 8, 16, 33), 64


def numerics(mx) -> dict:
    """What MLX's kernels do to a row's numbers on this device, as the engine sets them up:
    a float32 matmul's error against float64 (TF32 shows as ~1e-3, float32 as ~1e-6); for
    MLX's float32 and 4-bit matmuls, at which row counts row 0 keeps the bits it has among
    ROWS_ALL rows (a batch-invariant kernel: at every count); and how far the last query of a
    causal prefill lands from the same query alone in MLX's fused attention."""
    import numpy as np

    key = mx.random.key(0)
    kw, kx, kq, kk, kv = mx.random.split(key, 5)
    w = mx.random.normal((1536, 576), key=kw) * 0.05
    x = mx.random.normal((ROWS_ALL, 576), key=kx)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    got = np.asarray(x @ w.T)
    error = float(np.max(np.abs(got - exact)) / np.max(np.abs(exact)))
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    products = {
        "f32_matmul": lambda a: a @ w.T,
        "q4_matmul": lambda a: mx.quantized_matmul(a, wq, scales, biases, transpose=True,
                                                   group_size=64, bits=4)}
    same = {}
    for name, f in products.items():
        row0 = np.asarray(f(x)[0])
        same[name] = {str(m): bool(np.array_equal(np.asarray(f(x[:m])[0]), row0))
                      for m in ROWS_AMONG}
    heads, kv_heads, dim, length = 9, 3, 64, 40  # the embedded model's attention
    q = mx.random.normal((1, heads, length, dim), key=kq)
    k = mx.random.normal((1, kv_heads, length, dim), key=kk)
    v = mx.random.normal((1, kv_heads, length, dim), key=kv)
    sdpa = mx.fast.scaled_dot_product_attention
    full = sdpa(q, k, v, scale=dim ** -0.5, mask="causal")[:, :, -1]
    alone = sdpa(q[:, :, -1:], k, v, scale=dim ** -0.5)[:, :, 0]
    return {"f32_matmul_relative_error": error, "row_bits_kept": same,
            "attention_last_row_max_diff": float(mx.max(mx.abs(full - alone)))}


def _device_info(mx) -> dict | None:
    """mx.device_info() where this MLX has it (name, architecture, memory)."""
    get = getattr(mx, "device_info", None)
    return None if get is None else {k: v if isinstance(v, int | float | str | bool) else str(v)
                                     for k, v in get().items()}


# ---------------------------------------------------------------------------------------------
# serve


def cmd_serve(args: argparse.Namespace) -> int:
    """`batchscope serve` against `mlx_lm.server` on one exported folder at STREAMS streams:
    benchmarks/peers.py's HTTP section (its servers, workload and load client) at that one
    concurrency."""
    import dataclasses

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import peers  # benchmarks/peers.py

    from engine.platform import backend_info
    from engine.weights.formats import resolve_weights

    # A time limit's SIGTERM unwinds, so peers.running_server stops the servers it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    info = backend_info()
    weights = resolve_weights("auto", info, native_quantized=False)  # as peers.py picks it
    profile = dataclasses.replace(peers.QUICK if args.quick else peers.FULL,
                                  http_concurrency=(STREAMS,))
    with tempfile.TemporaryDirectory(prefix="batchscope-gpu-check-") as d:
        http = peers.section_http(profile, weights, 0, peers.Log(), Path(d))
    _write_json(Path(args.out) / "serve.json", {
        "streams": STREAMS, "weights": weights, "backend": info["backend"],
        "profile": dataclasses.asdict(profile), **http})
    row = http["rows"][0]
    for name, server in http["servers"].items():
        s = server["runs"][0]["summary"]
        print(f"{name}: {s['output_throughput']:.1f} output tok/s, p99 TTFT "
              f"{s['ttft']['p99_ms']:.0f} ms, {s['failed']} failed")
    print(f"batchscope / mlx_lm.server: {row['ratio']:.2f}x")
    return 0


# ---------------------------------------------------------------------------------------------
# report


# "off": the install left out by --no-install; "skipped": after a failed install; "not_run":
# left out by --steps.
NOT_RUN = ("off", "skipped", "not_run")


def read_steps(out: Path) -> list[dict]:
    """steps.tsv as the script wrote it: name, status, exit code, seconds, limit."""
    steps = []
    path = out / "steps.tsv"
    for line in path.read_text().splitlines() if path.is_file() else []:
        name, status, rc, seconds, limit = line.split("\t")
        steps.append({"name": name, "status": status, "exit_code": int(rc) if rc else None,
                      "seconds": float(seconds), "limit_s": int(limit),
                      "log": f"logs/{name}.log" if status not in NOT_RUN else None})
    return steps


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def tests_numbers(out: Path) -> dict | None:
    """Counts from pytest's JUnit XML, and the ids of the tests that failed."""
    try:
        root = ET.parse(out / "tests.xml").getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts | {"failed_ids": failed}


def calibrate_numbers(out: Path) -> dict | None:
    found = sorted((out / "calibration").glob("calibration-*.json"))
    data = _load(found[0]) if found else None
    if data is None:
        return None
    return {k: data.get(k) for k in ("threshold", "threshold_basis", "weights", "backend")} | {
        "elapsed_s": round(data["elapsed_s"], 1)}


def diverge_numbers(out: Path) -> dict | None:
    data = _load(out / "diverge.json")
    if data is None:
        return None
    return {k: data.get(k) for k in ("prompts", "max_tokens", "forked", "bit_identical",
                                     "same_tokens_numbers_differ", "errors")} | {
        "a": data["a"].get("label"), "b": data["b"].get("label")}


def batching_numbers(out: Path) -> dict | None:
    data = _load(out / "engine_batching.json")
    if data is None:
        return None
    found: dict = {"weights": data["weights"], "decode_tps": {},
                   "batch_generate_decode_tps": {}, "unmeasured": []}
    for r in data["rows"]:
        for system, key in (("engine", "decode_tps"), ("batch_generate",
                                                       "batch_generate_decode_tps")):
            rate = r[system]["decode_tps"]
            # Decode is the longer call's extra time; on a busy machine it can come out
            # negative (the longer call ran faster): no rate, said so.
            if rate <= 0:
                found["unmeasured"].append(f"{system} at {r['concurrency']}")
            found[key][str(r["concurrency"])] = round(rate, 1) if rate > 0 else None
    return found


def serve_numbers(out: Path) -> dict | None:
    data = _load(out / "serve.json")
    if data is None:
        return None
    found = {"streams": data["streams"], "weights": data["weights"],
             "ratio": round(data["rows"][0]["ratio"], 2)}
    for name, server in data["servers"].items():
        run = server["runs"][0]
        s = run["summary"]
        found[name] = {"requests": run["num_prompts"], "failed": s["failed"],
                       "output_tok_s": round(s["output_throughput"], 1),
                       "ttft_p50_ms": _ms(s["ttft"]["p50_ms"]),
                       "ttft_p99_ms": _ms(s["ttft"]["p99_ms"]),
                       "tpot_p50_ms": _ms(s["tpot"]["p50_ms"])}
    return found


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


NUMBERS = {"tests": tests_numbers, "calibrate": calibrate_numbers, "diverge": diverge_numbers,
           "batching": batching_numbers, "serve": serve_numbers}


def build_report(out: Path, mode: str) -> dict:
    steps = read_steps(out)
    device = _load(out / "device.json")
    for step in steps:
        if step["name"] == "device":
            step["numbers"] = device and {"problems": device.get("problems")}
        elif step["name"] in NUMBERS:
            step["numbers"] = NUMBERS[step["name"]](out)
        else:
            step["numbers"] = None
    smi = out / "nvidia-smi.txt"
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    statuses = {s["status"] for s in steps}
    # Every step recorded, and each passed, or was left out (the install by --no-install).
    ran_well = len(steps) == len(STEPS) and statuses <= {"passed", "off", "not_run"}
    return {
        "version": REPORT_VERSION, "mode": mode,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "passed": ran_well and "not_run" not in statuses,
        # Every step that ran passed, but --steps left some out: not a pass.
        "partial": ran_well and "not_run" in statuses,
        "seconds": round(sum(s["seconds"] for s in steps), 1),
        "python": sys.version.split()[0], "packages": versions,
        "gpu": smi.read_text().strip() if smi.is_file() else None,
        "device": device, "steps": steps,
    }


def render(report: dict) -> str:
    device = report["device"] or {}
    auto = device.get("auto") or {}
    lines = [
        f"# gpu-check ({report['mode']}): {_verdict(report)}", "",
        f"{report['date']}; {report['seconds']:.0f} s in all. "
        + ("MLX's CPU backend (--cpu): these numbers are not a GPU's." if report["mode"] == "cpu"
           else f"GPU: {report['gpu'] or 'unknown'}."), "",
        "| | |", "|---|---|",
        f"| MLX default device | {device.get('default_device', '?')} (backend "
        f"{device.get('backend', '?')}; metal {device.get('metal_available', '?')}, cuda "
        f"{device.get('cuda_available', '?')}) |",
        f"| device info | {device.get('device_info')} |",
        f"| float32 matmuls | {device.get('float32_matmuls', '?')} |",
        f"| numerics | {'; '.join(f'{k} {v}' for k, v in _flat(device.get('numerics') or {}))} |",
        f"| packages | {', '.join(f'{k} {v}' for k, v in report['packages'].items())}; "
        f"Python {report['python']} |",
    ]
    lines += [f"| auto {k.replace('_', ' ')} | {v} |" for k, v in auto.items()]
    if device:
        lines.append(f"| native CPU kernels loaded | {device.get('native_kernels_loaded')} |")
    lines += ["", "| step | status | seconds | limit | numbers |", "|---|---|---|---|---|"]
    for s in report["steps"]:
        numbers = "; ".join(f"{k} {v}" for k, v in _flat(s["numbers"] or {}))
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']:.1f} | {s['limit_s']} | "
                     f"{numbers.replace('|', '/')} |")
    return "\n".join(lines)


def _verdict(report: dict) -> str:
    if report["passed"]:
        return "PASSED"
    if report.get("partial"):
        left_out = [s["name"] for s in report["steps"] if s["status"] == "not_run"]
        return f"PARTIAL (every step run passed; not run: {', '.join(left_out)})"
    return "FAILED"


def _flat(numbers: dict, prefix: str = ""):
    """(dotted key, value) of a step's numbers, nested dicts spelled out, empty lists left out."""
    for key, value in numbers.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        elif value != []:
            yield f"{prefix}{key}", value


def cmd_report(args: argparse.Namespace) -> int:
    out = Path(args.out)
    report = build_report(out, args.mode)
    _write_json(out / "report.json", report)
    text = render(report)
    (out / "report.md").write_text(text + "\n")
    print(text)
    return 0 if report["passed"] else 1


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("device", help="the device MLX sees and what auto picks there")
    p.add_argument("out")
    p.add_argument("--require-gpu", action="store_true",
                   help="fail unless MLX runs on a CUDA GPU without the native CPU kernels")
    p.set_defaults(func=cmd_device)
    p = sub.add_parser("serve", help=f"batchscope serve vs mlx_lm.server at {STREAMS} streams")
    p.add_argument("out")
    p.add_argument("--quick", action="store_true", help="benchmarks/peers.py's quick sizes")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("report", help="report.json and report.md from the steps' files")
    p.add_argument("out")
    p.add_argument("--mode", choices=("cpu", "gpu"), required=True)
    p.set_defaults(func=cmd_report)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
