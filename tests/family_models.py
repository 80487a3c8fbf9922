"""Tiny random-weight mlx-lm folders of any family, and greedy generation from both sides.

A folder is made the way a user's is: mlx-lm's own ModelArgs and Model, its save_model and
save_config, and (for "q4") its quantize_model at 4 bits with group size 64, as mlx-community
ships. The tokenizer is the embedded model's (a real 49152-token vocabulary, so prompts are
real text). Weights are scaled up so logits are spread out and greedy choices are not
near-ties: a difference in the maths then shows as different tokens within a few steps.
"""

from __future__ import annotations

import contextlib
import io
import json
from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
VOCAB = 49152


@cache
def embedded_tokenizer():
    from engine.model_loader import load_embedded_tokenizer

    return load_embedded_tokenizer()


def make_folder(path: Path, module, config: dict, *, quantize: bool = False, seed: int = 0,
                scale: float = 3.0, bias_scale: float = 0.5) -> Path:
    """Write a tiny folder of the mlx-lm model `module` (e.g. mlx_lm.models.llama)."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import quantize_model, save_config, save_model

    from engine.model_loader import _portable_tokenizer_config

    config = {"vocab_size": VOCAB, "max_position_embeddings": 2048, **config}
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
    _portable_tokenizer_config(path / "tokenizer_config.json", tokenizer.chat_template)
    return path


def mlx_lm_greedy(folder: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """mlx-lm's own greedy generation (generate_step), one prompt at a time."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(folder))
    out = []
    for ids in prompts:
        steps = generate_step(mx.array(ids), model, max_tokens=max_tokens,
                              sampler=lambda logprobs: mx.argmax(logprobs, axis=-1))
        out.append([int(token) for token, _ in steps])
    return out


def mlx_lm_logits(folder: Path, ids: list[int]) -> np.ndarray:
    """mlx-lm's logits over a whole sequence, one forward without a cache."""
    from mlx_lm import load

    model, _ = load(str(folder))
    return np.array(model(mx.array(ids)[None])[0].astype(mx.float32))


def cli_generate(folder: Path, prompt: str, max_tokens: int, *extra: str) -> dict:
    """`batchscope generate PROMPT --model FOLDER --json`, in this process."""
    from app.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", prompt, "--model", str(folder), "--json", "--ignore-eos",
                     "--max-tokens", str(max_tokens), *extra]) == 0
    return json.loads(out.getvalue())


def check_cli_equals_mlx_lm(folder: Path, weights: str, max_tokens: int = 32,
                            prompts: list[str] = PROMPTS) -> None:
    """Greedy ids of `batchscope generate` equal mlx-lm's on the same folder, per prompt."""
    ours = [cli_generate(folder, p, max_tokens, "--weights", weights) for p in prompts]
    expected = mlx_lm_greedy(folder, [o["prompt_token_ids"] for o in ours], max_tokens)
    for prompt, o, e in zip(prompts, ours, expected, strict=True):
        assert len(o["token_ids"]) == max_tokens
        first = next((i for i, (a, b) in enumerate(zip(o["token_ids"], e, strict=True))
                      if a != b), None)
        assert o["token_ids"] == e, f"{folder.name} {weights} {prompt!r}: differs at {first}"


def check_batch_equals_alone(folder: Path, weights: str, long_prompt_tokens: int,
                             max_tokens: int = 24, **engine_options) -> None:
    """8 requests of different lengths at once (one of `long_prompt_tokens`, past a sliding
    window and a prefill chunk) each equal the same request alone; then a prefix-cache hit and
    a preempted-and-resumed request give the same tokens too. On a batch-invariant
    configuration (4-bit weights on the CPU, or --batch-invariant)."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    tokenizer = embedded_tokenizer()
    base = tokenizer.encode(" ".join(f"word{i} is number {i}." for i in range(400)))
    lengths = [long_prompt_tokens, 5, 17, 33, 48, 9, 70, 26]
    prompts = [base[i:i + n] for i, n in enumerate(lengths)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    options = dict(model=str(folder), weights=weights, max_num_batched_tokens=64,
                   num_kv_blocks=256, block_size=16, **engine_options)
    with Engine(EngineConfig(**options, enable_prefix_caching=False)) as engine:
        alone = [engine.generate(p, params).token_ids for p in prompts]
        handles = [engine.submit(p, params) for p in prompts]
        together = [h.result().token_ids for h in handles]
    assert all(len(t) == max_tokens for t in alone)
    assert together == alone
    # A prefix-cache hit: the long prompt again, after it was cached.
    with Engine(EngineConfig(**options)) as engine:
        first = engine.generate(prompts[0], params)
        again = engine.generate(prompts[0], params)
    assert again.cached_prompt_tokens > 0
    assert again.token_ids == first.token_ids == alone[0]
    # Preemption: a pool too small for all of them at once preempts and resumes some.
    small = dict(options, num_kv_blocks=-(-(long_prompt_tokens + max_tokens) // 16) + 6)
    with Engine(EngineConfig(**small, enable_prefix_caching=False)) as engine:
        handles = [engine.submit(p, params) for p in prompts]
        results = [h.result() for h in handles]
    assert sum(r.preemptions for r in results) > 0
    assert [r.token_ids for r in results] == alone
