"""scripts/gpu-check.sh: its help, its refusals, a run that stops at the install, and the report
its steps' files make (scripts/gpu_check.py). A whole run takes minutes: CI runs `--cpu`."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
_spec = importlib.util.spec_from_file_location("batchscope_gpu_check", ROOT / "scripts" /
                                               "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gpu_check
_spec.loader.exec_module(gpu_check)


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_help_prints_the_header_and_runs_nothing(tmp_path):
    done = run("--help", cwd=tmp_path)
    assert done.returncode == 0
    assert done.stdout.startswith("Checks batchscope on MLX's CUDA backend")
    for step in gpu_check.STEPS:  # every step is described
        assert f"\n  {step} " in done.stdout, step
    assert "set -euo" not in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments_and_a_used_folder_are_refused(tmp_path):
    done = run("--fast", cwd=tmp_path)
    assert done.returncode == 2 and "unknown argument --fast" in done.stderr
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    done = run("--cpu", "--out", "used", cwd=tmp_path)
    assert done.returncode == 2 and "not empty" in done.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None,
                    reason="this machine has nvidia-smi: the install would really run")
def test_without_a_gpu_the_install_fails_and_the_report_says_so(tmp_path):
    done = run("--out", "check", cwd=tmp_path)
    assert done.returncode == 1
    assert "nvidia-smi not found" in (tmp_path / "check" / "logs" / "install.log").read_text()
    report = json.loads((tmp_path / "check" / "report.json").read_text())
    assert report["mode"] == "gpu" and report["passed"] is False
    assert [(s["name"], s["status"]) for s in report["steps"]] == [
        ("install", "failed"), *((name, "skipped") for name in gpu_check.STEPS[1:])]
    assert report["device"] is None
    assert "# gpu-check (gpu): FAILED" in (tmp_path / "check" / "report.md").read_text()


def _steps(out: Path, statuses: dict[str, str]) -> None:
    rows = [f"{name}\t{statuses.get(name, 'passed')}\t0\t1.5\t60" for name in gpu_check.STEPS]
    (out / "steps.tsv").write_text("\n".join(rows) + "\n")


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="1" skipped="0" tests="3"><testcase classname="tests.engine.test_engine" name="a"/>
<testcase classname="tests.engine.test_engine" name="b"><failure message="x"/></testcase>
<testcase classname="tests.engine.test_engine" name="c"/></testsuite></testsuites>"""


def _rates(engine: float, batch_generate: float) -> dict:
    return {"engine": {"decode_tps": engine}, "batch_generate": {"decode_tps": batch_generate}}


def test_the_report_gathers_each_steps_numbers(tmp_path):
    _steps(tmp_path, {"install": "off", "tests": "failed"})
    (tmp_path / "device.json").write_text(json.dumps({
        "default_device": "Device(gpu, 0)", "backend": "cuda", "problems": [],
        "auto": {"attention": "MLX fused attention per sequence", "row_kernels": "MLX"}}))
    (tmp_path / "tests.xml").write_text(JUNIT)
    (tmp_path / "engine_batching.json").write_text(json.dumps({"weights": "q4", "rows": [
        {"concurrency": 1, **_rates(80.0, 70.0)}, {"concurrency": 16, **_rates(-5.0, 300.0)}]}))
    report = gpu_check.build_report(tmp_path, "gpu")
    assert report["passed"] is False  # the tests failed
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["tests"]["numbers"] == {"tests": 3, "failures": 1, "errors": 0, "skipped": 0,
                                         "passed": 2,
                                         "failed_ids": ["tests.engine.test_engine::b"]}
    # A negative decode rate (the longer call ran faster) is no rate, and is named.
    assert steps["batching"]["numbers"] == {
        "weights": "q4", "decode_tps": {"1": 80.0, "16": None},
        "batch_generate_decode_tps": {"1": 70.0, "16": 300.0}, "unmeasured": ["engine at 16"]}
    assert steps["calibrate"]["numbers"] is None  # no file: nothing made up
    assert steps["install"]["log"] is None and steps["tests"]["log"] == "logs/tests.log"
    md = gpu_check.render(report)
    assert "| auto attention | MLX fused attention per sequence |" in md
    assert "failed_ids ['tests.engine.test_engine::b']" in md


def test_the_report_passes_only_when_every_step_did(tmp_path):
    _steps(tmp_path, {"install": "off"})
    assert gpu_check.build_report(tmp_path, "cpu")["passed"] is True
    assert gpu_check.main(["report", str(tmp_path), "--mode", "cpu"]) == 0
    _steps(tmp_path, {"serve": "timed_out"})
    assert gpu_check.main(["report", str(tmp_path), "--mode", "cpu"]) == 1
    (tmp_path / "steps.tsv").write_text("install\tpassed\t0\t1.0\t60\n")  # the rest missing
    assert gpu_check.build_report(tmp_path, "cpu")["passed"] is False


def test_the_device_steps_numerics_on_this_backend():
    # isort: off
    import engine  # noqa: F401  (as the device step: TF32 off before MLX's first matmul)
    import mlx.core as mx
    # isort: on

    found = gpu_check.numerics(mx)
    # MLX's CPU backend: float32 is float32 (TF32 would be ~1e-3)
    assert found["f32_matmul_relative_error"] < 1e-5
    assert set(found["row_bits_kept"]) == {"f32_matmul", "q4_matmul"}
    for kept in found["row_bits_kept"].values():
        assert list(kept) == [str(m) for m in gpu_check.ROWS_AMONG]
        assert all(isinstance(v, bool) for v in kept.values())
    assert 0 <= found["attention_last_row_max_diff"] < 1e-3
    md = gpu_check.render({"mode": "cpu", "passed": True, "date": "d", "seconds": 1.0,
                           "gpu": None, "python": "3", "packages": {}, "steps": [],
                           "device": {"numerics": found}})
    assert "| numerics | f32_matmul_relative_error " in md
    assert "row_bits_kept.q4_matmul.1 " in md


def test_steps_names_are_checked_before_anything_runs(tmp_path):
    done = run("--cpu", "--steps", "device,warmup", cwd=tmp_path)
    assert done.returncode == 2 and "--steps: no step warmup" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_steps_left_out_are_recorded_and_the_report_says_partial(tmp_path):
    done = run("--cpu", "--no-install", "--steps", "device", "--out", "check", cwd=tmp_path)
    report = json.loads((tmp_path / "check" / "report.json").read_text())
    assert [(s["name"], s["status"]) for s in report["steps"]] == [
        ("install", "off"), ("device", "passed"),
        *((name, "not_run") for name in gpu_check.STEPS[2:])], done.stdout
    assert report["passed"] is False and report["partial"] is True
    assert done.returncode == 1  # a partial run is no pass
    md = (tmp_path / "check" / "report.md").read_text()
    assert "PARTIAL (every step run passed; not run: tests, calibrate" in md
    assert not (tmp_path / "check" / "logs" / "tests.log").exists()
