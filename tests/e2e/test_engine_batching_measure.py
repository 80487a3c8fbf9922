"""benchmarks/engine_batching.py's measure: decode is the full call's extra time, and a first
call slower than the full one (kernels compiled on first use, other work on the machine) is
measured again and, if it stays so, refused, not reported as a negative rate."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import engine_batching  # noqa: E402


def fake_run(walls: dict[int, float]):
    def run(prompts, max_tokens):
        return {"generated": len(prompts) * max_tokens, "wall": walls[max_tokens]}
    return run


def fake_runs(walls: list[float]):
    """Calls taking these walls in turn (whatever max_tokens)."""
    left = iter(walls)

    def run(prompts, max_tokens):
        return {"generated": len(prompts) * max_tokens, "wall": next(left)}
    return run


def test_decode_is_the_extra_time_of_the_full_call():
    m = engine_batching.measure(fake_run({1: 0.5, 33: 2.1}), [[1, 2], [3]], 32)
    assert m["decode_tokens"] == 64
    assert m["decode_time"] == pytest.approx(1.6)
    assert engine_batching.rates(m)["decode_tps"] == pytest.approx(40.0)


def test_a_first_call_slower_than_the_full_one_is_refused():
    with pytest.raises(RuntimeError, match="no decode time is left"):
        engine_batching.measure(fake_run({1: 3.0, 33: 2.1}), [[1, 2], [3]], 32)


def test_a_pair_without_decode_time_is_measured_again():
    m = engine_batching.measure(fake_runs([0.8, 0.6, 0.5, 2.1]), [[1, 2], [3]], 32)
    assert m["prefill_time"] == pytest.approx(0.5)
    assert m["decode_time"] == pytest.approx(1.6)
    with pytest.raises(RuntimeError, match="the last of 2 pairs"):
        engine_batching.measure(fake_runs([0.8, 0.6, 0.9, 0.7]), [[1, 2], [3]], 32, attempts=2)
