"""Routed experts as mlx-lm computes them, for `step.experts`.

mlx-lm's SwitchGLU runs the chosen experts with gather matmuls (rows sorted by expert once a
call holds 64 or more choices) and a compiled activation. A function compiled on the engine
thread makes the process abort at exit (MLX 0.32), so `SwitchExperts` is SwitchGLU's call with
the family's activation written out uncompiled: the same bits (tests/engine/test_experts.py,
tests/engine/test_family_gpt_oss.py).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU, _gather_sort, _scatter_unsort

from engine import collectives
from engine.models.base import UnsupportedModelError


class SwitchExperts:
    """switch(x, indices) for a SwitchGLU whose activation is `activation_type`, computed with
    `activation(gate, up)`."""

    def __init__(self, switch: nn.Module, activation_type: type,
                 activation: Callable[[mx.array, mx.array], mx.array]):
        act = switch.activation
        if type(switch) is not SwitchGLU or type(act) is not activation_type:
            raise UnsupportedModelError(
                f"experts {type(switch).__qualname__} with {type(act).__qualname__} are not "
                f"mlx-lm's SwitchGLU with {activation_type.__qualname__}")
        check_expert_dtype(switch)
        self.switch = switch
        self.activation = activation

    @property
    def num_experts(self) -> int:
        return int(self.switch.up_proj.num_experts)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        s = self.switch
        x = mx.expand_dims(x, (-2, -3))
        do_sort = indices.size >= 64
        idx, inv_order = indices, None
        if do_sort:
            x, idx, inv_order = _gather_sort(x, indices)
        x_up = s.up_proj(x, idx, sorted_indices=do_sort)
        x_gate = s.gate_proj(x, idx, sorted_indices=do_sort)
        x = s.down_proj(self.activation(x_gate, x_up), idx, sorted_indices=do_sort)
        if do_sort:
            x = _scatter_unsort(x, inv_order, indices.shape)
        return x.squeeze(-2)


def check_expert_dtype(switch: nn.Module) -> None:
    """MLX's CPU gather_mm computes float32 only (0.32: "[GatherMM::eval] Currently only
    supports float32"): dense bf16/f16 experts would fail at the first step, so refuse them
    at load. Quantized experts (gather_qmm) run in any dtype."""
    weight = switch.up_proj.weight
    if (mx.default_device() == mx.cpu and "scales" not in switch.up_proj
            and weight.dtype != mx.float32):
        raise UnsupportedModelError(
            f"dense {weight.dtype} experts do not run on the CPU backend (MLX's gather_mm "
            "computes float32 only there): load the model with --weights f32 or as shipped")


def sum_over_ranks(y: mx.array, block: nn.Module) -> mx.array:
    """A routed block's weighted sum of its experts, all_summed over its `sharding_group`
    where tensor parallelism split each expert (each rank holds a slice of every expert, as
    mlx-lm's blocks do); y itself otherwise. mlx-lm's Mixtral block has no such attribute
    until engine/distributed/shard.py gives it one."""
    group = getattr(block, "sharding_group", None)
    return y if group is None else collectives.all_sum(y, group)
