"""Async scheduling (engine/lookahead.py): a decode step built and queued while the one before
it computes gives the tokens of the step the scheduler would have built afterwards, whatever
ends the requests (max_tokens, EOS, a stop string, a cancel, a failed step), and leaks no KV
block."""

from __future__ import annotations

import pytest

import engine.model_runner as model_runner
from engine.block_manager import BlockManager
from engine.lookahead import continues, next_groups
from engine.sampling import SamplingParams
from engine.scheduler import Phase, RowGroup
from engine.sequence import Sequence
from engine.testing import cancel_after_tokens, tiny_model

PROMPTS = ["a", "hello there", "The quick brown fox jumps", "0123456789" * 3,
           "x" * 47, "paged attention!", "zz", "once upon a time, in a land far away"]


def params(i: int, **overrides) -> SamplingParams:
    """A mix: greedy and seeded sampling, logprobs, max_tokens from 3 to 24."""
    kind = ({"temperature": 0.8, "seed": 7 + i} if i % 3 == 1 else {})
    return SamplingParams(**{"max_tokens": 3 + 3 * i, "ignore_eos": True, "logprobs": i % 2 * 3,
                             **kind, **overrides})


def outputs(engine, prompts=PROMPTS, **overrides):
    handles = [engine.submit(p, params(i, **overrides)) for i, p in enumerate(prompts)]
    finishes = [h.result() for h in handles]
    return [(f.token_ids, f.reason, f.text) for f in finishes]


def logprobs(engine, prompts=PROMPTS):
    handles = [engine.submit(p, params(i)) for i, p in enumerate(prompts)]
    return [[(e.token_id, e.logprob, e.top_logprobs) for e in h if hasattr(e, "token_id")]
            for h in handles]


def assert_no_blocks_held(engine):
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0, f"{bm.num_used_blocks} blocks still held"


def overlapped(engine) -> list:
    return [r for r in engine.steps.recent() if r.overlapped]


def with_eos(token_id: int):
    """The tiny model whose tokenizer ends a request at `token_id`."""
    def load():
        loaded = tiny_model()
        loaded.tokenizer.eos_token_id = token_id
        return loaded
    return load


@pytest.fixture
def pair(make_engine):
    """An engine with async scheduling and one without, on the same weights and pool."""
    def make(loader=tiny_model, **config):
        return (make_engine(loader=loader, block_size=4, **config),
                make_engine(loader=loader, block_size=4, async_scheduling=False, **config))
    return make


def test_the_same_tokens_and_logprobs_with_and_without_async_scheduling(pair):
    on, off = pair()
    assert logprobs(on) == logprobs(off)
    assert outputs(on) == outputs(off)
    assert overlapped(on) and not overlapped(off)
    # Requests sure to end on a step's token are left out of the step ahead: nothing discarded.
    assert sum(r.discarded_rows for r in on.steps.recent()) == 0
    for engine in (on, off):
        assert_no_blocks_held(engine)


def test_requests_ended_by_eos_or_a_stop_string_mid_flight(pair):
    """The step ahead already holds their rows: discarded, recorded, their blocks freed; a
    later request over the same prompt (a prefix-cache hit) gets the same tokens."""
    reference, _ = pair()
    produced = [ids for ids, _, _ in outputs(reference)]
    eos = produced[-1][len(produced[-1]) // 2]  # a token from the middle of the longest output
    on, off = pair(loader=with_eos(eos))
    got, want = outputs(on, ignore_eos=False), outputs(off, ignore_eos=False)
    assert got == want
    assert any(reason == "stop" for _, reason, _ in got)
    assert sum(r.discarded_rows for r in on.steps.recent()) > 0
    stop = want[-1][2][2:3]  # a character of the longest output's text
    got, want = outputs(on, stop=[stop]), outputs(off, stop=[stop])
    assert got == want
    assert any(reason == "stop" for _, reason, _ in got)
    for engine in (on, off):
        assert_no_blocks_held(engine)
    hits = on.block_manager.stats.hits
    assert outputs(on, PROMPTS[-1:]) == outputs(off, PROMPTS[-1:])
    assert on.block_manager.stats.hits > hits


def test_cancelled_requests_keep_a_prefix_of_their_tokens(pair):
    on, off = pair()
    full = outputs(off)
    handles = [on.submit(p, params(i)) for i, p in enumerate(PROMPTS)]
    cancel_after_tokens(handles, [2, 4, 1, 5])
    for (want, _, _), h in zip(full, handles, strict=True):
        got = h.result().token_ids
        assert got == want[:len(got)]
    assert_no_blocks_held(on)


def test_a_failed_step_drops_the_step_ahead_and_the_engine_goes_on(pair, monkeypatch):
    """A step whose evaluation fails ends its requests with the error; the step queued behind
    it (built on its tokens) is waited out and dropped, never published."""
    on, off = pair()
    real = model_runner.PendingStep.result
    calls = {"n": 0}

    def fail_sixth(self, since=None):
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("injected evaluation fault")
        return real(self, since)

    monkeypatch.setattr(model_runner.PendingStep, "result", fail_sixth)
    handles = [on.submit(p, params(i, max_tokens=20)) for i, p in enumerate(PROMPTS[:3])]
    finishes = [h.result() for h in handles]
    assert all(f.reason == "error" and "injected evaluation fault" in f.error for f in finishes)
    failed = [r for r in on.steps.recent() if r.error]
    assert len(failed) == 1 and failed[0].step == on.step_count
    assert_no_blocks_held(on)
    monkeypatch.setattr(model_runner.PendingStep, "result", real)
    assert outputs(on, PROMPTS[:3]) == outputs(off, PROMPTS[:3])


def _seq(seq_id: str, computed: int, **sampling) -> Sequence:
    seq = Sequence(seq_id, list(range(3, 3 + computed)),
                   SamplingParams(**{"max_tokens": 10, **sampling}))
    seq.num_computed = computed - 1
    return seq


def _decode(seq: Sequence, bm: BlockManager) -> RowGroup:
    bm.allocate(seq.seq_id, seq.num_tokens)
    return RowGroup.of(seq, 1, Phase.DECODE, bm.block_table(seq.seq_id))


def test_next_groups_allocate_the_next_slot_and_leave_out_what_ends():
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    going, ending = _seq("going", 4), _seq("ending", 2, max_tokens=1)
    groups = [_decode(ending, bm), _decode(going, bm)]
    assert continues(groups)
    found = next_groups(groups, bm, max_model_len=100)
    assert found is not None
    (nxt,), sources = found
    assert sources == [1] and nxt.seq_id == "going"  # max_tokens reached: no step ahead
    assert (nxt.start, nxt.output_index, nxt.sample) == (4, 1, True)
    assert len(nxt.block_table) == 2  # position 4 starts the sequence's second block
    assert next_groups(groups, bm, max_model_len=5) is None  # the context ends it as well


def test_no_step_ahead_without_a_free_block_or_for_other_steps():
    bm = BlockManager(1, 4, enable_prefix_caching=False)
    groups = [_decode(_seq("full", 4), bm)]
    assert next_groups(groups, bm, max_model_len=100) is None  # the scheduler preempts
    prefill = RowGroup("p", [5, 6], 0, [0], True, SamplingParams(), phase=Phase.PREFILL,
                       seq=_seq("p", 2))
    assert not continues([prefill]) and not continues([])
    processed = _seq("q", 3)
    processed.logits_processors = (lambda tokens, logits: logits,)
    bm = BlockManager(4, 4)
    assert not continues([_decode(processed, bm)])
