"""benchmarks/prefix_copy.py: the three engines it compares differ in what they do with a
repeated prompt's tail, copied (by the native op or by MLX's ops) or computed again, and
nothing else is cached."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import prefix_copy  # noqa: E402


@pytest.mark.slow
def test_the_copying_engine_computes_one_token_and_the_other_the_tail():
    data = prefix_copy.measure("auto", context=32, tails=[5], rounds=1)
    row = data["rows"][0]
    assert row["prompt_tokens"] == 37
    assert row["cached"] == {"copy": 36, "copy_mlx": 36, "recompute": 32}
    assert all(len(runs) == 1 and runs[0] > 0 for runs in row["runs_ms"].values())
    assert all(ms is not None and ms > 0 for ms in row["copy_ms"].values())  # both copies timed
    md = prefix_copy.render(data)
    assert "| 5 | 36 |" in md and "| 32 |" in md
