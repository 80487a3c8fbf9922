"""Llama (and Mistral, which mlx-lm serves with the same class): the reference decoder.

Pre-norm blocks: x + attn(rmsnorm(x)), then x + swiglu_mlp(rmsnorm(x)). Optional biases on
the projections, any RoPE variant mlx-lm's initialize_rope builds (llama3, yarn, linear), and
`layer_types` sliding-window layers.
"""

from __future__ import annotations

from mlx_lm.models import llama

from engine.models.base import Family, llama_layer, llama_layer_spec


class Llama(Family):
    name = "llama"
    model_types = ("llama", "mistral")
    model_class = llama.Model
    differs = "the reference: RMSNorm, SwiGLU MLP, RoPE; optional sliding-window layer_types"

    def window(self, i):
        return self.inner.sliding_window if self.layers[i].use_sliding else None

    def layer(self, step, i, x):
        return llama_layer(step, i, self.layers[i], x)

    def fused_layer_spec(self, i):
        return llama_layer_spec(self.layers[i])
