"""Dequantize a model: quantized layers become dense ones of a float dtype."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten


def dequantize_to(model: nn.Module, dtype: mx.Dtype) -> nn.Module:
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


def dense_config(config: dict) -> dict:
    """A model's config without its quantization, for the model dequantized."""
    config = dict(config)
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    return config
