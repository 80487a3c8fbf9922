"""The native copy of KV pool rows (engine/native/pool_copy.cpp): the rows a prompt reuses from
part of a cached block, copied in place in every layer, as MLX's gather and scatter copy them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from native_ops import native_op, random

from engine.block_manager import KVCopy
from engine.kv_cache import KVPool


def copy_op():
    return native_op("pool_copy")


def filled_pool(op, dtype=mx.float32) -> KVPool:
    """Two pool layers of different shapes (as Gemma 4's), 6 blocks of 4, random rows."""
    pool = KVPool(2, 6, 4, [3, 1], [8, 16], dtype)
    pool.copy_op = op
    for layer, (heads, dim) in enumerate([(3, 8), (1, 16)]):
        keys, values = (mx.array(random((24, heads, dim), 10 * layer + i)) for i in (1, 2))
        pool.write(layer, mx.arange(24), keys, values)
    mx.eval(pool.state())
    return pool


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_the_native_copy_gives_the_pools_of_mlx_gather_and_scatter(dtype):
    op = copy_op()
    copies = [KVCopy("a", source=1, dest=4, rows=3), KVCopy("b", source=2, dest=5, rows=1)]
    native, mlx_ops = filled_pool(op, dtype), filled_pool(None, dtype)
    before = [np.array(a.astype(mx.float32)) for a in native.state()]
    native.copy_rows(copies)
    mlx_ops.copy_rows(copies)
    for ours, theirs, old in zip(native.state(), mlx_ops.state(), before, strict=True):
        assert ours.dtype == dtype
        ours, theirs = np.array(ours.astype(mx.float32)), np.array(theirs.astype(mx.float32))
        np.testing.assert_array_equal(ours, theirs)
        expected = old.copy()
        for src, dst in [(4, 16), (5, 17), (6, 18), (8, 20)]:
            expected[:, dst] = old[:, src]
        np.testing.assert_array_equal(ours, expected)  # and nothing else moved


def test_the_op_returns_the_rows_it_copied():
    op = copy_op()
    pool = filled_pool(op)
    assert op(pool.state(), [(0, 9), (1, 10)]).item() == 2
    assert op(pool.state(), []).item() == 0


@pytest.mark.parametrize("pairs, message", [
    ([(0, 24)], "slot 24 is outside the pool"),
    ([(-1, 3)], "slot -1 is outside the pool"),
    ([(0, 9), (1, 9)], "destination slot 9 is named twice"),
    ([(0, 9), (9, 10)], "slot 9 is both a source and a destination"),
])
def test_bad_pairs_are_refused_before_the_pools_are_touched(pairs, message):
    op = copy_op()
    pool = filled_pool(op)
    before = [np.array(a) for a in pool.state()]
    with pytest.raises(ValueError, match=message):
        op(pool.state(), pairs)
    for now, old in zip(pool.state(), before, strict=True):
        np.testing.assert_array_equal(np.array(now), old)


def test_pools_it_cannot_write_in_place_are_refused():
    op = copy_op()
    lazy = mx.zeros((2, 8, 4)) + 1  # not evaluated
    with pytest.raises(ValueError, match="evaluated, row-contiguous"):
        op([lazy], [(0, 1)])
    pools = [mx.zeros((1, 8, 4)), mx.zeros((1, 9, 4))]
    mx.eval(pools)
    with pytest.raises(ValueError, match="the same number of slots"):
        op(pools, [(0, 1)])
