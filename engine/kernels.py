"""Kernel-path policy: how a step's linear layers run over its rows.

- "gemm": one batched call per linear layer over all of the step's rows.
- "gemv": one call per row, results concatenated (each call is a matrix-vector product).
- "auto": row-wise while the step holds at most `threshold` rows, batched above.

Rows are the step's token positions (prefill chunk rows plus decode rows), not requests: a
request joining with a 120-token prompt chunk pushes a step far past any threshold (the
mini-vllm-rs write-up; docs/background.md).
With --batch-invariant the engine uses a fourth path, "tiled": a layer with a native kernel
takes it (engine/native_ops.py: each row computed alone), and only the rest comes here, in
calls of exactly `tile` rows (see _tiled).

On Metal, MLX itself switches kernels inside one batched call (qmv below a row limit, qmm
above); forcing "gemv" there means one single-row call per row, which always takes qmv.
"""

from __future__ import annotations

import mlx.core as mx

from engine.config import DEFAULT_TILE, KernelPath


def apply_linear(fn, x: mx.array, path: str, tile: int = DEFAULT_TILE) -> mx.array:
    """Run `fn` (a linear layer) on x of shape (1, rows, features) along `path`."""
    rows = x.shape[1]
    if path == KernelPath.TILED:
        return _tiled(fn, x, tile)
    if path == KernelPath.GEMM or rows == 1:
        return fn(x)
    return mx.concatenate([fn(x[:, i:i + 1]) for i in range(rows)], axis=1)


# mlx-lm's SwitchGLU sorts a call's (row, choice) pairs by expert from this many on.
EXPERT_SORT_AT = 64


# Measured on the CPU backend (MLX 0.32, tests/engine/test_experts.py), a row's expert output
# in calls of different sizes:
# - 4-bit (gather_qmm): the same bits in every call, sorted or not.
# - float32 (gather_mm), with OpenBLAS: the same bits in every call on the same side of
#   EXPERT_SORT_AT, different bits across it: the sorted call multiplies the gathered copies
#   of the rows, the unsorted one the rows broadcast over their k choices, and OpenBLAS gives
#   the two layouts different bits. (MLX's bundled BLAS gives the same bits.)
# So "gemm" is not batch-invariant for float32 experts (a decode row alone vs in a step of
# 64 / k rows or more), and "tiled" keeps every call under EXPERT_SORT_AT choices: calls of
# min(tile, 63 // k) rows. Dense bf16/f16 experts do not run on the CPU at all: its gather_mm
# computes float32 only.
def apply_experts(fn, x: mx.array, indices: mx.array, path: str,
                  tile: int = DEFAULT_TILE) -> mx.array:
    """Run `fn` (mlx-lm's SwitchGLU-style expert block: fn(x, indices)) on x (1, rows, hidden)
    with the router's choice indices (1, rows, k) along `path`: "gemm" one gathered call for
    all rows, "gemv" one call per row, "tiled" calls of exactly `expert_tile(tile, k)` rows
    (padding rows routed to expert 0 and dropped)."""
    rows = x.shape[1]
    if path == KernelPath.GEMM or rows == 1:
        return fn(x, indices)
    if path == KernelPath.TILED:
        tile = expert_tile(tile, indices.shape[-1])
        padded = -(-rows // tile) * tile
        if padded != rows:
            x = mx.pad(x, [(0, 0), (0, padded - rows), (0, 0)])
            indices = mx.pad(indices, [(0, 0), (0, padded - rows), (0, 0)])
        outs = [fn(x[:, i:i + tile], indices[:, i:i + tile]) for i in range(0, padded, tile)]
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
        return out[:, :rows] if padded != rows else out
    return mx.concatenate([fn(x[:, i:i + 1], indices[:, i:i + 1]) for i in range(rows)], axis=1)


def expert_tile(tile: int, k: int) -> int:
    """Rows per expert call on the tiled path: at most `tile`, and fewer than EXPERT_SORT_AT
    choices (k per row) so that the call is never sorted."""
    return max(1, min(tile, (EXPERT_SORT_AT - 1) // k))


def _tiled(fn, x: mx.array, tile: int) -> mx.array:
    """Batch-invariant: the rows go through calls of exactly `tile` rows (the last one padded
    with zeros). The same shape means the same kernel, blocking and thread split, and a row's
    arithmetic does not depend on the values of the other rows, so each row gets the same bits
    whatever shares its step. (Measured with OpenBLAS: a 576->192 projection gives one row
    different bits for 1-6 rows than for 7 or more; 1536->576 for 1 row only.)"""
    rows = x.shape[1]
    padded = -(-rows // tile) * tile
    if padded != rows:
        x = mx.pad(x, [(0, 0), (0, padded - rows), (0, 0)])
    outs = [fn(x[:, i:i + tile]) for i in range(0, padded, tile)]
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
    return out[:, :rows] if padded != rows else out
