"""What every model family states, and the llama-style pieces most of them share.

A family adapter says how one decoder computes around the engine's packed rows: it takes the
step's hidden states (1, rows, hidden) through embedding, layers and head, using mlx-lm's own
modules and weights for everything but attention. Attention, RoPE positions, the kernel path
of every linear layer and the expert calls go through the step (`engine.step.Step`), so an
adapter never sees block tables, the pool or a kernel policy. A family whose layers are
llama's pre-norm block names their modules (`fused_layer_spec`) for the native fused layer.

Families whose layers keep a recurrent state instead of keys and values (qwen3_5's and
qwen3_next's Gated DeltaNet layers, engine/models/qwen3_5.py): `layer_kv` gives such a layer no
pool layer but a LayerState, and the step hands it the sequences' slots in the state pool kept
beside the paged KV (engine/state_pool.py; allocated and freed with the request, as blocks
are: engine/state_slots.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import Llama3RoPE, ProportionalRoPE, SuScaledRoPE, YarnRoPE

from engine.native_ops import FusedLayer
from engine.state_pool import LayerState
from engine.step import Step


class UnsupportedModelError(ValueError):
    """A model the engine cannot compute exactly: refused at load, never run."""


@dataclass(frozen=True)
class LayerKV:
    """What one decoder layer keeps in the paged pool, and how it reads it."""

    pool_layer: int  # the pool layer holding its keys and values
    writes: bool  # False: it reads keys and values another layer wrote (KV sharing)
    kv_heads: int
    head_dim: int
    window: int | None = None  # sliding window: each row sees its last `window` positions
    # A recurrent layer (Gated DeltaNet): no pool layer (pool_layer -1, writes False); its
    # per-sequence state lives in the state pool (engine/state_pool.py).
    state: LayerState | None = None


class Family:
    """One model family. Subclasses state their maths in `layer` (and `embed` / `head` where
    they differ from llama) and name the mlx-lm class they were written for."""

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]  # config.json model_type values it serves
    model_class: ClassVar[type]  # the mlx-lm Model class its maths was written against
    differs: ClassVar[str]  # how it differs from llama, for `batchscope models`

    def __init__(self, model: nn.Module, config: dict):
        self.model = model
        self.config = config
        self.inner = model.model
        self.layers = list(self.inner.layers)
        for i, layer in enumerate(self.layers):  # a recurrent layer has no self_attn
            check_rope(getattr(getattr(layer, "self_attn", None), "rope", None), self.name, i)

    # ---- what the engine asks of every family -------------------------------------------
    def layer_kv(self) -> list[LayerKV]:
        """One entry per decoder layer. Default: each layer has its own pool layer."""
        return [LayerKV(i, True, layer.self_attn.n_kv_heads, head_dim(layer.self_attn),
                        self.window(i))
                for i, layer in enumerate(self.layers)]

    def window(self, i: int) -> int | None:
        """Layer i's sliding window, or None for full attention."""
        return None

    def fused_layer_spec(self, i: int) -> FusedLayer | None:
        """Layer i's modules as the native fused decoder layer takes them, where its `layer`
        computes llama_layer (which asks the step for that op), else None (the default).
        Asked once per layer by the runner."""
        return None

    def recurrent_layers(self) -> list[LayerState]:
        """The layers that keep a recurrent state, in state-pool order (none: all attend)."""
        return [kv.state for kv in self.layer_kv() if kv.state is not None]

    def conv_dtype(self) -> mx.Dtype:
        """The dtype of the recurrent layers' conv state (a family with such layers says)."""
        raise NotImplementedError

    def embed(self, step: Step, tokens: mx.array) -> mx.array:
        return step.embed(self.inner.embed_tokens, tokens)  # (1, rows, hidden)

    def layer(self, step: Step, i: int, x: mx.array) -> mx.array:
        raise NotImplementedError

    def head(self, step: Step, h: mx.array) -> mx.array:
        """Logits (1, n, vocab) for the last hidden states h (1, n, hidden) of sampled rows."""
        h = step.norm(self.inner.norm, h)
        if getattr(self.model, "lm_head", None) is not None:
            return step.linear(self.model.lm_head, h)
        return step.linear(self.inner.embed_tokens, h, tied=True)

    def expert_layers(self) -> dict[int, int]:
        """Mixture-of-experts layers: layer index -> number of experts (empty: a dense model).
        The dashboard shows expert load only for a model that has some."""
        return {}

    def describe_layers(self) -> list[str]:
        """Per layer kind, one line for the start-up log (only where layers differ)."""
        windows = [w for w in (self.window(i) for i in range(len(self.layers))) if w]
        if not windows:
            return []
        return [f"{len(windows)} of {len(self.layers)} layers attend over a sliding window "
                f"of {windows[0]} tokens"]


# RoPE modules whose rotation depends on the position alone, so they rotate each row at its own
# (array) offset exactly as mlx-lm rotates a whole sequence. DynamicNTKScalingRoPE is not one:
# its base depends on the call's length and an int offset.
PER_ROW_ROPES = (nn.RoPE, ProportionalRoPE, Llama3RoPE, YarnRoPE, SuScaledRoPE)


def check_rope(rope: nn.Module | None, family: str, i: int) -> None:
    """Refuse at load a RoPE the step cannot apply at each row's own position (None: a layer
    without RoPE)."""
    if rope is not None and type(rope) not in PER_ROW_ROPES and type(rope).__name__ != "NoPE":
        raise UnsupportedModelError(
            f"{family} layer {i}: RoPE {type(rope).__name__} cannot rotate each row at its own "
            "position")


def gelu_approx(x: mx.array) -> mx.array:
    """mlx.nn.gelu_approx's formula, uncompiled: mlx-lm's is mx.compile'd, and a function
    compiled on the engine thread makes the process abort at exit (MLX 0.32). The same bits."""
    return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def head_dim(attn: nn.Module) -> int:
    dim = getattr(attn, "head_dim", None)
    if dim is None:
        dim = attn.q_proj.weight.shape[0] // attn.n_heads  # llama's Attention keeps no head_dim
    return int(dim)


# ---- llama-style pieces ----------------------------------------------------------------


def llama_attention(step: Step, i: int, attn: nn.Module, h: mx.array, *,
                    qk_norm: bool = False, rope: bool = True) -> mx.array:
    """Separate q/k/v projections (biases live in the modules), optional per-head q/k
    RMSNorm before RoPE, paged attention, the output projection."""
    rows = step.rows
    q, k, v = step.linears([attn.q_proj, attn.k_proj, attn.v_proj], h)
    q = q.reshape(rows, attn.n_heads, -1)
    k = k.reshape(rows, attn.n_kv_heads, -1)
    v = v.reshape(rows, attn.n_kv_heads, -1)
    if qk_norm:
        q, k = step.norm(attn.q_norm, q), step.norm(attn.k_norm, k)
    if rope:
        q, k = step.rope(attn.rope, q, k)
    o = step.attend(i, q, k, v, attn.scale)
    return step.linear(attn.o_proj, o[None])


def llama_layer(step: Step, i: int, layer: nn.Module, x: mx.array, *, qk_norm: bool = False,
                rope: bool = True) -> mx.array:
    """The pre-norm block: x + attn(rmsnorm(x)), then x + swiglu_mlp(rmsnorm(x)), op by op. The
    runner takes the layer as one native op instead where the step takes every part of it
    natively (ModelRunner.decoder_layers, the same bits: the family's fused_layer_spec(i) must
    be llama_layer_spec with the same qk_norm and rope)."""
    x = x + llama_attention(step, i, layer.self_attn, step.norm(layer.input_layernorm, x),
                            qk_norm=qk_norm, rope=rope)
    return x + swiglu_mlp(step, layer.mlp, step.norm(layer.post_attention_layernorm, x))


def llama_layer_spec(layer: nn.Module, *, qk_norm: bool = False,
                     rope: bool = True) -> FusedLayer:
    """llama_layer's modules, as the fused op takes them."""
    attn, mlp = layer.self_attn, layer.mlp
    return FusedLayer(layer.input_layernorm, layer.post_attention_layernorm, attn.q_proj,
                      attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                      mlp.down_proj, attn.n_heads, attn.n_kv_heads, head_dim(attn), attn.scale,
                      q_norm=attn.q_norm if qk_norm else None,
                      k_norm=attn.k_norm if qk_norm else None,
                      rope=attn.rope if rope else None)


def swiglu_mlp(step: Step, mlp: nn.Module, h: mx.array) -> mx.array:
    # Not mlx-lm's compiled `swiglu`: a function compiled on a non-main thread makes the
    # process abort at exit (MLX 0.32). The uncompiled form gives bit-identical results.
    gate, up = step.linears([mlp.gate_proj, mlp.up_proj], h)
    return step.linear(mlp.down_proj, nn.silu(gate) * up)
