"""A request's tokens and logprobs, bit for bit, alone and alongside others of different
lengths, its prompt cut into other prefill chunks there: on the default 4-bit path (the native
kernels compute each row alone), and with --batch-invariant on 4-bit and float32 weights
(tests/e2e/test_batch_invariant.py checks the same on the real model)."""

from __future__ import annotations

import pytest

from engine.engine import Submission
from engine.sampling import SamplingParams
from engine.testing import tiny_model

TARGET = "paged attention reads each sequence's own blocks; " * 2  # 102 tokens
OTHERS = ["hello there", "The quick brown fox jumps over the lazy dog. " * 2, "0123456789" * 3,
          "x" * 47, "zz", "once upon a time, in a land far away " * 3]
BUDGET = 48  # tokens per step: the target's prompt takes several chunks, more beside others


def outputs(engine, companions: int) -> tuple[list[tuple[int, float]], list[int]]:
    """The target's (token id, logprob) list, admitted in one step after `companions` others
    of different lengths (so it gets what is left of the step's budget), and the rows of each
    of its prefill chunks."""
    others = [Submission(p, SamplingParams(max_tokens=8 + 5 * i, ignore_eos=True))
              for i, p in enumerate(OTHERS[:companions])]
    target = Submission(TARGET, SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1))
    *handles, handle = engine.submit_many([*others, target])
    result = [(e.token_id, e.logprob) for e in handle if hasattr(e, "token_id")]
    for h in handles:
        h.result()
    chunks = [e.rows for r in engine.steps.recent() for e in r.entries
              if e.request_id == handle.request_id and e.phase == "prefill"]
    return result, chunks


def engine_for(make_engine, weights: str, batch_invariant: bool):
    return make_engine(loader=lambda: tiny_model(quantize=weights == "q4"),
                       batch_invariant=batch_invariant, block_size=4,
                       max_num_batched_tokens=BUDGET, enable_prefix_caching=False)


@pytest.mark.parametrize("weights,batch_invariant",
                         [("q4", False), ("q4", True), ("f32", True)],
                         ids=["q4-default", "q4-batch-invariant", "f32-batch-invariant"])
def test_a_request_gives_the_same_bits_alone_and_alongside(make_engine, weights,
                                                           batch_invariant):
    engine = engine_for(make_engine, weights, batch_invariant)
    alone, chunks_alone = outputs(engine, 0)
    assert len(alone) == 16 and len(chunks_alone) > 1
    for n in (1, 3, len(OTHERS)):
        together, chunks = outputs(engine, n)
        assert together == alone, n  # tokens and logprobs, bit for bit
        assert chunks != chunks_alone  # its prompt in other chunks
    # Steps of more rows than the float32 kernel's limit (32) took part.
    assert max(r.total_rows for r in engine.steps.recent()) > 32


def test_batch_invariant_4bit_computes_what_the_default_computes(make_engine):
    """On 4-bit weights every layer has its native kernel: the flag changes no bit."""
    default = outputs(engine_for(make_engine, "q4", False), 3)[0]
    assert outputs(engine_for(make_engine, "q4", True), 3)[0] == default


def test_the_start_up_log_says_which_steps_are_batch_invariant(make_engine):
    """The row kernels, in words (logged at start): every 4-bit step is row-invariant on the
    native kernel; float32 only up to its row limit, unless --batch-invariant."""
    q4 = engine_for(make_engine, "q4", batch_invariant=False)
    assert "every step is batch-invariant" in q4.row_kernels
    f32 = engine_for(make_engine, "f32", batch_invariant=False)
    assert "batch-invariant up to there" in f32.row_kernels
    assert "every step" not in f32.row_kernels
