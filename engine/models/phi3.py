"""Phi-3 (and Phi-4-mini, which ships as model_type "phi3").

llama's block with fused projections: one qkv_proj whose output splits into queries, keys and
values, one gate_up_proj whose output splits in half into gate and up. RoPE may rotate only
part of each head (partial_rotary_factor) and may be scaled (linear, or "su"/"longrope":
mlx-lm's SuScaledRoPE, which scales the rotated part and uses the long factors); both are in
each layer's attn.rope and take one position per row.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import phi3

from engine.models.base import Family


class Phi3(Family):
    name = "phi3"
    model_types = ("phi3",)
    model_class = phi3.Model
    differs = "fused qkv_proj and gate_up_proj; partial and su/longrope-scaled RoPE"

    def layer(self, step, i, x):
        layer = self.layers[i]
        x = x + self._attention(step, i, layer.self_attn, step.norm(layer.input_layernorm, x))
        return x + self._mlp(step, layer.mlp, step.norm(layer.post_attention_layernorm, x))

    def _attention(self, step, i, attn, h):
        rows, dim = step.rows, attn.head_dim
        q_end = attn.n_heads * dim
        qkv = step.linear(attn.qkv_proj, h)
        q, k, v = mx.split(qkv, [q_end, q_end + attn.n_kv_heads * dim], axis=-1)
        q = q.reshape(rows, attn.n_heads, dim)
        k = k.reshape(rows, attn.n_kv_heads, dim)
        v = v.reshape(rows, attn.n_kv_heads, dim)
        q, k = step.rope(attn.rope, q, k)
        o = step.attend(i, q, k, v, attn.scale)
        return step.linear(attn.o_proj, o[None])

    def _mlp(self, step, mlp, h):
        gate, up = mx.split(step.linear(mlp.gate_up_proj, h), 2, axis=-1)
        # mlx-lm's compiled swiglu, uncompiled (see base.swiglu_mlp): bit-identical.
        return step.linear(mlp.down_proj, nn.silu(gate) * up)

    def describe_layers(self):
        rope = self.layers[0].self_attn.rope
        rotated = getattr(rope, "dims", None) or getattr(rope, "dim", None)
        head_dim = self.layers[0].self_attn.head_dim
        lines = []
        if rotated and rotated != head_dim:
            lines.append(f"RoPE rotates {rotated} of {head_dim} dimensions per head")
        if type(rope) is not nn.RoPE:
            lines.append(f"RoPE: {type(rope).__name__}")
        return lines
