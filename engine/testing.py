"""Tiny random-weight models for tests and benchmarks: a llama with a byte tokenizer (fast tests
of the engine's real code paths), and mlx-lm folders of any family (make_family_folder).

4-bit quantized by default because MLX's CPU quantized matmul computes each row on its own,
so batched and row-wise execution are bit-identical there (docs/kernel-paths.md): any
difference between a request run alone and in a batch then points at a real bug (block
tables, positions, masks).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path

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


def cancel_after_tokens(handles, counts) -> None:
    """Read each request's events and cancel it once it has produced counts[i] tokens (a
    request that finishes sooner is left as it is); handles past len(counts) are not touched."""
    for handle, n in zip(handles, counts, strict=False):
        tokens = 0
        for event in handle:
            tokens += hasattr(event, "token_id")
            if tokens >= n:
                handle.cancel()
                break


class ScriptedDrafts:
    """A Proposer (engine/speculative.py) drafting known continuations."""

    def __init__(self, wrong: int = 3, vocab: int = ByteTokenizer.vocab_size):
        """wrong: every wrong-th output position gets a wrong draft (1: every draft is
        wrong); vocab: the model's, to keep a wrong draft a valid token."""
        self.wrong = wrong
        self.vocab = vocab
        self.expected: dict[tuple[int, ...], list[int]] = {}

    def learn(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        self.expected[tuple(prompt_ids)] = list(output_ids)

    def propose(self, wanted):
        out = {}
        for seq_id, tokens, k in wanted:
            for prompt, continuation in self.expected.items():
                n = len(prompt)
                done = len(tokens) - n
                if tuple(tokens[:n]) != prompt or tokens[n:] != continuation[:done]:
                    continue
                out[seq_id] = [(t + 1) % self.vocab if (done + i) % self.wrong == self.wrong - 1
                               else t for i, t in enumerate(continuation[done:done + k])]
        return out


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


FAMILY_VOCAB = 49152


# Prompts whose greedy continuations tests/e2e/test_reference.py and benchmarks/kv_dtype.py
# compare with mlx-lm's.
REFERENCE_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colors: 1.",
    "Water boils at 100 degrees Celsius, which is",
]


def mlx_lm_greedy(weights: str):
    """An independent reference: mlx-lm's own generate_step on the embedded model exported as
    an mlx-lm folder at `weights` (engine.export.export_model, as `batchscope
    export-model`). Returns (tokenizer, generate), generate(prompt_ids, max_tokens) giving
    mlx-lm's greedy ids and, per step, its logprobs over the vocabulary."""
    import tempfile

    import numpy as np
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from engine.export import export_model

    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = load(str(export_model(tmp, weights=weights)))

    def generate(prompt_ids: list[int], max_tokens: int):
        steps = list(generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens))
        return ([int(token) for token, _ in steps],
                [np.array(logprobs.astype(mx.float32)) for _, logprobs in steps])

    return tokenizer, generate


@cache
def embedded_tokenizer():
    from engine.model_loader import load_embedded_tokenizer

    return load_embedded_tokenizer()


def make_family_folder(path: Path, module, config: dict, *, quantize: bool = False,
                       seed: int = 0, scale: float = 3.0, bias_scale: float = 0.5) -> Path:
    """Write a tiny folder of the mlx-lm model `module` (e.g. mlx_lm.models.llama).

    Made the way a user's folder is: mlx-lm's own ModelArgs and Model, its save_model and
    save_config, and with quantize=True its quantize_model at 4 bits, group size 64, as
    mlx-community ships. The tokenizer is the embedded model's (a real 49152-token vocabulary,
    so prompts are real text). Weights are scaled up so logits are spread out and greedy
    choices are not near-ties."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import quantize_model, save_config, save_model

    from engine.export import portable_tokenizer_config

    config = {"vocab_size": FAMILY_VOCAB, "max_position_embeddings": 2048, **config}
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Matrices scaled up (spread logits); 1-d parameters (norms, biases) get random values so
    # a family's use of them (1 + w norms, biases) is exercised, not left at 0 or 1.
    params = []
    for name, p in tree_flatten(model.parameters()):
        if p.ndim >= 2:
            p = p * scale
        elif p.dtype in (mx.float32, mx.float16, mx.bfloat16):
            p = p + bias_scale * mx.random.normal(p.shape, dtype=p.dtype)
        params.append((name, p))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    if quantize:
        model, config = quantize_model(model, config, group_size=64, bits=4)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(config, path / "config.json")
    tokenizer = embedded_tokenizer()
    tokenizer.save_pretrained(str(path))
    portable_tokenizer_config(path / "tokenizer_config.json", tokenizer.chat_template)
    return path


# Tiny configurations of every supported family, by name: (mlx_lm.models module, config). Tests
# build folders from them (tests/engine/test_family_*.py), and so does benchmarks/families.py.
_DENSE = {"hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "tie_word_embeddings": True}
_S, _F = "sliding_attention", "full_attention"
_GEMMA4 = {"model_type": "gemma4_text", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "head_dim": 16, "global_head_dim": 32,
           "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "sliding_window": 16,
           "final_logit_softcapping": 30.0,
           "rope_parameters": {
               _F: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                    "rope_type": "proportional"},
               _S: {"partial_rotary_factor": 1.0, "rope_theta": 10000.0,
                    "rope_type": "default"}}}
_MOE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
_PHI3 = {"model_type": "phi3", "hidden_size": 128, "num_hidden_layers": 3,
         "intermediate_size": 256, "num_attention_heads": 4, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0}
_HYBRID = {"hidden_size": 64, "num_hidden_layers": 8, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "rms_norm_eps": 1e-6, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
           "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
           "full_attention_interval": 4, "tie_word_embeddings": False,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.25}}
FAMILY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {**_DENSE, "model_type": "llama", "head_dim": 16}),
    "llama-sliding": ("llama", {**_DENSE, "model_type": "llama", "head_dim": 16,
                                "layer_types": [_S, _S, _F], "sliding_window": 24}),
    "mistral": ("llama", {**_DENSE, "model_type": "mistral", "tie_word_embeddings": False}),
    "qwen2": ("qwen2", {**_DENSE, "model_type": "qwen2"}),
    "qwen3": ("qwen3", {**_DENSE, "model_type": "qwen3", "head_dim": 16}),
    "smollm3": ("smollm3", {**_DENSE, "model_type": "smollm3", "no_rope_layer_interval": 2}),
    # 4 layers, every 3rd global: layers 0, 1 and 3 slide over 20 tokens (not a multiple of
    # the 16-token block), layer 2 sees everything. hidden 128: sqrt(128) is not a bfloat16, so
    # the embedding scale's rounding shows; query_pre_attn_scalar != head_dim, so its scale too.
    "gemma3_text": ("gemma3_text", {
        "model_type": "gemma3_text", "hidden_size": 128, "num_hidden_layers": 4,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "query_pre_attn_scalar": 24, "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 20, "sliding_window_pattern": 3}),
    # Untied heads: with a tied one these random models repeat their input token. Layers 4
    # and 5 share the keys and values of layers 3 (the last sliding one before them) and 2;
    # per-layer inputs; their MLPs are double-wide.
    "gemma4_text": ("gemma4_text", {
        **_GEMMA4, "num_hidden_layers": 6, "layer_types": [_S, _S, _F, _S, _S, _F],
        "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": FAMILY_VOCAB, "use_double_wide_mlp": True,
        "tie_word_embeddings": False}),
    # Experts beside the MLP; full layers with one kv head whose values are their keys.
    "gemma4_text-moe": ("gemma4_text", {
        **_GEMMA4, "num_hidden_layers": 5, "layer_types": [_S, _F, _S, _S, _F],
        "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 0,
        "use_double_wide_mlp": False, "attention_k_eq_v": True,
        "num_global_key_value_heads": 1, "enable_moe_block": True, "num_experts": 4,
        "top_k_experts": 2, "moe_intermediate_size": 64, "tie_word_embeddings": False}),
    "gpt_oss": ("gpt_oss", {
        "model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 4,
        "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 16, "rms_norm_eps": 1e-5, "rope_theta": 150000,
        "layer_types": [_S, _F] * 2,
        # gpt-oss's own RoPE scaling (its config.json)
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                         "truncate": False}}),
    # Layer 1 is dense (mlp_only_layers): layers 0 and 2 route, each token to 2 of 8 experts.
    "qwen3_moe": ("qwen3_moe", {
        **_MOE, "model_type": "qwen3_moe", "num_hidden_layers": 3, "head_dim": 16,
        "intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": [1], "moe_intermediate_size": 64,
        "norm_topk_prob": True, "rope_theta": 10000.0}),
    # Every layer routes; the experts are intermediate_size wide.
    "mixtral": ("mixtral", {
        **_MOE, "model_type": "mixtral", "num_hidden_layers": 2, "intermediate_size": 64,
        "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6}),
    # Hybrids: layers 0-2 and 4-6 Gated DeltaNet, 3 and 7 gated attention (every 4th); two
    # value heads per key head; RoPE on a quarter of each head.
    "qwen3_5": ("qwen3_5", {**_HYBRID, "model_type": "qwen3_5"}),
    "qwen3_5_moe": ("qwen3_5_moe", {**_HYBRID, "model_type": "qwen3_5_moe", "num_experts": 4,
                                    "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                    "shared_expert_intermediate_size": 32}),
    # Flat config; layer 1 keeps a dense MLP (mlp_only_layers), the others route.
    "qwen3_next": ("qwen3_next", {
        **_HYBRID, "model_type": "qwen3_next", "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25, "num_experts": 4, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": [1], "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "norm_topk_prob": True}),
    # Phi-3-mini's shape: full rotary, one kv head per head, its own lm_head.
    "phi3": ("phi3", {**_PHI3, "tie_word_embeddings": False}),
    # Phi-4-mini's shape: 3/4 of each head rotated, grouped kv heads, tied embeddings; factor
    # 2048 / 512 > 1, so SuScaledRoPE scales the rotated part by sqrt(1 + ln 4 / ln 512).
    "phi3-longrope": ("phi3", {
        **_PHI3, "num_key_value_heads": 2, "tie_word_embeddings": True,
        "partial_rotary_factor": 0.75, "max_position_embeddings": 2048,
        "original_max_position_embeddings": 512,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 12,
                         "long_factor": [1.0 + 0.25 * i for i in range(12)]}}),
}
