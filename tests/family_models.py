"""Greedy generation from both sides on tiny random-weight folders of any family.

The folders come from engine.testing.make_family_folder (mlx-lm's own classes, save_model and
quantize_model; the embedded tokenizer): a difference in the maths shows as different tokens
within a few steps.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import mlx.core as mx

from engine.testing import embedded_tokenizer
from engine.testing import make_family_folder as make_folder

__all__ = ["LOGPROB_TOL", "PROMPTS", "check_batch_equals_alone", "check_cli_equals_mlx_lm",
           "cli_generate", "embedded_tokenizer", "make_folder", "mlx_lm_greedy"]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


# The engine's float32 kernels agree with mlx-lm to ~1e-5 in the logprobs; a wrong detail that
# rarely flips a greedy token on a tiny random folder (a bfloat16-rounded scale, GELU's tanh
# form, a logit soft-cap, which keeps the order) moves them by ~1e-3. 2e-4 separates the two.
LOGPROB_TOL = 2e-4


def mlx_lm_greedy(folder: Path, prompts: list[list[int]],
                  max_tokens: int) -> list[list[tuple[int, float]]]:
    """mlx-lm's own greedy generation (generate_step), one prompt at a time: each token with
    its logprob."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(folder))
    out = []
    for ids in prompts:
        steps = generate_step(mx.array(ids), model, max_tokens=max_tokens,
                              sampler=lambda logprobs: mx.argmax(logprobs, axis=-1))
        out.append([(int(t), float(lp[int(t)].astype(mx.float32))) for t, lp in steps])
    return out


def cli_generate(folder: Path, prompt: str, max_tokens: int, *extra: str) -> dict:
    """`batchscope generate PROMPT --model FOLDER --json`, in this process."""
    from app.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", prompt, "--model", str(folder), "--json", "--ignore-eos",
                     "--max-tokens", str(max_tokens), *extra]) == 0
    return json.loads(out.getvalue())


def check_cli_equals_mlx_lm(folder: Path, weights: str, max_tokens: int = 32, *extra: str,
                            tol: float = LOGPROB_TOL, prompts: list[str] = PROMPTS) -> None:
    """`batchscope generate`'s greedy ids equal mlx-lm's on the same folder, and each token's
    logprob is within `tol` of mlx-lm's, per prompt."""
    ours = [cli_generate(folder, p, max_tokens, "--weights", weights, *extra) for p in prompts]
    expected = mlx_lm_greedy(folder, [o["prompt_token_ids"] for o in ours], max_tokens)
    for prompt, o, e in zip(prompts, ours, expected, strict=True):
        ids = [t for t, _ in e]
        assert len(o["token_ids"]) == max_tokens
        first = next((i for i, (a, b) in enumerate(zip(o["token_ids"], ids, strict=True))
                      if a != b), None)
        assert o["token_ids"] == ids, f"{folder.name} {weights} {prompt!r}: differs at {first}"
        worst = max(abs(t["logprob"] - lp) for t, (_, lp) in zip(o["tokens"], e, strict=True))
        assert worst <= tol, f"{folder.name} {weights} {prompt!r}: logprobs off by {worst:.2g}"


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
