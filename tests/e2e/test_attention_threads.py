"""benchmarks/attention_threads.py: the two settings alternate turn by turn in one process, the
kernel's threshold is restored after, and a context's row reports both medians."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from native_ops import native_op

from engine import native
from engine.testing import tiny_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import attention_threads  # noqa: E402
import step_profile  # noqa: E402


def test_the_settings_alternate_and_the_default_comes_back(monkeypatch):
    native_op("paged_attention")
    runner = step_profile.decode_runner(tiny_model(), 64)
    default = native.attention_parallel_cost()
    set_to = []
    real = native.set_attention_parallel_cost

    def recording(cost):
        set_to.append(cost)
        return real(cost)

    monkeypatch.setattr(native, "set_attention_parallel_cost", recording)
    r = attention_threads.measure(runner, 1, 40, 3, default)
    one = attention_threads.ONE_THREAD
    assert set_to == [one, default, default, one, one, default, default]  # the last restores
    assert real(default) == default
    assert r["one_thread_ms"] > 0 and r["shared_ms"] > 0
    assert math.isclose(r["ratio"], r["one_thread_ms"] / r["shared_ms"])


def test_the_table_names_each_context_and_its_cost():
    meta = {"date": "2026-01-01 00:00", "head": "abc1234", "model": "m", "weights": "q4",
            "rows": 1, "turns": 2, "default_cost": 10.0, "threads": 2, "backend": "MLX"}
    results = {20: {"cost": 11.25, "one_thread_ms": 5.5, "shared_ms": 5.0, "ratio": 1.1}}
    table = attention_threads.render(results, meta)
    assert "| 20 | 11.2 | 5.500 | 5.000 | 1.100x |" in table
    assert "default cost (10)" in table
