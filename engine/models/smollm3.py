"""SmolLM3: llama's block, but every `no_rope_layer_interval`-th layer has no RoPE (NoPE)."""

from __future__ import annotations

from mlx_lm.models import smollm3

from engine.models.base import Family, llama_layer, llama_layer_spec


class SmolLM3(Family):
    name = "smollm3"
    model_types = ("smollm3",)
    model_class = smollm3.Model
    differs = "llama's block; some layers (no_rope_layers) skip RoPE"

    def __init__(self, model, config):
        super().__init__(model, config)
        self.uses_rope = [bool(flag) for flag in model.args.no_rope_layers]

    def layer(self, step, i, x):
        return llama_layer(step, i, self.layers[i], x, rope=self.uses_rope[i])

    def fused_layer_spec(self, i):
        return llama_layer_spec(self.layers[i], rope=self.uses_rope[i])

    def describe_layers(self):
        skipped = self.uses_rope.count(False)
        return [f"{skipped} of {len(self.layers)} layers without RoPE"] if skipped else []
