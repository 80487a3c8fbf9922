"""OpenAI's logit_bias, frequency_penalty and presence_penalty, and vLLM's repetition_penalty
and min_p (engine/penalties.py, engine/sampler.py): the
processors against a numpy reference, and in the engine: per request, the same tokens alone
and among others, with and without drafted tokens."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.penalties import penalty_processors
from engine.sampling import SamplingParams
from engine.testing import ScriptedDrafts, tiny_model

PROMPTS = ["abcabcabc", "hello there", "The quick brown fox", "x" * 20]


def test_the_processors_against_a_numpy_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 50)).astype(np.float32)
    tokens = [3, 3, 9, 7, 7, 7, 3, 12]  # the first 3 are the prompt
    params = SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4,
                            logit_bias={9: 5.0, 12: -100})
    out = mx.array(logits)
    for processor in penalty_processors(params, prompt_len=3):
        out = processor(mx.array(tokens), out)
    expected = logits.copy()
    expected[0, 9] += 5.0
    expected[0, 12] -= 100
    for t, count in {7: 3, 3: 1, 12: 1}.items():  # generated: 7, 7, 7, 3, 12
        expected[0, t] -= 0.7 * count - 0.4
    np.testing.assert_allclose(np.array(out), expected, rtol=0, atol=1e-5)
    assert penalty_processors(SamplingParams(), 3) == ()  # the defaults add nothing


def test_the_repetition_penalty_against_a_numpy_reference():
    logits = np.array([[2.0, -1.0, 0.5, -3.0, 1.0]], dtype=np.float32)
    [processor] = penalty_processors(SamplingParams(repetition_penalty=1.5), prompt_len=2)
    out = np.array(processor(mx.array([0, 3, 3]), mx.array(logits)))  # prompt too
    np.testing.assert_allclose(out, [[2.0 / 1.5, -1.0, 0.5, -3.0 * 1.5, 1.0]], rtol=1e-6)


def test_min_p_one_keeps_only_the_likeliest_token(make_engine):
    """min_p = 1 keeps the tokens as likely as the likeliest: a seeded draw at temperature 1
    is then the greedy token; below it, the draw differs."""
    engine = make_engine()
    plain = engine.generate(PROMPTS[1], greedy()).token_ids
    kept = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True, min_p=1.0)
    assert engine.generate(PROMPTS[1], kept).token_ids == plain
    free = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    assert engine.generate(PROMPTS[1], free).token_ids != plain


def test_bad_values_are_refused_by_name():
    for kwargs, name in (({"frequency_penalty": 2.5}, "frequency_penalty"),
                         ({"presence_penalty": True}, "presence_penalty"),
                         ({"logit_bias": {-1: 1.0}}, "logit_bias"),
                         ({"logit_bias": {5: 101}}, "logit_bias"),
                         ({"repetition_penalty": 0}, "repetition_penalty"),
                         ({"min_p": 1.5}, "min_p")):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)


def greedy(n=16, **kw):
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def test_logit_bias_bans_and_forces_tokens(make_engine):
    engine = make_engine()
    plain = engine.generate(PROMPTS[0], greedy()).token_ids
    banned = engine.generate(PROMPTS[0], greedy(logit_bias={plain[0]: -100})).token_ids
    assert plain[0] not in banned
    forced = engine.generate(PROMPTS[0], greedy(logit_bias={65: 100})).token_ids
    assert forced == [65] * 16


def test_a_frequency_penalty_breaks_repetition(make_engine):
    engine = make_engine()
    plain = engine.generate("x" * 20, greedy(24)).token_ids
    penalized = engine.generate("x" * 20, greedy(24, frequency_penalty=2.0)).token_ids
    assert penalized[0] == plain[0]  # nothing generated yet: no penalty
    assert len(set(plain)) < len(set(penalized))  # the random model loops; the penalty breaks it


@pytest.mark.parametrize("weights", ["q4"])
def test_penalties_give_the_same_tokens_alone_among_others_and_with_drafts(make_engine, weights):
    """Seeded sampling with every adjustment: a request's tokens do not depend on its batch,
    and verify rows count the drafts before them as decode rows count generated tokens."""
    params = [greedy(frequency_penalty=0.8, presence_penalty=0.3, logit_bias={66: 2.0},
                     repetition_penalty=1.3),
              SamplingParams(max_tokens=16, temperature=0.9, seed=7, ignore_eos=True,
                             frequency_penalty=1.2, logit_bias={70: -100}, min_p=0.05)]
    engine = make_engine(loader=lambda: tiny_model(quantize=weights == "q4"))
    alone = [[engine.generate(p, sp).token_ids for sp in params] for p in PROMPTS]
    handles = [[engine.submit(p, sp) for sp in params] for p in PROMPTS]
    assert [[h.result().token_ids for h in row] for row in handles] == alone
    drafts = ScriptedDrafts(wrong=3)
    for p, row in zip(PROMPTS, alone, strict=True):
        drafts.learn(engine.encode(p), row[0])
    spec = make_engine(loader=lambda: tiny_model(quantize=weights == "q4"), speculative="ngram",
                       num_speculative_tokens=3, speculative_max_batch=16, proposer=drafts)
    handles = [spec.submit(p, params[0]) for p in PROMPTS]
    assert [h.result().token_ids for h in handles] == [row[0] for row in alone]
    records = spec.steps.recent()
    assert 0 < sum(r.accepted_tokens for r in records) < sum(r.draft_tokens for r in records)
