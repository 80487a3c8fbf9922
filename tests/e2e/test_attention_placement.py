"""benchmarks/attention.py's block-placement measurement: the shuffled pool holds the same keys
and values as the consecutive one (the kernel's outputs agree bit for bit), so the two times
differ only by where the blocks lie."""

from __future__ import annotations

import sys
from pathlib import Path

from native_ops import native_op

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import attention  # noqa: E402


def test_shuffled_blocks_hold_the_same_contents_as_consecutive_ones():
    kernel = native_op("paged_attention")
    times, rates, delta = attention.block_placement(rows=3, context=40, rounds=1, kernel=kernel)
    assert delta == 0.0
    assert set(times) == set(rates) == {"consecutive blocks", "shuffled blocks"}
    assert all(r > 0 for r in rates.values())
