from __future__ import annotations

import mlx.core as mx
import pytest

from engine.attention import attend


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("rows,ctx", [(1, 1), (1, 40), (1, 701), (7, 7), (16, 53), (37, 37),
                                      (3, 129), (64, 300)])
def test_grouped_attention_is_bit_identical_to_mlx_fused_attention(dtype, rows, ctx):
    mx.random.seed(rows * 1000 + ctx)
    q = mx.random.normal((rows, 9, 64)).astype(dtype)
    k = mx.random.normal((3, ctx, 64)).astype(dtype)
    v = mx.random.normal((3, ctx, 64)).astype(dtype)
    fused = attend(q, k, v, 0.125, fused=True)
    ours = attend(q, k, v, 0.125, fused=False)
    assert ours.shape == (rows, 9 * 64)
    assert mx.array_equal(fused, ours).item()


def test_causal_rows_do_not_see_later_positions():
    mx.random.seed(0)
    q = mx.random.normal((4, 2, 8))
    k = mx.random.normal((1, 6, 8))
    v = mx.random.normal((1, 6, 8))
    full = attend(q, k, v, 0.3, fused=False)
    # Changing the last key/value must only affect the last row (it is the only one that sees it).
    k2 = mx.concatenate([k[:, :5], k[:, 5:] + 1.0], axis=1)
    v2 = mx.concatenate([v[:, :5], v[:, 5:] - 1.0], axis=1)
    changed = attend(q, k2, v2, 0.3, fused=False)
    assert mx.array_equal(full[:3], changed[:3]).item()
    assert not mx.array_equal(full[3], changed[3]).item()
