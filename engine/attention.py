"""Attention for a packed step: each sequence's rows attend over its own context.

Two ways, both exact per sequence (never over a padded batch: padding changes the length of
the softmax and matmul reductions, and with them the floating-point result, which would make a
request's output depend on what shares its batch):

- On the CPU backend every row goes through the native kernel (engine/native/): one op per
  layer for all of a step's sequences, decode rows and prefill chunks alike, reading keys and
  values straight from the paged pool through each block table (no gather copy) and skipping
  the causal upper triangle. A row's arithmetic depends on its own query, position and context
  alone: it gets the same bits as a decode row, as a row of a prefill chunk of any length, and
  whatever shares the step. benchmarks/attention.py measures it against the MLX-ops path and
  mlx-lm's padded fused call.
- Otherwise (other backends, the kernel not built or turned off, attention sinks) MLX ops over
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
so in float32 it differs from the MLX-ops path by ~1e-7 (tests/engine/test_attention.py). It
keeps no rows x context score tensor: a thread holds the scores of 16 rows of one head.

Attention sinks (gpt_oss): a learned logit per query head that joins each row's softmax as an
extra column and takes its share of the probability mass, with no value. The MLX-ops path puts
it first, as MLX's own fallback does (bit-identical to it, tests/engine/test_attention_sinks.py);
the fused path passes it to MLX. The native kernel has none, so such layers plan their rows on
MLX ops.
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
    if keys.dtype != q.dtype:  # a pool narrower than the model (kv_dtype): widened to q's
        keys, values = keys.astype(q.dtype), values.astype(q.dtype)
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
    """How one step's rows attend, worked out once per step and used by every layer: through
    the native kernel (`tables`, `lens`, `query_lens` for every sequence) or as MLX ops
    (`spans` over the blocks `read` gathers)."""

    spans: list[Span]
    read: mx.array | None  # block ids gathered for the spans
    tables: mx.array | None  # (seqs, max_blocks) int32
    lens: mx.array | None  # (seqs,) int32 context lengths
    query_lens: mx.array | None  # (seqs,) int32 rows per sequence
    window: int | None = None  # a sliding-window layer's W: rows see their last W positions

    @property
    def native(self) -> bool:
        return self.tables is not None


def plan_step(contexts: list[tuple[int, int, list[int]]], block_size: int,
              native: bool, window: int | None = None) -> StepAttention:
    """contexts: per sequence, in row order, (rows, context length, block table). With
    `native`, every sequence goes to the native kernel, which reads the pool through the
    tables. Otherwise each span gathers its context's blocks (with a window, only those that
    hold its rows' last `window` positions)."""
    if native:
        width = max(-(-ctx // block_size) for _, ctx, _ in contexts)
        table = np.zeros((len(contexts), width), dtype=np.int32)
        for i, (_, ctx, blocks) in enumerate(contexts):
            n_blocks = -(-ctx // block_size)
            table[i, :n_blocks] = blocks[:n_blocks]
        return StepAttention(
            spans=[], read=None, tables=mx.array(table),
            lens=mx.array(np.asarray([ctx for _, ctx, _ in contexts], dtype=np.int32)),
            query_lens=mx.array(np.asarray([rows for rows, _, _ in contexts], dtype=np.int32)),
            window=window)
    spans, read, row, ctx_at = [], [], 0, 0
    for rows, ctx, blocks in contexts:
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
    return StepAttention(spans=spans, read=mx.array(np.asarray(read, dtype=np.int64)),
                         tables=None, lens=None, query_lens=None, window=window)


def attend_step(q: mx.array, plan: StepAttention, pool: KVPool, layer: int, scale: float,
                fused: bool, kernel: Callable | None,
                sinks: mx.array | None = None) -> mx.array:
    """One layer's attention for a planned step. q: (rows, heads, dim); the pool already holds
    the step's writes for this layer; sinks: (heads,) or None. Returns (rows, heads * dim) in
    the step's row order."""
    if plan.native:
        if sinks is not None:
            raise ValueError("the native attention kernel has no attention sinks: plan with "
                             "native=False")
        return kernel(q, *pool.layer(layer), plan.tables, plan.lens, plan.query_lens, scale,
                      pool.block_size, plan.window or 0)
    keys, values = pool.read_blocks(layer, plan.read)
    return attend(q, keys, values, plan.spans, scale, fused, plan.window, sinks)
