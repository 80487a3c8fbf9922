"""The Gated DeltaNet recurrence of a packed step (engine/recurrence.py): the MLX-ops path has
mlx-lm's bits; the native kernel (engine/native/gated_delta.cpp) agrees with a float64
reference and the ops path; a sequence cut into steps, a snapshot, and a sequence packed with
others give the states and outputs of the sequence computed alone."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk
from mlx_lm.models.qwen3_5 import GatedDeltaNet, TextModelArgs
from mlx_lm.models.qwen3_next import Qwen3NextGatedDeltaNet
from native_ops import native_op

from engine.recurrence import gated_delta_rows

PATHS = ["ops", "native"]


def make_layer(k_heads=2, v_heads=4, k_dim=32, v_dim=32, kernel=4, seed=0):
    """A tiny qwen3_5 GatedDeltaNet with random weights (A_log and dt_bias included)."""
    mx.random.seed(seed)
    args = TextModelArgs(model_type="qwen3_5", hidden_size=64, linear_num_key_heads=k_heads,
                         linear_num_value_heads=v_heads, linear_key_head_dim=k_dim,
                         linear_value_head_dim=v_dim, linear_conv_kernel_dim=kernel)
    layer = GatedDeltaNet(args)
    layer.dt_bias = mx.random.normal((v_heads,))
    mx.eval(layer.parameters())
    return layer


def step_inputs(layer, rows, seed):
    """Random qkv, a, b for `rows` rows (qkv at the scale of an in_proj output)."""
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((rows, layer.conv_dim)).astype(np.float32)
    a = rng.standard_normal((rows, layer.num_v_heads)).astype(np.float32)
    b = rng.standard_normal((rows, layer.num_v_heads)).astype(np.float32)
    return mx.array(qkv), mx.array(a), mx.array(b)


def pools(layer, slots=12, seed=1):
    """Pools with random states in every slot, as numpy arrays (each run copies them)."""
    rng = np.random.default_rng(seed)
    conv = rng.standard_normal((slots, layer.conv_kernel_size - 1, layer.conv_dim))
    state = 0.1 * rng.standard_normal((slots, layer.num_v_heads, layer.head_v_dim,
                                       layer.head_k_dim))
    return conv.astype(np.float32), state.astype(np.float32)


def run(path, layer, qkv, a, b, conv, state, groups, snapshots=()):
    """gated_delta_rows on fresh copies of the pools: (y, conv pool, state pool) as numpy."""
    kernel = native_op("gated_delta_rows") if path == "native" else None
    conv_pool, state_pool = mx.array(conv), mx.array(state)
    mx.eval(conv_pool, state_pool)  # the native op writes evaluated pools in place
    y, conv_pool, state_pool = gated_delta_rows(qkv, a, b, layer, conv_pool, state_pool,
                                                groups, list(snapshots), kernel=kernel)
    mx.eval(y)
    return np.array(y), np.array(conv_pool), np.array(state_pool)


# ---- mlx-lm's bits -------------------------------------------------------------------------


def mlx_lm_rows(layer, x, cache):
    """mlx-lm's y (before the gated norm) for inputs x (1, T, hidden) continuing the cache, and
    its states after them: y from mlx-lm's own pieces, the states from the module's call."""
    B, T, _ = x.shape
    qkv, a, b = layer.in_proj_qkv(x), layer.in_proj_a(x), layer.in_proj_b(x)
    conv_out = nn.silu(layer.conv1d(mx.concatenate([cache[0], qkv], axis=1)))
    q, k, v = mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1)
    q = q.reshape(B, T, layer.num_k_heads, layer.head_k_dim)
    k = k.reshape(B, T, layer.num_k_heads, layer.head_k_dim)
    v = v.reshape(B, T, layer.num_v_heads, layer.head_v_dim)
    q, k = normalize_qk(q, k, inv_scale=layer.head_k_dim**-0.5, eps=1e-6)
    y, _ = gated_delta_update(q, k, v, a, b, layer.A_log, layer.dt_bias, cache[1],
                              use_kernel=False)
    layer(x, cache=cache)
    return y[0], qkv[0], a[0], b[0]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_ops_path_has_mlx_lms_bits(dtype):
    layer = make_layer()
    layer.set_dtype(dtype)
    # Two sequences that have seen a few tokens in mlx-lm's cache: one continues with a 9-row
    # chunk, the other with one decode row, in one step.
    caches, steps, slots = [ArraysCache(2), ArraysCache(2)], [9, 1], [3, 7]
    conv_pool = mx.zeros((10, 3, layer.conv_dim), dtype=dtype)
    state_pool = mx.zeros((10, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim))
    for i, cache in enumerate(caches):
        layer(mx.random.normal((1, 5 + i, 64)).astype(dtype), cache=cache)
        conv_pool[slots[i]] = cache[0][0]
        state_pool[slots[i]] = cache[1][0]
    parts = [mlx_lm_rows(layer, mx.random.normal((1, n, 64)).astype(dtype), cache)
             for n, cache in zip(steps, caches, strict=True)]
    qkv, a, b = (mx.concatenate([p[j] for p in parts]) for j in (1, 2, 3))
    y, conv_pool, state_pool = gated_delta_rows(qkv, a, b, layer, conv_pool, state_pool,
                                                list(zip(steps, slots, strict=True)), [])
    assert y.dtype == dtype
    assert mx.array_equal(y, mx.concatenate([p[0] for p in parts])).item()
    for slot, cache in zip(slots, caches, strict=True):
        assert mx.array_equal(conv_pool[slot], cache[0][0]).item()
        assert mx.array_equal(state_pool[slot], cache[1][0]).item()


def test_a_qwen3_next_layer_leaves_mlx_lms_states():
    mx.random.seed(0)
    layer = Qwen3NextGatedDeltaNet(SimpleNamespace(
        hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, rms_norm_eps=1e-6))
    x = mx.random.normal((1, 9, 64))
    q, k, v, _, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x),
                                                          layer.in_proj_ba(x))
    qkv = mx.concatenate([t.reshape(9, -1) for t in (q, k, v)], axis=-1)  # its conv input
    cache = ArraysCache(2)
    layer(x, cache=cache)
    _, conv_pool, state_pool = gated_delta_rows(
        qkv, a[0], b[0], layer, mx.zeros((2, 3, layer.conv_dim)),
        mx.zeros((2, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim)), [(9, 1)], [])
    assert mx.array_equal(conv_pool[1], cache[0][0]).item()
    assert mx.array_equal(state_pool[1], cache[1][0]).item()


# ---- the native kernel ---------------------------------------------------------------------


def float64_reference(layer, qkv, a, b, conv, state, groups):
    """The maths in float64, group by group and row by row: y and the final states."""
    hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    w = np.array(layer.conv1d.weight, dtype=np.float64)[:, :, 0]  # (C, K)
    K = w.shape[1]
    qkv, a, b = (np.array(t, dtype=np.float64) for t in (qkv, a, b))
    conv, state = conv.astype(np.float64), state.astype(np.float64)
    A = np.exp(np.array(layer.A_log, dtype=np.float64))
    dt = np.array(layer.dt_bias, dtype=np.float64)
    ys, first = [], 0
    for n, slot in groups:
        ext = np.concatenate([conv[slot], qkv[first:first + n]])
        S = state[slot]
        for t in range(n):
            x = (w.T * ext[t:t + K]).sum(0)
            x = x / (1 + np.exp(-x))
            q, k = x[:hk * dk].reshape(hk, dk), x[hk * dk:2 * hk * dk].reshape(hk, dk)
            v = x[2 * hk * dk:].reshape(hv, dv)
            q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
            k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
            r = first + t
            beta = 1 / (1 + np.exp(-b[r]))
            g = np.exp(-A * np.log1p(np.exp(a[r] + dt)))
            y = np.empty((hv, dv))
            for h in range(hv):
                kh, qh = k[h // (hv // hk)], q[h // (hv // hk)]
                S[h] *= g[h]
                S[h] += np.outer((v[h] - S[h] @ kh) * beta[h], kh)
                y[h] = S[h] @ qh
            ys.append(y)
        conv[slot] = ext[n:]
        first += n
    return np.stack(ys), conv, state


@pytest.mark.parametrize("k_heads,v_heads,k_dim,v_dim", [(2, 4, 32, 32), (2, 2, 24, 40),
                                                        (4, 8, 64, 64)])
def test_the_native_kernel_matches_a_float64_reference_and_the_ops_path(k_heads, v_heads,
                                                                        k_dim, v_dim):
    layer = make_layer(k_heads, v_heads, k_dim, v_dim)
    groups = [(1, 4), (11, 0), (1, 9), (6, 2)]
    qkv, a, b = step_inputs(layer, 19, seed=2)
    conv, state = pools(layer)
    y, conv_out, state_out = run("native", layer, qkv, a, b, conv, state, groups)
    ref_y, ref_conv, ref_state = float64_reference(layer, qkv, a, b, conv, state, groups)
    assert np.abs(y - ref_y).max() <= 1e-5 * np.abs(ref_y).max()
    assert np.array_equal(conv_out, ref_conv.astype(np.float32))
    assert np.abs(state_out - ref_state).max() <= 1e-5 * np.abs(ref_state).max()
    ops_y, ops_conv, ops_state = run("ops", layer, qkv, a, b, conv, state, groups)
    assert np.abs(y - ops_y).max() <= 1e-5 * np.abs(ops_y).max()
    assert np.array_equal(conv_out, ops_conv)
    assert np.abs(state_out - ops_state).max() <= 1e-5 * np.abs(ops_state).max()


# ---- steps, snapshots, batch invariance (both paths) ---------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_a_sequence_in_chunks_equals_it_whole(path, chunk):
    layer = make_layer()
    qkv, a, b = step_inputs(layer, 70, seed=3)
    conv, state = pools(layer)
    whole_y, whole_conv, whole_state = run(path, layer, qkv, a, b, conv, state, [(70, 5)])
    ys = []
    for first in range(0, 70, chunk):
        n = min(chunk, 70 - first)
        rows = slice(first, first + n)
        y, conv, state = run(path, layer, qkv[rows], a[rows], b[rows], conv, state, [(n, 5)])
        ys.append(y)
    assert np.array_equal(np.concatenate(ys), whole_y)
    assert np.array_equal(conv, whole_conv)
    assert np.array_equal(state, whole_state)


@pytest.mark.parametrize("path", PATHS)
def test_a_snapshot_holds_the_states_after_its_row(path):
    layer = make_layer()
    qkv, a, b = step_inputs(layer, 26, seed=4)
    conv, state = pools(layer)
    # The 20-row sequence starts at row 6, after a decode row and a 5-row chunk.
    groups = [(1, 0), (5, 1), (20, 2)]
    rows = [0, 1, 2, 10, 19]
    snaps = [(6 + r, 6 + i) for i, r in enumerate(rows)]
    _, conv_out, state_out = run(path, layer, qkv, a, b, conv, state, groups, snaps)
    for i, r in enumerate(rows):
        part = slice(6, 6 + r + 1)
        _, conv_r, state_r = run(path, layer, qkv[part], a[part], b[part], conv, state,
                                 [(r + 1, 2)])
        assert np.array_equal(conv_out[6 + i], conv_r[2])
        assert np.array_equal(state_out[6 + i], state_r[2])
    # The snapshot of a 1-row group, too.
    _, conv_out, state_out = run(path, layer, qkv, a, b, conv, state, groups, [(0, 11)])
    assert np.array_equal(conv_out[11], conv_out[0])
    assert np.array_equal(state_out[11], state_out[0])


@pytest.mark.parametrize("path", PATHS)
def test_a_sequence_gets_the_same_bits_alone_and_packed_with_others(path):
    layer = make_layer()
    conv, state = pools(layer)
    packed = [(5, 0), (1, 1), (13, 2), (1, 3), (1, 4), (30, 5), (1, 6)]
    qkv, a, b = step_inputs(layer, sum(n for n, _ in packed), seed=5)
    y, conv_out, state_out = run(path, layer, qkv, a, b, conv, state, packed)
    first = 0
    for n, slot in packed:
        rows = slice(first, first + n)
        alone_y, alone_conv, alone_state = run(path, layer, qkv[rows], a[rows], b[rows], conv,
                                               state, [(n, slot)])
        assert np.array_equal(y[rows], alone_y)
        assert np.array_equal(conv_out[slot], alone_conv[slot])
        assert np.array_equal(state_out[slot], alone_state[slot])
        first += n
    # The slots no group names are untouched.
    assert np.array_equal(state_out[7:], state[7:])
    assert np.array_equal(conv_out[7:], conv[7:])


# ---- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("groups,snapshots,match", [
    ([(3, 1), (1, 1)], [], "named twice"),
    ([(3, 1), (1, 2)], [(0, 2)], "named twice"),
    ([(3, 1)], [], "sum to 4"),
    ([(4, 12)], [], "outside the pool"),
])
def test_bad_groups_are_refused_before_a_pool_is_written(path, groups, snapshots, match):
    layer = make_layer()
    qkv, a, b = step_inputs(layer, 4, seed=6)
    conv, state = pools(layer)
    kernel = native_op("gated_delta_rows") if path == "native" else None
    with pytest.raises(ValueError, match=match):
        gated_delta_rows(qkv, a, b, layer, mx.array(conv), mx.array(state), groups, snapshots,
                         kernel=kernel)


def test_the_native_kernel_refuses_other_dtypes():
    layer = make_layer()
    layer.set_dtype(mx.bfloat16)
    qkv, a, b = (t.astype(mx.bfloat16) for t in step_inputs(layer, 2, seed=7))
    conv, state = pools(layer)
    with pytest.raises(ValueError, match="float32"):
        gated_delta_rows(qkv, a, b, layer, mx.array(conv).astype(mx.bfloat16),
                         mx.array(state), [(2, 0)], [], kernel=native_op("gated_delta_rows"))


@pytest.mark.parametrize("groups,snapshots,lazy,match", [
    ([(3, 1), (1, 1)], [], False, "slot 1 is named twice"),
    ([(4, 1)], [(2, 2), (2, 3)], False, "snapshot row 2 is named twice"),
    ([(4, 1)], [(4, 2)], False, "snapshot row 4 is outside the step"),
    ([(2, 1), (1, 2)], [], False, "sum to qkv's rows"),
    ([(4, 1)], [], True, "must be evaluated"),
])
def test_the_native_op_itself_refuses_what_it_cannot_write(groups, snapshots, lazy, match):
    layer = make_layer()
    qkv, a, b = step_inputs(layer, 4, seed=8)
    conv, state = (mx.array(p) for p in pools(layer))
    if lazy:
        conv = conv + 0
    else:
        mx.eval(conv, state)
    with pytest.raises(ValueError, match=match):
        native_op("gated_delta_rows")(
            qkv, a, b, layer.conv1d.weight, layer.A_log, layer.dt_bias, conv, state, groups,
            snapshots, k_heads=2, v_heads=4, k_dim=32, v_dim=32)
