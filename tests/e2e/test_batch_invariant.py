"""--batch-invariant on the real model, float32 with OpenBLAS (where GEMM and GEMV differ) and
4-bit: a request gives the same bits alone and alongside 1, 3, 7 and 15 other requests."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.platform import blas_loaded
from engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

TARGETS = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "The three most important inventions of the twentieth century are",
]
OTHERS = [
    "Tell me about the history of Rome, starting with its founding myths and its kings.",
    "def quicksort(xs):", "The weather today is", "List five prime numbers:",
    "Why do cats purr?", "A" * 40, "Explain continuous batching.",
    "Write a poem about the moon and the sea and the stars above the harbour at night.",
    "What is 2+2?", "Hello!", "Translate 'good morning' to French.",
    "Name three rivers in Europe.", "The quick brown fox", "In 1492,", "My favourite food is",
]
TOKENS = 24


def outputs(engine: Engine, target: str, companions: int) -> list[tuple[int, float]]:
    """The target's (token id, logprob) list, generated alongside `companions` others."""
    handles = [engine.submit(target, SamplingParams(max_tokens=TOKENS, ignore_eos=True,
                                                    logprobs=1))]
    handles += [engine.submit(p, SamplingParams(max_tokens=TOKENS + 3 * i, ignore_eos=True))
                for i, p in enumerate(OTHERS[:companions])]
    result = [(e.token_id, e.logprob) for e in handles[0] if hasattr(e, "token_id")]
    for h in handles[1:]:
        h.result()
    return result


def engine_for(batch_invariant: bool, row_kernels: str = "auto", weights: str = "f32") -> Engine:
    return Engine(EngineConfig(weights=weights, batch_invariant=batch_invariant,
                               num_kv_blocks=512, max_num_seqs=16, row_kernels=row_kernels))


@pytest.mark.parametrize("weights", ["f32", "q4"])
def test_batch_invariant_mode_gives_the_same_bits_at_every_batch_size(weights):
    with engine_for(True, weights=weights).start() as engine:
        for target in TARGETS:
            alone = outputs(engine, target, 0)
            for n in (1, 3, 7, 15):
                assert outputs(engine, target, n) == alone, (target, n)
        paths = {r.kernel_path for r in engine.steps.recent()}
        # Every layer of the model on its native kernel: the steps are recorded native.
        native = engine.runner.native_matmul_applies or engine.runner.native_quantized_applies
        assert paths == ({"native"} if native else {"tiled"})
        assert engine.block_manager.num_used_blocks == 0


def test_normal_mode_is_not_batch_invariant_here():
    """The check above means something only if the normal mode does differ on this machine.
    On MLX's matmul, that is: the native decode kernel computes each row alone (see
    tests/engine/test_decode_linear.py), so with it only prefill steps could differ."""
    if not blas_loaded():
        pytest.fail("needs OpenBLAS (libopenblas0-pthread): with the reference BLAS float32 "
                    "GEMM and GEMV agree and this comparison shows nothing")
    with engine_for(False, row_kernels="mlx").start() as engine:
        alone = outputs(engine, TARGETS[0], 0)
        batched = outputs(engine, TARGETS[0], 7)
    delta = max(abs(a[1] - b[1]) for a, b in zip(alone, batched, strict=True))
    assert delta > 0.0
