"""Attention for a packed step: each sequence's rows attend over its own gathered context.

On the CPU backend MLX's fused scaled_dot_product_attention falls back to a composition of
matmul + softmax; writing that composition here over the head-major paged pool is bit-identical
(tests/engine/test_attention.py). The query transform and the output layout are done once for
the whole step, and one `split` per operand cuts every sequence's queries, keys and values out
as views, so each sequence and layer costs three ops (matmul, softmax, matmul). On the CPU
backend each MLX op has a fixed dispatch cost that, at 16 sequences x 30 layers, is a visible
part of a decode step: benchmarks/attention.py measures this path against a padded batch. On
Metal and CUDA the fused kernel is the fast path and is used per sequence.

Attention is computed per sequence, never over a padded batch: padding changes the length of
the softmax and matmul reductions, and with them the floating-point result
(benchmarks/attention.py reports the difference), which would make a request's output depend on
what shares its batch.
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
        for s, qs, ks, vs in zip(spans, _cut(q, spans, 0, "row"), _cut(keys, spans, 1, "ctx"),
                                 _cut(values, spans, 1, "ctx"), strict=True):
            o = mx.fast.scaled_dot_product_attention(
                qs.transpose(1, 0, 2)[None], ks[None], vs[None], scale=scale,
                mask="causal" if s.rows > 1 else None)
            outs.append(o[0].transpose(1, 0, 2).reshape(s.rows, heads * dim))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

    rep = heads // kv_heads
    # The layout of MLX's own fallback: grouped heads kept apart, (kv, rep, rows, dim).
    qg = (q * scale).reshape(rows, kv_heads, rep, dim).transpose(1, 2, 0, 3)
    keys_t = keys.swapaxes(-1, -2)[:, None]  # (kv, 1, dim, total_ctx)
    values = values[:, None]  # (kv, 1, total_ctx, dim)
    outs = []
    for s, qs, ks, vs in zip(spans, _cut(qg, spans, 2, "row"), _cut(keys_t, spans, 3, "ctx"),
                             _cut(values, spans, 2, "ctx"), strict=True):
        scores = qs @ ks
        if s.rows > 1:
            causal = (mx.arange(s.ctx_len - s.rows, s.ctx_len)[:, None]
                      >= mx.arange(s.ctx_len)[None])
            scores = mx.where(causal, scores, mx.finfo(scores.dtype).min)
        probs = mx.softmax(scores, axis=-1, precise=True)
        outs.append(probs @ vs)  # (kv, rep, rows, dim)
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    return o.transpose(2, 0, 1, 3).reshape(rows, heads * dim)


def _cut(x: mx.array, spans: list[Span], axis: int, kind: str) -> list[mx.array]:
    """Each span's rows (kind "row") or context (kind "ctx") of x along axis, as views.

    One `split` op for all spans instead of a slice op each. A context may be followed by
    padding (the pool is gathered by whole blocks): its piece is then trimmed to ctx_len."""
    if kind == "row":
        starts, lengths = [s.row for s in spans], [s.rows for s in spans]
    else:
        starts, lengths = [s.ctx for s in spans], [s.ctx_len for s in spans]
    pieces = mx.split(x, starts[1:], axis=axis) if len(spans) > 1 else [x]
    ends = starts[1:] + [x.shape[axis]]
    out = []
    for piece, start, length, end in zip(pieces, starts, lengths, ends, strict=True):
        if end - start != length:
            index = [slice(None)] * x.ndim
            index[axis] = slice(0, length)
            piece = piece[tuple(index)]
        out.append(piece)
    return out
