"""engine/collectives.py: the forward's all_sums, timed apart from the compute when asked."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine import collectives


@pytest.fixture
def group():
    yield mx.distributed.init()  # no launcher: this process alone, a group of one
    collectives.set_timing(False)


def test_timed_all_sum_sums_and_counts_its_seconds_once(group):
    x = mx.arange(12, dtype=mx.float32).reshape(3, 4)
    collectives.set_timing(True)
    out = collectives.all_sum(x * 2, group)
    assert mx.array_equal(out, x * 2 * group.size())
    first = collectives.take_seconds()
    assert first > 0
    assert collectives.take_seconds() == 0.0  # taken: counting starts again


def test_untimed_all_sum_reports_no_time(group):
    collectives.set_timing(False)
    out = collectives.all_sum(mx.ones((2, 2)), group)
    mx.eval(out)
    assert collectives.take_seconds() is None  # not zero: nothing was measured
