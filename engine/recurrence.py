"""The Gated DeltaNet recurrence (Qwen3.5 / Qwen3-Next linear-attention layers) on a step's packed
rows: the depthwise conv, q/k normalization, gates and the delta-rule state update of every
sequence in the step, each reading and writing its own slot of the layer's state pool.

Two implementations of one call: MLX ops (mlx-lm's formulas, op for op; what Metal and CUDA
run, and every dtype) and the native CPU kernel (engine/native/gated_delta.h, float32). A row's
result depends only on its own sequence's rows and state, never on what else shares the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import normalize_qk

Group = tuple[int, int]  # (number of rows, slot)
Snapshot = tuple[int, int]  # (global row, slot)


def gated_delta_rows(qkv: mx.array, a: mx.array, b: mx.array, layer: nn.Module,
                     conv_pool: mx.array, state_pool: mx.array, groups: Sequence[Group],
                     snapshots: Sequence[Snapshot], kernel: Callable | None = None,
                     ) -> tuple[mx.array, mx.array, mx.array]:
    """A GDN layer's recurrence for a step's rows, before its gated RMSNorm.

    qkv: (rows, conv_dim), the in_proj output before the conv, [q | k | v] as mlx-lm's conv
    input; a, b: (rows, Hv); layer: mlx-lm's GatedDeltaNet (qwen3_5 or qwen3_next);
    conv_pool: (slots, K - 1, conv_dim) in qkv's dtype; state_pool: (slots, Hv, Dv, Dk) float32.
    groups: (num_rows, slot) per sequence, in row order: its states are read from the slot and
    the final ones written back. snapshots: (global_row, slot): the row's group's states after
    that row are also written to that slot (never a group's slot).
    kernel: the native op (float32 only) or None for MLX ops.

    Returns (y (rows, Hv, Dv) in qkv's dtype, conv_pool, state_pool). MLX ops return new pools
    (a scatter); the native op writes the given pools in place when y is evaluated, and returns
    them: evaluate y before reading the pools.
    """
    _check(qkv, a, b, layer, conv_pool, state_pool, groups, snapshots)
    if kernel is not None:
        if qkv.dtype != mx.float32:
            raise ValueError(f"gated_delta_rows: the native kernel takes float32, not {qkv.dtype}")
        y = kernel(qkv, a, b, layer.conv1d.weight, layer.A_log, layer.dt_bias, conv_pool,
                   state_pool, list(groups), list(snapshots), k_heads=layer.num_k_heads,
                   v_heads=layer.num_v_heads, k_dim=layer.head_k_dim, v_dim=layer.head_v_dim)
        return y, conv_pool, state_pool
    return _ops_rows(qkv, a, b, layer, conv_pool, state_pool, groups, snapshots)


def _check(qkv, a, b, layer, conv_pool, state_pool, groups, snapshots) -> None:
    """Refuse a call whose shapes or groups the recurrence cannot take, naming what is wrong."""
    hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    conv_dim, keep = 2 * hk * dk + hv * dv, layer.conv_kernel_size - 1
    rows = qkv.shape[0]
    if rows < 1:
        raise ValueError("gated_delta_rows: a step has at least one row")
    if qkv.shape != (rows, conv_dim):
        raise ValueError(f"gated_delta_rows: qkv {qkv.shape} must be (rows, {conv_dim})")
    if a.shape != (rows, hv) or b.shape != (rows, hv):
        raise ValueError(f"gated_delta_rows: a {a.shape} and b {b.shape} must be ({rows}, {hv})")
    if conv_pool.ndim != 3 or conv_pool.shape[1:] != (keep, conv_dim):
        raise ValueError(f"gated_delta_rows: conv_pool {conv_pool.shape} must be "
                         f"(slots, {keep}, {conv_dim})")
    if conv_pool.dtype != qkv.dtype:
        raise ValueError(f"gated_delta_rows: conv_pool is {conv_pool.dtype}, qkv {qkv.dtype}")
    if (state_pool.shape != (conv_pool.shape[0], hv, dv, dk)
            or state_pool.dtype != mx.float32):
        raise ValueError(f"gated_delta_rows: state_pool {state_pool.shape} {state_pool.dtype} "
                         f"must be float32 ({conv_pool.shape[0]}, {hv}, {dv}, {dk})")
    slots = conv_pool.shape[0]
    if any(n < 1 for n, _ in groups) or sum(n for n, _ in groups) != rows:
        raise ValueError(f"gated_delta_rows: groups' row counts must be >= 1 and sum to {rows}")
    group_slots = [s for _, s in groups]
    snap_slots = [s for _, s in snapshots]
    if any(not 0 <= s < slots for s in group_slots + snap_slots):
        raise ValueError(f"gated_delta_rows: a slot is outside the pool's {slots}")
    if len(set(group_slots + snap_slots)) != len(group_slots) + len(snap_slots):
        raise ValueError("gated_delta_rows: a slot is named twice (groups and snapshots each "
                         "need their own)")
    if any(not 0 <= r < rows for r, _ in snapshots):
        raise ValueError(f"gated_delta_rows: a snapshot row is outside the step's {rows}")


def _silu(x: mx.array) -> mx.array:
    """mlx.nn.silu's formula, uncompiled (mlx.nn's is mx.compile'd: see
    engine.models.base.gelu_approx)."""
    return x * mx.sigmoid(x)


def _gates(a: mx.array, b: mx.array, layer: nn.Module) -> tuple[mx.array, mx.array]:
    """(beta, g) of every row: mlx-lm's sigmoid(b) and compute_g, uncompiled."""
    g = mx.exp(-mx.exp(layer.A_log.astype(mx.float32)) * mx.logaddexp(a + layer.dt_bias, 0))
    return mx.sigmoid(b), g


def _step(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
          state: mx.array) -> tuple[mx.array, mx.array]:
    """One row of each of a batch of sequences: mlx-lm's _gated_delta_step_ops (scalar gate, no
    mask), uncompiled. q, k: (B, Hv, Dk); v: (B, Hv, Dv); g, beta: (B, Hv);
    state: (B, Hv, Dv, Dk)."""
    state = state * g[..., None, None]
    kv_mem = (state * k[..., None, :]).sum(axis=-1)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)
    return y.astype(q.dtype), state


def _ops_rows(qkv, a, b, layer, conv_pool, state_pool, groups, snapshots):
    hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    keep = layer.conv_kernel_size - 1
    weight = layer.conv1d.weight
    conv_dim = weight.shape[0]

    def conv(inputs: mx.array) -> mx.array:  # (B, T + keep, C) -> (B, T, C), as nn.Conv1d
        return _silu(mx.conv1d(inputs, weight, groups=conv_dim))

    def heads(x: mx.array) -> tuple[mx.array, mx.array, mx.array]:  # (..., C) -> q, k, v
        q, k, v = mx.split(x, [hk * dk, 2 * hk * dk], axis=-1)
        q, k = normalize_qk(q.reshape(*q.shape[:-1], hk, dk), k.reshape(*k.shape[:-1], hk, dk),
                            inv_scale=dk**-0.5, eps=1e-6)
        if hv > hk:  # each key head serves Hv / Hk value heads, as gated_delta_ops repeats them
            q, k = mx.repeat(q, hv // hk, -2), mx.repeat(k, hv // hk, -2)
        return q, k, v.reshape(*v.shape[:-1], hv, dv)

    beta, g = _gates(a, b, layer)
    # Read the groups' states first, evaluated: the writes at the end are then the pools'
    # only users, and MLX updates them in place instead of copying every slot each layer.
    at = mx.array([slot for _, slot in groups])
    conv_in, state_in = conv_pool[at], state_pool[at]
    mx.eval(conv_in, state_in)
    snap_at = {r: s for r, s in snapshots}
    ys: list[tuple[int, mx.array]] = []  # (first row, y of those rows)
    write_slots: list[int] = []
    windows: list[mx.array] = []  # conv windows, (K - 1, C) each
    states: list[mx.array] = []  # recurrent states, (Hv, Dv, Dk) each

    starts, first = [], 0
    for n, _ in groups:
        starts.append(first)
        first += n
    decode = [j for j, (n, _) in enumerate(groups) if n == 1]
    if decode:
        # The 1-row groups as one batch: each batch row's arithmetic is its own.
        rows, which = mx.array([starts[j] for j in decode]), mx.array(decode)
        inputs = mx.concatenate([conv_in[which], qkv[rows][:, None]], axis=1)
        q, k, v = heads(conv(inputs)[:, 0])
        y, state = _step(q, k, v, g[rows], beta[rows], state_in[which])
        for i, j in enumerate(decode):
            ys.append((starts[j], y[i][None]))
            for slot in [groups[j][1]] + ([snap_at[starts[j]]] if starts[j] in snap_at else []):
                write_slots.append(slot)
                windows.append(inputs[i, 1:])
                states.append(state[i])
    for j, (n, slot) in enumerate(groups):
        if n == 1:
            continue
        r0 = starts[j]
        inputs = mx.concatenate([conv_in[j], qkv[r0:r0 + n]], axis=0)
        q, k, v = heads(conv(inputs[None])[0])
        state = state_in[j][None]
        rows_y = []
        for t in range(n):
            y, state = _step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[r0 + t:r0 + t + 1],
                             beta[r0 + t:r0 + t + 1], state)
            rows_y.append(y)
            if r0 + t in snap_at:
                write_slots.append(snap_at[r0 + t])
                windows.append(inputs[t + 1:t + 1 + keep])
                states.append(state[0])
        ys.append((r0, mx.concatenate(rows_y, axis=0)))
        write_slots.append(slot)
        windows.append(inputs[n:])
        states.append(state[0])

    ys.sort(key=lambda item: item[0])
    y = mx.concatenate([part for _, part in ys], axis=0) if len(ys) > 1 else ys[0][1]
    index = mx.array(write_slots)[:, None, None]
    conv_pool = mx.put_along_axis(conv_pool, index, mx.stack(windows), axis=0)
    state_pool = mx.put_along_axis(state_pool, index[..., None], mx.stack(states), axis=0)
    return y, conv_pool, state_pool
