"""Calibration: a real (tiny-model) run's JSON and SVG, the choice of T, and where T comes from."""

from __future__ import annotations

import json
import logging
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest

from app.lab.calibration import (
    ENV_DIR,
    MODES,
    calibrate,
    calibration_path,
    choose_threshold,
    describe_paths,
    load_calibration,
    one_row_same_call,
    render_svg,
    render_table,
    same_call_at_one_row,
    save_calibration,
    saved_thresholds,
)
from engine.testing import tiny_model
from engine.thresholds import DEFAULT_THRESHOLD, backend_key, resolve_threshold

SVG = "{http://www.w3.org/2000/svg}"
ROW_KEYS = {"concurrency", "unbatched_tps", "gemm_tps", "gemv_tps", "gemv_over_gemm",
            "unbatched_decode_tps", "gemm_decode_tps", "gemv_decode_tps",
            "gemv_over_gemm_decode", "detail"}


@pytest.fixture(autouse=True)
def calibration_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    return tmp_path


def synthetic(ratios: dict[int, float], **extra) -> dict:
    """A saved-calibration-shaped result whose decode-only GEMV/GEMM ratios are `ratios`."""
    rows = []
    for n, ratio in ratios.items():
        gemm = 10.0 * n
        rows.append({"concurrency": n, "unbatched_tps": 10.0, "gemm_tps": gemm,
                     "gemv_tps": gemm * ratio, "gemv_over_gemm": ratio,
                     "unbatched_decode_tps": 11.0, "gemm_decode_tps": gemm,
                     "gemv_decode_tps": gemm * ratio, "gemv_over_gemm_decode": ratio})
    result = {"model": "tiny-llama", "weights": "q4", "backend": "cpu-openblas",
              "max_tokens": 8, "date": "2025-01-01T00:00:00+00:00", "mlx_version": "0",
              "rows": rows, "threshold": choose_threshold(rows)}
    result.update(extra)
    return result


# ---- a real run on the tiny model ------------------------------------------------------------
@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("calibration")
    lines: list[str] = []
    result = calibrate(concurrency=(2, 1), max_tokens=4, progress=lines.append,
                       loader=tiny_model, out_dir=out)
    return result, lines, out


def test_calibrate_result_shape(measured):
    result, lines, _ = measured
    assert result["model"] == "tiny-llama" and result["weights"] == "q4"
    assert result["concurrency"] == [1, 2] and result["max_tokens"] == 4
    assert result["backend"] == backend_key(result["backend_info"])
    for key in ("mlx_version", "date", "host", "threshold_basis", "prompt_tokens"):
        assert result[key]
    assert [r["concurrency"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert set(row) == ROW_KEYS
        n = row["concurrency"]
        for mode in MODES:
            m = row["detail"][mode]
            assert row[f"{mode}_tps"] == m["tps"] > 0
            assert m["tokens"] == n * 4  # ignore_eos: every request makes max_tokens tokens
            # Only decode steps holding all the rows count: 3 per request one at a time; up to 3
            # batched (fewer if a request joined a step late).
            assert m["decode_tps"] > 0
            if mode == "unbatched":
                assert m["decode_steps"] == 3 * n
            else:
                assert 1 <= m["decode_steps"] <= 3
            # The tiny 4-bit model's gemm steps are native where the native kernel takes them.
            batched = ["native"] if result["native_gemm"] else ["gemm"]
            assert m["decode_paths"] == (["gemv"] if mode == "gemv" else batched)
        assert row["gemv_over_gemm"] == pytest.approx(row["gemv_tps"] / row["gemm_tps"])
        assert row["gemv_over_gemm_decode"] == pytest.approx(
            row["gemv_decode_tps"] / row["gemm_decode_tps"])
    # The tiny 4-bit model's gemm steps take the native kernel where it is built.
    from engine import native

    assert result["native_gemm"] == native.decode_quantized_fast()
    assert result["decode_paths"] == {"unbatched": batched, "gemm": batched, "gemv": ["gemv"]}
    # A 1-row gemv step is MLX's call; a 1-row gemm step the native kernel's, where it runs.
    assert result["one_row_same_call"] is not result["native_gemm"]
    assert result["threshold"] == choose_threshold(result["rows"],
                                                   one_row_same_call=not result["native_gemm"])
    # One progress line per measurement (plus one per engine load).
    assert sum("requests:" in line for line in lines) == len(MODES) * 2


def test_calibrate_saves_json_and_svg(measured):
    result, _, out = measured
    path = calibration_path("tiny-llama", "q4", result["backend_info"], out)
    assert result["path"] == str(path)
    saved = json.loads(path.read_text())
    assert saved["threshold"] == result["threshold"] and len(saved["rows"]) == 2
    svg = ET.parse(path.with_suffix(".svg")).getroot()
    assert svg.tag == f"{SVG}svg"
    series = {g.get("data-series") for g in svg.iter(f"{SVG}g") if g.get("data-series")}
    assert {"unbatched", "gemm", "gemv", "gemv_over_gemm_decode"} <= series
    # load_calibration finds it by model, weights and backend (dict or key).
    found = load_calibration("tiny-llama", "q4", result["backend_info"], out)
    assert found is not None and found["threshold"] == result["threshold"]
    assert found["path"] == str(path)
    assert load_calibration("tiny-llama", "q4", result["backend"], out) is not None
    assert load_calibration("tiny-llama", "f32", result["backend"], out) is None


def test_calibrate_repeats_keep_the_best_run(tmp_path):
    lines: list[str] = []
    result = calibrate(concurrency=(2,), max_tokens=3, progress=lines.append, loader=tiny_model,
                       repeats=2, save=False)
    assert "path" not in result and not list(tmp_path.iterdir())
    for mode in MODES:
        m = result["rows"][0]["detail"][mode]
        assert len(m["tps_runs"]) == 2 and m["tps"] == max(m["tps_runs"])
    # Rounds alternate the mode order: each mode is measured early and late.
    loads = [line.split("]")[0] + "]" for line in lines if "loading" in line]
    assert loads == ["[unbatched 1/2]", "[gemm 1/2]", "[gemv 1/2]", "[gemv 2/2]", "[gemm 2/2]",
                     "[unbatched 2/2]"]


def test_calibrate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="concurrency"):
        calibrate(concurrency=(0, 2), loader=tiny_model)
    with pytest.raises(ValueError, match="max_tokens"):
        calibrate(concurrency=(1,), max_tokens=1, loader=tiny_model)


# ---- choosing T ------------------------------------------------------------------------------
@pytest.mark.parametrize("ratios, expected", [
    ({1: 1.0, 3: 1.343, 4: 1.092, 5: 0.907}, 4),  # the mini-vllm-rs table: crossing between 4 and 5
    ({1: 0.97, 2: 0.81, 4: 0.68}, 1),  # GEMM wins from 2 rows; 1 row is the same call: noise
    ({2: 0.81, 4: 0.68}, 0),  # GEMM wins at the first measured count
    ({1: 1.0, 2: 1.1, 4: 0.9, 8: 1.2}, 2),  # every n <= N must favour GEMV, not just N
    ({8: 1.2, 1: 1.0, 2: 1.05, 4: 1.01}, 8),  # order does not matter
    ({1: 1.0, 2: 1.0}, 2),  # a tie counts for GEMV
])
def test_choose_threshold(ratios, expected):
    assert choose_threshold(synthetic(ratios)["rows"]) == expected


def test_one_row_counts_where_the_native_kernels_take_gemm_steps():
    """There a 1-row GEMV step is MLX's call and a 1-row GEMM step the native kernel's: the
    measured q4 table (GEMV 21% of GEMM at 1 row) must give 0, never row-wise."""
    rows = synthetic({1: 0.215, 2: 0.114, 4: 0.073})["rows"]
    assert choose_threshold(rows) == 1
    assert choose_threshold(rows, one_row_same_call=False) == 0
    assert choose_threshold(synthetic({1: 1.02, 2: 0.9})["rows"], one_row_same_call=False) == 1


def test_choose_threshold_falls_back_to_aggregate_ratio():
    rows = synthetic({1: 1.0, 2: 1.2, 3: 0.9})["rows"]
    for row in rows:
        row["gemv_over_gemm_decode"] = None
    assert choose_threshold(rows) == 2


# ---- files, table, plot ----------------------------------------------------------------------
def test_save_and_load_use_env_dir(calibration_dir):
    result = save_calibration(synthetic({1: 1.0, 2: 1.3, 4: 0.8}))
    assert result["path"] == str(calibration_dir / "calibration-tiny-llama-q4-cpu-openblas.json")
    found = load_calibration("tiny-llama", "q4", "cpu-openblas")
    assert found["threshold"] == 2 and found["plot_path"].endswith(".svg")
    assert load_calibration("tiny-llama", "q4", "metal") is None


def test_load_ignores_broken_files(calibration_dir, caplog):
    path = calibration_path("tiny-llama", "q4", "cpu")
    path.write_text("{not json")
    assert load_calibration("tiny-llama", "q4", "cpu") is None
    path.write_text(json.dumps({"threshold": -1, "rows": []}))
    assert load_calibration("tiny-llama", "q4", "cpu") is None
    assert "ignoring" in caplog.text


def test_file_names_are_safe():
    path = calibration_path("../weird name/x", "q4", {"backend": "cpu", "blas": "/usr/lib/x.so"})
    assert path.parent == calibration_path("m", "q4", "cpu").parent
    assert path.name == "calibration-weird_name_x-q4-cpu-openblas.json"


def test_backend_key():
    assert backend_key({"backend": "metal", "blas": None}) == "metal"
    assert backend_key({"backend": "cpu", "blas": "/usr/lib/libopenblas.so.0"}) == "cpu-openblas"
    assert backend_key({"backend": "cpu", "blas": None, "platform": "linux"}) == "cpu"
    assert backend_key("cuda") == "cuda"


def test_table_and_svg_of_synthetic_result():
    result = synthetic({1: 1.0, 2: 1.25, 4: 0.5}, model="<m&>")
    table = render_table(result).splitlines()
    assert table[0].startswith(
        "| concurrency | unbatched | batched GEMM | batched GEMV | GEMV/GEMM |")
    assert table[3].startswith("| 2 | 10.0 | 20.0 | 25.0 | 125.0% |")
    root = ET.fromstring(render_svg(result))  # the model name is escaped: still valid XML
    groups = {g.get("data-series"): g for g in root.iter(f"{SVG}g") if g.get("data-series")}
    for key in ("unbatched", "gemm", "gemv", "gemv_over_gemm_decode", "gemv_over_gemm"):
        assert len(groups[key].findall(f"{SVG}circle")) == 3
    threshold = [g for g in root.iter(f"{SVG}g") if g.get("class") == "threshold"]
    assert threshold and threshold[0].get("data-threshold") == "2"
    assert "<m&>" in "".join(root.itertext())


def test_one_row_is_exempt_only_where_both_policies_make_the_same_calls():
    """A 1-row step's ratio is noise where both policies make the same calls: MLX's on both
    (no native kernel on gemm steps), or the native kernels on both (both recorded native)."""
    def rows(gemm: str, gemv: str) -> list[dict]:
        return [{"concurrency": 1, "detail": {"gemm": {"decode_paths": [gemm]},
                                              "gemv": {"decode_paths": [gemv]}}}]

    assert same_call_at_one_row(False, rows("gemm", "gemv"))
    assert not same_call_at_one_row(True, rows("native", "gemv"))
    assert not same_call_at_one_row(True, rows("gemm", "gemv"))  # e.g. native layers, MLX experts
    assert same_call_at_one_row(True, rows("native", "native"))
    # Saved files: the key, else (older ones) whether gemm steps took the native kernels.
    assert one_row_same_call({"one_row_same_call": False}) is False
    assert one_row_same_call({"native_gemm": True}) is False
    assert one_row_same_call({}) is True


def test_the_report_says_what_each_policy_ran_on():
    paths = {"unbatched": ["native"], "gemm": ["native"], "gemv": ["gemv"]}
    result = synthetic({1: 1.0, 2: 0.9}, decode_paths=paths)
    assert describe_paths(result) == ("decode steps ran on: unbatched native · gemm native · "
                                      "gemv gemv")
    assert describe_paths(synthetic({1: 1.0})) is None  # a file from before
    root = ET.fromstring(render_svg(result))
    shown = [g for g in root.iter(f"{SVG}g") if g.get("class") == "decode-paths"]
    assert [t.text for t in shown[0]] == ["decode steps ran on", "unbatched: native",
                                          "gemm: native", "gemv: gemv"]


# ---- resolve_threshold: the table the engine is given ---------------------------------------
def config(policy: str = "auto", threshold: int | None = None):
    return SimpleNamespace(model="embedded", kernel_policy=policy, kernel_threshold=threshold)


def test_resolve_threshold_precedence(caplog):
    caplog.set_level(logging.INFO, logger="batchscope.engine")
    table = saved_thresholds()
    assert table == {}
    assert resolve_threshold(config(), "tiny-llama", "q4", "cpu-openblas", table) == (
        DEFAULT_THRESHOLD, "default")
    assert "uncalibrated" in caplog.text and "batchscope calibrate" in caplog.text

    saved = save_calibration(synthetic({1: 1.0, 2: 1.3, 3: 1.1, 4: 0.9}))
    table = saved_thresholds()
    threshold, source = resolve_threshold(config(), "tiny-llama", "q4", "cpu-openblas", table)
    assert threshold == 3 and source.startswith(f"calibration {saved['path']}")
    assert resolve_threshold(config(), "tiny-llama", "q4",
                             {"backend": "cpu", "blas": "libopenblas.so.0"}, table)[0] == 3
    # The flag wins over the calibration, even a flag of 0 or of the default value.
    assert resolve_threshold(config(threshold=0), "tiny-llama", "q4", "cpu-openblas",
                             table) == (0, "flag")
    assert resolve_threshold(config(threshold=1), "tiny-llama", "q4", "cpu-openblas",
                             table) == (1, "flag")
    # Other weights or backend: not this calibration.
    assert resolve_threshold(config(), "tiny-llama", "f32", "cpu-openblas", table) == (
        DEFAULT_THRESHOLD, "default")
    assert resolve_threshold(config(), "tiny-llama", "q4", "metal", table) == (
        DEFAULT_THRESHOLD, "default")
    # gemm / gemv do not use the threshold.
    assert resolve_threshold(config("gemm"), "tiny-llama", "q4", "cpu-openblas", table) == (
        DEFAULT_THRESHOLD, "default")
    # No table given: the engine reads nothing and runs with the default.
    assert resolve_threshold(config(), "tiny-llama", "q4", "cpu-openblas") == (
        DEFAULT_THRESHOLD, "default")


def test_saved_thresholds_skip_unreadable_files(tmp_path):
    (tmp_path / "calibration-x-q4-cpu.json").write_text("{not json")
    save_calibration(synthetic({1: 1.0, 2: 1.3}), tmp_path)
    assert list(saved_thresholds(tmp_path)) == [("tiny-llama", "q4", "cpu-openblas")]
