"""The recurrent-state pool: real storage for the per-sequence state of recurrent layers.

Per Gated DeltaNet layer, two arrays addressed by slot (engine/state_slots.py says which slot
is whose): the conv state (slots, K - 1, conv_dim), the last K - 1 inputs of the layer's causal
convolution, in the model's dtype; and the recurrent state (slots, value heads, value dim, key
dim), always float32, as mlx-lm keeps them. A step zeroes the slots of sequences that start
from nothing, copies checkpoints into the slots of sequences that resume from one, then each
layer reads and writes its groups' slots (engine/recurrence.py). The list holds the only
reference to each array, so MLX can update it in place instead of copying the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.recurrence import gated_delta_rows


@dataclass(frozen=True)
class LayerState:
    """What one recurrent layer keeps per sequence (a Gated DeltaNet layer)."""

    index: int  # its arrays in the state pool
    conv_dim: int
    conv_kernel: int
    v_heads: int
    v_dim: int
    k_dim: int

    def conv_shape(self, slots: int) -> tuple[int, ...]:
        return (slots, self.conv_kernel - 1, self.conv_dim)

    def state_shape(self, slots: int) -> tuple[int, ...]:
        return (slots, self.v_heads, self.v_dim, self.k_dim)

    def slot_bytes(self, conv_dtype: mx.Dtype) -> int:
        conv = (self.conv_kernel - 1) * self.conv_dim * conv_dtype.size
        return conv + self.v_heads * self.v_dim * self.k_dim * mx.float32.size


class StatePool:
    def __init__(self, layers: list[LayerState], num_slots: int, conv_dtype: mx.Dtype):
        self.layers = layers
        self.num_slots = num_slots
        self.conv_dtype = conv_dtype
        self._conv = [mx.zeros(s.conv_shape(num_slots), dtype=conv_dtype) for s in layers]
        self._state = [mx.zeros(s.state_shape(num_slots), dtype=mx.float32) for s in layers]
        mx.eval(self._conv, self._state)

    def slot_bytes(self) -> int:
        """One slot over every recurrent layer: what a sequence (or a checkpoint) costs."""
        return sum(s.slot_bytes(self.conv_dtype) for s in self.layers)

    def describe(self, slots) -> str:
        """The pool at start, in words (slots: its engine.state_slots.StateSlots)."""
        mib = self.slot_bytes() / 2**20
        every = (f", a checkpoint every {slots.interval} tokens" if slots.checkpoints else "")
        return (f"{len(self.layers)} recurrent layers, {self.slot_bytes()} bytes "
                f"({mib:.2f} MiB) per sequence; {slots.live} sequence slots, {slots.scratch} "
                f"scratch for drafts, {slots.checkpoints} prefix checkpoints{every}: "
                f"{self.nbytes() / 2**20:.0f} MiB")

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._conv + self._state)

    def prepare(self, fresh: list[int], restores: list[tuple[int, int]]) -> None:
        """Before a step: zero the slots of sequences starting from nothing, and copy each
        (checkpoint, slot) pair's checkpoint into the slot of the sequence resuming from it."""
        if fresh:
            at = mx.array(fresh)
            for a in self._conv + self._state:
                a[at] = mx.zeros((len(fresh), *a.shape[1:]), dtype=a.dtype)  # in place
        if restores:
            self.copy([src for src, _ in restores], [dst for _, dst in restores])
        elif fresh:
            mx.eval(self.state())

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Slot dst[n] takes slot src[n]'s state, in every layer. Evaluated now: the native
        recurrence writes the pool in place and takes only evaluated arrays."""
        src_at, dst_at = mx.array(src), mx.array(dst)
        # The slots read first, evaluated: the write is then the array's only user and MLX
        # makes it in place (a read in the same graph made it copy the whole pool).
        arrays = self.state()
        values = [a[src_at] for a in arrays]
        mx.eval(values)
        for a, value in zip(arrays, values, strict=True):
            a[dst_at] = value  # the pool's own array object, updated in place
        mx.eval(arrays)

    def gated_delta(self, layer: int, module, qkv: mx.array, a: mx.array, b: mx.array,
                    groups: list[tuple[int, int]], snapshots: list[tuple[int, int]],
                    kernel) -> mx.array:
        """Layer `layer`'s recurrence over a step's rows (engine/recurrence.py): groups are
        (rows, slot) in row order, snapshots (row, slot). Returns y (rows, v_heads, v_dim)."""
        y, self._conv[layer], self._state[layer] = gated_delta_rows(
            qkv, a, b, module, self._conv[layer], self._state[layer], groups, snapshots, kernel)
        return y

    def read(self, slot: int) -> mx.array:
        """A slot's recurrent state in every layer: (layers, v_heads, v_dim, k_dim) when the
        layers agree in shape (the divergence view compares them)."""
        return mx.stack([s[slot] for s in self._state])

    def state(self) -> list[mx.array]:
        """Arrays to evaluate with a step, so the pool updates land before the next one."""
        return self._conv + self._state
