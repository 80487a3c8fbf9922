"""Gemma 3 (text only: model_type "gemma3_text"; the multimodal "gemma3" folders are not served).

Against llama: embeddings scaled by sqrt(hidden) (rounded to bfloat16 first, as mlx-lm does),
(1 + w) RMSNorms (mlx-lm's own gemma3_text.RMSNorm modules), per-head q/k norm before RoPE,
the attention scale from query_pre_attn_scalar, a norm on the attention output and on both
sides of the MLP, a GELU (tanh approximation) gated MLP, and sliding-window layers interleaved
with global ones (every sliding_window_pattern-th layer is global), each kind with its own RoPE
base, already built into each layer's attn.rope. Residual sums are clipped to the float16
range in float16 models (mlx-lm's clip_residual).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma3_text

from engine.models.base import Family, gelu_approx, llama_attention

_F16_MAX = mx.finfo(mx.float16).max


def clip_residual(x: mx.array, y: mx.array) -> mx.array:
    """mlx-lm's gemma3_text.clip_residual, uncompiled (see engine.models.base.gelu_approx)."""
    if x.dtype != mx.float16:
        return x + y
    return mx.clip(x.astype(mx.float32) + y.astype(mx.float32), -_F16_MAX,
                   _F16_MAX).astype(mx.float16)


class Gemma3(Family):
    name = "gemma3"
    model_types = ("gemma3_text",)
    model_class = gemma3_text.Model
    differs = ("sqrt(hidden)-scaled embeddings, (1 + w) RMSNorms, q/k norms, norms after "
               "attention and around a GELU MLP, sliding-window layers between global ones")

    def __init__(self, model, config):
        super().__init__(model, config)
        args = model.args
        self.sliding_window = int(args.sliding_window)
        # mlx-lm's scale: sqrt(hidden) rounded to bfloat16, then cast to the activations' dtype.
        self.embed_scale = mx.array(args.hidden_size**0.5, mx.bfloat16)

    def window(self, i):
        return self.sliding_window if self.layers[i].self_attn.is_sliding else None

    def embed(self, step, tokens):
        h = step.embed(self.inner.embed_tokens, tokens)
        return h * self.embed_scale.astype(h.dtype)

    def layer(self, step, i, x):
        layer = self.layers[i]
        r = llama_attention(step, i, layer.self_attn, layer.input_layernorm(x), qk_norm=True)
        h = clip_residual(x, layer.post_attention_layernorm(r))
        mlp = layer.mlp
        r = layer.pre_feedforward_layernorm(h)
        r = gelu_approx(step.linear(mlp.gate_proj, r)) * step.linear(mlp.up_proj, r)
        r = step.linear(mlp.down_proj, r)
        return clip_residual(h, layer.post_feedforward_layernorm(r))

    def describe_layers(self):
        lines = super().describe_layers()
        attn = [layer.self_attn for layer in self.layers]
        local = next((a.rope for a in attn if a.is_sliding), None)
        glob = next((a.rope for a in attn if not a.is_sliding), None)
        if local is not None and glob is not None:
            lines.append(f"RoPE: {_rope_text(local)} on sliding layers, {_rope_text(glob)} "
                         "on global ones")
        return lines


def _rope_text(rope: nn.Module) -> str:
    base, scale = getattr(rope, "base", None), getattr(rope, "scale", 1.0)
    if not isinstance(base, int | float):
        return type(rope).__name__
    return f"base {base:g}" + (f" (positions x {scale:g})" if scale != 1.0 else "")
