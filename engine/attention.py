"""Attention for a packed step: each sequence's rows attend over its own context.

Two ways, both exact per sequence (never over a padded batch: padding changes the length of
the softmax and matmul reductions, and with them the floating-point result, which would make a
request's output depend on what shares its batch):

- Decode rows on the CPU backend go through the native kernel (engine/native/): one op per
  layer reads every row's keys and values straight from the paged pool through its block
  table, with arithmetic that depends on the row alone. benchmarks/attention.py measures it
  against the MLX-ops path and mlx-lm's padded fused call.
- Everything else (prefill chunks, other backends, or the kernel not built) uses MLX ops over
  contexts gathered by block. On the CPU backend MLX's fused scaled_dot_product_attention falls
  back to a composition of matmul + softmax; writing that composition here over the head-major
  pool is bit-identical to it (tests/engine/test_attention.py), at three ops per sequence and
  layer, each with a fixed dispatch cost. On Metal and CUDA the fused kernel is used per
  sequence.

A sliding-window layer (window W) attends only to each row's last W positions: its spans
gather only the blocks that hold them, a mask hides the rest of the first block, and the native
kernel starts W positions back. This is mlx-lm's own rule (create_causal_mask's window_size):
a row at position p sees keys (p - W, p].

The native kernel rounds where MLX's ops round for float16/bfloat16 but sums in its own order,
so in float32 it differs from the MLX-ops path by ~1e-7 (tests/engine/test_attention.py).

Attention sinks (gpt_oss): a learned logit per query head that joins each row's softmax as an
extra column and takes its share of the probability mass, with no value. The MLX-ops path puts
it first, as MLX's own fallback does (bit-identical to it, tests/engine/test_attention_sinks.py);
the fused path passes it to MLX. The native kernel has none, so such layers plan their decode
rows on MLX ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.kv_cache import KVPool


def use_fused_attention() -> bool:
    return mx.default_device() != mx.cpu


@dataclass(frozen=True)
class Span:
    """One sequence in a step: rows [row, row + rows) of q, context [ctx, ctx + ctx_len)."""

    row: int
    rows: int
    ctx: int
    ctx_len: int


def _mask(s: Span, window: int | None) -> mx.array | None:
    """Which context positions each of the span's rows sees (None: all of them)."""
    if s.rows == 1 and not (window and s.ctx_len > window):
        return None
    query_pos = mx.arange(s.ctx_len - s.rows, s.ctx_len)[:, None]
    key_pos = mx.arange(s.ctx_len)[None]
    mask = query_pos >= key_pos
    if window:
        mask = mask & (query_pos - key_pos < window)
    return mask


def attend(q: mx.array, keys: mx.array, values: mx.array, spans: list[Span], scale: float,
           fused: bool, window: int | None = None, sinks: mx.array | None = None) -> mx.array:
    """q: (rows, heads, dim); keys, values: (kv_heads, total_ctx, dim), the contexts of all
    spans one after another. Each span's rows are its last positions: row i of a span sees
    context positions up to ctx_len - rows + i (causal), and with a window only the last
    `window` of those. sinks: (heads,) logits added to each row's softmax. Returns (rows,
    heads * dim)."""
    rows, heads, dim = q.shape
    kv_heads = keys.shape[0]
    if fused:
        outs = []
        for s, qs, ks, vs in zip(spans, _cut(q, spans, 0, "row"), _cut(keys, spans, 1, "ctx"),
                                 _cut(values, spans, 1, "ctx"), strict=True):
            mask = _mask(s, window)
            if mask is not None and not window:
                mask = "causal"
            o = mx.fast.scaled_dot_product_attention(
                qs.transpose(1, 0, 2)[None], ks[None], vs[None], scale=scale, mask=mask,
                sinks=sinks)
            outs.append(o[0].transpose(1, 0, 2).reshape(s.rows, heads * dim))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

    rep = heads // kv_heads
    # The layout of MLX's own fallback: grouped heads kept apart, (kv, rep, rows, dim).
    qg = (q * scale).reshape(rows, kv_heads, rep, dim).transpose(1, 2, 0, 3)
    keys_t = keys.swapaxes(-1, -2)[:, None]  # (kv, 1, dim, total_ctx)
    values = values[:, None]  # (kv, 1, total_ctx, dim)
    if sinks is not None:  # cast as MLX's fallback does, to the type of q, k and v
        sinks = sinks.astype(mx.result_type(q, keys, values)).reshape(kv_heads, rep, 1, 1)
    outs = []
    for s, qs, ks, vs in zip(spans, _cut(qg, spans, 2, "row"), _cut(keys_t, spans, 3, "ctx"),
                             _cut(values, spans, 2, "ctx"), strict=True):
        scores = qs @ ks
        mask = _mask(s, window)
        if mask is not None:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        if sinks is not None:
            # The sink is the softmax's first column (its place in MLX's fallback, which
            # fixes the order of the sum), then dropped: it has no value.
            column = mx.broadcast_to(sinks, (*scores.shape[:-1], 1))
            scores = mx.concatenate([column, scores], axis=-1)
        probs = mx.softmax(scores, axis=-1, precise=True)
        if sinks is not None:
            probs = probs[..., 1:]
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


@dataclass
class StepAttention:
    """How one step's rows attend, worked out once per step and used by every layer.

    Rows [0, native_rows) of the reordered q go through the native kernel; the rest are
    `spans` over the blocks `read` gathers. `order` reorders q so (None: already in order),
    `inverse` puts the output rows back."""

    spans: list[Span]
    read: mx.array | None  # block ids gathered for the spans
    native_rows: int
    tables: mx.array | None  # (native_rows, max_blocks) int32
    lens: mx.array | None  # (native_rows,) int32
    order: mx.array | None
    inverse: mx.array | None
    window: int | None = None  # a sliding-window layer's W: rows see their last W positions


def plan_step(contexts: list[tuple[int, int, list[int]]], block_size: int,
              native: bool, window: int | None = None) -> StepAttention:
    """contexts: per sequence, in row order, (rows, context length, block table). With
    `native`, single-row (decode) sequences go to the native kernel. With a window, each span
    gathers only the blocks that hold its rows' last `window` positions."""
    to_native = [native and rows == 1 for rows, _, _ in contexts]
    starts = np.cumsum([0] + [rows for rows, _, _ in contexts])
    order = ([int(starts[i]) for i, n in enumerate(to_native) if n]
             + [r for i, n in enumerate(to_native) if not n
                for r in range(starts[i], starts[i + 1])])
    tables = lens = None
    natives = [c for c, n in zip(contexts, to_native, strict=True) if n]
    if natives:
        width = max(-(-ctx // block_size) for _, ctx, _ in natives)
        table = np.zeros((len(natives), width), dtype=np.int32)
        for i, (_, ctx, blocks) in enumerate(natives):
            n_blocks = -(-ctx // block_size)
            table[i, :n_blocks] = blocks[:n_blocks]
        tables = mx.array(table)
        lens = mx.array(np.asarray([ctx for _, ctx, _ in natives], dtype=np.int32))
    spans, read, row, ctx_at = [], [], len(natives), 0
    for (rows, ctx, blocks), n in zip(contexts, to_native, strict=True):
        if n:
            continue
        # Contexts are gathered by whole blocks (cheaper than slot by slot); each starts at a
        # block boundary of the gathered array and its span ignores the tail padding.
        n_blocks = -(-ctx // block_size)
        first = 0
        if window:  # the first position the span's first row sees
            first = max(0, ctx - rows - window + 1) // block_size
        read.extend(blocks[first:n_blocks])
        spans.append(Span(row, rows, ctx_at, ctx - first * block_size))
        row += rows
        ctx_at += (n_blocks - first) * block_size
    identity = order == list(range(len(order)))
    return StepAttention(
        spans=spans, read=mx.array(np.asarray(read, dtype=np.int64)) if read else None,
        native_rows=len(natives), tables=tables, lens=lens,
        order=None if identity else mx.array(order),
        inverse=None if identity else mx.array(np.argsort(order)), window=window)


def attend_step(q: mx.array, plan: StepAttention, pool: KVPool, layer: int, scale: float,
                fused: bool, kernel: Callable | None,
                sinks: mx.array | None = None) -> mx.array:
    """One layer's attention for a planned step. q: (rows, heads, dim); the pool already holds
    the step's writes for this layer; sinks: (heads,) or None. Returns (rows, heads * dim) in
    the step's row order."""
    if sinks is not None and plan.native_rows:
        raise ValueError("the native decode kernel has no attention sinks: plan with "
                         "native=False")
    if plan.order is not None:
        q = q[plan.order]
    outs = []
    if plan.native_rows:
        outs.append(kernel(q[:plan.native_rows], *pool.layer(layer), plan.tables, plan.lens,
                           scale, pool.block_size, plan.window or 0))
    if plan.spans:
        keys, values = pool.read_blocks(layer, plan.read)
        rest = q[plan.native_rows:] if plan.native_rows else q
        spans = [Span(s.row - plan.native_rows, s.rows, s.ctx, s.ctx_len) for s in plan.spans]
        outs.append(attend(rest, keys, values, spans, scale, fused, plan.window, sinks))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    return out if plan.inverse is None else out[plan.inverse]
