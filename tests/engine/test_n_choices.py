"""n choices of one prompt (engine/choices.py): each choice as a request of its own would
give it, the prompt's full KV blocks shared by all of them, and every block back at the end."""

from __future__ import annotations

import threading

import pytest

from engine.choices import submit_choices
from engine.errors import RequestError
from engine.sampling import SamplingParams

PROMPT = "a shared system prompt that is long enough; question one"  # 56 tokens
BLOCK = 4


def greedy(n=24):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def seeded(seed, n=20):
    return SamplingParams(max_tokens=n, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True)


def assert_no_blocks_held(engine):
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0, f"{bm.num_used_blocks} blocks still held"


def choices(engine, params, n, prompt=PROMPT):
    return [h.result().token_ids for h in submit_choices(engine, prompt, params, n)]


def watch_blocks(engine):
    """Per step, before its forward: (blocks held by every running request, blocks in use)."""
    seen = []

    def record(plan):
        bm = engine.block_manager
        holders = bm.holders()
        running = len(engine.scheduler.running)
        seen.append((sum(len(h) == running > 1 for h in holders.values()), bm.num_used_blocks))
    engine.before_forward = record
    return seen


def test_greedy_choices_equal_a_single_request_and_share_the_prompt_blocks(make_engine):
    reference = make_engine(block_size=BLOCK, enable_prefix_caching=False)
    expected = reference.generate(PROMPT, greedy()).token_ids
    engine = make_engine(block_size=BLOCK)
    seen = watch_blocks(engine)
    handles = submit_choices(engine, PROMPT, greedy(), 3)
    results = [h.result() for h in handles]
    assert [r.token_ids for r in results] == [expected] * 3
    prompt_len = len(engine.encode(PROMPT))
    full = (prompt_len - 1) // BLOCK  # the blocks the prefix cache can share
    tail = (prompt_len - 1) % BLOCK  # rows of the last block: copied where worth it
    copied = tail if tail >= engine.block_manager.min_copy_rows else 0
    cached = full * BLOCK + copied
    assert [r.cached_prompt_tokens for r in results] == [0, cached, cached]
    # While the three ran together, the prompt's full blocks were held by all three at once,
    # and the pool held far fewer blocks than three separate requests would.
    assert max(shared for shared, _ in seen) == full
    per_request = -(-(prompt_len + 24) // BLOCK)
    assert max(used for _, used in seen) < 3 * per_request - full
    assert_no_blocks_held(engine)


def test_the_kv_map_shows_the_shared_blocks(make_engine):
    engine = make_engine(block_size=BLOCK)
    snaps = []
    engine.before_forward = lambda plan: snaps.append(engine.kv_snapshot())
    handles = submit_choices(engine, PROMPT, greedy(8), 3)
    ids = {h.request_id for h in handles}
    for h in handles:
        h.result()
    shared = [b for s in snaps for b, holders in s["holders"].items() if set(holders) == ids]
    assert shared, "no step saw a block held by all three choices"
    assert_no_blocks_held(engine)


def test_seeded_choices_are_reproducible_distinct_and_each_as_alone(make_engine):
    engine = make_engine(block_size=BLOCK)
    first = choices(engine, seeded(7), 3)
    assert choices(engine, seeded(7), 3) == first
    assert len({tuple(t) for t in first}) == 3  # each choice its own random stream
    # Choice i is the request seeded with 7 + i, alone or beside other requests.
    alone = [engine.generate(PROMPT, seeded(7 + i)).token_ids for i in range(3)]
    assert first == alone
    others = [engine.submit(p, seeded(1)) for p in ("other", "requests here")]
    beside = choices(engine, seeded(7), 3)
    for h in others:
        h.result()
    assert beside == first
    assert_no_blocks_held(engine)


def test_preempted_choices_resume_to_the_same_tokens(make_engine):
    params = greedy(40)
    expected = make_engine(block_size=BLOCK).generate(PROMPT, params).token_ids
    # 40 blocks of 4 cannot hold four choices growing to ~96 tokens each: preemption.
    small = make_engine(num_kv_blocks=40, block_size=BLOCK)
    results = [h.result() for h in submit_choices(small, PROMPT, params, 4)]
    assert sum(r.preemptions for r in results) > 0
    assert [r.token_ids for r in results] == [expected] * 4
    assert_no_blocks_held(small)


def test_cancelling_midway_frees_every_block(make_engine):
    engine = make_engine(block_size=BLOCK)
    handles = submit_choices(engine, PROMPT, SamplingParams(max_tokens=400, ignore_eos=True), 3)
    events = iter(handles[2])
    next(events)  # the last choice has a token: all three are running and hold blocks
    assert engine.block_manager.num_used_blocks > 0
    for h in handles:
        h.cancel()
    assert [h.result().reason for h in handles] == ["cancelled"] * 3
    assert_no_blocks_held(engine)


def test_cancelling_the_first_choice_before_it_samples_releases_the_others(make_engine):
    engine = make_engine(block_size=BLOCK)
    gate = threading.Event()  # the engine thread waits inside a blocker's first step
    inside = threading.Event()

    def hold(plan):
        inside.set()
        gate.wait(10)

    engine.before_forward = hold
    blocker = engine.submit("blocker", greedy(2))
    # the choices arrive once the blocker's step has begun, never in the same step
    assert inside.wait(10)
    handles = submit_choices(engine, PROMPT, greedy(6), 3)
    handles[0].cancel()  # reaches the engine with the choices, before the first one runs
    gate.set()
    results = [h.result() for h in handles]
    assert results[0].reason == "cancelled" and results[0].completion_tokens == 0
    assert [r.reason for r in results[1:]] == ["length"] * 2
    blocker.result()
    assert_no_blocks_held(engine)


def test_a_bad_n_is_refused_naming_n(make_engine):
    engine = make_engine(block_size=BLOCK)
    for n in (0, -1, True, 2.0):
        with pytest.raises(RequestError) as e:
            submit_choices(engine, PROMPT, greedy(), n)
        assert e.value.param == "n"
    assert not engine.scheduler.has_work()
