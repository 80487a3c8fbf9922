"""Mixture-of-experts families: Qwen3-MoE and Mixtral.

Each MoE layer's router is a linear gate (through the step's kernel path), then mlx-lm's own
top-k selection, then the chosen experts through `step.experts` (which records the choice for
StepRecord.expert_rows), then the weighted sum, all with mlx-lm's ops in mlx-lm's order:

- qwen3_moe: softmax (precise) over all experts, the top k by argpartition, their
  probabilities renormalised to sum to 1 where `norm_topk_prob`; layers listed in
  `mlp_only_layers` or off the `decoder_sparse_step` keep a dense SwiGLU MLP. Attention is
  Qwen3's (per-head q/k RMSNorm before RoPE).
- mixtral: the top k of the raw gate logits by argpartition, then softmax (precise) over
  those k only. Attention is llama's, under Mixtral's attribute names.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import mixtral, qwen3_moe
from mlx_lm.models.switch_layers import SwiGLU

from engine.models.base import (
    Family,
    LayerKV,
    llama_attention,
    swiglu_mlp,
)
from engine.models.experts import SwitchExperts, sum_over_ranks


def swiglu_experts(switch: nn.Module) -> SwitchExperts:
    """The experts of a SwitchGLU with SwiGLU: silu(gate) * up."""
    return SwitchExperts(switch, SwiGLU, lambda gate, up: nn.silu(gate) * up)


class _MoEFamily(Family):
    """What both MoE families share: which layers route to experts, and how many experts."""

    def __init__(self, model: nn.Module, config: dict):
        super().__init__(model, config)
        self._experts: dict[int, SwitchExperts] = {}
        for i, layer in enumerate(self.layers):
            block = self._moe_block(layer)
            if block is not None:
                self._experts[i] = swiglu_experts(block.switch_mlp)

    def _moe_block(self, layer: nn.Module) -> nn.Module | None:
        raise NotImplementedError

    def expert_layers(self) -> dict[int, int]:
        return {i: e.num_experts for i, e in self._experts.items()}

    def describe_layers(self) -> list[str]:
        layers = self.expert_layers()
        if not layers:
            return super().describe_layers()
        top_k = self.model.args.num_experts_per_tok
        kinds = "/".join(map(str, sorted(set(layers.values()))))
        return [*super().describe_layers(), f"{len(layers)} of {len(self.layers)} layers route "
                f"each token to {top_k} of {kinds} experts"]


class Qwen3Moe(_MoEFamily):
    name = "qwen3_moe"
    model_types = ("qwen3_moe",)
    model_class = qwen3_moe.Model
    differs = ("Qwen3's attention; routed SwiGLU experts (softmax, top-k, optional "
               "renormalisation), dense MLP on mlp_only_layers")

    def _moe_block(self, layer):
        mlp = layer.mlp
        return mlp if isinstance(mlp, qwen3_moe.Qwen3MoeSparseMoeBlock) else None

    def layer(self, step, i, x):
        layer = self.layers[i]
        x = x + llama_attention(step, i, layer.self_attn, step.norm(layer.input_layernorm, x),
                                qk_norm=True)
        h = step.norm(layer.post_attention_layernorm, x)
        if i not in self._experts:
            return x + swiglu_mlp(step, layer.mlp, h)
        return x + self._moe(step, i, layer.mlp, h)

    def _moe(self, step, i, block, x):
        # Qwen3MoeSparseMoeBlock.__call__, op for op.
        gates = step.linear(block.gate, x)
        gates = mx.softmax(gates, axis=-1, precise=True)
        k = block.top_k
        inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if block.norm_topk_prob:
            scores /= mx.sum(scores, axis=-1, keepdims=True)
        y = step.experts(i, self._experts[i], x, inds, block.num_experts)
        return sum_over_ranks((y * scores[..., None]).sum(axis=-2).astype(y.dtype), block)


class Mixtral(_MoEFamily):
    name = "mixtral"
    model_types = ("mixtral",)
    model_class = mixtral.Model
    differs = ("llama's attention; every layer routes to SwiGLU experts (top-k of the gate "
               "logits, softmax over those k)")

    def _moe_block(self, layer):
        return layer.block_sparse_moe

    def layer_kv(self):
        return [LayerKV(i, True, layer.self_attn.num_key_value_heads, layer.self_attn.head_dim)
                for i, layer in enumerate(self.layers)]

    def layer(self, step, i, x):
        layer = self.layers[i]
        x = x + _mixtral_attention(step, i, layer.self_attn, step.norm(layer.input_layernorm, x))
        h = step.norm(layer.post_attention_layernorm, x)
        return x + self._moe(step, i, layer.block_sparse_moe, h)

    def _moe(self, step, i, block, x):
        # MixtralSparseMoeBlock.__call__, op for op.
        gates = step.linear(block.gate, x)
        k = block.num_experts_per_tok
        inds = mx.stop_gradient(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])
        scores = mx.take_along_axis(gates, inds, axis=-1)
        scores = mx.softmax(scores, axis=-1, precise=True)
        y = step.experts(i, self._experts[i], x, inds, block.num_experts)
        return sum_over_ranks((y * scores[..., None]).sum(axis=-2), block)


def _mixtral_attention(step, i, attn, h):
    """llama_attention for MixtralAttention, which names its head counts differently."""
    rows = step.rows
    q = step.linear(attn.q_proj, h).reshape(rows, attn.num_heads, -1)
    k = step.linear(attn.k_proj, h).reshape(rows, attn.num_key_value_heads, -1)
    v = step.linear(attn.v_proj, h).reshape(rows, attn.num_key_value_heads, -1)
    q, k = step.rope(attn.rope, q, k)
    o = step.attend(i, q, k, v, attn.scale)
    return step.linear(attn.o_proj, o[None])
