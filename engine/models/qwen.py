"""Qwen2 (q/k/v biases, held by the projection modules) and Qwen3 (per-head q/k RMSNorm
applied before RoPE). Otherwise llama's block."""

from __future__ import annotations

from mlx_lm.models import qwen2, qwen3

from engine.models.base import Family, llama_attention, swiglu_mlp


class Qwen2(Family):
    name = "qwen2"
    model_types = ("qwen2",)
    model_class = qwen2.Model
    differs = "biases on the q, k and v projections"
    qk_norm = False

    def layer(self, step, i, x):
        layer = self.layers[i]
        x = x + llama_attention(step, i, layer.self_attn, step.norm(layer.input_layernorm, x),
                                qk_norm=self.qk_norm)
        return x + swiglu_mlp(step, layer.mlp, step.norm(layer.post_attention_layernorm, x))


class Qwen3(Qwen2):
    name = "qwen3"
    model_types = ("qwen3",)
    model_class = qwen3.Model
    differs = "per-head RMSNorm on queries and keys before RoPE; no biases"
    qk_norm = True
