"""Tensor-parallel sharding of a loaded model, the way mlx-lm shards it: `model.shard(group)`.

mlx-lm's shard() column-shards q/k/v/gate/up ("all-to-sharded": each rank computes its slice of
the outputs, no communication) and row-shards o/down ("sharded-to-all": each rank multiplies
its slice of the inputs, then one all_sum), and divides each attention's n_heads and
n_kv_heads by the group size, so each rank's paged pool holds its share of the KV heads. A
mixture-of-experts block (qwen3_moe) is sharded in place: every expert's gate and up hold a
slice of its outputs, its down the matching slice of its inputs, the router stays whole, and
the block all_sums its weighted sum of the experts (`sharding_group`), as mlx-lm's does.
mlx-lm's Mixtral has no shard(); `shard_mixtral` splits it the same way (llama's attention
under Mixtral's names, every layer's experts in place). gpt-oss's shard() also gives each rank
its heads' attention sinks and divides every expert's down bias by N (the all_sum adds the N
shares back).

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
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx.utils import tree_flatten, tree_map

from engine.models import Family, UnsupportedModelError, family_for
from engine.native_ops import ROW_SHARDED

# Families whose layers are llama's block over the step's linears (engine/models/base.py
# llama_layer), or a block of routed experts (Qwen3-MoE, Mixtral, gpt-oss), and whose mlx-lm
# Model.shard() (Mixtral: shard_mixtral) shards exactly those linears and experts.
SHARDABLE_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss")
_COLUMN_SHARDED = (nn.AllToShardedLinear, nn.QuantizedAllToShardedLinear)


def check_shardable(model, size: int, config: dict | None = None) -> Family:
    """UnsupportedModelError naming why `model` cannot be split over `size` ranks; else the
    model's family."""
    family = family_for(model, config)
    if family.name not in SHARDABLE_FAMILIES:
        raise UnsupportedModelError(
            f"{family.name}: tensor parallelism supports {', '.join(SHARDABLE_FAMILIES)} only")
    if family.name not in OWN_SHARD and not callable(getattr(model, "shard", None)):
        raise UnsupportedModelError(f"{family.name}: mlx-lm's model has no shard()")
    for i, layer in enumerate(family.layers):
        attn = layer.self_attn
        # The feed-forward that is split: a dense MLP, or a routed block's experts (their
        # weights are (experts, out, in); a dense layer's (out, in): outputs are shape[-2]).
        ffn, expert = _feed_forward(layer)
        heads, kv_heads = _head_counts(attn)
        counts = {"attention heads": heads, "kv heads": kv_heads,
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
    return family


def shard_model(model, group: mx.distributed.Group, config: dict | None = None) -> None:
    """Shard `model` in place over `group` (check_shardable first), with its column-sharded
    layers made plain linears; every rank must call it on the same model."""
    family = check_shardable(model, group.size(), config)
    own = OWN_SHARD.get(family.name)
    if own is not None:
        own(model, group)
    else:
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


def _head_counts(attn: nn.Module) -> tuple[int, int]:
    """(attention heads, kv heads) under mlx-lm's llama, Mixtral or gpt-oss names."""
    if hasattr(attn, "n_heads"):
        return attn.n_heads, attn.n_kv_heads
    heads = attn.num_heads if hasattr(attn, "num_heads") else attn.num_attention_heads
    return heads, attn.num_key_value_heads


def _feed_forward(layer: nn.Module) -> tuple[nn.Module, str]:
    """The layer's feed-forward that is split, and "expert " where it is a block's routed
    experts (Qwen3-MoE and Mixtral: switch_mlp; gpt-oss: experts), else ""."""
    block = layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp
    for name in ("switch_mlp", "experts"):
        if hasattr(block, name):
            return getattr(block, name), "expert "
    return block, ""


def shard_mixtral(model, group: mx.distributed.Group) -> None:
    """mlx-lm's Qwen3-MoE shard() applied to Mixtral, which has none: q/k/v column-sharded,
    o row-sharded and each rank's share of the heads; every layer's experts sharded in place
    (gate and up: a slice of each expert's outputs; down: the matching inputs), the router
    whole, and the block all_summing its weighted sum (engine/models/moe.py Mixtral)."""
    n = group.size()
    for layer in model.layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
        attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
        attn.num_heads //= n
        attn.num_key_value_heads //= n
        block = layer.block_sparse_moe
        block.sharding_group = group
        for name, how in (("gate_proj", "all-to-sharded"), ("down_proj", "sharded-to-all"),
                          ("up_proj", "all-to-sharded")):
            shard_inplace(getattr(block.switch_mlp, name), how, group=group)


# Families whose mlx-lm model has no shard(): how they are split instead.
OWN_SHARD = {"mixtral": shard_mixtral}


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
