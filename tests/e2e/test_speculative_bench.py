"""benchmarks/speculative.py end to end on the real model, at its smallest: it writes its table
and JSON, checks the three engines' tokens agree, and keeps where the files go out of the
recorded command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import speculative as bench
finally:
    sys.path.remove(str(ROOT / "benchmarks"))


def test_the_benchmark_runs_and_reports_speedup_acceptance_and_agreement(tmp_path):
    argv = ["--streams", "1", "--rounds", "1", "--max-tokens", "24", "--out-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    data = json.loads((tmp_path / "speculative.json").read_text())
    assert "--out-dir" not in data["command"] and str(tmp_path) not in data["command"]
    (row,) = data["rows"]
    assert row["streams"] == 1 and row["same_tokens"]
    always = row["conditions"]["ngram, always"]
    assert always["drafted"] > 0 and 0 < always["acceptance"] <= 1
    assert row["conditions"]["off"]["drafted"] == 0
    text = (tmp_path / "speculative.md").read_text()
    assert "| 1 |" in text and "x) |" in text


def test_the_two_workloads_are_sixteen_distinct_prompts_each():
    from engine.testing import embedded_tokenizer

    tokenizer = embedded_tokenizer()
    for workload in ("copy", "open"):
        ids = bench.prompts(tokenizer, workload)
        assert len(ids) == 16 and len({tuple(i) for i in ids}) == 16
