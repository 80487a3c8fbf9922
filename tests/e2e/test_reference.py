"""batchscope against an independent reference: mlx-lm's own generation on the exported folder.

mlx-lm runs the 4-bit layers through MLX's quantized_matmul; batchscope's gemm steps on the CPU
run them through the native quantized kernel (engine/native/decode_quantized.cpp), which sums
in another order, so the logits are not the same bits: they differ by float32 rounding
(measured: at most 3e-5 in a token's logprob over these prompts). The token ids are compared
exactly up to the first one that differs, if any; every logprob up to there must be within
LOGPROB_BOUND of mlx-lm's, and at a differing token the two choices must have been within
2 * LOGPROB_BOUND of each other in mlx-lm's logprobs (a near-tie that rounding may flip: the
test reports it with both sides' numbers). On these prompts no token differs today. Slow:
loads the real model.
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings

import pytest

from engine.testing import REFERENCE_PROMPTS, mlx_lm_greedy

pytestmark = pytest.mark.slow

PROMPTS = REFERENCE_PROMPTS
MAX_TOKENS = 64
# A token's logprob, batchscope's against mlx-lm's, on the same context (measured: <= 3e-5).
LOGPROB_BOUND = 1e-3


def mlx_lm_reference(weights: str):
    """mlx-lm's greedy ids and logprobs on the exported folder (engine.testing.mlx_lm_greedy),
    MAX_TOKENS unless told."""
    tokenizer, generate = mlx_lm_greedy(weights)
    return tokenizer, lambda ids, max_tokens=MAX_TOKENS: generate(ids, max_tokens)


@pytest.fixture(scope="module")
def reference():
    return mlx_lm_reference("q4")


@pytest.fixture(scope="module")
def reference_f32():
    """mlx-lm on float32 weights: its CPU quantized matmul takes one row at a time, minutes for
    a long prompt's prefill, while float32 goes through BLAS."""
    return mlx_lm_reference("f32")


def assert_follows_reference(ours: list[int], logprobs: list[float], expected, what=""):
    """Our ids and their logprobs against mlx-lm's (ids, logprobs): the same ids, or the same up
    to a near-tie (see the module docstring), with every logprob up to there within bounds."""
    ids, ref = expected
    assert len(ours) == len(ids), what
    first = next((i for i, (a, b) in enumerate(zip(ours, ids, strict=True)) if a != b), None)
    upto = len(ours) if first is None else first + 1
    diffs = [abs(logprobs[i] - float(ref[i][ours[i]])) for i in range(upto)]
    assert max(diffs) <= LOGPROB_BOUND, (what, max(diffs))
    if first is not None:
        gap = float(ref[first][ids[first]] - ref[first][ours[first]])
        report = (f"{what}: token {first} differs from mlx-lm's: ours {ours[first]} "
                  f"(logprob {logprobs[first]:.6f}, mlx-lm's {ref[first][ours[first]]:.6f}), "
                  f"mlx-lm's {ids[first]} (logprob {ref[first][ids[first]]:.6f}): gap {gap:.2e}")
        assert gap <= 2 * LOGPROB_BOUND, report
        warnings.warn(report, stacklevel=2)


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
                   "--ignore-eos", "--logprobs", "1")
    assert ours["prompt_token_ids"] == tokenizer.encode(prompt)
    assert_follows_reference(ours["token_ids"], [t["logprob"] for t in ours["tokens"]],
                             generate(ours["prompt_token_ids"]), prompt)
    assert ours["finish_reason"] == "length"


def test_chat_prompt_matches_mlx_lm_chat_template(reference):
    tokenizer, generate = reference
    ours = run_cli("Name a fruit.", "--chat", "--json", "--max-tokens", "24", "--weights", "q4",
                   "--ignore-eos", "--logprobs", "1")
    messages = [{"role": "user", "content": "Name a fruit."}]
    assert ours["prompt_token_ids"] == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True)
    assert_follows_reference(ours["token_ids"], [t["logprob"] for t in ours["tokens"]],
                             generate(ours["prompt_token_ids"], 24), "chat")


def test_batched_engine_equals_mlx_lm_per_prompt(reference):
    """All prompts in one continuous batch, with chunked prefill mixed into decode steps."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.events import TokenEvent
    from engine.sampling import SamplingParams

    tokenizer, generate = reference
    prompts = PROMPTS + ["Hello", "Why is the sky blue?", "1, 2, 3, 4,"]
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1)
    config = EngineConfig(weights="q4", max_num_batched_tokens=16, num_kv_blocks=256)
    with Engine(config).start() as engine:
        handles = [engine.submit(p, params) for p in prompts]
        events = [list(h) for h in handles]
        results = [h.result() for h in handles]
        mixed = [r for r in engine.steps.recent() if r.prefill_rows and r.decode_rows]
        assert engine.block_manager.num_used_blocks == 0
    assert mixed, "expected steps mixing prefill chunks with decode rows"
    for prompt, result, evs in zip(prompts, results, events, strict=True):
        logprobs = [e.logprob for e in evs if isinstance(e, TokenEvent)]
        assert_follows_reference(result.token_ids, logprobs,
                                 generate(tokenizer.encode(prompt), 24), prompt)


def test_a_long_prompt_in_several_chunks_equals_mlx_lm(reference_f32):
    """A 1700-token prompt prefilled in four chunks of 512 rows, every chunk attending over
    the context the earlier ones left in the pool (the native attention kernel on the CPU),
    on float32 weights (see reference_f32)."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.events import TokenEvent
    from engine.sampling import SamplingParams

    tokenizer, generate = reference_f32
    ids = tokenizer.encode(" ".join(PROMPTS * 40))[:1700]
    params = SamplingParams(max_tokens=32, ignore_eos=True, logprobs=1)
    config = EngineConfig(weights="f32", max_num_batched_tokens=512, num_kv_blocks=128)
    with Engine(config).start() as engine:
        handle = engine.submit(ids, params)
        logprobs = [e.logprob for e in handle if isinstance(e, TokenEvent)]
        result = handle.result()
        prefill_steps = [r for r in engine.steps.recent() if r.prefill_rows]
    assert len(prefill_steps) == 4
    assert_follows_reference(result.token_ids, logprobs, generate(ids, 32), "long prompt")
