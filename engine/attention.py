"""Attention for a packed step: each sequence's rows attend over its own gathered context.

On the CPU backend MLX's fused scaled_dot_product_attention falls back to a composition of
matmul + softmax; writing that composition here over the head-major paged pool is bit-identical
(tests/engine/test_attention.py), and it was faster in an ad-hoc timing (no benchmark in the
repo isolates attention yet; benchmarks/engine_batching.py measures whole steps): the query
transform and the output layout are done once for the whole step, leaving six small ops per
sequence and layer (MLX costs ~4 us per op on CPU, so at 16 sequences x 30 layers the op count
matters). On Metal and CUDA the fused kernel
is the fast path and is used per sequence.

Attention is computed per sequence, never over a padded batch: padding changes the length of
the softmax and matmul reductions, and with them the floating-point result (seen in an ad-hoc
check: up to 5e-7 in float32), which would make a request's output depend on what shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


def use_fused_attention() -> bool:
    return mx.default_device() != mx.cpu


@dataclass(frozen=True)
class Span:
    """One sequence in a step: rows [row, row + rows) of q, context [ctx, ctx + ctx_len)."""

    row: int
    rows: int
    ctx: int
    ctx_len: int


def attend(q: mx.array, keys: mx.array, values: mx.array, spans: list[Span], scale: float,
           fused: bool) -> mx.array:
    """q: (rows, heads, dim); keys, values: (kv_heads, total_ctx, dim), the contexts of all
    spans one after another. Each span's rows are its last positions: row i of a span sees
    context positions up to ctx_len - rows + i (causal). Returns (rows, heads * dim)."""
    rows, heads, dim = q.shape
    kv_heads = keys.shape[0]
    if fused:
        outs = []
        for s in spans:
            o = mx.fast.scaled_dot_product_attention(
                q[s.row:s.row + s.rows].transpose(1, 0, 2)[None],
                keys[None, :, s.ctx:s.ctx + s.ctx_len], values[None, :, s.ctx:s.ctx + s.ctx_len],
                scale=scale, mask="causal" if s.rows > 1 else None)
            outs.append(o[0].transpose(1, 0, 2).reshape(s.rows, heads * dim))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

    rep = heads // kv_heads
    # The layout of MLX's own fallback: grouped heads kept apart, (kv, rep, rows, dim).
    qg = (q * scale).reshape(rows, kv_heads, rep, dim).transpose(1, 2, 0, 3)
    keys_t = keys.swapaxes(-1, -2)[:, None]  # (kv, 1, dim, total_ctx)
    values = values[:, None]  # (kv, 1, total_ctx, dim)
    outs = []
    for s in spans:
        scores = qg[:, :, s.row:s.row + s.rows] @ keys_t[..., s.ctx:s.ctx + s.ctx_len]
        if s.rows > 1:
            causal = (mx.arange(s.ctx_len - s.rows, s.ctx_len)[:, None]
                      >= mx.arange(s.ctx_len)[None])
            scores = mx.where(causal, scores, mx.finfo(scores.dtype).min)
        probs = mx.softmax(scores, axis=-1, precise=True)
        outs.append(probs @ values[:, :, s.ctx:s.ctx + s.ctx_len])  # (kv, rep, rows, dim)
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    return o.transpose(2, 0, 1, 3).reshape(rows, heads * dim)
