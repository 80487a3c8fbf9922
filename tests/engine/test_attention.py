from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from native_ops import native_op

from engine.attention import Span, attend, attend_step, plan_step
from engine.kv_cache import KVPool


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


# ---- the native paged kernel (engine/native/) ----------------------------------------------

def native_kernel():
    return native_op("paged_attention")


def fragmented_pool(lens, dtype, block_size=16, kv_heads=3, dim=64, seed=0):
    """A pool with random contents and, per sequence, a block table of scattered blocks."""
    rng = np.random.default_rng(seed)
    need = sum(-(-n // block_size) for n in lens)
    num_blocks = 3 * need + 4
    pool = KVPool(1, num_blocks, block_size, kv_heads, dim)
    fill = rng.standard_normal((num_blocks * block_size, kv_heads, dim)).astype(np.float32)
    pool.write(0, mx.arange(num_blocks * block_size), mx.array(fill).astype(dtype),
               mx.array(fill * 0.5 - 0.1).astype(dtype))
    order = rng.permutation(num_blocks)  # a real pool is fragmented
    tables, at = [], 0
    for n in lens:
        nb = -(-n // block_size)
        tables.append([int(b) for b in order[at:at + nb]])
        at += nb
    return pool, tables


def table_array(tables, width=None):
    width = width or max(map(len, tables))
    out = np.zeros((len(tables), width), np.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return mx.array(out)


def numpy_reference(q, keys, values, lens, tables, scale, block_size):
    """Float64 attention over each row's slots: an independent reference for the kernel."""
    q = np.array(q.astype(mx.float32), np.float64)
    k = np.array(keys.astype(mx.float32), np.float64)
    v = np.array(values.astype(mx.float32), np.float64)
    rows, heads, dim = q.shape
    rep = heads // k.shape[0]
    out = np.zeros((rows, heads, dim))
    for r, (n, table) in enumerate(zip(lens, tables, strict=True)):
        slots = (np.array(table)[:, None] * block_size + np.arange(block_size)).reshape(-1)[:n]
        for h in range(heads):
            s = k[h // rep, slots] @ q[r, h] * scale
            p = np.exp(s - s.max())
            out[r, h] = (p / p.sum()) @ v[h // rep, slots]
    return out.reshape(rows, heads * dim)


def run_reference(q, keys, values, lens, tables, scale, block_size, rows_of, window=0):
    """Float64 attention of each sequence's rows (its last rows_of positions) over its slots:
    an independent reference for the kernel. Row i of a run at position p sees (p - window, p]
    (window 0: all of [0, p])."""
    return windowed_reference(q, keys, values, lens, tables, scale, block_size,
                              window or max(lens), rows_of)


def kernel_call(kernel, q, pool, tables, lens, rows_of, window=0, width=None):
    return kernel(q, *pool.layer(0), table_array(tables, width), mx.array(lens),
                  mx.array(rows_of), 0.125, 16, window)


@pytest.mark.parametrize("dtype,tol", [(mx.float32, 2e-6), (mx.float16, 4e-3),
                                       (mx.bfloat16, 3e-2)])
def test_native_kernel_matches_float64_attention_over_fragmented_blocks(dtype, tol):
    kernel = native_kernel()
    lens = [1, 15, 16, 17, 40, 129, 300]
    pool, tables = fragmented_pool(lens, dtype)
    q = mx.random.normal((len(lens), 9, 64), key=mx.random.key(1)).astype(dtype)
    out = kernel_call(kernel, q, pool, tables, lens, [1] * len(lens))
    assert out.shape == (len(lens), 9 * 64) and out.dtype == dtype
    ref = numpy_reference(q, *pool.layer(0), lens, tables, 0.125, 16)
    assert np.max(np.abs(np.array(out.astype(mx.float32)) - ref)) < tol


# Runs of rows (prefill chunks) with starts inside blocks and on block edges, whole prompts,
# runs longer than one 16-row tile and a 1-row run, next to decode rows.
RUNS = [(1, 40), (12, 52), (33, 33), (1, 7), (16, 80), (47, 200), (5, 5), (17, 17)]


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128),
                                                (4, 1, 80), (2, 1, 256), (6, 2, 40)])
@pytest.mark.parametrize("window", [0, 20])
def test_native_kernel_runs_of_rows_match_float64(heads, kv_heads, dim, window):
    """GQA ratios from 1 to 4 and the head dims the families use (80 and 40: not a multiple of
    the vector width), with and without a sliding window."""
    kernel = native_kernel()
    rows_of, lens = [r for r, _ in RUNS], [c for _, c in RUNS]
    pool, tables = fragmented_pool(lens, mx.float32, kv_heads=kv_heads, dim=dim, seed=11)
    q = mx.random.normal((sum(rows_of), heads, dim), key=mx.random.key(5))
    out = kernel_call(kernel, q, pool, tables, lens, rows_of, window)
    ref = run_reference(q, *pool.layer(0), lens, tables, 0.125, 16, rows_of, window)
    assert np.max(np.abs(np.array(out) - ref)) < 2e-6


@pytest.mark.parametrize("pool_dtype,tol", [(mx.float16, 4e-3), (mx.bfloat16, 3e-2)])
@pytest.mark.parametrize("dim", [64, 40])
def test_native_kernel_reads_a_narrower_pool_with_float32_queries(pool_dtype, tol, dim):
    """--kv-dtype: a float16/bfloat16 pool under a float32 model; the float64 reference reads
    the same stored (rounded) keys and values, so only the arithmetic is compared."""
    kernel = native_kernel()
    rows_of, lens = [r for r, _ in RUNS], [c for _, c in RUNS]
    pool, tables = fragmented_pool(lens, pool_dtype, dim=dim, seed=12)
    q = mx.random.normal((sum(rows_of), 9, dim), key=mx.random.key(6))
    out = kernel_call(kernel, q, pool, tables, lens, rows_of)
    assert out.dtype == mx.float32
    ref = run_reference(q, *pool.layer(0), lens, tables, 0.125, 16, rows_of)
    assert np.max(np.abs(np.array(out) - ref)) < 2e-6
    # The queries kept in float32: better than rounding them to the pool's dtype.
    rounded = kernel_call(kernel, q.astype(pool_dtype), pool, tables, lens, rows_of)
    assert np.max(np.abs(np.array(rounded.astype(mx.float32)) - ref)) < tol


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_native_kernel_is_close_to_the_mlx_ops_path(dtype):
    kernel = native_kernel()
    rows_of, lens = [r for r, _ in RUNS], [c for _, c in RUNS]
    pool, tables = fragmented_pool(lens, dtype, seed=3)
    q = mx.random.normal((sum(rows_of), 9, 64), key=mx.random.key(2)).astype(dtype)
    contexts = list(zip(rows_of, lens, tables, strict=True))
    plan_native, plan_ops = plan_step(contexts, 16, True), plan_step(contexts, 16, False)
    assert plan_native.native and not plan_ops.native

    def run(plan, k):
        return attend_step(q, plan, pool, 0, 0.125, False, k)

    a, b = run(plan_native, kernel), run(plan_ops, None)
    delta = mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item()
    # Two different computations: close (in float16 the rounding to the dtype hides most of
    # the different order of the sums)
    assert delta < (1e-6 if dtype == mx.float32 else 2e-3)


@pytest.mark.parametrize("dtype,pool_dtype,dim", [
    (mx.float32, mx.float32, 64), (mx.float32, mx.float32, 40), (mx.bfloat16, mx.bfloat16, 64),
    (mx.float32, mx.float16, 64), (mx.float32, mx.bfloat16, 40)])
@pytest.mark.parametrize("window", [0, 20])
def test_native_kernel_gives_a_row_the_same_bits_alone_and_with_any_company(dtype, pool_dtype,
                                                                            dim, window):
    """A row of a run equals the same row computed as a decode row (its context cut at its
    position), a run equals itself alone, and a wider table (a longer batch-mate) changes
    nothing: for the model's dtype, a narrower pool, and a head dim the vectors do not
    divide."""
    kernel = native_kernel()
    rows_of, lens = [r for r, _ in RUNS], [c for _, c in RUNS]
    pool, tables = fragmented_pool(lens, pool_dtype, dim=dim, seed=5)
    q = mx.random.normal((sum(rows_of), 9, dim), key=mx.random.key(3)).astype(dtype)
    together = kernel_call(kernel, q, pool, tables, lens, rows_of, window)
    row = 0
    for rows, n, table in zip(rows_of, lens, tables, strict=True):
        mine = together[row:row + rows]
        alone = kernel_call(kernel, q[row:row + rows], pool, [table], [n], [rows], window, 40)
        assert mx.array_equal(alone, mine).item()
        for i in range(rows):
            decoded = kernel_call(kernel, q[row + i:row + i + 1], pool, [table],
                                  [n - rows + i + 1], [1], window)
            assert mx.array_equal(decoded, mine[i:i + 1]).item(), (rows, n, i)
        row += rows
    # The check can fail: a row attended over one position fewer has other bits.
    short = kernel_call(kernel, q[0:1], pool, [tables[0]], [lens[0] - 1], [1], window)
    assert not mx.array_equal(short, together[0:1]).item()


@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (10, 2), (4, 4)])
def test_native_kernel_long_rows_have_the_bits_of_decode_rows(window, heads, kv_heads):
    """Rows of long runs, whose windows start at every offset within a block: the softmax's sum
    (16 partial sums, then a tree) is the decode row's, whatever key the tile counts from; and
    a decode row's scores, taken for up to 3 query heads of a kv head at once, are each head's
    own (GQA ratios 1, 3, 4 and 5)."""
    kernel = native_kernel()
    rows_of, lens = [37, 16], [700, 333]
    pool, tables = fragmented_pool(lens, mx.float32, kv_heads=kv_heads, seed=9)
    q = mx.random.normal((sum(rows_of), heads, 64), key=mx.random.key(8))
    together = kernel_call(kernel, q, pool, tables, lens, rows_of, window)
    row = 0
    for rows, n, table in zip(rows_of, lens, tables, strict=True):
        for i in range(rows):
            decoded = kernel_call(kernel, q[row + i:row + i + 1], pool, [table],
                                  [n - rows + i + 1], [1], window)
            assert mx.array_equal(decoded, together[row + i:row + i + 1]).item(), (n, i)
        row += rows


def test_native_kernel_refuses_bad_tables_and_shapes_with_errors():
    kernel = native_kernel()
    pool, tables = fragmented_pool([20], mx.float32)
    k, v = pool.layer(0)
    q = mx.zeros((1, 9, 64))
    one = mx.array([1])

    def call(q, table, lens, qlens, k=k, v=v):
        return kernel(q, k, v, table, mx.array(lens), mx.array(qlens), 0.1, 16)

    with pytest.raises(RuntimeError, match="block id is out of range"):
        mx.eval(call(q, mx.array([[0, 10**6]], dtype=mx.int32), [20], [1]))
    with pytest.raises(RuntimeError, match="context length is out of range"):
        mx.eval(call(q, table_array(tables), [0], [1]))
    with pytest.raises(RuntimeError, match="query length is out of range"):
        mx.eval(call(mx.zeros((21, 9, 64)), table_array(tables), [20], [21]))
    with pytest.raises(RuntimeError, match="add up to q's rows"):
        mx.eval(call(mx.zeros((3, 9, 64)), table_array(tables), [20], [2]))
    with pytest.raises(ValueError, match="block_tables must be"):
        kernel(q, k, v, table_array(tables + tables), mx.array([20]), one, 0.1, 16)
    with pytest.raises(ValueError, match="one dtype"):
        call(q.astype(mx.float16), table_array(tables), [20], [1])
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        call(q, table_array(tables), [20], [1], k.astype(mx.int32), v.astype(mx.int32))


def test_attention_setting_is_checked():
    from engine.config import EngineConfig
    from engine.native_ops import attention_kernel

    with pytest.raises(ValueError, match="attention must be one of"):
        EngineConfig(attention="fast")
    assert attention_kernel("mlx", fused=False) is None
    assert attention_kernel("auto", fused=True) is None  # GPU: MLX's fused attention
    with pytest.raises(ValueError, match="CPU backend only"):
        attention_kernel("native", fused=True)


def test_one_rope_call_over_queries_and_keys_equals_two():
    """model_runner rotates q and k in one call; RoPE must treat each head alone for that."""
    from engine.testing import tiny_model

    rope = tiny_model(quantize=False).model.model.layers[0].self_attn.rope
    mx.random.seed(3)
    q, k = mx.random.normal((5, 4, 16)), mx.random.normal((5, 2, 16))
    pos = mx.array([0, 3, 17, 100, 511], dtype=mx.int32)
    both = rope(mx.concatenate([q, k], axis=1)[:, :, None, :], offset=pos)[:, :, 0, :]
    assert mx.array_equal(both[:, :4], rope(q[:, :, None, :], offset=pos)[:, :, 0, :]).item()
    assert mx.array_equal(both[:, 4:], rope(k[:, :, None, :], offset=pos)[:, :, 0, :]).item()


# ---- sliding windows ---------------------------------------------------------------------

def windowed_reference(q, keys, values, lens, tables, scale, block_size, window, rows_of):
    """Float64: each row at position p sees the slots of positions (p - window, p]."""
    q = np.array(q.astype(mx.float32), np.float64)
    k = np.array(keys.astype(mx.float32), np.float64)
    v = np.array(values.astype(mx.float32), np.float64)
    heads, dim = q.shape[1:]
    rep = heads // k.shape[0]
    out, r = np.zeros(q.shape), 0
    for n, table, rows in zip(lens, tables, rows_of, strict=True):
        slots = (np.array(table)[:, None] * block_size + np.arange(block_size)).reshape(-1)
        for i in range(rows):
            p = n - rows + i
            seen = slots[max(0, p - window + 1):p + 1]
            for h in range(heads):
                s = k[h // rep, seen] @ q[r, h] * scale
                e = np.exp(s - s.max())
                out[r, h] = (e / e.sum()) @ v[h // rep, seen]
            r += 1
    return out.reshape(q.shape[0], heads * dim)


@pytest.mark.parametrize("native", [True, False])
def test_sliding_window_rows_see_only_their_last_window_positions(native):
    """Decode rows (native kernel or MLX ops) and prefill chunks starting anywhere in a block,
    with contexts shorter and longer than the window, against float64."""
    kernel = native_kernel() if native else None
    window = 20
    lens, rows_of = [1, 19, 20, 21, 53, 130, 40, 77], [1, 1, 1, 1, 1, 1, 13, 30]
    pool, tables = fragmented_pool(lens, mx.float32, seed=5)
    q = mx.random.normal((sum(rows_of), 9, 64), key=mx.random.key(4))
    contexts = list(zip(rows_of, lens, tables, strict=True))
    plan, unwindowed = plan_step(contexts, 16, native, window), plan_step(contexts, 16, native)
    assert plan.native == native
    if not native:  # the spans gather only the blocks their windows reach
        assert plan.read.size < unwindowed.read.size
    out = attend_step(q, plan, pool, 0, 0.125, False, kernel)
    ref = windowed_reference(q, *pool.layer(0), lens, tables, 0.125, 16, window, rows_of)
    assert np.max(np.abs(np.array(out) - ref)) < 2e-6
    # Without the window the long contexts' rows differ: the check can fail.
    full = attend_step(q, unwindowed, pool, 0, 0.125, False, kernel)
    assert np.max(np.abs(np.array(full) - ref)) > 1e-2
