"""A tiny random-weight llama and a byte tokenizer: fast tests of the engine's real code paths.

4-bit quantized by default because MLX's CPU quantized matmul computes each row on its own,
so batched and row-wise execution are bit-identical there (FACTS.md): any difference between a
request run alone and in a batch then points at a real bug (block tables, positions, masks).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from engine.model_loader import LoadedModel


class ByteTokenizer:
    """Token id = byte value + 3; ids 0..2 are <unk>, <bos>, <eos>."""

    vocab_size = 259
    eos_token_id = 2

    @property
    def eos_token_ids(self) -> set[int]:
        return {self.eos_token_id}

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id - 3]) if token_id >= 3 else b""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


def tiny_config(**overrides) -> dict:
    config = {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "vocab_size": ByteTokenizer.vocab_size, "head_dim": 16,
        "max_position_embeddings": 512, "rope_theta": 10000.0, "rope_traditional": False,
        "tie_word_embeddings": True,
    }
    config.update(overrides)
    return config


def tiny_model(seed: int = 0, quantize: bool = True, **overrides) -> LoadedModel:
    """Build on the calling thread (the engine thread, when passed to Engine as a loader)."""
    config = tiny_config(**overrides)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # Larger than default init so logits are spread out and greedy choices are not near-ties.
    model.update(nn.utils.tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, model.parameters()))
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
        config["quantization"] = {"group_size": 32, "bits": 4}
    mx.eval(model.parameters())
    return LoadedModel(model=model, tokenizer=ByteTokenizer(), config=config, name="tiny-llama",
                       weights="q4" if quantize else "f32", source="tiny")


class FixedTextTokenizer(ByteTokenizer):
    """Decodes every token to the same text: tests make the model's output hostile with it."""

    def __init__(self, text: str):
        self.text = text

    def decode(self, ids: list[int]) -> str:
        return self.text * len(ids)


def tiny_model_saying(text: str):
    """The tiny model, every output token of which reads as `text`."""

    def load(*args, **kwargs) -> LoadedModel:
        loaded = tiny_model()
        loaded.tokenizer = FixedTextTokenizer(text)
        return loaded

    return load
