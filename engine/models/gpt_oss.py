"""gpt_oss: attention sinks, biases on every attention projection, sliding-window layers
alternating with full ones (config.json's layer_types), YaRN RoPE, and a mixture of experts
whose router, expert projections and clamped SwiGLU all have biases or constants of their own.

mlx-lm's op order throughout (mlx_lm/models/gpt_oss.py): the router's top-k is its own
`mlx_topk`, the expert weights a precise softmax over the k chosen logits, and the experts
mlx-lm's SwitchGLU call with its activation uncompiled (engine/models/experts.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gpt_oss

from engine.models.base import Family, LayerKV, UnsupportedModelError
from engine.models.experts import SwitchExperts, sum_over_ranks


def uncompiled_swiglu_oai(gate: mx.array, x: mx.array, alpha: float, limit: float) -> mx.array:
    # mlx-lm's swiglu_oai, uncompiled: a function compiled on the engine thread makes the
    # process abort at exit (MLX 0.32); the bits are the same (tests/engine/test_family_gpt_oss).
    gate = mx.minimum(gate, limit)
    x = mx.clip(x, -limit, limit)
    return (x + 1.0) * (gate * mx.sigmoid(alpha * gate))


def oai_experts(switch: nn.Module) -> SwitchExperts:
    """The experts of a SwitchGLU with gpt_oss's clamped SwigluOAI."""
    act = switch.activation
    alpha, limit = getattr(act, "_alpha", None), getattr(act, "_limit", None)
    return SwitchExperts(switch, gpt_oss.SwigluOAI,
                         lambda gate, up: uncompiled_swiglu_oai(gate, up, alpha, limit))


class GptOss(Family):
    name = "gpt_oss"
    model_types = ("gpt_oss",)
    model_class = gpt_oss.Model
    differs = ("attention sinks (a learned per-head logit in the softmax); q/k/v/o biases; "
               "sliding-window layers alternating with full ones; YaRN RoPE; a mixture of "
               "experts with biases and a clamped SwiGLU")

    def __init__(self, model, config):
        super().__init__(model, config)
        types = list(self.inner.layer_types)
        if len(types) != len(self.layers):
            # mlx-lm zips layers with layer_types: it would silently skip the layers past them.
            raise UnsupportedModelError(
                f"gpt_oss: {len(types)} layer_types for {len(self.layers)} layers")
        self.windows = [None if t == "full_attention" else int(self.inner.window_size)
                        for t in types]
        self.experts = [oai_experts(layer.mlp.experts) for layer in self.layers]

    def layer_kv(self):
        return [LayerKV(i, True, layer.self_attn.num_key_value_heads, layer.self_attn.head_dim,
                        self.window(i))
                for i, layer in enumerate(self.layers)]

    def window(self, i):
        return self.windows[i]

    def layer(self, step, i, x):
        layer = self.layers[i]
        x = x + self._attention(step, i, layer.self_attn, step.norm(layer.input_layernorm, x))
        return x + self._moe(step, i, layer.mlp, step.norm(layer.post_attention_layernorm, x))

    def _attention(self, step, i, attn, h):
        rows, dim = step.rows, attn.head_dim
        q = step.linear(attn.q_proj, h).reshape(rows, -1, dim)
        k = step.linear(attn.k_proj, h).reshape(rows, -1, dim)
        v = step.linear(attn.v_proj, h).reshape(rows, -1, dim)
        q, k = step.rope(attn.rope, q, k)  # YaRN's input scale is per element: same bits
        o = step.attend(i, q, k, v, attn.sm_scale, sinks=attn.sinks)
        return step.linear(attn.o_proj, o[None])

    def _moe(self, step, i, mlp, h):
        g = step.linear(mlp.router, h)
        logits, indices = gpt_oss.mlx_topk(g, k=mlp.num_experts_per_tok, axis=-1)
        weights = mx.softmax(logits, axis=-1, precise=True)
        y = step.experts(i, self.experts[i], h, indices, mlp.num_local_experts)
        return sum_over_ranks((y * mx.expand_dims(weights, axis=-1)).sum(axis=-2), mlp)

    def expert_layers(self):
        return {i: e.num_experts for i, e in enumerate(self.experts)}

    def describe_layers(self):
        n, top_k = len(self.layers), self.layers[0].mlp.num_experts_per_tok
        experts = sorted(set(self.expert_layers().values()))
        return super().describe_layers() + [
            f"{n} of {n} layers with attention sinks: their rows take MLX ops (the native "
            "attention kernel has no sinks)",
            f"{n} of {n} layers route each token to {top_k} of "
            f"{'/'.join(map(str, experts))} experts"]
