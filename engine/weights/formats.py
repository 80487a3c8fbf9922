"""Which format a model's weights are served in: "q4" (as shipped), "f32" or "bf16".

"q4" = the weights as shipped (the GGUF's 4-bit linears and 8-bit embedding, or whatever
quantization a folder ships); "f32"/"bf16" = dequantized at load into that dtype. The rules
for "auto" (resolve_weights, and for a folder folder_format then settle_folder_format), and
whether a dequantized folder fits in memory (check_expansion).
"""

from __future__ import annotations

import json
import logging
import struct
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from engine.config import WEIGHT_FORMATS
from engine.platform import available_memory
from engine.platform import backend_info as _backend_info

log = logging.getLogger("batchscope.engine")

DTYPES = {"f32": mx.float32, "bf16": mx.bfloat16}


def validate_weights(weights: str) -> None:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(
            f"unknown weights format {weights!r}: choose one of {', '.join(WEIGHT_FORMATS)}"
        )


def resolve_weights(requested: str, backend_info: dict | None = None,
                    native_quantized: bool | None = None) -> str:
    """Turn a requested weights format into a concrete one ("q4", "f32" or "bf16").

    Explicit formats pass through. "auto" picks the fastest format for the backend, as
    measured by benchmarks/engine_weights.py, benchmarks/llama_cpp_peer.py and
    benchmarks/weights_speed.py (benchmarks/results/engine_weights.md and llama_cpp.md;
    docs/weights.md has weights_speed.py's table):
      - Metal / CUDA: "q4". MLX has fast quantized GPU kernels, and decode is bound by
        memory bandwidth, which 4-bit weights cut ~4x against bf16.
      - CPU with the native quantized kernel built and a vector path for it (AVX-512 or
        AVX2; native_quantized, default: native.decode_quantized_fast()): "q4". The engine
        decodes at q4 as fast as at f32 or faster (faster at one sequence, about level at
        8-16 in benchmarks/results/engine_weights.md), in a fifth of the memory, and every
        row of a step gets the same bits whatever shares it; its prefill stays close to f32's.
      - CPU without it, with an optimized BLAS (OpenBLAS preloaded on Linux; Accelerate on
        macOS): "f32". MLX's CPU quantized matmul computes one row at a time: f32 decodes
        faster at batch 1, more so batched, and prefills far faster (weights_speed.py).
      - CPU with only MLX's bundled reference BLAS: "bf16" (MLX's own kernels: ahead of q4
        and f32 once rows are batched and for prefill, in weights_speed.py; bf16 rounds the
        weights, so greedy text can differ from q4's: docs/weights.md, Numerics).
    A folder whose quantization the native kernel cannot take falls back to the CPU rules
    without it (settle_folder_format).
    """
    validate_weights(requested)
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

    from engine.native_ops import quantized_weight  # the kernel's own rule for a layer

    quantized = [m for m in model.modules()
                 if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding
                               | QuantizedSwitchLinear)]
    half = [name for name, v in tree_flatten(model.parameters())
            if v.dtype in (mx.float16, mx.bfloat16) and not name.endswith((".scales", ".biases"))]
    return bool(quantized) and not half and all(
        not isinstance(m, QuantizedSwitchLinear) and quantized_weight(m, type(m)) is not None
        for m in quantized)


def folder_format(folder: Path, requested: str) -> str:
    """The format to load a folder in, decided before reading its weights: resolve_weights'
    choice, fitted to the memory available (check_expansion) where it would dequantize."""
    weights = resolve_weights(requested)
    if weights in DTYPES:
        weights = check_expansion(folder, requested, weights)
    return weights


def settle_folder_format(folder: Path, requested: str, weights: str, model: nn.Module) -> str:
    """The format to serve a loaded folder's `model` in, `weights` being folder_format's
    choice: on the CPU "auto" revisits it now that the layers are known."""
    if requested == "auto" and weights == "q4" and mx.default_device() == mx.cpu \
            and not native_takes(model):
        # Not a format the native kernel takes (or not quantized): the CPU rule without it.
        weights = resolve_weights("auto", native_quantized=False)
        weights = check_expansion(folder, requested, weights)
    if requested == "auto" and weights == "bf16" and has_experts(model) \
            and mx.default_device() == mx.cpu:
        # MLX's CPU gather_mm (dense experts) computes float32 only
        weights = check_expansion(folder, requested, "f32")
    return weights


def has_experts(model: nn.Module) -> bool:
    """Whether the model has mixture-of-experts layers (mlx-lm's stacked expert weights)."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    return any(isinstance(m, SwitchLinear | QuantizedSwitchLinear) for m in model.modules())


def describe_weights(model: nn.Module) -> str:
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


# Share of the available memory a dequantized folder may take at load ("auto"): the shipped
# weights are in memory while they expand, and the KV pool and the server need room after.
EXPANSION_FIT = 0.75
_SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4,
                         "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def check_expansion(folder: Path, requested: str, weights: str) -> str:
    """The format to load a folder in, given that `weights` (f32 or bf16) would dequantize
    or convert it: "auto" keeps the shipped format ("q4") when the expansion would not fit
    comfortably in the memory available now, and says so; an explicit format that cannot
    fit at all is refused, naming the sizes."""
    sizes = expansion_bytes(folder, DTYPES[weights].size)
    free = available_memory()
    if sizes is None or free is None:
        return weights
    shipped, expanded = sizes
    # At load the shipped weights are in memory while they expand. At f32 on the CPU the
    # native float32 kernel then adds its packed copy of the layers (about the expanded
    # bytes again, engine/native/decode_linear.h), once the shipped ones are gone.
    packed = weights == "f32" and _float32_kernel_packs()
    need = max(shipped + expanded, 2 * expanded) if packed else shipped + expanded
    copy = ", twice that with the native float32 kernel's packed copy" if packed else ""
    gib = 2**30
    if requested == "auto" and need > EXPANSION_FIT * free:
        log.warning("weights: keeping %s's shipped format (%.1f GiB): %s would need %.1f GiB "
                    "(%.1f GiB as %s%s), more than %.0f%% of the %.1f GiB available",
                    folder.name, shipped / gib, weights, need / gib, expanded / gib, weights,
                    copy, EXPANSION_FIT * 100, free / gib)
        return "q4"
    if requested != "auto" and need > free:
        raise ValueError(f"--weights {weights}: {folder.name} would need {need / gib:.1f} GiB "
                         f"({shipped / gib:.1f} GiB shipped, {expanded / gib:.1f} GiB "
                         f"as {weights}{copy}), more than the {free / gib:.1f} GiB available; "
                         "--weights q4 keeps the shipped format")
    return weights


def _float32_kernel_packs() -> bool:
    """Whether float32 layers get the native float32 kernel's packed copy here: where the
    default row_kernels setting takes the kernel (--row-kernels mlx, which the loader does not
    know, would not: counted anyway)."""
    from engine.attention import use_fused_attention
    from engine.config import NativeSetting
    from engine.native_ops import matmul_kernel

    return matmul_kernel(NativeSetting.AUTO, use_fused_attention()) is not None


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
