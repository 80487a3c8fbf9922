"""app.stats.percentile: linear interpolation between closest ranks, in both arithmetics."""

from __future__ import annotations

import numpy as np
import pytest

from app.stats import percentile


@pytest.mark.parametrize("method", ["numpy", "lerp"])
def test_linear_between_closest_ranks(method):
    assert percentile([], 50, method=method) is None
    assert percentile([4.0], 99, method=method) == 4.0
    values = [0.3, 0.1, 0.2]  # unsorted on purpose
    assert percentile(values, 0, method=method) == 0.1
    assert percentile(values, 50, method=method) == 0.2
    assert percentile(values, 100, method=method) == 0.3
    assert percentile(values, 90, method=method) == pytest.approx(0.28)


def test_methods_keep_their_own_last_bits():
    values = [0.626, 0.066, 0.013, 0.837, 0.259]
    assert percentile(values, 90) == float(np.percentile(values, 90)) == 0.7526
    assert percentile(values, 90, method="lerp") == 0.7525999999999999  # 0.626 + 0.211 * 0.6
