"""Tensor-parallel sharding of a loaded model, the way mlx-lm shards it: `model.shard(group)`.

mlx-lm's shard() column-shards q/k/v/gate/up ("all-to-sharded": each rank computes its slice of
the outputs, no communication) and row-shards o/down ("sharded-to-all": each rank multiplies
its slice of the inputs, then one all_sum), and divides each attention's n_heads and
n_kv_heads by the group size, so each rank's paged pool holds its share of the KV heads. A
mixture-of-experts block (qwen3_moe) is sharded in place: every expert's gate and up hold a
slice of its outputs, its down the matching slice of its inputs, the router stays whole, and
the block all_sums its weighted sum of the experts (`sharding_group`), as mlx-lm's does.

The runner computes a sharded layer exactly (engine/native_ops.py): the column-sharded layers
are turned back into plain nn.Linear / nn.QuantizedLinear over their slice (their forward is
exactly that), so the native kernels take them as any layer; a row-sharded layer runs the
native kernel on its slice, then all_sum, then its bias, as its own forward does. The fused
decoder layer has no all_sum inside, so a sharded layer is computed op by op.

Refused by name (UnsupportedModelError): a family whose adapter is not verified on sharded
layers, a model without shard(), head / kv head / intermediate counts that do not divide by
the group size, a quantized row-sharded slice that does not hold whole quantization groups,
and any module left of a kind the runner does not compute exactly.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from engine.models import UnsupportedModelError, family_for
from engine.native_ops import ROW_SHARDED

# Families whose layers are llama's block over the step's linears (engine/models/base.py
# llama_layer), or Qwen3-MoE's block of routed experts, and whose mlx-lm Model.shard() shards
# exactly those linears and experts.
SHARDABLE_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
_COLUMN_SHARDED = (nn.AllToShardedLinear, nn.QuantizedAllToShardedLinear)


def check_shardable(model, size: int, config: dict | None = None) -> None:
    """UnsupportedModelError naming why `model` cannot be split over `size` ranks."""
    family = family_for(model, config)
    if family.name not in SHARDABLE_FAMILIES:
        raise UnsupportedModelError(
            f"{family.name}: tensor parallelism supports {', '.join(SHARDABLE_FAMILIES)} only")
    if not callable(getattr(model, "shard", None)):
        raise UnsupportedModelError(f"{family.name}: mlx-lm's model has no shard()")
    for i, layer in enumerate(family.layers):
        attn = layer.self_attn
        # The feed-forward that is split: a dense MLP, or a routed block's experts (their
        # weights are (experts, out, in); a dense layer's (out, in): outputs are shape[-2]).
        ffn = getattr(layer.mlp, "switch_mlp", layer.mlp)
        expert = "expert " if ffn is not layer.mlp else ""
        counts = {"attention heads": attn.n_heads, "kv heads": attn.n_kv_heads,
                  f"{expert}intermediate size": ffn.gate_proj.weight.shape[-2]}
        for what, n in counts.items():
            if n % size:
                raise UnsupportedModelError(
                    f"{family.name} layer {i}: {n} {what} do not split over {size} ranks")
        for name, m in (("o_proj", attn.o_proj), ("down_proj", ffn.down_proj)):
            if "scales" in m:  # quantized: each rank's slice of inputs holds whole groups
                inputs = m.scales.shape[-1] * m.group_size
                if (inputs // size) % m.group_size:
                    raise UnsupportedModelError(
                        f"{family.name} layer {i}: {name}'s {inputs} inputs over {size} ranks "
                        f"are not whole quantization groups of {m.group_size}")


def shard_model(model, group: mx.distributed.Group, config: dict | None = None) -> None:
    """Shard `model` in place over `group` (check_shardable first), with its column-sharded
    layers made plain linears; every rank must call it on the same model."""
    check_shardable(model, group.size(), config)
    model.shard(group)
    model.update_modules(tree_map(_plain, model.leaf_modules(),
                                  is_leaf=lambda m: isinstance(m, nn.Module)))
    allowed = (nn.Linear, nn.QuantizedLinear, *ROW_SHARDED)
    for name, m in tree_flatten(model.leaf_modules(),
                                is_leaf=lambda m: isinstance(m, nn.Module)):
        if "distributed" in type(m).__module__ and not isinstance(m, allowed):
            raise UnsupportedModelError(f"{name}: {type(m).__name__} is not computed exactly "
                                        "by the runner")
    mx.eval(model.parameters())


def _plain(m: nn.Module) -> nn.Module:
    """A column-sharded layer as the plain layer over its slice (the same forward: its
    sum_gradients only acts on gradients); other modules as they are."""
    if not isinstance(m, _COLUMN_SHARDED):
        return m
    bias = "bias" in m
    if isinstance(m, nn.QuantizedAllToShardedLinear):
        inputs = m.scales.shape[-1] * m.group_size
        plain = nn.QuantizedLinear(inputs, m.weight.shape[0], bias, m.group_size, m.bits,
                                   mode=m.mode)
        plain.update(m.parameters())
        return plain
    plain = nn.Linear(m.weight.shape[1], m.weight.shape[0], bias)
    plain.update(m.parameters())
    return plain
