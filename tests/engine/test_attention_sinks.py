"""Attention sinks (gpt_oss): a learned logit per query head that joins each row's softmax.

The MLX-ops path must give the bits of MLX's own fallback of
mx.fast.scaled_dot_product_attention(..., sinks=) (what mlx-lm runs on the CPU), and the maths
of a float64 reference."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.attention import Span, attend, attend_step, plan_step
from engine.kv_cache import KVPool

HEADS, KV_HEADS, DIM = 6, 2, 32


def random_step(spans_shape, dtype, seed=0):
    """q for all rows of a step, the concatenated contexts of its sequences, and sinks."""
    mx.random.seed(seed)
    rows = sum(r for r, _ in spans_shape)
    total = sum(c for _, c in spans_shape)
    q = mx.random.normal((rows, HEADS, DIM)).astype(dtype)
    k = mx.random.normal((KV_HEADS, total, DIM)).astype(dtype)
    v = mx.random.normal((KV_HEADS, total, DIM)).astype(dtype)
    sinks = (2.0 * mx.random.normal((HEADS,))).astype(dtype)
    spans, row, ctx = [], 0, 0
    for r, c in spans_shape:
        spans.append(Span(row, r, ctx, c))
        row, ctx = row + r, ctx + c
    return q, k, v, sinks, spans


def reference(q, k, v, sinks, spans, scale, window=None) -> np.ndarray:
    """float64: per row, softmax over [sink, the scores it sees], then the weighted values."""
    q, k, v, sinks = (np.array(a.astype(mx.float32)).astype(np.float64) for a in (q, k, v, sinks))
    rep = HEADS // KV_HEADS
    out = np.zeros((q.shape[0], HEADS, DIM))
    for s in spans:
        for r in range(s.rows):
            pos = s.ctx_len - s.rows + r
            first = max(0, pos - window + 1) if window else 0
            for h in range(HEADS):
                keys = k[h // rep, s.ctx + first:s.ctx + pos + 1]
                vals = v[h // rep, s.ctx + first:s.ctx + pos + 1]
                logits = np.concatenate([[sinks[h]], keys @ q[s.row + r, h] * scale])
                p = np.exp(logits - logits.max())
                p /= p.sum()
                out[s.row + r, h] = p[1:] @ vals
    return out.reshape(q.shape[0], HEADS * DIM)


SHAPES = [[(1, 1)], [(1, 40)], [(7, 7)], [(16, 53)], [(3, 129)], [(1, 70), (5, 5), (9, 30)]]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sinks_on_mlx_ops_are_bit_identical_to_mlx_fused_attention(dtype, window, shape):
    # On the CPU backend the fused call is MLX's fallback: the arithmetic mlx-lm runs.
    q, k, v, sinks, spans = random_step(shape, dtype, seed=len(shape) * 100 + shape[0][1])
    fused = attend(q, k, v, spans, 0.125, fused=True, window=window, sinks=sinks)
    ours = attend(q, k, v, spans, 0.125, fused=False, window=window, sinks=sinks)
    assert ours.shape == (q.shape[0], HEADS * DIM)
    assert mx.array_equal(fused, ours).item()


@pytest.mark.parametrize("window", [None, 16])
def test_sinks_match_float64_attention(window):
    q, k, v, sinks, spans = random_step([(1, 70), (12, 40), (1, 9), (5, 5)], mx.float32)
    ours = np.array(attend(q, k, v, spans, 0.3, fused=False, window=window, sinks=sinks))
    expected = reference(q, k, v, sinks, spans, 0.3, window)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=2e-6)
    # The sink takes its share of the mass: without it the rows are not the same.
    plain = np.array(attend(q, k, v, spans, 0.3, fused=False, window=window))
    assert np.abs(plain - expected).max() > 1e-2


def test_a_sink_far_below_every_score_changes_no_bit():
    # exp(sink - max) is 0: the softmax's sum and max are those without a sink.
    q, k, v, _, spans = random_step([(1, 33), (6, 20)], mx.float32)
    low = mx.full((HEADS,), -1e30)
    with_sink = attend(q, k, v, spans, 0.125, fused=False, sinks=low)
    assert mx.array_equal(with_sink, attend(q, k, v, spans, 0.125, fused=False)).item()


def test_a_planned_step_with_sinks_keeps_decode_rows_off_the_native_kernel():
    bs, lens, rows = 16, [40, 7, 25], [1, 7, 1]  # decode, prefill, decode
    rng = np.random.default_rng(0)
    pool = KVPool(1, 12, bs, KV_HEADS, DIM)
    fill = rng.standard_normal((12 * bs, KV_HEADS, DIM)).astype(np.float32)
    pool.write(0, mx.arange(12 * bs), mx.array(fill), mx.array(fill * 0.5))
    tables = [[5, 2, 9], [0], [11, 3]]
    contexts = list(zip(rows, lens, tables, strict=True))
    q = mx.array(rng.standard_normal((sum(rows), HEADS, DIM)).astype(np.float32))
    sinks = mx.array(rng.standard_normal(HEADS).astype(np.float32))

    def never(*args):
        raise AssertionError("the native kernel has no sinks")

    with pytest.raises(ValueError, match="no attention sinks"):
        attend_step(q, plan_step(contexts, bs, True), pool, 0, 0.2, False, never, sinks)
    plan = plan_step(contexts, bs, False)
    assert not plan.native
    out = attend_step(q, plan, pool, 0, 0.2, False, never, sinks)
    at = 0
    for r, n, table in contexts:  # each sequence alone, its context read slot by slot
        slots = (np.asarray(table)[:, None] * bs + np.arange(bs)).reshape(-1)[:n]
        keys, values = pool.read(0, mx.array(slots))
        alone = attend(q[at:at + r], keys, values, [Span(0, r, 0, n)], 0.2, fused=False,
                       sinks=sinks)
        assert mx.array_equal(out[at:at + r], alone).item()
        at += r
