"""The sampler's logits-processor hook (engine/sampler.py): mlx-lm's processor(tokens, logits)
on a row's raw logits before the log-softmax, per request, beside rows that have none."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.model_runner import ModelRunner, pool_for
from engine.models import family_for
from engine.sampling import SamplingParams
from engine.scheduler import Phase, RowGroup
from engine.sequence import Sequence
from engine.testing import tiny_model

PROMPTS = {"a": [7, 30, 41, 99, 12, 5], "b": [60, 61, 62, 63], "c": [9, 8, 7, 6, 5, 4, 3, 21]}
TABLES = {"a": [0, 1], "b": [2, 3], "c": [4, 5]}
DRAFTS = [44, 45]


def ban(token: int):
    def processor(tokens: mx.array, logits: mx.array) -> mx.array:
        return mx.where(mx.arange(logits.shape[-1]) == token, float("-inf"), logits)

    return processor


def step(processors: dict) -> tuple[dict, dict]:
    """One step on a fresh runner after the prompts' prefill: a and b sample the token after
    their prompt, c verifies its last token and two drafts. processors: seq id -> its
    processors. Returns (seq id -> [(token, logprob)], what each processor call saw)."""
    model = tiny_model().model
    family = family_for(model)
    runner = ModelRunner(model, pool_for(family, 16, 16), "auto", "auto", family)
    seen: list[list[int]] = []

    def record(tokens: mx.array, logits: mx.array) -> mx.array:
        seen.append(tokens.tolist())
        return logits

    seqs = {name: Sequence(name, prompt, SamplingParams(),
                           logits_processors=tuple(processors.get(name, ())) +
                           ((record,) if name == "c" else ()))
            for name, prompt in PROMPTS.items()}
    c = seqs["c"]
    c.prompt_ids, c.output_ids = c.prompt_ids[:-1], c.prompt_ids[-1:]  # c decodes its last
    prefill = [RowGroup(n, s.token_ids[:-1], 0, TABLES[n], False, s.params, seq=s)
               for n, s in seqs.items()]
    runner.run(prefill)
    groups = [RowGroup(n, s.token_ids[-1:], s.num_tokens - 1, TABLES[n], True, s.params,
                       seq=s) for n, s in seqs.items() if n != "c"]
    groups.append(RowGroup("c", c.token_ids[-1:] + DRAFTS, c.num_tokens - 1, TABLES["c"],
                           True, c.params, phase=Phase.VERIFY, seq=c))
    out = runner.run(groups).sampled
    return {n: [(s.token_id, s.logprob) for s in o.samples] for n, o in out.items()}, seen


def test_a_processor_changes_its_own_row_only_and_sees_the_tokens_before_each_row():
    plain, seen = step({})
    greedy = plain["a"][0][0]
    banned, seen_banned = step({"a": [ban(greedy)]})
    assert banned["a"][0][0] != greedy  # the processor's row chose another token
    assert banned["b"] == plain["b"] and banned["c"] == plain["c"]  # the others' bits
    # c's verify rows: each position's processor saw the sequence up to its own token.
    c = PROMPTS["c"]
    assert seen == seen_banned == [c + DRAFTS[:j] for j in range(len(DRAFTS) + 1)]


def test_processors_apply_in_order():
    plain, _ = step({})
    greedy = plain["b"][0][0]
    # Ban the greedy token, then undo every ban by writing the raw row back: the last wins.
    undo = [None]

    def keep(tokens: mx.array, logits: mx.array) -> mx.array:
        undo[0] = logits
        return logits

    def restore(tokens: mx.array, logits: mx.array) -> mx.array:
        return undo[0]

    assert step({"b": [keep, ban(greedy), restore]})[0] == plain
    assert step({"b": [keep, restore, ban(greedy)]})[0]["b"][0][0] != greedy


def test_greedy_rows_take_the_native_op_with_the_bits_of_the_sampler_ops():
    """draw hands all-greedy steps without top logprobs or drafts to NativeOps.greedy; the
    tokens and logprobs are those of its own ops. A step that wants top logprobs, samples or
    verifies drafts keeps them."""
    from engine.sampler import draw

    model = tiny_model().model
    family = family_for(model)
    runner = ModelRunner(model, pool_for(family, 16, 16), "auto", "auto", family)
    if runner.greedy_kernel is None:
        pytest.skip("native ops not built")
    logits = mx.random.normal((3, 300), key=mx.random.key(4)) * 5
    calls = []

    def greedy(x):
        calls.append(x.shape)
        return runner.greedy(x)

    def groups(params):
        return [RowGroup(f"s{i}", [1], 0, [0], True, params) for i in range(3)]

    def read(params, with_op):
        out = draw(logits, groups(params), runner.logsumexp, [],
                   greedy if with_op else None).read()
        return [(s.token_id, s.logprob, s.top) for o in out.values() for s in o.samples]

    plain = SamplingParams()
    assert read(plain, True) == read(plain, False) and calls == [(3, 300)]
    with_top = SamplingParams(logprobs=2)
    assert read(with_top, True) == read(with_top, False) and len(calls) == 1
    sampling = SamplingParams(temperature=0.8, seed=1)
    read(sampling, True)
    assert len(calls) == 1
