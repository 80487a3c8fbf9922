"""benchmarks/serve_ab.py: each server's figures are the medians of its rounds, the ratio is
working tree over base, the median of the rounds' own ratios with their quartiles and range;
the table says which revisions it compared."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import serve_ab  # noqa: E402


def _round(base_tps: float, tree_tps: float) -> dict:
    return {"base": {"output_tps": base_tps, "tpot_ms": 1000 / base_tps, "ttft_ms": 20.0},
            "tree": {"output_tps": tree_tps, "tpot_ms": 1000 / tree_tps, "ttft_ms": 10.0}}


def test_the_ratio_is_tree_over_base_the_median_of_the_rounds_own():
    # The rounds' ratios 1.10, 1.125, 1.20, 1.00, 1.05: median 1.10, where the ratio of the
    # rates' medians (105 / 100) would be 1.05.
    rounds = [_round(100.0, 110.0), _round(80.0, 90.0), _round(50.0, 60.0),
              _round(120.0, 120.0), _round(100.0, 105.0)]
    summary = serve_ab.summarize_rounds(rounds)
    assert summary["base"]["output_tps"] == 100.0
    assert summary["tree"]["output_tps"] == 105.0
    assert summary["tree"]["ttft_ms"] == 10.0
    ratio = summary["ratio"]
    assert ratio["median"] == pytest.approx(1.10)
    assert (ratio["min"], ratio["max"]) == (pytest.approx(1.0), pytest.approx(1.2))
    assert ratio["q1"] < ratio["median"] < ratio["q3"]

    meta = {"date": "2026-12-05 17:00", "base": "abc123", "head": "def456", "rounds": 5,
            "weights": "q4", "backend": "MLX on cpu"}
    table = serve_ab.render(summary, meta)
    assert "from abc123 and from the working tree (at def456)" in table
    assert "| abc123 | 100.0 | 10.00 | 20.0 |" in table
    assert "| working tree | 105.0 | 9.52 | 10.0 |" in table
    assert "1.100x (median of the rounds' own" in table


def test_one_round_has_its_ratio_as_quartiles():
    summary = serve_ab.summarize_rounds([_round(100.0, 110.0)])
    assert summary["ratio"]["q1"] == summary["ratio"]["q3"] == pytest.approx(1.1)
