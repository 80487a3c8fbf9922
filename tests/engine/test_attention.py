from __future__ import annotations

import mlx.core as mx
import pytest

from engine.attention import Span, attend


def random_step(spans_shape, dtype, seed=0):
    """q for all rows of a step and the concatenated contexts of its sequences."""
    mx.random.seed(seed)
    rows = sum(r for r, _ in spans_shape)
    total = sum(c for _, c in spans_shape)
    q = mx.random.normal((rows, 9, 64)).astype(dtype)
    k = mx.random.normal((3, total, 64)).astype(dtype)
    v = mx.random.normal((3, total, 64)).astype(dtype)
    spans, row, ctx = [], 0, 0
    for r, c in spans_shape:
        spans.append(Span(row, r, ctx, c))
        row, ctx = row + r, ctx + c
    return q, k, v, spans


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("rows,ctx", [(1, 1), (1, 40), (1, 701), (7, 7), (16, 53), (37, 37),
                                      (3, 129), (64, 300)])
def test_grouped_attention_is_bit_identical_to_mlx_fused_attention(dtype, rows, ctx):
    q, k, v, spans = random_step([(rows, ctx)], dtype, seed=rows * 1000 + ctx)
    fused = attend(q, k, v, spans, 0.125, fused=True)
    ours = attend(q, k, v, spans, 0.125, fused=False)
    assert ours.shape == (rows, 9 * 64)
    assert mx.array_equal(fused, ours).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_a_sequence_gets_the_same_bits_alone_and_packed_with_others(dtype):
    shape = [(1, 300), (12, 40), (1, 7), (5, 5), (1, 129)]
    q, k, v, spans = random_step(shape, dtype)
    packed = attend(q, k, v, spans, 0.125, fused=False)
    for s in spans:
        alone = attend(q[s.row:s.row + s.rows], k[:, s.ctx:s.ctx + s.ctx_len],
                       v[:, s.ctx:s.ctx + s.ctx_len], [Span(0, s.rows, 0, s.ctx_len)], 0.125,
                       fused=False)
        assert mx.array_equal(packed[s.row:s.row + s.rows], alone).item()


def test_causal_rows_do_not_see_later_positions():
    q, k, v, spans = random_step([(4, 6)], mx.float32)
    full = attend(q, k, v, spans, 0.3, fused=False)
    # Changing the last key/value must only affect the last row (it is the only one that sees it).
    k2 = mx.concatenate([k[:, :5], k[:, 5:] + 1.0], axis=1)
    v2 = mx.concatenate([v[:, :5], v[:, 5:] - 1.0], axis=1)
    changed = attend(q, k2, v2, spans, 0.3, fused=False)
    assert mx.array_equal(full[:3], changed[:3]).item()
    assert not mx.array_equal(full[3], changed[3]).item()
