"""benchmarks/build_ab.py --measure step: each row's ratio is base over working tree (above 1:
the working tree is faster), the median of the rounds' own ratios, with their range; the table
says so and prints what was summarized."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import build_ab  # noqa: E402


def _round(base_ms: dict[int, float], head_ms: dict[int, float]) -> dict:
    return {"base": {"rows": {str(r): {"ms": ms} for r, ms in base_ms.items()}},
            "head": {"rows": {str(r): {"ms": ms} for r, ms in head_ms.items()}}}


def test_step_ratios_are_base_over_head_medians_of_the_rounds():
    rounds = [_round({1: 10.0, 8: 20.0}, {1: 8.0, 8: 20.0}),   # 1.25x, 1.00x
              _round({1: 9.0, 8: 24.0}, {1: 9.0, 8: 20.0}),    # 1.00x, 1.20x
              _round({1: 12.0, 8: 21.0}, {1: 10.0, 8: 30.0})]  # 1.20x, 0.70x
    rows = build_ab.summarize_step(rounds, [1, 8])
    one, eight = rows
    assert one["rows"] == 1 and one["base_ms"] == 10.0 and one["head_ms"] == 9.0
    assert one["ratio"] == pytest.approx(1.20)
    assert (one["min"], one["max"]) == (pytest.approx(1.0), pytest.approx(1.25))
    assert eight["ratio"] == pytest.approx(1.0)
    assert (eight["min"], eight["max"]) == (pytest.approx(0.7), pytest.approx(1.2))

    args = Namespace(base="abc123", weights="q4", rounds=3, context=300)
    table = build_ab.render_step(rows, args, "def456")
    assert "context of 300 tokens), base abc123 against the working tree (at def456)" in table
    assert "| 1 | 10.00 | 9.00 | 1.20x (1.00-1.25) |" in table
    assert "| 8 | 21.00 | 20.00 | 1.00x (0.70-1.20) |" in table


def test_kernel_rows_give_the_linears_and_the_head_each_their_ratio():
    def part(linears, head):
        return {str(r): {"linears_ms": linears[r], "head_ms": head[r]} for r in linears}

    rounds = [{"base": {"rows": part({1: 4.0}, {1: 1.5})},
               "head": {"rows": part({1: 4.0}, {1: 1.2})}},   # 1.00x, 1.25x
              {"base": {"rows": part({1: 3.6}, {1: 1.4})},
               "head": {"rows": part({1: 4.0}, {1: 1.4})}}]   # 0.90x, 1.00x
    parts = {key: build_ab.summarize_step(rounds, [1], key) for key in build_ab.KERNEL_KEYS}
    assert parts["linears_ms"][0]["ratio"] == pytest.approx(0.95)
    assert parts["head_ms"][0]["ratio"] == pytest.approx(1.125)
    args = Namespace(base="abc123", weights="q4", rounds=2)
    table = build_ab.render_kernel(parts, args, "def456")
    assert "base abc123 against the working tree (at def456)" in table
    assert "| 1 | 3.80 | 4.00 | 0.95x (0.90-1.00) | 1.45 | 1.30 | 1.12x (1.00-1.25) |" in table
