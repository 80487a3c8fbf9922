"""Read a llama GGUF as mlx-lm's `llama.Model`: tensor names, config and quantization.

MLX reads GGUF natively and hands Q4_1 tensors back in its own affine-quantized layout, so
the file maps onto mlx-lm's `llama.Model` without any re-quantization; only the names (here)
and the tokenizer (gguf_tokenizer) need translating.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama

# llama.cpp tensor names -> mlx-lm llama module paths.
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_PARAM_SUFFIXES = ("weight", "scales", "biases")


def gguf_to_mlx_name(name: str) -> str:
    """Map one GGUF tensor name (e.g. blk.3.attn_q.scales) to its mlx-lm parameter path."""
    stem, _, suffix = name.rpartition(".")
    if suffix not in _GGUF_PARAM_SUFFIXES:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", stem):
        layer, part = m.groups()
        if part in _GGUF_BLOCK_NAMES:
            return f"model.layers.{layer}.{_GGUF_BLOCK_NAMES[part]}.{suffix}"
    elif stem in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[stem]}.{suffix}"
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def metadata_value(metadata: dict, key: str) -> Any:
    """A required GGUF metadata entry, as a Python value."""
    if key not in metadata:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    value = metadata[key]
    return value.item() if isinstance(value, mx.array) else value


def load_gguf_llama(tensors: dict[str, mx.array], metadata: dict) -> tuple[nn.Module, dict, dict]:
    """(model, config, quantization) from the tensors and metadata `mx.load` read from a GGUF:
    mlx-lm's llama with the layers the file packs quantized as shipped, its config dict, and
    mlx-lm's config "quantization" for them ({} when nothing is quantized)."""
    config = _gguf_config(metadata, tied_embeddings="output.weight" not in tensors)
    mapped = {gguf_to_mlx_name(name): value for name, value in tensors.items()}
    model, quantization = _build_quantized_llama(config, mapped)
    return model, config, quantization


def _float32_repr(value: float) -> float:
    # GGUF stores float32: 1e-5 arrives as 9.999999747e-06. Keep the shortest decimal
    # that round-trips through float32, so config.json reads naturally.
    return float(np.format_float_scientific(np.float32(value), unique=True))


def _gguf_config(metadata: dict, tied_embeddings: bool) -> dict:
    """The mlx-lm llama config dict described by GGUF metadata."""
    arch = metadata_value(metadata, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only llama is supported)")
    hidden = int(metadata_value(metadata, "llama.embedding_length"))
    heads = int(metadata_value(metadata, "llama.attention.head_count"))
    head_dim = int(metadata.get("llama.attention.key_length", hidden // heads))
    rotary_dim = int(metadata.get("llama.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(f"partial rotary embeddings ({rotary_dim} of {head_dim}) unsupported")
    vocab_size = int(metadata.get("llama.vocab_size", len(metadata["tokenizer.ggml.tokens"])))
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(metadata_value(metadata, "llama.block_count")),
        "intermediate_size": int(metadata_value(metadata, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata_value(metadata, "llama.attention.head_count_kv")),
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": int(metadata_value(metadata, "llama.context_length")),
        "rope_theta": _float32_repr(metadata_value(metadata, "llama.rope.freq_base")),
        # GGUF keeps Q/K in llama.cpp's interleaved rotary layout (convert_hf_to_gguf
        # permutes them), which is what rope_traditional=True expects. With False the text
        # still looks fluent but its logits drift from llama.cpp's (often another top-1 token).
        "rope_traditional": True,
        "rms_norm_eps": _float32_repr(
            metadata_value(metadata, "llama.attention.layer_norm_rms_epsilon")),
        # No output.weight in the file: the LM head reuses the token embedding.
        "tie_word_embeddings": tied_embeddings,
        "bos_token_id": int(metadata_value(metadata, "tokenizer.ggml.bos_token_id")),
    }


def _quant_params(module: nn.Module, path: str, weights: dict[str, mx.array]) -> dict:
    """group_size and bits a packed weight was quantized with, derived from its shapes."""
    in_features = module.weight.shape[-1]
    packed_width = weights[f"{path}.weight"].shape[-1]
    n_groups = weights[f"{path}.scales"].shape[-1]
    if (32 * packed_width) % in_features or in_features % n_groups:
        raise ValueError(
            f"{path}: packed width {packed_width} and {n_groups} groups do not fit "
            f"{in_features} input features"
        )
    return {
        "group_size": in_features // n_groups,
        "bits": 32 * packed_width // in_features,
        "mode": "affine",
    }


def _quantization_config(per_layer: dict[str, dict]) -> dict:
    """mlx-lm's config "quantization": the common setting plus per-layer overrides.

    mlx_lm.utils.load_model looks each module path up in this dict first, so layers
    that differ from the default (here the 8-bit embedding) must be listed by path.
    """
    if not per_layer:
        return {}
    counts = Counter((p["group_size"], p["bits"]) for p in per_layer.values())
    (group_size, bits), _ = counts.most_common(1)[0]
    config: dict[str, Any] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    for path, params in sorted(per_layer.items()):
        if (params["group_size"], params["bits"]) != (group_size, bits):
            config[path] = dict(params)
    return config


def _build_quantized_llama(config: dict, weights: dict[str, mx.array]) -> tuple[nn.Module, dict]:
    """Instantiate mlx-lm's llama, quantize the layers the weights are packed for, load."""
    model = llama.Model(llama.ModelArgs.from_dict(config))
    per_layer: dict[str, dict] = {}

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        per_layer[path] = _quant_params(module, path, weights)
        return per_layer[path]

    nn.quantize(model, class_predicate=predicate)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model, _quantization_config(per_layer)
