"""One forward as a model family sees it (engine/models/): the step's packed rows, their
positions, its kernel path and tile, and the operations that depend on the engine rather than
the family: linear layers along the step's path, RoPE at each row's position, paged
attention, routed experts and the fused decoder layer. It keeps the tally of the paths those
calls took (engine/kernels.py, PathTally): what the step records."""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
import numpy as np

from engine.attention import StepAttention, attend_step, plan_step
from engine.config import KernelPath
from engine.kernels import PathTally, apply_experts
from engine.kv_cache import KVPool
from engine.native_ops import NativeOps
from engine.scheduler import RowGroup
from engine.state_pool import StatePool


class Runner(Protocol):
    """What a step needs of the runner that made it (engine/model_runner.py's ModelRunner:
    the native ops, the pool and the layers' KV layout)."""

    pool: KVPool
    states: StatePool | None  # the recurrent layers' state pool (None: no such layers)
    recurrence_kernel: object | None
    layer_kv: list  # engine.models.LayerKV per decoder layer
    tile: int  # rows per call on the tiled path
    fused_attention: bool
    attention_kernel: object | None
    linear = NativeOps.linear
    linears = NativeOps.linears
    norm = NativeOps.norm
    native_rope = NativeOps.native_rope

    def decoder_layers(self, step: Step, i: int,
                       x: mx.array) -> tuple[mx.array, int] | None: ...


class Step:
    """One step's rows in (1, rows, hidden) order and everything per step: positions, pool
    slots written, attention plans, expert choices."""

    def __init__(self, runner: Runner, groups: list[RowGroup], path: str = KernelPath.GEMM,
                 tokens: mx.array | None = None):
        """tokens: the rows' input tokens as an array (None: the groups' token_ids)."""
        self.runner = runner
        self.path = KernelPath(path)
        self.tile = runner.tile
        bs = runner.pool.block_size
        ids, positions, write, self.contexts = [], [], [], []
        for g in groups:
            ids.extend(g.token_ids)
            rows = range(g.start, g.start + g.num_rows)
            positions.extend(rows)
            table = g.block_table
            # Plain Python, not numpy: a decode step writes one slot per row, and this runs on
            # caches the previous step's weights have just flushed.
            write.extend([table[p // bs] * bs + p % bs for p in rows])
            self.contexts.append((g.num_rows, g.start + g.num_rows, table))
        self.rows = len(ids)
        self.tokens = mx.array(ids) if tokens is None else tokens
        self.tally = PathTally(self.path, self.rows, self.tile)
        self.pos = mx.array(positions, dtype=mx.int32)
        self.write = mx.array(write, dtype=mx.int32)  # pool slots (int32: the fused op's)
        self._plans: dict[tuple[int | None, bool], StepAttention] = {}  # (window, sinks)
        self.expert_choices: list[tuple[int, int, mx.array]] = []  # (layer, experts, indices)
        self.state_groups: list[tuple[int, int]] = []  # (rows, slot) per group
        self.snapshots: list[tuple[int, int]] = []  # (row of the step, slot)
        if runner.states is not None:
            self._prepare_states(groups, runner.states)

    def _prepare_states(self, groups: list[RowGroup], states: StatePool) -> None:
        """The groups' state slots and snapshots in step rows; zero the slots of sequences
        that start now, copy checkpoints into those that resume from one."""
        row, fresh, restores = 0, [], []
        for g in groups:
            if g.state_slot is None:
                raise ValueError(f"{g.seq_id}: a model with recurrent layers needs a state slot "
                                 "for every group")
            self.state_groups.append((g.num_rows, g.state_slot))
            self.snapshots.extend((row + r, slot) for r, slot in g.snapshots)
            if g.restore_from is not None:
                restores.append((g.restore_from, g.state_slot))
            elif g.start == 0:
                fresh.append(g.state_slot)
            row += g.num_rows
        states.prepare(fresh, restores)

    def linear(self, module, x: mx.array, tied: bool = False) -> mx.array:
        """A linear layer (tied=True: an embedding used as the output head)."""
        return self.runner.linear(module, x, tied, self.path, self.tile, self.tally)

    def linears(self, modules: list, x: mx.array) -> list[mx.array]:
        """Several linear layers over the same input (q/k/v, gate/up): the same results as
        one `linear` each, in fewer calls where the step's kernel allows."""
        return self.runner.linears(modules, x, self.path, self.tile, self.tally)

    def rope(self, rope, q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
        """q: (rows, heads, dim), k: (rows, kv_heads, dim), rotated at each row's position.

        On the CPU the native op rotates each at its rows' positions (engine/native/row_ops.h).
        Otherwise each row is its own "batch" entry so MLX's RoPE takes a per-row position, and
        queries and keys go through one call, half the calls: RoPE rotates each head alone, so
        the bits are those of two calls (tests/engine/test_attention.py)."""
        native_rope = self.runner.native_rope(rope, q, k)
        if native_rope is not None:
            op, inv_freqs, scale = native_rope
            return tuple(op(x, self.pos, inv_freqs, rope.dims, rope.traditional, scale)
                         for x in (q, k))
        n = q.shape[1]
        qk = rope(mx.concatenate([q, k], axis=1)[:, :, None, :], offset=self.pos)[:, :, 0, :]
        return qk[:, :n], qk[:, n:]

    def norm(self, module, x: mx.array) -> mx.array:
        """An RMS norm module (mlx-lm's nn.RMSNorm) on x: the native op where it applies."""
        return self.runner.norm(module, x)

    def embed(self, module, tokens: mx.array) -> mx.array:
        """An embedding module on the step's tokens (rows,): (1, rows, dims), the native op
        where it applies (NativeOps.embed)."""
        return self.runner.embed(module, tokens)

    def attend(self, i: int, q: mx.array, k: mx.array | None, v: mx.array | None,
               scale: float, sinks: mx.array | None = None) -> mx.array:
        """Layer i's attention: store the rows' keys and values (unless the layer reads
        another layer's), then each row attends over its own context. sinks: (heads,) logits
        that join each row's softmax (gpt_oss). Returns (rows, heads * dim)."""
        runner = self.runner
        kv = runner.layer_kv[i]
        if kv.writes:
            runner.pool.write(kv.pool_layer, self.write, k, v)
        return attend_step(q, self.plan(kv.window, sinks is not None), runner.pool,
                           kv.pool_layer, scale, runner.fused_attention,
                           runner.attention_kernel, sinks)

    def plan(self, window: int | None, sinks: bool = False) -> StepAttention:
        """How this step's rows attend in a layer with this window (made once per step)."""
        key = (window, sinks)
        plan = self._plans.get(key)
        if plan is None:
            # The native kernel has no sinks: such a layer's decode rows take MLX ops.
            native = self.runner.attention_kernel is not None and not sinks
            plan = self._plans[key] = plan_step(self.contexts, self.runner.pool.block_size,
                                                native, window)
        return plan

    def recurrent(self, i: int, layer, qkv: mx.array, a: mx.array, b: mx.array) -> mx.array:
        """Layer i's Gated DeltaNet recurrence (mlx-lm's module `layer`) over every group's
        rows, each sequence from and into its own state slot: qkv (rows, conv_dim) before the
        convolution, a and b (rows, v_heads). Returns (rows, v_heads, v_dim)."""
        runner = self.runner
        kernel = runner.recurrence_kernel if qkv.dtype == mx.float32 else None  # float32 only
        return runner.states.gated_delta(runner.layer_kv[i].state.index, layer, qkv, a, b,
                                         self.state_groups, self.snapshots, kernel)

    def decoder_layers(self, i: int, x: mx.array) -> tuple[mx.array, int] | None:
        """Layers i, i + 1, ... as one native op (each the family's Family.fused_layer_spec):
        (the output, how many layers), or None where the step computes layer i op by op (the
        family's `layer`): the same bits either way."""
        out = self.runner.decoder_layers(self, i, x)
        if out is not None:  # every part of them a native op, each row alone: one call a layer
            self.tally.took(KernelPath.NATIVE, 1)
        return out

    def experts(self, i: int, switch, x: mx.array, indices: mx.array,
                num_experts: int) -> mx.array:
        """Layer i's routed experts: `switch` is mlx-lm's expert block (SwitchGLU:
        switch(x, indices) with gather matmuls), x (1, rows, hidden), indices (1, rows, k) the
        router's choice. The step's kernel path decides the calls (engine/kernels.py); the
        choice is recorded (StepOutput.expert_rows)."""
        self.expert_choices.append((i, num_experts, indices))
        return apply_experts(switch, x, indices, self.path, self.tile, self.tally)

    def expert_rows(self) -> dict[int, list[int]]:
        """Rows per expert in each MoE layer, from the evaluated router choices."""
        return {i: np.bincount(np.array(indices).reshape(-1), minlength=n).tolist()
                for i, n, indices in self.expert_choices}


def slots(block_table: list[int], num_tokens: int, block_size: int) -> np.ndarray:
    """Pool slots of positions [0, num_tokens) of a sequence with this block table."""
    n_blocks = -(-num_tokens // block_size)
    table = np.asarray(block_table[:n_blocks], dtype=np.int64)
    return (table[:, None] * block_size + np.arange(block_size)).reshape(-1)[:num_tokens]
