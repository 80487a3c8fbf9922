"""batchscope against an independent reference: mlx-lm's own generation on the exported folder.

The embedded 4-bit model on MLX's CPU backend computes every row independently, so the token
ids must match exactly, alone and batched. Slow: loads the real model.
"""

from __future__ import annotations

import contextlib
import io
import json

import mlx.core as mx
import pytest

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colors: 1.",
    "Water boils at 100 degrees Celsius, which is",
]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def reference():
    """Greedy ids from mlx-lm's generate_step on the folder `batchscope export-model` wrote."""
    import tempfile

    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from app.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        assert main(["export-model", tmp]) == 0
        model, tokenizer = load(tmp)

    def generate(prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        steps = generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens)
        return [int(token) for token, _ in steps]

    return tokenizer, generate


def run_cli(*args: str) -> dict:
    from app.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", *args]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_cli_greedy_tokens_equal_mlx_lm(prompt, reference):
    tokenizer, generate = reference
    ours = run_cli(prompt, "--json", "--max-tokens", str(MAX_TOKENS), "--weights", "q4",
                   "--ignore-eos")
    assert ours["prompt_token_ids"] == tokenizer.encode(prompt)
    expected = generate(ours["prompt_token_ids"])
    assert ours["token_ids"] == expected
    assert ours["finish_reason"] == "length"


def test_chat_prompt_matches_mlx_lm_chat_template(reference):
    tokenizer, generate = reference
    ours = run_cli("Name a fruit.", "--chat", "--json", "--max-tokens", "24", "--weights", "q4",
                   "--ignore-eos")
    messages = [{"role": "user", "content": "Name a fruit."}]
    assert ours["prompt_token_ids"] == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True)
    assert ours["token_ids"] == generate(ours["prompt_token_ids"], 24)


def test_batched_engine_equals_mlx_lm_per_prompt(reference):
    """All prompts in one continuous batch, with chunked prefill mixed into decode steps."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    tokenizer, generate = reference
    prompts = PROMPTS + ["Hello", "Why is the sky blue?", "1, 2, 3, 4,"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    config = EngineConfig(weights="q4", max_num_batched_tokens=16, num_kv_blocks=256)
    with Engine(config).start() as engine:
        handles = [engine.submit(p, params) for p in prompts]
        results = [h.result() for h in handles]
        mixed = [r for r in engine.steps.recent() if r.prefill_rows and r.decode_rows]
        assert engine.block_manager.num_used_blocks == 0
    assert mixed, "expected steps mixing prefill chunks with decode rows"
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == generate(tokenizer.encode(prompt), 24), prompt
