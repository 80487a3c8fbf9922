"""Model families: one adapter per family, chosen by config.json's `model_type`.

Each adapter states how its decoder computes around the engine's packed rows and paged
attention (engine/models/base.py). The registry is explicit: a model_type that is not listed
is refused by name, and so is a model whose mlx-lm class is not the one its adapter was
written for. Adding a family is one module here, one line in FAMILIES, and one test in
tests/engine/test_families.py.
"""

from __future__ import annotations

from engine.models.base import Family, LayerKV, UnsupportedModelError
from engine.models.llama import Llama
from engine.models.qwen import Qwen2, Qwen3
from engine.models.smollm3 import SmolLM3

FAMILIES: tuple[type[Family], ...] = (Llama, Qwen2, Qwen3, SmolLM3)

_BY_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}


def supported_model_types() -> list[str]:
    return sorted(_BY_TYPE)


def model_type_of(model, config: dict | None = None) -> str:
    args = getattr(model, "args", None)
    model_type = getattr(args, "model_type", None) or (config or {}).get("model_type")
    if not model_type:
        raise UnsupportedModelError("the model names no model_type: not an mlx-lm model")
    return str(model_type)


def family_for(model, config: dict | None = None) -> Family:
    """The adapter for a loaded mlx-lm model, or UnsupportedModelError naming why not."""
    model_type = model_type_of(model, config)
    family = _BY_TYPE.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: "
            f"{', '.join(supported_model_types())}")
    if type(model) is not family.model_class:
        cls = type(model)
        expected = family.model_class
        raise UnsupportedModelError(
            f"model_type {model_type!r}: the loaded class {cls.__module__}.{cls.__qualname__} "
            f"is not {expected.__module__}.{expected.__qualname__}, which the {family.name} "
            "adapter was written for")
    return family(model, dict(config or {}))


__all__ = ["FAMILIES", "Family", "LayerKV", "UnsupportedModelError", "family_for",
           "model_type_of", "supported_model_types"]
