"""/calibration and /calibration.json, with and without a saved calibration (tiny model)."""

from __future__ import annotations

import argparse

import pytest
from bs4 import BeautifulSoup
from starlette.testclient import TestClient

from app.cli import calibrate as calibrate_cli
from app.lab.calibration import (
    ENV_DIR,
    backend_key,
    calibration_path,
    choose_threshold,
    save_calibration,
)
from app.settings import Settings
from app.web.app import create_app
from engine.config import EngineConfig
from engine.engine import Engine
from engine.platform import backend_info
from engine.testing import tiny_model

JSON = {"accept": "application/json"}


@pytest.fixture(scope="module")
def client():
    app = create_app(Settings(engine=EngineConfig(num_kv_blocks=64)),
                     engine_factory=lambda config: Engine(config, loader=tiny_model))
    with TestClient(app) as c:
        yield c


@pytest.fixture(autouse=True)
def calibration_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    return tmp_path


def save_synthetic(ratios: dict[int, float], **extra) -> dict:
    rows = []
    for n, ratio in ratios.items():
        rows.append({"concurrency": n, "unbatched_tps": 7.0, "gemm_tps": 8.0 * n,
                     "gemv_tps": 8.0 * n * ratio, "gemv_over_gemm": ratio,
                     "unbatched_decode_tps": 7.5, "gemm_decode_tps": 9.0 * n,
                     "gemv_decode_tps": 9.0 * n * ratio, "gemv_over_gemm_decode": ratio,
                     "detail": {"gemm": {"tps": 8.0 * n}}})
    return save_calibration({
        "model": "tiny-llama", "weights": "q4", "backend": backend_key(backend_info()),
        "backend_info": backend_info(), "mlx_version": "0.32.4", "max_tokens": 16,
        "date": "2025-06-01T12:00:00+00:00", "host": "bench-host", "cpu_count": 2,
        "repeats": 1, "elapsed_s": 42.0, "threshold_basis": "decode-only tokens/s",
        "rows": rows, "threshold": choose_threshold(rows, not extra.get("native_gemm")), **extra})


def test_uncalibrated_page_says_how_to_calibrate(client, calibration_dir):
    page = BeautifulSoup(client.get("/calibration").text, "html.parser")
    assert page.select_one("section.uncalibrated") is not None
    assert page.select_one("pre[data-col=command]").text == \
        "batchscope calibrate --model embedded --weights q4"
    expected = calibration_path("tiny-llama", "q4", backend_info())
    assert page.select_one("[data-col=expected_path]").text == str(expected)
    assert expected.parent == calibration_dir
    assert page.select_one("svg") is None

    data = client.get("/calibration.json").json()
    assert data["calibration"] is None
    assert data["model"] == "tiny-llama" and data["weights"] == "q4"
    assert data["backend"] == backend_key(backend_info())
    assert data["command"] == "batchscope calibrate --model embedded --weights q4"
    assert client.get("/calibration", headers=JSON).json() == data


def test_calibrated_page_shows_table_plot_and_threshold(client):
    saved = save_synthetic({1: 1.0, 3: 1.343, 4: 1.092, 5: 0.907})
    response = client.get("/calibration")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    page = BeautifulSoup(response.text, "html.parser")
    assert page.select_one("section.uncalibrated") is None
    assert page.select_one("[data-col=threshold] strong").text == "4"
    assert page.select_one("[data-col=path]").text == saved["path"]
    assert "bench-host" in page.select_one("[data-col=host]").text
    assert page.select_one("[data-col=date]").text.startswith("2025-06-01T12:00:00")
    rows = page.select("table.calibration tbody tr")
    assert [r["data-concurrency"] for r in rows] == ["1", "3", "4", "5"]
    row3 = rows[1]
    assert row3.select_one("[data-col=gemm_tps]").text == "24.0"
    assert row3.select_one("[data-col=gemv_over_gemm]").text == "134.3%"
    assert row3.select_one("[data-col=gemv_over_gemm_decode]").text == "134.3%"
    assert [r.get("class") for r in rows] == [["gemv-side"]] * 3 + [None]
    svg = page.select_one("figure.calibration-plot svg")
    assert svg is not None
    assert {g["data-series"] for g in svg.select("g[data-series]")} >= {"unbatched", "gemm",
                                                                       "gemv"}

    data = client.get("/calibration.json").json()
    cal = data["calibration"]
    assert cal["threshold"] == cal["threshold_from_rows"] == 4
    assert cal["path"] == saved["path"] and cal["host"] == "bench-host"
    assert [r["concurrency"] for r in cal["rows"]] == [1, 3, 4, 5]
    assert cal["rows"][1]["gemv_over_gemm"] == pytest.approx(1.343)
    assert "detail" not in cal["rows"][0] and "plot_svg" not in data


def test_native_gemm_calibration_keeps_its_threshold_and_names_its_paths(client):
    """Where a 1-row gemm step is the native kernel's and a gemv step MLX's, the 1-row ratio
    counts (here GEMM wins: T = 0), and the page recomputes T from the rows by that rule."""
    rows = {1: 0.9, 2: 0.8}
    paths = {"unbatched": ["native"], "gemm": ["native"], "gemv": ["gemv"]}
    save_synthetic(rows, native_gemm=True, one_row_same_call=False, decode_paths=paths)
    rows_only = [{"concurrency": n, "gemv_over_gemm_decode": r} for n, r in rows.items()]
    page = BeautifulSoup(client.get("/calibration").text, "html.parser")
    assert page.select_one("[data-col=threshold] strong").text == "0"
    assert page.select_one("[data-col=threshold] .error-text") is None
    assert page.select_one("[data-col=decode_paths]").text.startswith(
        "decode steps ran on: unbatched native · gemm native · gemv gemv")
    cal = client.get("/calibration.json").json()["calibration"]
    assert cal["threshold"] == cal["threshold_from_rows"] == 0
    assert choose_threshold(rows_only) == 1  # the exemption would have given 1


def test_calibration_for_other_weights_is_not_shown(client):
    save_calibration({"model": "tiny-llama", "weights": "f32",
                      "backend": backend_key(backend_info()), "max_tokens": 8,
                      "rows": [], "threshold": 0})
    assert client.get("/calibration.json").json()["calibration"] is None


def test_calibrate_command(monkeypatch, capsys, calibration_dir):
    parser = argparse.ArgumentParser(prog="batchscope")
    calibrate_cli.add_calibrate_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["calibrate", "--weights", "q4", "--concurrency", "1", "2", "4",
                              "--max-tokens", "16", "--out", str(calibration_dir)])
    calls = []

    def fake(model, weights, concurrency, max_tokens, progress, **kw):
        calls.append((model, weights, list(concurrency), max_tokens, kw))
        progress("[gemm]   2 requests: ...")
        return {**save_synthetic({1: 1.0, 2: 1.2, 4: 0.7}), "elapsed_s": 3.0}

    monkeypatch.setattr("app.lab.calibration.calibrate", fake)
    assert args.func(args) == 0
    assert calls == [("embedded", "q4", [1, 2, 4], 16,
                      {"repeats": 1, "out_dir": str(calibration_dir)})]
    out, err = capsys.readouterr()
    assert "[gemm]   2 requests" in err
    assert "| concurrency | unbatched | batched GEMM | batched GEMV | GEMV/GEMM |" in out
    assert "| 2 | 7.0 | 16.0 | 19.2 | 120.0% |" in out
    assert "chosen threshold T = 2 rows" in out and "calibration-tiny-llama-q4-" in out
