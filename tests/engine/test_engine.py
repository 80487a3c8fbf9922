"""The engine end to end on a tiny random-weight 4-bit model (rows are computed independently,
by the native quantized kernel on gemm steps and MLX's CPU quantized kernel on the others, so
batching must not change a single token)."""

from __future__ import annotations

import asyncio
import gc
import threading

import numpy as np
import pytest

from engine.sampling import SamplingParams
from engine.testing import tiny_model

PROMPTS = ["a", "hello there", "The quick brown fox jumps", "0123456789" * 3,
           "x" * 47, "paged attention!", "zz", "once upon a time, in a land far away"]


def greedy(n=24):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def assert_no_blocks_held(engine):
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0, f"{bm.num_used_blocks} blocks still held"


def alone(engine, prompts, params):
    return [engine.generate(p, params).token_ids for p in prompts]


def together(engine, prompts, params):
    handles = [engine.submit(p, params) for p in prompts]
    return [h.result().token_ids for h in handles]


def test_eight_requests_together_equal_each_alone(make_engine):
    engine = make_engine(block_size=4)
    solo = alone(engine, PROMPTS, greedy())
    batched = together(engine, PROMPTS, greedy())
    assert batched == solo
    # They really shared steps: some step held rows of several requests.
    assert max(len(r.entries) for r in engine.steps.recent()) == len(PROMPTS)
    assert_no_blocks_held(engine)


def test_chunked_prefill_mixed_with_decode_gives_the_same_tokens(make_engine):
    engine = make_engine(block_size=4, max_num_batched_tokens=8)  # prompts split into chunks
    solo_engine = make_engine(block_size=16, max_num_batched_tokens=512,
                              enable_prefix_caching=False)
    expected = alone(solo_engine, PROMPTS, greedy())
    assert together(engine, PROMPTS, greedy()) == expected
    records = engine.steps.recent()
    assert all(r.total_rows <= 8 for r in records)
    assert any(r.prefill_rows and r.decode_rows for r in records)  # mixed steps happened
    assert_no_blocks_held(engine)


def test_preemption_and_resume_give_the_same_tokens(make_engine):
    params = greedy(40)
    big = make_engine(num_kv_blocks=256, block_size=4)
    expected = alone(big, PROMPTS[:6], params)
    # 24 blocks of 4 tokens cannot hold six requests growing to ~70 tokens: preemption.
    small = make_engine(num_kv_blocks=24, block_size=4, enable_prefix_caching=False)
    handles = [small.submit(p, params) for p in PROMPTS[:6]]
    results = [h.result() for h in handles]
    assert sum(r.preemptions for r in results) > 0
    assert any(r.preempted for r in small.steps.recent())
    assert [r.token_ids for r in results] == expected
    assert_no_blocks_held(small)


@pytest.mark.parametrize("attention, copied", [("native", 3), ("mlx", 0)])
def test_prefix_cache_hits_and_gives_the_same_tokens(make_engine, attention, copied):
    engine = make_engine(block_size=4, attention=attention)
    prompt = "a shared system prompt that is long enough; question one"
    tail = (len(engine.encode(prompt)) - 1) % 4
    assert tail == 3
    first = engine.generate(prompt, greedy())
    second = engine.generate(prompt, greedy())
    assert second.token_ids == first.token_ids
    assert first.cached_prompt_tokens == 0
    # Blocks of 4: the native copy takes the tail's 3 rows (it copies any number); with MLX's
    # ops 3 rows are too few to be worth copying, and are computed again.
    assert second.cached_prompt_tokens == (len(engine.encode(prompt)) - 1) // 4 * 4 + copied
    assert engine.block_manager.stats.copied == copied
    assert engine.block_manager.stats.hits > 0
    assert engine.block_manager.num_cached_blocks > 0
    assert_no_blocks_held(engine)


def test_cancel_frees_blocks_and_reports_cancelled(make_engine):
    engine = make_engine()
    handle = engine.submit("cancel me please", SamplingParams(max_tokens=400, ignore_eos=True))
    events = iter(handle)
    next(events)  # a first token arrived: the request is running and holds blocks
    assert engine.block_manager.num_used_blocks > 0
    handle.cancel()
    finish = handle.result()
    assert finish.reason == "cancelled"
    assert 0 < finish.completion_tokens < 400
    assert_no_blocks_held(engine)


def test_stop_strings_max_tokens_and_streamed_text(make_engine):
    engine = make_engine()
    free = engine.generate("stop test", greedy(30))
    assert free.reason == "length" and free.completion_tokens == 30
    stop = free.text[5:8]
    assert stop
    handle = engine.submit("stop test", SamplingParams(max_tokens=30, ignore_eos=True,
                                                      stop=(stop,)))
    streamed = []
    for event in handle:
        streamed.append(event.text_delta if event is handle.finish else event.text)
    finish = handle.finish
    assert finish.reason == "stop"
    assert finish.text == free.text[:free.text.index(stop)]
    assert "".join(streamed) == finish.text  # the stop string never reached the stream


def test_seeded_sampling_is_reproducible_and_batch_independent(make_engine):
    engine = make_engine()
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    a = engine.generate("sample me", params).token_ids
    b = together(engine, ["sample me", "other", "requests here"], params)[0]
    c = engine.generate("sample me", SamplingParams(max_tokens=20, temperature=1.0, seed=99,
                                                    ignore_eos=True)).token_ids
    assert a == b
    assert a != c


def test_logprobs_and_top_alternatives(make_engine):
    engine = make_engine()
    handle = engine.submit("logprobs", SamplingParams(max_tokens=3, logprobs=5, ignore_eos=True))
    tokens = [e for e in handle if hasattr(e, "token_id")]
    assert len(tokens) == 3
    for t in tokens:
        assert len(t.top_logprobs) == 5
        ids = [i for i, _ in t.top_logprobs]
        lps = [lp for _, lp in t.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert t.token_id == ids[0]  # greedy picks the best alternative
        assert t.logprob == pytest.approx(lps[0]) and t.logprob <= 0


def test_step_records_describe_the_batch(make_engine):
    engine = make_engine(block_size=4)
    together(engine, ["abc", "defgh"], greedy(6))
    records = engine.steps.recent()
    assert sum(r.prefill_rows for r in records) == 3 + 5
    assert all(r.total_rows == r.prefill_rows + r.decode_rows for r in records)
    shared = [r for r in records if len(r.entries) == 2]
    assert shared, "the two requests never shared a step"
    # A step that launched the next one ahead holds the block each of its rows writes there.
    ahead = {r.step - 1: {e.request_id for e in r.entries} for r in records if r.overlapped}
    assert ahead, "no step was launched ahead of the next"
    for r in shared:
        assert r.kv_blocks_used == sum(e.blocks_held for e in r.entries)
        assert r.kv_blocks_used + r.kv_blocks_free + r.kv_blocks_cached == r.kv_blocks_total
        for e in r.entries:
            context = e.context_len + (e.request_id in ahead.get(r.step, ()))
            assert e.blocks_held == -(-context // 4)
            if e.phase == "decode":
                assert e.rows == 1
    # Each request's prefill rows add up to its prompt, then it decodes one row per step.
    prefill: dict[str, int] = {}
    for r in records:
        for e in r.entries:
            if e.phase == "prefill":
                prefill[e.request_id] = prefill.get(e.request_id, 0) + e.rows
    assert sorted(prefill.values()) == [3, 5]
    last = records[-1]
    # The tiny 4-bit model's every layer and head take the native kernel where it is built.
    native = "native" if engine.runner.native_quantized_applies else "gemm"
    assert last.decode_rows == len(last.entries) and last.kernel_path == native
    assert [r.step for r in records] == list(range(1, len(records) + 1))
    for before, r in zip(records, records[1:], strict=False):
        assert r.model_time > 0
        # An overlapped step began computing while the one before was still booking: its model
        # time fits between that step's start and its own end, the events published between
        # the two steps included (started_at is the wall clock, the durations perf_counter's:
        # a millisecond for the two clocks).
        since = before.started_at if r.overlapped else r.started_at
        assert r.model_time <= r.started_at + r.wall_time - since + 1e-3


def test_subscribers_follow_steps_live(make_engine):
    engine = make_engine()
    seen = []
    unsubscribe = engine.subscribe(seen.append)
    engine.generate("hi", greedy(4))
    unsubscribe()
    engine.generate("hi", greedy(4))
    assert [r.step for r in seen] == list(range(1, 5))


def test_bad_requests_are_rejected_before_queueing(make_engine):
    engine = make_engine(num_kv_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="empty"):
        engine.submit("", greedy())
    with pytest.raises(ValueError, match="context window"):
        engine.submit("x", SamplingParams(max_tokens=10_000))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.submit("x" * 20, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="token ids"):
        engine.submit([1, 2, 99999], greedy())
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)


def test_an_exception_inside_a_step_fails_that_step_and_the_engine_goes_on(make_engine):
    engine = make_engine()
    calls = {"n": 0}

    def explode_once(plan):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")

    engine.before_forward = explode_once
    handle = engine.submit("doomed", greedy(10))
    events = list(handle)
    assert handle.finish.reason == "error" and "injected fault" in handle.finish.error
    assert any(type(e).__name__ == "ErrorEvent" for e in events)
    assert_no_blocks_held(engine)
    assert engine.generate("still alive", greedy(5)).completion_tokens == 5


def test_async_consumers_receive_events_on_their_loop(make_engine):
    engine = make_engine()

    async def consume():
        handle = engine.submit("async", greedy(6), loop=asyncio.get_running_loop())
        texts = [e async for e in handle]
        return texts, threading.current_thread()

    events, thread = asyncio.run(consume())
    assert thread is threading.main_thread()
    assert events[-1].reason == "length" and len(events) == 7


def test_idle_engine_blocks_instead_of_spinning(make_engine):
    engine = make_engine()
    engine.generate("warm", greedy(2))
    before = engine.step_count
    threading.Event().wait(0.3)
    assert engine.step_count == before  # no steps while idle
    assert engine.running


def test_a_running_engine_keeps_setup_out_of_full_collections_and_a_stopped_one_frees_it(
        make_engine):
    """Setup's objects are frozen while the engine runs (a full collection would walk the
    model and tokenizer between two steps); once it stops they are garbage like any other,
    or every engine a process started would stay in memory."""
    engine = make_engine()
    assert gc.get_freeze_count() > 0
    engine.stop()
    assert gc.get_freeze_count() == 0


def test_float32_model_gives_the_same_tokens_batched_as_alone(make_engine):
    """f32 uses BLAS: a batched GEMM may sum in another order than one row alone, but on this
    tiny model no greedy choice is near a tie, so the tokens must agree; a difference is
    reported with the top-2 margin it came from."""
    engine = make_engine(loader=lambda: tiny_model(quantize=False))
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)
    solo = [engine.submit(p, params) for p in PROMPTS[:1]][0]
    solo_events = [e for e in solo if hasattr(e, "token_id")]
    batch = [engine.submit(p, params) for p in PROMPTS[:4]]
    batch_events = [e for e in batch[0] if hasattr(e, "token_id")]
    assert len(solo_events) == len(batch_events) == 16
    for h in batch[1:]:
        h.result()
    for s, b in zip(solo_events, batch_events, strict=True):
        if s.token_id != b.token_id:
            margin = s.top_logprobs[0][1] - s.top_logprobs[1][1]
            pytest.fail(f"token {s.index} differs ({s.token_id} vs {b.token_id}); "
                        f"top-2 margin alone was {margin:.2e}")


@pytest.mark.parametrize("policy,threshold", [("gemv", 1), ("auto", 4)])
def test_kernel_paths_give_identical_tokens_on_a_row_independent_backend(make_engine, policy,
                                                                         threshold):
    """4-bit on MLX's CPU backend computes each row alone: the path must not change a bit. On
    MLX's kernel for every path (row_kernels "mlx"): the native one that gemm steps take by
    default sums in another order (tests/engine/test_decode_quantized.py bounds the gap)."""
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)
    gemm = make_engine(block_size=4, row_kernels="mlx")
    other = make_engine(block_size=4, kernel_policy=policy, kernel_threshold=threshold,
                        row_kernels="mlx")
    a = [[(e.token_id, e.logprob) for e in h if hasattr(e, "token_id")]
         for h in [gemm.submit(p, params) for p in PROMPTS[:4]]]
    b = [[(e.token_id, e.logprob) for e in h if hasattr(e, "token_id")]
         for h in [other.submit(p, params) for p in PROMPTS[:4]]]
    assert a == b  # tokens and logprobs, bit for bit
    paths = {(r.kernel_path, r.total_rows, r.linear_calls_per_layer) for r in other.steps.recent()}
    for path, rows, calls in paths:
        expected = "gemv" if policy == "gemv" or rows <= threshold else "gemm"
        assert path == expected
        assert calls == (rows if path == "gemv" else 1)
    assert all(r.kernel_path == "gemm" for r in gemm.steps.recent())


def test_bad_kernel_policy_is_rejected():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="kernel policy"):
        EngineConfig(kernel_policy="fast")
    with pytest.raises(ValueError, match="threshold"):
        EngineConfig(kernel_policy="auto", kernel_threshold=-1)


def test_trace_records_what_each_step_wrote_for_the_request(make_engine):
    engine = make_engine(block_size=4, max_num_batched_tokens=8)
    prompt = "a prompt of twenty chars"  # 24 tokens: three prefill chunks of 8
    handle = engine.submit(prompt, greedy(5), trace=True)
    other = engine.submit("untraced", greedy(5))
    finish = handle.result()
    assert other.result().trace is None
    trace = finish.trace
    assert [t["step"] for t in trace] == finish.steps
    assert sum(t["rows"] for t in trace) == len(engine.encode(prompt)) + 5 - 1
    cfg = engine.loaded.config
    native = "native" if engine.runner.native_quantized_applies else "gemm"
    for t in trace:
        assert t["kv"].shape == (cfg["num_hidden_layers"], 2, cfg["num_key_value_heads"],
                                 t["rows"], cfg["head_dim"])
        assert t["path"] == native and t["step_rows"] >= t["rows"]
    sampled = [t for t in trace if t["logits"] is not None]
    assert len(sampled) == 5
    # The logits are the ones sampled from: greedy picks their argmax.
    assert [int(t["logits"].argmax()) for t in sampled] == finish.token_ids


def test_submit_many_puts_requests_in_the_same_first_step(make_engine):
    from engine.engine import Submission

    engine = make_engine(block_size=4)
    for _ in range(3):  # one by one, the first request may or may not run a step alone
        handles = engine.submit_many([Submission(p, greedy(4)) for p in PROMPTS[:5]])
        results = [h.result() for h in handles]
        firsts = {r.steps[0] for r in results}
        assert len(firsts) == 1, f"first steps {firsts}: not admitted together"
    assert_no_blocks_held(engine)


def test_submit_many_after_joins_at_the_chosen_token(make_engine):
    from engine.engine import Submission

    engine = make_engine(block_size=4)
    queued = threading.Event()  # the target's first step waits until the others are queued
    engine.before_forward = lambda plan: queued.wait(10)
    target = engine.submit("The quick brown fox jumps", greedy(12))
    events = []
    # Held by the engine until the target has produced 5 tokens.
    others = engine.submit_many([Submission(p, greedy(3)) for p in PROMPTS[:3]],
                                after=(target.request_id, 5))
    queued.set()
    for event in target:
        events.append(event)
    results = [h.result() for h in others]
    token_steps = [e.step for e in events if hasattr(e, "token_id")]
    # Token #5 of the target is computed in the step where the others start their prefill.
    assert {r.steps[0] for r in results} == {token_steps[5]}
    assert_no_blocks_held(engine)


def test_submit_many_validates_all_before_queueing_any(make_engine):
    from engine.engine import Submission
    from engine.errors import RequestError

    engine = make_engine(block_size=4)
    before = engine.step_count
    with pytest.raises(RequestError):
        engine.submit_many([Submission("fine", greedy(4)), Submission("", greedy(4))])
    assert engine.step_count == before and not engine.scheduler.has_work()


def test_held_requests_can_be_cancelled_and_are_released_when_the_target_ends(make_engine):
    from engine.engine import Submission

    engine = make_engine(block_size=4)
    target = engine.submit("hello there", greedy(3))
    held = engine.submit_many([Submission("zz", greedy(2)), Submission("paged", greedy(2))],
                              after=(target.request_id, 100))  # more than the target makes
    held[0].cancel()
    assert target.result().completion_tokens == 3
    assert held[0].result().reason == "cancelled"
    late = held[1].result()  # released when the target finished, then run to the end
    assert late.reason == "length" and late.steps[0] > target.result().steps[-1]
    assert_no_blocks_held(engine)


def test_result_can_be_read_twice(make_engine):
    engine = make_engine(block_size=4)
    handle = engine.submit("hello", greedy(2))
    first = handle.result()
    assert handle.result() is first and list(handle) == []


@pytest.mark.parametrize("attention", ["native", "mlx"])
def test_a_repeated_prompt_copies_its_last_rows_and_emits_the_same_logits(make_engine,
                                                                         attention):
    """The rows a repeated prompt copies from the first request's last block are the ones
    that request computed: the second computes one token and emits the same tokens with the
    same logits (the MLX-ops path, which GPU backends run, updates the pool by scatter)."""
    engine = make_engine(block_size=16, attention=attention)
    assert (engine.pool.copy_op is not None) == (attention == "native")  # the path under test
    prompt = "a prompt whose last block is only partly full, at twenty"
    ids = engine.encode(prompt)
    tail = (len(ids) - 1) % 16
    assert tail >= engine.block_manager.min_copy_rows  # rows enough to be copied
    first = engine.submit(prompt, greedy(8), trace=True).result()
    second = engine.submit(prompt, greedy(8), trace=True).result()
    assert second.cached_prompt_tokens == len(ids) - 1
    assert engine.block_manager.stats.copied == tail
    assert second.token_ids == first.token_ids
    logits = [np.stack([t["logits"][-1] for t in r.trace]) for r in (first, second)]
    assert np.abs(logits[0] - logits[1]).max() <= 1e-5
    assert_no_blocks_held(engine)


def test_a_failed_copy_fails_its_request_and_leaves_no_block_held(make_engine):
    engine = make_engine(block_size=16)
    prompt = "a prompt whose last block is only partly full, at twenty"
    first = engine.generate(prompt, greedy(4))

    def broken(copies):
        raise RuntimeError("the pool could not copy")
    engine.pool.copy_rows = broken
    failed = engine.generate(prompt, greedy(4))
    assert failed.reason == "error" and "the pool could not copy" in failed.error
    assert_no_blocks_held(engine)
    del engine.pool.copy_rows  # the engine goes on
    assert engine.generate(prompt, greedy(4)).token_ids == first.token_ids
