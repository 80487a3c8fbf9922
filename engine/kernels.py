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

What a step records is the path its calls took (PathTally): "native" where every matmul call
of the step ran on a native row kernel (engine/native_ops.py: each row computed alone, in an
order set by the weights' shape only), else the policy's path, which at least one call took
through MLX or the BLAS.

On Metal, MLX itself switches kernels inside one batched call (qmv below a row limit, qmm
above); forcing "gemv" there means one single-row call per row, which always takes qmv.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from engine.config import DEFAULT_TILE, KernelPath


class PathTaken(NamedTuple):
    """What a step records of its matmul calls (StepRecord.kernel_path and
    linear_calls_per_layer)."""

    path: KernelPath
    calls_per_layer: int  # the most calls one linear layer (or expert block) made on `path`


class PathTally:
    """The paths a step's matmul calls took: every linear layer, the head, routed experts and
    fused decoder layers report theirs as they are built (engine/step.py). The step is
    `native` only where every call ran on a native row kernel, so a row's bits depend on
    nothing else in the step; one call through MLX or the BLAS, whose rows share its blocking,
    and it is recorded along the policy's path (`planned`). A step with no call (a failed one)
    records the planned path and the calls it would have made."""

    def __init__(self, planned: KernelPath, rows: int, tile: int = DEFAULT_TILE):
        self.planned, self.rows, self.tile = KernelPath(planned), rows, tile
        self._calls: dict[KernelPath, int] = {}

    def took(self, path: KernelPath, calls: int) -> None:
        """A layer made `calls` calls along `path` (KernelPath.NATIVE: the native kernels)."""
        self._calls[path] = max(self._calls.get(path, 0), calls)

    def taken(self) -> PathTaken:
        if self._calls.keys() == {KernelPath.NATIVE}:
            return PathTaken(KernelPath.NATIVE, self._calls[KernelPath.NATIVE])
        planned = self.planned
        return PathTaken(planned, self._calls.get(planned) or _calls(planned, self.rows,
                                                                     self.tile))


def _calls(path: KernelPath, rows: int, tile: int) -> int:
    """Calls one linear layer makes along an MLX path over this many rows."""
    if path == KernelPath.TILED:
        return -(-rows // tile)
    return 1 if path == KernelPath.GEMM else rows


def apply_linear(fn, x: mx.array, path: str, tile: int = DEFAULT_TILE,
                 tally: PathTally | None = None) -> mx.array:
    """Run `fn` (a linear layer) on x of shape (1, rows, features) along `path`; `tally`: the
    step's record of the paths its calls take."""
    rows = x.shape[1]
    if tally is not None:
        tally.took(KernelPath(path), _calls(KernelPath(path), rows, tile))
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
                  tile: int = DEFAULT_TILE, tally: PathTally | None = None) -> mx.array:
    """Run `fn` (mlx-lm's SwitchGLU-style expert block: fn(x, indices)) on x (1, rows, hidden)
    with the router's choice indices (1, rows, k) along `path`: "gemm" one gathered call for
    all rows, "gemv" one call per row, "tiled" calls of exactly `expert_tile(tile, k)` rows
    (padding rows routed to expert 0 and dropped). These are MLX's gather calls: a step with
    experts never records `native`."""
    rows = x.shape[1]
    if tally is not None:
        path = KernelPath(path)
        tally.took(path, _calls(path, rows, expert_tile(tile, indices.shape[-1])))
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
