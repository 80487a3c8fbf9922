"""Model families: one adapter per family, chosen by config.json's `model_type`.

Each adapter states how its decoder computes around the engine's packed rows and paged
attention (engine/models/base.py). The registry is explicit: a model_type that is not listed
is refused by name, and so is a model whose mlx-lm class is not the one its adapter was
written for. Adding a family is one module here, one line in FAMILIES, one configuration in
engine.testing.FAMILY_CONFIGS and one test file, tests/engine/test_family_<name>.py
(docs/models.md).
"""

from __future__ import annotations

from engine.models.base import Family, LayerKV, UnsupportedModelError
from engine.models.gemma3 import Gemma3
from engine.models.gemma4 import Gemma4
from engine.models.gpt_oss import GptOss
from engine.models.llama import Llama
from engine.models.moe import Mixtral, Qwen3Moe
from engine.models.phi3 import Phi3
from engine.models.qwen import Qwen2, Qwen3
from engine.models.qwen3_5 import Qwen3_5, Qwen3_5Moe, Qwen3Next
from engine.models.smollm3 import SmolLM3

FAMILIES: tuple[type[Family], ...] = (Llama, Qwen2, Qwen3, SmolLM3, Gemma3, Phi3, GptOss,
                                      Qwen3Moe, Mixtral, Gemma4, Qwen3_5, Qwen3_5Moe,
                                      Qwen3Next)

# mlx-lm's other recurrent (state-space and hybrid) families: refused with what they are, not
# as unknown, until they have adapters.
RECURRENT_TYPES = ("mamba", "mamba2", "nemotron_h", "lfm2", "lfm2_moe", "granitemoehybrid",
                   "falcon_h1", "jamba", "plamo2", "recurrent_gemma", "rwkv7", "kimi_linear")

_BY_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}


def supported_model_types() -> list[str]:
    return sorted(_BY_TYPE)


def model_type_of(model, config: dict | None = None) -> str:
    args = getattr(model, "args", None)
    model_type = getattr(args, "model_type", None) or (config or {}).get("model_type")
    if not model_type:
        raise UnsupportedModelError("the model names no model_type: not an mlx-lm model")
    return str(model_type)


def check_model_type(model_type: str) -> type[Family]:
    """The family serving model_type, or UnsupportedModelError listing the supported ones."""
    family = _BY_TYPE.get(model_type)
    if family is None and model_type in RECURRENT_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is a recurrent (state-space or hybrid) model without "
            "an adapter yet; the hybrid families supported are qwen3_5, qwen3_5_moe and "
            "qwen3_next")
    if family is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: "
            f"{', '.join(supported_model_types())}")
    return family


def family_for(model, config: dict | None = None) -> Family:
    """The adapter for a loaded mlx-lm model, or UnsupportedModelError naming why not."""
    model_type = model_type_of(model, config)
    family = check_model_type(model_type)
    if type(model) is not family.model_class:
        cls = type(model)
        expected = family.model_class
        raise UnsupportedModelError(
            f"model_type {model_type!r}: the loaded class {cls.__module__}.{cls.__qualname__} "
            f"is not {expected.__module__}.{expected.__qualname__}, which the {family.name} "
            "adapter was written for")
    return family(model, dict(config or {}))


__all__ = ["FAMILIES", "Family", "LayerKV", "UnsupportedModelError", "check_model_type",
           "family_for",
           "model_type_of", "supported_model_types"]
