"""Prompt lookup on the real model (q4, the CPU's native kernels): greedy text with speculation
equals greedy text without it, token for token and logprob for logprob, alone and with 8
requests in flight while others prefill; and on copy-heavy prompts most drafts are accepted."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import Engine, Submission
from engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

PASSAGE = ("The paged KV cache splits every sequence's keys and values into fixed blocks of "
           "sixteen tokens, kept in one pool and addressed through a block table, so that "
           "memory is allocated as a sequence grows and freed the moment it finishes.")
PROMPTS = [f"Repeat the following text exactly.\n\n{PASSAGE}",
           "Copy this list: apples, pears, plums, apples, pears, plums, apples, pears.",
           "def add(a, b):\n    return a + b\n\nWrite add again, unchanged.",
           "Once upon a time, in a small village by the sea, there lived",
           f"Summarise in one sentence: {PASSAGE}",
           "Count from one to twenty in words.",
           "Why is the sky blue?",
           f"Repeat twice: {PASSAGE[:80]}"]
PARAMS = SamplingParams(max_tokens=48, ignore_eos=True, logprobs=1)


def run(engine: Engine, prompts: list[str]) -> list[list[tuple[int, float]]]:
    ids = [engine.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    handles = engine.submit_many([Submission(i, PARAMS) for i in ids])
    out = [[(e.token_id, e.logprob) for e in h if hasattr(e, "token_id")] for h in handles]
    for h in handles:
        h.result()
    return out


@pytest.fixture(scope="module")
def engines():
    common = {"weights": "q4", "max_num_batched_tokens": 64, "enable_prefix_caching": False}
    plain = Engine(EngineConfig(**common)).start()
    spec = Engine(EngineConfig(**common, speculative="ngram",
                               speculative_max_batch=16)).start()
    yield plain, spec
    plain.stop()
    spec.stop()


def test_speculation_keeps_greedy_tokens_and_logprobs_alone_and_batched(engines):
    plain, spec = engines
    expected = [run(plain, [p])[0] for p in PROMPTS]
    first = spec.step_count + 1
    assert run(spec, PROMPTS[:1]) == expected[:1]
    copy = [r for r in spec.steps.recent() if r.step >= first]
    # The passage is copied: most of what prompt lookup drafts there is accepted.
    assert sum(r.accepted_tokens for r in copy) > 0.7 * sum(r.draft_tokens for r in copy)
    assert [run(spec, [p])[0] for p in PROMPTS[1:]] == expected[1:]
    first = spec.step_count + 1
    assert run(spec, PROMPTS) == expected  # 64-row budget: prompts prefill beside verify rows
    steps = [r for r in spec.steps.recent() if r.step >= first]
    assert any(r.verify_rows and r.prefill_rows for r in steps)
    assert sum(r.accepted_tokens for r in steps) > 0
    bm = spec.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0
