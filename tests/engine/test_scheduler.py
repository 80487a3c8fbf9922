"""Scheduler decisions, without a model: we play the engine's postprocess by hand."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import SeqStatus, Sequence


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=16, prefix=True):
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(bm, max_num_seqs, budget), bm


def seq(name, n_prompt, first=0):
    return Sequence(name, list(range(first, first + n_prompt)), SamplingParams(max_tokens=100))


def advance(sched, out, token=7):
    """What the engine does after a forward: count computed rows, append sampled tokens."""
    for g in out.groups:
        g.seq.num_computed += g.num_rows
        sched.bm.register_full_blocks(g.seq.seq_id, g.seq.token_ids, g.seq.num_computed)
        if g.sample:
            g.seq.output_ids.append(token)


def test_budget_is_respected_and_long_prompts_are_chunked():
    sched, _ = make(budget=16)
    a = seq("a", 40)
    sched.add(a)
    sizes = []
    while not a.output_ids:
        out = sched.schedule()
        assert out.num_rows <= 16
        sizes.append([(g.seq.seq_id, g.start, g.num_rows, g.sample) for g in out.groups])
        advance(sched, out)
    assert sizes == [[("a", 0, 16, False)], [("a", 16, 16, False)], [("a", 32, 8, True)]]


def test_decode_rows_come_first_then_prefill_chunks_fill_the_budget():
    sched, _ = make(budget=8)
    a, b = seq("a", 3), seq("b", 30, first=100)
    sched.add(a)
    advance(sched, sched.schedule())  # a prefilled, sampled its first token
    sched.add(b)
    out = sched.schedule()
    assert [(g.seq.seq_id, g.phase, g.num_rows) for g in out.groups] == [
        ("a", "decode", 1), ("b", "prefill", 7)]
    advance(sched, out)
    out = sched.schedule()
    assert [(g.seq.seq_id, g.phase, g.num_rows) for g in out.groups] == [
        ("a", "decode", 1), ("b", "prefill", 7)]


def test_max_num_seqs_limits_admission():
    sched, _ = make(max_num_seqs=2, budget=100)
    for i in range(4):
        sched.add(seq(f"s{i}", 3, first=10 * i))
    out = sched.schedule()
    assert [g.seq.seq_id for g in out.groups] == ["s0", "s1"]
    assert len(sched.waiting) == 2


def test_preemption_frees_the_newest_and_requeues_it_at_the_head():
    # 4 blocks of 4 tokens: two sequences of 7 tokens fill 2 blocks each.
    sched, bm = make(num_blocks=4, block_size=4, budget=64, prefix=False)
    a, b = seq("a", 7), seq("b", 7, first=50)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())  # both prefilled: 7 computed + 1 sampled each
    advance(sched, sched.schedule())  # both decode position 7: 2 blocks each, pool full
    assert bm.num_free_blocks == 0
    out = sched.schedule()  # a needs a 3rd block for position 8: b (newest) is preempted
    assert [s.seq_id for s in out.preempted] == ["b"]
    assert [g.seq.seq_id for g in out.groups] == ["a"]
    assert b.status is SeqStatus.WAITING and b.num_computed == 0
    assert sched.waiting[0] is b and b.num_preemptions == 1
    assert bm.block_table("b") == []
    advance(sched, out)
    bm.check_invariants()


def test_preempted_sequence_recomputes_prompt_and_outputs_then_samples():
    sched, bm = make(num_blocks=4, block_size=4, budget=64, prefix=False)
    a, b = seq("a", 7), seq("b", 7, first=50)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())
    advance(sched, sched.schedule())
    advance(sched, sched.schedule())  # b preempted, a decodes
    sched.finish(a, "stop")
    out = sched.schedule()
    (g,) = out.groups
    assert g.seq is b and g.start == 0 and g.num_rows == b.num_tokens == 9 and g.sample


def test_finish_and_cancel_free_blocks_wherever_the_sequence_is():
    sched, bm = make()
    a, b = seq("a", 5), seq("b", 5, first=20)
    sched.add(a)
    advance(sched, sched.schedule())
    sched.add(b)
    sched.finish(b, "cancelled")  # still waiting
    sched.finish(a, "cancelled")  # running
    assert not sched.has_work()
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_prefix_cache_hit_skips_computed_blocks_at_admission():
    sched, bm = make(budget=64)
    a = seq("a", 9)
    sched.add(a)
    advance(sched, sched.schedule())
    sched.finish(a, "stop")
    b = seq("b", 9)  # same prompt
    sched.add(b)
    out = sched.schedule()
    (g,) = out.groups
    assert g.start == 8 and g.num_rows == 1  # two cached blocks of 4, last token recomputed
    assert b.num_cached_prompt == 8


def test_a_sequences_tokens_slice_across_prompt_and_outputs():
    s = Sequence("a", [10, 11, 12], SamplingParams())
    s.output_ids += [20, 21]
    for start in range(6):
        for stop in range(start, 7):
            assert s.tokens(start, stop) == s.token_ids[start:stop], (start, stop)
