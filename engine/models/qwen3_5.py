"""Hybrid families: Qwen3.5 / Qwen3.6 (qwen3_5, qwen3_5_moe) and Qwen3-Next (qwen3_next).

Every `full_attention_interval`-th layer is gated attention, the others Gated DeltaNet:

- gated attention: q_proj is twice as wide, query and gate interleaved per head; per-head
  q/k RMSNorm, RoPE on a `partial_rotary_factor` share of each head, paged attention, then
  o_proj(attention * sigmoid(gate));
- Gated DeltaNet: q, k, v (and z, b, a) projections; a depthwise causal convolution over the
  sequence's conv state and the new rows, SiLU, normalised q and k, the delta-rule recurrence
  over a float32 state (engine/recurrence.py, through the step's state slots: nothing of it
  lives in the KV pool), then an RMSNorm gated by silu(z) and out_proj. qwen3_5 keeps separate
  in_proj_qkv / z / b / a; qwen3_next fuses them per key head (in_proj_qkvz, in_proj_ba),
  reordered by mlx-lm's own fix_query_key_value_ordering.
- the MLP: SwiGLU, or (num_experts > 0) softmax top-k routed experts plus a shared expert
  gated by a sigmoid; qwen3_next routes only on `decoder_sparse_step` layers outside
  `mlp_only_layers`.

All with mlx-lm's modules, weights and ops in mlx-lm's order; its compiled helpers
(precise_swiglu, compute_g) are written out uncompiled (see base.gelu_approx for why). A
conditional-generation folder's vision tower is not loaded (mlx-lm's sanitize drops its
weights): the text model is served and the start-up log says so.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5, qwen3_5_moe, qwen3_next

from engine.models.base import Family, LayerKV, UnsupportedModelError, swiglu_mlp
from engine.models.experts import SwitchExperts
from engine.models.moe import swiglu_experts
from engine.state_pool import LayerState


class Qwen3_5(Family):
    name = "qwen3_5"
    model_types = ("qwen3_5",)
    model_class = qwen3_5.Model
    differs = ("hybrid: Gated DeltaNet layers (a recurrent state per sequence) between gated "
               "attention layers (sigmoid output gate, partial RoPE)")

    def __init__(self, model: nn.Module, config: dict):
        super().__init__(model, config)
        self.lm = getattr(model, "language_model", model)  # holds lm_head and the args
        args = self.lm.args
        if args.full_attention_interval > args.num_hidden_layers:
            raise UnsupportedModelError(
                f"{self.name}: full_attention_interval {args.full_attention_interval} exceeds "
                f"the {args.num_hidden_layers} layers")
        check_layer_types(config, self.name, [layer.is_linear for layer in self.layers])
        self._states: dict[int, LayerState] = {}
        for i, layer in enumerate(self.layers):
            if layer.is_linear:
                gdn = layer.linear_attn
                self._states[i] = LayerState(len(self._states), gdn.conv_dim,
                                             gdn.conv_kernel_size, gdn.num_v_heads,
                                             gdn.head_v_dim, gdn.head_k_dim)
        self._experts: dict[int, SwitchExperts] = {
            i: swiglu_experts(layer.mlp.switch_mlp) for i, layer in enumerate(self.layers)
            if hasattr(layer.mlp, "switch_mlp")}

    # ---- what the engine asks ----------------------------------------------------------------
    def layer_kv(self) -> list[LayerKV]:
        out, pool_layer = [], 0
        for i, layer in enumerate(self.layers):
            if i in self._states:
                out.append(LayerKV(-1, False, 0, 0, state=self._states[i]))
            else:
                attn = layer.self_attn
                out.append(LayerKV(pool_layer, True, attn.num_key_value_heads, attn.head_dim))
                pool_layer += 1
        return out

    def conv_dtype(self) -> mx.Dtype:
        """The dtype of the conv state: the activations' (mlx-lm keeps it in the input's)."""
        gdn = self.layers[next(iter(self._states))].linear_attn
        return gdn.dt_bias.dtype

    def expert_layers(self) -> dict[int, int]:
        return {i: e.num_experts for i, e in self._experts.items()}

    def describe_layers(self) -> list[str]:
        n = len(self.layers)
        lines = [f"{len(self._states)} of {n} layers are Gated DeltaNet (a recurrent state per "
                 f"sequence), {n - len(self._states)} gated attention"]
        if self.config.get("vision_config"):
            lines.append("the folder's vision tower (vision_config) is not loaded: text only")
        if self._experts:
            args = self.lm.args
            lines.append(f"{len(self._experts)} of {n} layers route each token to "
                         f"{args.num_experts_per_tok} of {args.num_experts} experts, plus a "
                         "shared expert")
        return lines

    def head(self, step, h):
        h = step.norm(self.inner.norm, h)
        if self.lm.args.tie_word_embeddings:
            return step.linear(self.inner.embed_tokens, h, tied=True)
        return step.linear(self.lm.lm_head, h)

    # ---- the maths -----------------------------------------------------------------------
    def layer(self, step, i, x):
        layer = self.layers[i]
        h = step.norm(layer.input_layernorm, x)
        if i in self._states:
            x = x + self._gated_delta(step, i, layer.linear_attn, h)
        else:
            x = x + gated_attention(step, i, layer.self_attn, h)
        h = step.norm(layer.post_attention_layernorm, x)
        if i in self._experts:
            return x + self._moe(step, i, layer.mlp, h)
        return x + swiglu_mlp(step, layer.mlp, h)

    def _projections(self, step, gdn, h):
        """(qkv (rows, conv_dim), z (rows, Hv, Dv), b, a (rows, Hv)) for one GDN layer."""
        qkv, z, b, a = step.linears([gdn.in_proj_qkv, gdn.in_proj_z, gdn.in_proj_b,
                                     gdn.in_proj_a], h)
        return qkv[0], z[0].reshape(step.rows, gdn.num_v_heads, gdn.head_v_dim), b[0], a[0]

    def _gated_delta(self, step, i, gdn, h):
        qkv, z, b, a = self._projections(step, gdn, h)
        y = step.recurrent(i, gdn, qkv, a, b)  # (rows, Hv, Dv)
        out = gated_rms_norm(gdn.norm, y, z)
        return step.linear(gdn.out_proj, out.reshape(1, step.rows, -1))

    def _moe(self, step, i, block, x):
        # Qwen3NextSparseMoeBlock.__call__, op for op.
        gates = mx.softmax(step.linear(block.gate, x), axis=-1, precise=True)
        k = block.top_k
        inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if block.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        y = step.experts(i, self._experts[i], x, inds, block.num_experts)
        y = (y * scores[..., None]).sum(axis=-2)
        shared = swiglu_mlp(step, block.shared_expert, x)
        return y + mx.sigmoid(step.linear(block.shared_expert_gate, x)) * shared


class Qwen3_5Moe(Qwen3_5):
    name = "qwen3_5_moe"
    model_types = ("qwen3_5_moe",)
    model_class = qwen3_5_moe.Model
    differs = "qwen3_5 with routed SwiGLU experts and a sigmoid-gated shared expert"


class Qwen3Next(Qwen3_5):
    name = "qwen3_next"
    model_types = ("qwen3_next",)
    model_class = qwen3_next.Model
    differs = ("qwen3_5's hybrid layers with the GDN projections fused per key head; routed "
               "experts with a shared expert on decoder_sparse_step layers")

    def _projections(self, step, gdn, h):
        qkvz, ba = step.linears([gdn.in_proj_qkvz, gdn.in_proj_ba], h)
        q, k, v, z, b, a = gdn.fix_query_key_value_ordering(qkvz, ba)
        rows = step.rows
        qkv = mx.concatenate([q.reshape(1, rows, -1), k.reshape(1, rows, -1),
                              v.reshape(1, rows, -1)], axis=-1)
        return qkv[0], z[0], b[0], a[0]


def gated_attention(step, i, attn, h):
    """Qwen3NextAttention over the step's rows: the query's second half per head gates the
    output through a sigmoid."""
    rows = step.rows
    qg, k, v = step.linears([attn.q_proj, attn.k_proj, attn.v_proj], h)
    q, gate = mx.split(qg.reshape(rows, attn.num_attention_heads, -1), 2, axis=-1)
    k = k.reshape(rows, attn.num_key_value_heads, -1)
    v = v.reshape(rows, attn.num_key_value_heads, -1)
    q, k = step.norm(attn.q_norm, q), step.norm(attn.k_norm, k)
    q, k = step.rope(attn.rope, q, k)
    o = step.attend(i, q, k, v, attn.scale)
    return step.linear(attn.o_proj, o[None] * mx.sigmoid(gate.reshape(1, rows, -1)))


def gated_rms_norm(norm: nn.Module, y: mx.array, z: mx.array) -> mx.array:
    """Qwen3NextRMSNormGated: rms_norm(y) * silu(z), the product in float32 (mlx-lm's
    precise_swiglu, uncompiled)."""
    x = mx.fast.rms_norm(y, norm.weight, norm.eps)
    return (nn.silu(z.astype(mx.float32)) * x.astype(mx.float32)).astype(y.dtype)


def check_layer_types(config: dict, family: str, linear: list[bool]) -> None:
    """mlx-lm places the layers by full_attention_interval and ignores the config's
    `layer_types` (Hugging Face's list): a folder whose list says otherwise would be computed
    with the wrong layer at some index, so it is refused naming the first."""
    types = config.get("text_config", config).get("layer_types")
    if types is None:
        return
    expected = ["linear_attention" if is_linear else "full_attention" for is_linear in linear]
    if len(types) != len(expected):
        raise UnsupportedModelError(f"{family}: config layer_types has {len(types)} entries "
                                    f"for {len(expected)} layers")
    for i, (said, made) in enumerate(zip(types, expected, strict=True)):
        if said != made:
            raise UnsupportedModelError(
                f"{family}: config layer_types says layer {i} is {said!r}, but "
                f"full_attention_interval makes it {made!r} (as mlx-lm computes it)")
