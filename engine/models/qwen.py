"""Qwen2 (q/k/v biases, held by the projection modules) and Qwen3 (per-head q/k RMSNorm
applied before RoPE). Otherwise llama's block."""

from __future__ import annotations

from mlx_lm.models import qwen2, qwen3

from engine.models.base import Family, llama_layer, llama_layer_spec


class Qwen2(Family):
    name = "qwen2"
    model_types = ("qwen2",)
    model_class = qwen2.Model
    differs = "biases on the q, k and v projections"
    qk_norm = False

    def layer(self, step, i, x):
        return llama_layer(step, i, self.layers[i], x, qk_norm=self.qk_norm)

    def fused_layer_spec(self, i):
        return llama_layer_spec(self.layers[i], qk_norm=self.qk_norm)


class Qwen3(Qwen2):
    name = "qwen3"
    model_types = ("qwen3",)
    model_class = qwen3.Model
    differs = "per-head RMSNorm on queries and keys before RoPE; no biases"
    qk_norm = True
