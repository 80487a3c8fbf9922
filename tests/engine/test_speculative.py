"""Speculative decoding inside the batch (engine/speculative.py): proposals, verification in the
shared step, KV rollback, and the sampling rule.

The engine tests run the tiny random 4-bit model, whose rows are computed independently (the
native kernels), so greedy text with speculation must equal greedy text without it token for
token. Prompt lookup rarely guesses right on random weights, so most of them draft with an
oracle: the request's true greedy continuation, corrupted at a chosen place, which makes every
accept length happen."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import sampler
from engine.engine import Submission
from engine.model_runner import ModelRunner, pool_for
from engine.models import family_for
from engine.sampling import SamplingParams
from engine.scheduler import Phase, RowGroup
from engine.speculative import (
    NgramProposer,
    accepted_prefix,
    propose_ngram,
)
from engine.testing import cancel_after_tokens, tiny_model

PROMPTS = ["a", "hello there", "The quick brown fox jumps", "0123456789" * 3,
           "x" * 47, "paged attention!", "zz", "once upon a time, in a land far away"]
SPEC = {"speculative": "ngram", "num_speculative_tokens": 4, "speculative_max_batch": 16}


def greedy(n=24, **kw):
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


class Oracle:
    """Drafts the request's known greedy continuation; a draft is replaced by a wrong token
    with probability `wrong` (seeded), so accept lengths from 0 to k all occur."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]], wrong: float = 0.3,
                 seed: int = 0):
        self.expected = expected
        self.wrong = wrong
        self.rng = random.Random(seed)
        self.calls = 0

    def propose(self, wanted):
        self.calls += 1
        out = {}
        for seq_id, tokens, k in wanted:
            for prompt, continuation in self.expected.items():
                n = len(prompt)
                if tuple(tokens[:n]) == prompt and tokens[n:] == continuation[:len(tokens) - n]:
                    drafts = continuation[len(tokens) - n:len(tokens) - n + k]
                    out[seq_id] = [(d + 1) % 256 if self.rng.random() < self.wrong else d
                                   for d in drafts]
        return out


def reference(make_engine, prompts, params, **config):
    engine = make_engine(**config)
    return {tuple(engine.encode(p)): engine.generate(p, params).token_ids for p in prompts}


def spec_totals(engine):
    records = engine.steps.recent()
    drafted = sum(r.draft_tokens for r in records)
    accepted = sum(r.accepted_tokens for r in records)
    return drafted, accepted


def assert_no_blocks_held(engine):
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0, f"{bm.num_used_blocks} blocks still held"


# ---- proposals -------------------------------------------------------------------------------
def test_prompt_lookup_proposes_what_followed_the_latest_match_of_the_longest_ngram():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert propose_ngram(tokens, 3, 1, 3) == [7, 8, 5]  # the later of two matches of [1, 2, 3]
    assert propose_ngram(tokens, 10, 1, 3) == [7, 8, 5, 1, 2, 3]  # cut where the tokens end
    assert propose_ngram([4, 5, 6, 5], 2, 1, 3) == [6, 5]  # falls back to n = 1
    assert propose_ngram([4, 5, 6, 5], 2, 2, 3) == []  # no 2-gram repeats
    assert propose_ngram([7], 4, 1, 2) == [] and propose_ngram([7, 7], 0, 1, 1) == []


def test_greedy_acceptance_keeps_the_agreeing_prefix():
    assert accepted_prefix([5, 6, 7], [5, 6, 7]) == 3
    assert accepted_prefix([5, 6, 7], [5, 9, 7]) == 1
    assert accepted_prefix([5, 6, 7], [1, 6, 7]) == 0
    assert accepted_prefix([], []) == 0


def test_bad_speculative_settings_are_refused_by_name():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="speculative must be one of"):
        EngineConfig(speculative="eagle")
    with pytest.raises(ValueError, match="num_tokens"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(speculative="ngram", prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="speculative must be true or false"):
        SamplingParams(speculative="yes")


# ---- verification in the shared step ---------------------------------------------------------
def test_greedy_with_drafts_equals_greedy_without_alone_and_in_a_batch(make_engine):
    expected = reference(make_engine, PROMPTS, greedy())
    oracle = Oracle(expected)
    engine = make_engine(block_size=4, max_num_batched_tokens=32, **SPEC, proposer=oracle)
    handles = [engine.submit(p, greedy()) for p in PROMPTS]  # prefill chunks beside verify rows
    assert [h.result().token_ids for h in handles] == list(expected.values())
    assert any(r.verify_rows and r.prefill_rows for r in engine.steps.recent())
    alone = [engine.generate(p, greedy()).token_ids for p in PROMPTS]
    assert alone == list(expected.values())
    records = engine.steps.recent()
    lengths = {e.accepted for r in records for e in r.entries if e.phase == "verify"}
    assert lengths == set(range(5))  # every accept length from none to all four
    drafted, accepted = spec_totals(engine)
    assert 0 < accepted < drafted
    assert_no_blocks_held(engine)


def test_prompt_lookup_gives_the_same_tokens_as_no_speculation(make_engine):
    prompts = ["abcabcabcabc", "the cat the cat the cat", "x" * 30]
    expected = reference(make_engine, prompts, greedy(32))
    engine = make_engine(block_size=4, prompt_lookup_min=1, **SPEC)
    assert isinstance(engine.proposer, NgramProposer)
    handles = [engine.submit(p, greedy(32)) for p in prompts]
    assert [h.result().token_ids for h in handles] == list(expected.values())
    drafted, _ = spec_totals(engine)
    assert drafted > 0
    assert_no_blocks_held(engine)


def test_batch_invariant_float32_with_drafts_equals_without(make_engine):
    def f32():
        return tiny_model(quantize=False)

    config = {"batch_invariant": True, "invariant_tile": 8, "loader": f32}
    expected = reference(make_engine, PROMPTS[:4], greedy(), **config)
    engine = make_engine(**config, **SPEC, proposer=Oracle(expected))
    handles = [engine.submit(p, greedy()) for p in PROMPTS[:4]]
    assert [h.result().token_ids for h in handles] == list(expected.values())
    assert spec_totals(engine)[1] > 0


def test_step_records_and_tokens_count_exactly_what_was_drafted_and_accepted(make_engine):
    expected = reference(make_engine, PROMPTS[:3], greedy())
    engine = make_engine(**SPEC, proposer=Oracle(expected))
    finishes = [h.result() for h in [engine.submit(p, greedy()) for p in PROMPTS[:3]]]
    records = engine.steps.recent()
    for r in records:
        verify = [e for e in r.entries if e.phase == "verify"]
        assert r.verify_rows == sum(e.rows for e in verify)
        assert r.draft_tokens == sum(e.drafted for e in verify) == r.verify_rows - len(verify)
        assert r.accepted_tokens == sum(e.accepted for e in verify)
        assert all(0 <= e.accepted <= e.drafted for e in verify)
        assert r.total_rows == r.prefill_rows + r.decode_rows + r.verify_rows
        assert r.speculation == "on"
    assert sum(r.accepted_tokens for r in records) > 0
    # Every output token is produced once: by a decode row, a prefill's last row, or a verify
    # group (accepted drafts + the target's token).
    produced = sum(e.accepted + 1 for r in records for e in r.entries if e.sampled)
    assert produced == sum(len(f.token_ids) for f in finishes)


def test_drafted_tokens_are_marked_on_their_events(make_engine):
    expected = reference(make_engine, PROMPTS[:1], greedy())
    engine = make_engine(**SPEC, proposer=Oracle(expected, wrong=0.0))
    handle = engine.submit(PROMPTS[0], greedy())
    tokens = [e for e in handle if hasattr(e, "token_id")]
    drafted = [t.drafted for t in tokens]
    assert drafted[0] is False  # the prefill's token is the target's own
    assert sum(drafted) == spec_totals(engine)[1] > 0
    assert [t.token_id for t in tokens] == expected[tuple(engine.encode(PROMPTS[0]))]
    # A step emits its accepted drafts and then one token of the target's.
    by_step = {}
    for t in tokens:
        by_step.setdefault(t.step, []).append(t.drafted)
    assert all(flags[-1] is False and all(flags[:-1]) for flags in by_step.values())


def test_speculation_turns_off_past_the_batch_limit_and_per_request(make_engine):
    expected = reference(make_engine, PROMPTS[:4], greedy())
    engine = make_engine(**{**SPEC, "speculative_max_batch": 2}, proposer=Oracle(expected))
    lengths = [4, 4, 24, 24]  # two finish early: the other two speculate alone
    # All four reach the same step (submitted one by one, the engine could start the first
    # alone), so the next steps start with four running.
    handles = engine.submit_many([Submission(p, greedy(n))
                                  for p, n in zip(PROMPTS, lengths, strict=False)])
    assert [h.result().token_ids for h in handles] == [
        ids[:n] for ids, n in zip(expected.values(), lengths, strict=True)]
    records = engine.steps.recent()
    # Decided on the requests running when the step starts.
    crowded = [r for r in records if r.speculation == "off: 4 running > 2"]
    assert crowded and all(r.verify_rows == 0 for r in crowded)
    assert all(r.speculation == "on" for r in records if r.verify_rows)
    assert any(r.verify_rows for r in records)  # once two had finished

    engine = make_engine(**SPEC, proposer=Oracle(expected))
    out = engine.generate(PROMPTS[0], greedy(speculative=False))
    assert out.token_ids == expected[tuple(engine.encode(PROMPTS[0]))]
    assert spec_totals(engine) == (0, 0)


def test_drafts_never_run_past_max_tokens(make_engine):
    expected = reference(make_engine, PROMPTS[:2], greedy(24))
    engine = make_engine(**SPEC, proposer=Oracle(expected, wrong=0.0))
    for n in (1, 2, 3, 6):
        out = engine.generate(PROMPTS[1], greedy(n))
        assert out.token_ids == expected[tuple(engine.encode(PROMPTS[1]))][:n]
        assert out.reason == "length"
    assert_no_blocks_held(engine)


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(wrong=st.sampled_from([0.0, 0.2, 0.6, 1.0]), seed=st.integers(0, 1000),
       cancel_after=st.lists(st.integers(0, 12), min_size=0, max_size=3),
       num_blocks=st.sampled_from([20, 26, 64]))
def test_no_block_leaks_through_drafts_cancels_and_preemptions(make_engine, wrong, seed,
                                                             cancel_after, num_blocks):
    """A small pool preempts requests mid-verification; cancels land between any two steps."""
    expected = EXPECTED_CACHE.get("tiny") or EXPECTED_CACHE.setdefault(
        "tiny", reference(make_engine, PROMPTS, greedy()))
    engine = make_engine(block_size=4, num_kv_blocks=num_blocks, max_num_batched_tokens=24,
                         **SPEC, proposer=Oracle(expected, wrong, seed))
    handles = [engine.submit(p, greedy()) for p in PROMPTS]
    cancel_after_tokens(handles, cancel_after)
    finishes = [h.result() for h in handles]
    for f, continuation in zip(finishes, expected.values(), strict=True):
        if f.reason == "length":
            assert f.token_ids == continuation
        else:
            assert f.reason == "cancelled" and f.token_ids == continuation[:len(f.token_ids)]
    assert_no_blocks_held(engine)


EXPECTED_CACHE: dict[str, dict] = {}


def test_preemption_mid_verification_resumes_on_the_same_tokens(make_engine):
    expected = reference(make_engine, PROMPTS, greedy())
    engine = make_engine(block_size=4, num_kv_blocks=20, max_num_batched_tokens=24, **SPEC,
                         proposer=Oracle(expected))
    handles = [engine.submit(p, greedy()) for p in PROMPTS]
    assert [h.result().token_ids for h in handles] == list(expected.values())
    assert engine.scheduler.num_preemptions > 0
    assert spec_totals(engine)[1] > 0
    assert_no_blocks_held(engine)


# ---- speculative sampling --------------------------------------------------------------------
VOCAB = 8
# Target distributions at the two positions: the draft (token 0) is likely but not certain.
P0 = np.array([0.45, 0.2, 0.1, 0.08, 0.07, 0.05, 0.03, 0.02])
P1 = np.array([0.05, 0.5, 0.2, 0.1, 0.05, 0.05, 0.03, 0.02])
DRAFTS = [0, 1]
# The 0.999 quantile of chi-square with 7 degrees of freedom.
CHI2_7_999 = 24.32


def _runner():
    model = tiny_model().model
    family = family_for(model)
    return ModelRunner(model, pool_for(family, 8, 16), "auto", "auto", family)


def _draws(runner, n, temperature=1.0):
    """n seeded verify groups of [last token, 0, 1] over fixed logits: the emitted tokens."""
    scale = temperature  # logits scaled so that softmax(logits / T) is P
    logits = np.log(np.stack([P0, P1, P1])) * scale
    draws = []
    for first in range(0, n, 500):  # steps of 500 requests: one graph of them all is slow
        groups = [RowGroup(f"s{i}", [5] + DRAFTS, 10, [0], True,
                           SamplingParams(temperature=temperature, seed=i), 0,
                           phase=Phase.VERIFY)
                  for i in range(first, min(n, first + 500))]
        rows = mx.array(np.tile(logits, (len(groups), 1)).astype(np.float32))
        out = sampler.sample(rows, groups, runner.logsumexp, [])
        draws += [[s.token_id for s in out[g.seq_id].samples] for g in groups]
        if temperature == 1.0:  # then a row's logprobs are log P: each token reports its own
            for g in groups:
                for p, s in zip((P0, P1, P1), out[g.seq_id].samples, strict=False):
                    assert s.logprob == pytest.approx(np.log(p[s.token_id]), abs=1e-5)
    return draws


def _chi2(counts: np.ndarray, p: np.ndarray) -> float:
    expected = counts.sum() * p
    return float(((counts - expected) ** 2 / expected).sum())


def _first_and_second(draws):
    first = np.bincount([d[0] for d in draws], minlength=VOCAB)
    second = np.bincount([d[1] for d in draws if len(d) > 1], minlength=VOCAB)
    return first, second


@pytest.mark.parametrize("temperature", [1.0, pytest.param(0.7, marks=pytest.mark.slow)])
def test_speculative_sampling_emits_the_target_distribution(temperature):
    runner = _runner()
    draws = _draws(runner, 2000, temperature)
    first, second = _first_and_second(draws)
    assert _chi2(first, P0) < CHI2_7_999, first
    # The second token exists only after the first draft was accepted; it follows P1.
    assert second.sum() == pytest.approx(2000 * P0[0], rel=0.1)
    assert _chi2(second, P1) < CHI2_7_999, second
    # Seeded: the same seeds draw the same tokens.
    assert _draws(runner, 50, temperature) == draws[:50]


@pytest.mark.slow  # 2000 draws; runs in `make test` (CI)
def test_a_wrong_acceptance_rule_fails_the_distribution_check(monkeypatch):
    """The check above can fail: sampling the residual without taking the draft out (a
    common mistake) over-weights the draft."""
    right = sampler.verify_row

    def wrong(logprobs, p, output_index, draft):
        accept_prob, u, _ = right(logprobs, p, output_index, draft)
        _, residual_key = mx.random.split(sampler.row_key(p, output_index))
        scores = sampler.target_scores(logprobs, p)
        return accept_prob, u, mx.random.categorical(scores, key=residual_key)[0]

    monkeypatch.setattr(sampler, "verify_row", wrong)
    first, _ = _first_and_second(_draws(_runner(), 2000))
    assert _chi2(first, P0) > CHI2_7_999


def test_drafted_tokens_carry_the_logprobs_and_alternatives_decoding_gives(make_engine):
    params = greedy(logprobs=3)

    def events(engine, prompt):
        return [(e.token_id, e.logprob, e.top_logprobs)
                for e in engine.submit(prompt, params) if hasattr(e, "token_id")]

    plain = make_engine()
    expected = {tuple(plain.encode(p)): plain.generate(p, params).token_ids for p in PROMPTS[:3]}
    engine = make_engine(**SPEC, proposer=Oracle(expected))
    for prompt in PROMPTS[:3]:
        assert events(engine, prompt) == events(plain, prompt)
    assert spec_totals(engine)[1] > 0


def test_a_request_that_stops_on_an_accepted_draft_counts_only_what_it_emitted(make_engine):
    expected = reference(make_engine, PROMPTS[:1], greedy())
    continuation = list(expected.values())[0]
    engine = make_engine(**SPEC, proposer=Oracle(expected, wrong=0.0))
    # Stop at output token 6 (one of a verify step's drafts, 4 to a step after the prefill's).
    decode = engine.tokenizer.decode
    stop = decode(continuation[:7])[len(decode(continuation[:6])):]
    assert stop and stop not in decode(continuation[:6])
    handle = engine.submit(PROMPTS[0], greedy(24, stop=[stop]))
    tokens = [e for e in handle if hasattr(e, "token_id")]
    finish = handle.result()
    assert finish.reason == "stop" and finish.token_ids == continuation[:7]
    entries = [e for r in engine.steps.recent() for e in r.entries]
    assert sum(e.emitted for e in entries) == 7
    assert sum(e.accepted for e in entries) == sum(t.drafted for t in tokens)
    assert sum(r.accepted_tokens for r in engine.steps.recent()) == sum(t.drafted for t in tokens)
    assert entries[-1].phase == "verify" and entries[-1].emitted < entries[-1].drafted + 1
