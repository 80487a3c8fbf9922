"""Gemma 4 (text only: model_type "gemma4_text"), computed as mlx-lm's gemma4_text does.

Against llama:
- embeddings scaled by sqrt(hidden); optional per-layer inputs (embed_tokens_per_layer of the
  step's tokens plus a projection of the scaled embeddings, normed and mixed), which each layer
  gates into its output after the MLP;
- sliding-window layers between full-attention ones, each kind with its own head_dim
  (global_head_dim), kv head count (num_global_key_value_heads with attention_k_eq_v) and RoPE
  (the full layers' "proportional" RoPE rotates only part of each head), already built into
  each layer's attn.rope;
- q/k RMSNorms and a scale-free RMSNorm on values, attention scale 1.0; with attention_k_eq_v
  the full layers' values are their (un-normed, un-rotated) keys;
- the last num_kv_shared_layers layers write no keys or values: each reads those of the last
  earlier layer of its own kind (mlx-lm's previous_kvs), so the pool holds fewer layers;
- norms after attention and around a GELU-gated MLP (double-wide on KV-shared layers when
  configured), an optional routed-experts block beside the MLP, a learned scalar per layer;
- final logits soft-capped: tanh(logits / cap) * cap.

mlx-lm compiles its GELU, geglu and soft-cap; a function compiled on the engine thread makes
the process abort at exit (MLX 0.32), so they are written out here uncompiled: the same bits.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text

from engine.models.base import Family, LayerKV, UnsupportedModelError, gelu_approx
from engine.models.experts import SwitchExperts

_KINDS = ("sliding_attention", "full_attention")


def geglu_experts(switch: nn.Module) -> SwitchExperts:
    """The experts of a SwitchGLU with gemma4's GeGLU: gelu_approx(gate) * up."""
    return SwitchExperts(switch, gemma4_text.GeGLU, lambda gate, up: gelu_approx(gate) * up)


class Gemma4(Family):
    name = "gemma4"
    model_types = ("gemma4_text",)
    model_class = gemma4_text.Model
    differs = ("sqrt(hidden)-scaled embeddings plus per-layer inputs; sliding and full layers "
               "with their own head sizes, kv heads and (partial) RoPE; q/k/v norms, scale 1; "
               "later layers reuse earlier layers' KV; GELU MLP, optional experts; layer "
               "scalars; soft-capped logits")

    def __init__(self, model, config):
        super().__init__(model, config)
        inner = self.inner
        self.args = model.args
        for i, layer in enumerate(self.layers):
            if layer.layer_type not in _KINDS:
                raise UnsupportedModelError(
                    f"gemma4_text layer {i}: layer type {layer.layer_type!r} is neither "
                    "sliding_attention nor full_attention")
        # KV sharing exactly as mlx-lm wires it: layer j attends over the keys and values of
        # layer previous_kvs[j] (itself, or the last non-shared layer of its kind).
        self.source = [int(j) for j in inner.previous_kvs]
        self.pool_index: dict[int, int] = {}
        for i, layer in enumerate(self.layers):
            src = self.source[i]
            writes = src == i
            if writes != bool(layer.self_attn.has_kv) or self.source[src] != src:
                raise UnsupportedModelError(
                    f"gemma4_text layer {i}: its KV source {src} is not a layer "
                    "that computes keys and values")
            if writes:
                self.pool_index[i] = len(self.pool_index)
        self.experts = {i: geglu_experts(layer.experts.switch_glu)
                        for i, layer in enumerate(self.layers) if layer.enable_moe}
        self._per_layer: tuple[object, mx.array] | None = None  # (step, per-layer inputs)

    # ---- layout --------------------------------------------------------------------------
    def layer_kv(self):
        out = []
        for i in range(len(self.layers)):
            src = self.layers[self.source[i]].self_attn
            out.append(LayerKV(self.pool_index[self.source[i]], self.source[i] == i,
                               int(src.n_kv_heads), int(src.head_dim), self.window(i)))
        return out

    def window(self, i):
        return int(self.inner.window_size) if self.layers[i].self_attn.is_sliding else None

    def expert_layers(self):
        return {i: e.num_experts for i, e in self.experts.items()}

    # ---- the forward ---------------------------------------------------------------------
    def embed(self, step, tokens):
        inner = self.inner
        h = step.embed(inner.embed_tokens, tokens) * inner.embed_scale
        self._per_layer = None
        if inner.hidden_size_per_layer_input:
            # Gemma4TextModel._get_per_layer_inputs and _project_per_layer_inputs, from the
            # step's own tokens (every row's, so each row's inputs are its token's).
            shape = (len(self.layers), inner.hidden_size_per_layer_input)
            given = step.embed(inner.embed_tokens_per_layer, tokens)
            given = mx.unflatten(given * inner.embed_tokens_per_layer_scale, -1, shape)
            proj = step.linear(inner.per_layer_model_projection, h)
            proj = mx.unflatten(proj * inner.per_layer_projection_scale, -1, shape)
            proj = inner.per_layer_projection_norm(proj)
            self._per_layer = (step, (proj + given) * inner.per_layer_input_scale)
        return h

    def layer(self, step, i, x):
        layer = self.layers[i]
        h = x + layer.post_attention_layernorm(
            self._attention(step, i, layer.self_attn, layer.input_layernorm(x)))
        if layer.enable_moe:
            h1 = layer.post_feedforward_layernorm_1(
                _geglu_mlp(step, layer.mlp, layer.pre_feedforward_layernorm(h)))
            h2 = layer.post_feedforward_layernorm_2(self._moe(step, i, layer, h))
            r = h1 + h2
        else:
            r = _geglu_mlp(step, layer.mlp, layer.pre_feedforward_layernorm(h))
        h = h + layer.post_feedforward_layernorm(r)
        if layer.per_layer_input_gate is not None and self._per_layer is not None:
            owner, per_layer = self._per_layer
            assert owner is step, "per-layer inputs of another step"
            gate = gelu_approx(step.linear(layer.per_layer_input_gate, h))
            gate = step.linear(layer.per_layer_projection, gate * per_layer[:, :, i, :])
            h = h + layer.post_per_layer_input_norm(gate)
        return h * layer.layer_scalar

    def head(self, step, h):
        logits = super().head(step, h)
        cap = self.model.final_logit_softcapping
        return logits if cap is None else mx.tanh(logits / cap) * cap

    def _attention(self, step, i, attn, h):
        rows = step.rows
        q = attn.q_norm(step.linear(attn.q_proj, h).reshape(rows, attn.n_heads, attn.head_dim))
        if self.source[i] != i:  # reads its source layer's keys and values from the pool
            q, _ = step.rope(attn.rope, q, q[:, :0])
            o = step.attend(i, q, None, None, attn.scale)
            return step.linear(attn.o_proj, o[None])
        keys = step.linear(attn.k_proj, h).reshape(rows, attn.n_kv_heads, attn.head_dim)
        values = keys  # attention_k_eq_v: the values are the raw keys
        if not attn.use_k_eq_v:
            values = step.linear(attn.v_proj, h).reshape(rows, attn.n_kv_heads, attn.head_dim)
        q, k = step.rope(attn.rope, q, attn.k_norm(keys))
        o = step.attend(i, q, k, attn.v_norm(values), attn.scale)
        return step.linear(attn.o_proj, o[None])

    def _moe(self, step, i, layer, h):
        # Router.__call__ on the un-normed h; Experts.__call__ on pre_feedforward_layernorm_2(h).
        router = layer.router
        k = router.config.top_k_experts
        x = mx.fast.rms_norm(h, router.scale * router._root_size, router.eps)
        scores = step.linear(router.proj, x)
        inds = mx.stop_gradient(mx.argpartition(scores, kth=-k, axis=-1)[..., -k:])
        weights = mx.softmax(mx.take_along_axis(scores, inds, axis=-1), axis=-1)
        weights = weights * router.per_expert_scale[inds]
        x = layer.pre_feedforward_layernorm_2(h)
        y = step.experts(i, self.experts[i], x, inds, router.config.num_experts)
        return (mx.expand_dims(weights, -1) * y).sum(-2)

    def describe_layers(self):
        lines = super().describe_layers()
        shared = [i for i in range(len(self.layers)) if self.source[i] != i]
        if shared:
            lines.append(f"{len(shared)} of {len(self.layers)} layers reuse an earlier layer's "
                         f"keys and values: the pool holds {len(self.pool_index)} layers")
        kinds = {}
        for layer in self.layers:
            a = layer.self_attn
            heads = f"{a.n_kv_heads} kv head{'' if a.n_kv_heads == 1 else 's'}"
            kinds.setdefault(layer.layer_type,
                             f"head_dim {a.head_dim}, {heads}, {type(a.rope).__name__}")
        if len(set(kinds.values())) > 1:
            lines.append("; ".join(f"{kind}: {text}" for kind, text in kinds.items()))
        if self.experts:
            lines.append(f"{len(self.experts)} of {len(self.layers)} layers add "
                         f"{self.args.top_k_experts} of {self.args.num_experts} routed experts "
                         "to the MLP")
        return lines


def _geglu_mlp(step, mlp, h):
    """gemma4_text.MLP: down(gelu_approx(gate(h)) * up(h))."""
    gate = step.linear(mlp.gate_proj, h)
    return step.linear(mlp.down_proj, gelu_approx(gate) * step.linear(mlp.up_proj, h))
