"""The draft-model proposer (--speculative draft, engine/draft.py): a draft model's greedy tokens
verified in the shared step, its own paged KV, rollback to the common prefix, release.

The target is the tiny random 4-bit model (its rows are computed independently by the native
kernels, so greedy text with speculation must equal greedy text without it, bit for bit). Its
first layer drafts for it (layers:1): right now and then, mostly wrong, so drafts are both
accepted and rejected. The draft's own correctness (its cache after rollbacks) is checked
against a fresh proposer's drafts, since a wrong draft never changes the target's text."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.draft import DraftProposer, check_vocabulary, load_draft
from engine.model_runner import ModelRunner, pool_for
from engine.models import family_for
from engine.sampling import SamplingParams
from engine.testing import ByteTokenizer, cancel_after_tokens, tiny_model

PROMPTS = ["a", "hello there", "The quick brown fox jumps", "0123456789" * 3,
           "x" * 47, "paged attention!", "zz", "once upon a time, in a land far away"]
DRAFT = {"speculative": "draft", "draft_model": "layers:1", "num_speculative_tokens": 4,
         "speculative_max_batch": 16}


def greedy(n=24, **kw):
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def events(handle):
    """(token id, logprob, alternatives) of every token a request emitted."""
    return [(e.token_id, e.logprob, e.top_logprobs) for e in handle if hasattr(e, "token_id")]


def spec_totals(engine):
    records = engine.steps.recent()
    return sum(r.draft_tokens for r in records), sum(r.accepted_tokens for r in records)


def assert_no_blocks_held(engine):
    for bm in (engine.block_manager, engine.proposer.block_manager):
        bm.check_invariants()
        assert bm.num_used_blocks == 0, f"{bm.num_used_blocks} blocks still held"
    assert engine.proposer.cached_requests == []


class Recording:
    """Wraps the engine's draft proposer: keeps every (tokens, room, drafts) it was asked for
    and gave, so a test can redo them on a fresh cache. wrong > 0: each draft handed to the
    engine is replaced by a wrong token with that probability (seeded), so every accept length
    happens while the draft's cache holds its own drafts."""

    def __init__(self, inner: DraftProposer, wrong: float = 0.0, seed: int = 0):
        self.inner = inner
        self.wrong = wrong
        self.rng = random.Random(seed)
        self.calls: list[tuple[list[int], int, list[int]]] = []

    def propose(self, wanted):
        out = self.inner.propose(wanted)
        self.calls += [(list(tokens), k, out.get(seq_id, [])) for seq_id, tokens, k in wanted]
        return {s: [(t + 1) % 256 if self.rng.random() < self.wrong else t for t in d]
                for s, d in out.items()}

    def release(self, seq_id):
        self.inner.release(seq_id)

    def __getattr__(self, name):  # block_manager, cached_requests, forwards
        return getattr(self.inner, name)


_EXPECTED: dict[str, list[int]] = {}


def expected_tokens(make_engine, prompts=PROMPTS) -> list[list[int]]:
    """Greedy tokens of the tiny model without speculation (made once per test session)."""
    if not _EXPECTED:
        engine = make_engine()
        _EXPECTED.update({p: engine.generate(p, greedy()).token_ids for p in PROMPTS})
    return [_EXPECTED[p] for p in prompts]


def _proposer(loaded, draft_spec="layers:1", num_blocks=64, block_size=4, max_rows=32,
              loader=None):
    """A DraftProposer on its own, as engine.draft.draft_proposer builds one."""
    family = family_for(loaded.model, loaded.config)
    draft = load_draft(draft_spec, loaded, family, loader)
    runner = ModelRunner(draft.model, pool_for(draft.family, num_blocks, block_size), "auto",
                         "auto", draft.family)
    return DraftProposer(draft, runner, BlockManager(num_blocks, block_size, False), max_rows,
                         lambda rows: "gemm")


# ---- the target's output is unchanged ----------------------------------------------------------
def test_greedy_with_draft_model_equals_greedy_without_alone_and_in_a_batch(make_engine):
    params = greedy(logprobs=3)
    plain = make_engine(block_size=4)
    expected = [events(plain.submit(p, params)) for p in PROMPTS]
    engine = make_engine(block_size=4, max_num_batched_tokens=32, **DRAFT)
    handles = [engine.submit(p, params) for p in PROMPTS]  # prefill chunks beside verify rows
    assert [events(h) for h in handles] == expected
    records = engine.steps.recent()
    assert any(r.verify_rows and r.prefill_rows for r in records)
    assert max(sum(e.phase == "verify" for e in r.entries) for r in records) >= 4
    assert [events(engine.submit(p, params)) for p in PROMPTS] == expected  # alone
    drafted, accepted = spec_totals(engine)
    assert 0 < accepted < drafted  # the draft is sometimes right, mostly wrong
    lengths = {e.accepted for r in records for e in r.entries if e.phase == "verify"}
    assert 0 in lengths and max(lengths) >= 1
    assert sum(r.propose_time for r in records) > 0
    assert_no_blocks_held(engine)


def test_one_propose_call_is_at_most_k_batched_draft_forwards(make_engine):
    engine = make_engine(block_size=4, **DRAFT)
    recording = Recording(engine.proposer)
    engine.proposer = recording
    handles = [engine.submit(p, greedy()) for p in PROMPTS]
    for h in handles:
        h.result()
    inner = recording.inner
    steps_drafting = sum(1 for r in engine.steps.recent() if r.speculation == "on"
                         and r.num_running > 0)
    # One forward per round for all the requests together, never one per request.
    assert 0 < inner.forwards <= 4 * steps_drafting
    assert len(recording.calls) > inner.forwards


def test_a_separately_loaded_draft_and_an_exact_copy_of_the_target(make_engine):
    """A draft given as a model (not layers:N) is loaded, checked and run on its own weights;
    a copy of the target drafts exactly its tokens: every draft is accepted."""
    expected = expected_tokens(make_engine, PROMPTS[:4])
    copy = make_engine(block_size=4, **{**DRAFT, "draft_model": "copy"},
                       draft_loader=lambda spec: tiny_model())
    assert not copy.proposer.draft.shared
    handles = [copy.submit(p, greedy()) for p in PROMPTS[:4]]
    assert [h.result().token_ids for h in handles] == expected
    drafted, accepted = spec_totals(copy)
    assert drafted > 0 and accepted == drafted
    assert_no_blocks_held(copy)


# ---- refusals --------------------------------------------------------------------------------
def test_a_draft_with_another_vocabulary_is_refused_naming_both_sizes(make_engine, tmp_path):
    from mlx_lm.models import llama

    from engine.testing import FAMILY_CONFIGS, FAMILY_VOCAB, make_family_folder

    folder = make_family_folder(tmp_path / "draft", llama, FAMILY_CONFIGS["llama"][1])
    with pytest.raises(ValueError, match=rf"draft scores {FAMILY_VOCAB} tokens.*target "
                                         rf"{ByteTokenizer.vocab_size}") as e:
        make_engine(speculative="draft", draft_model=str(folder))
    assert "'draft'" in str(e.value) and "'tiny-llama'" in str(e.value)


def test_a_draft_with_another_tokenizer_is_refused():
    target = tiny_model()
    other_eos = tiny_model(num_hidden_layers=1)
    other_eos.tokenizer = type("OtherEos", (ByteTokenizer,), {"eos_token_id": 3})()
    with pytest.raises(ValueError, match=r"draft on \[3\], the target on \[2\]"):
        check_vocabulary(target, other_eos)
    bigger = tiny_model(vocab_size=300)
    with pytest.raises(ValueError, match="draft scores 300 tokens.*target 259"):
        check_vocabulary(target, bigger)
    check_vocabulary(target, tiny_model(seed=3))  # same vocabulary: accepted


def test_draft_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="speculative 'draft' needs a draft model"):
        EngineConfig(speculative="draft")
    with pytest.raises(ValueError, match="used by speculative 'draft' only"):
        EngineConfig(speculative="ngram", draft_model="layers:1")
    with pytest.raises(ValueError, match="layers:N takes a positive number"):
        EngineConfig(speculative="draft", draft_model="layers:0")
    loaded = tiny_model()
    with pytest.raises(ValueError, match="has 2 decoder layers; a layers:N draft takes 1 to 1"):
        load_draft("layers:2", loaded, family_for(loaded.model, loaded.config))


# ---- the draft's own cache -------------------------------------------------------------------
def test_drafts_after_rollbacks_equal_a_fresh_drafts(make_engine):
    """The draft's cache keeps the common prefix of what it saw and the request's tokens: its
    drafts are the draft model's greedy continuation of the request's tokens, as a proposer
    with an empty cache makes them, after every accept length (an exact draft, its drafts
    corrupted on the way to the engine)."""
    engine = make_engine(block_size=4, max_num_batched_tokens=16,
                         **{**DRAFT, "draft_model": "copy"}, draft_loader=lambda s: tiny_model())
    recording = Recording(engine.proposer, wrong=0.3)
    engine.proposer = recording
    for h in [engine.submit(p, greedy()) for p in PROMPTS]:
        h.result()
    lengths = {e.accepted for r in engine.steps.recent() for e in r.entries
               if e.phase == "verify"}
    assert lengths == set(range(5))
    assert sum(1 for _, _, d in recording.calls if d) > 40
    fresh = _proposer(tiny_model(), "copy", block_size=4, max_rows=4096,
                      loader=lambda s: tiny_model())
    for i, (tokens, k, drafts) in enumerate(recording.calls):
        again = fresh.propose([(f"fresh-{i}", tokens, k)]).get(f"fresh-{i}", [])
        fresh.release(f"fresh-{i}")
        assert drafts == again[:len(drafts)], f"call {i}: {drafts} != {again}"
        assert len(drafts) == k or not drafts  # a long catch-up waits a step
    assert_no_blocks_held(engine)


def test_rollback_keeps_the_common_prefix_and_trims_the_blocks_past_it():
    proposer = _proposer(tiny_model(), block_size=4)
    fresh = _proposer(tiny_model(), block_size=4)

    def propose(tokens, k):
        drafts = proposer.propose([("s", tokens, k)])["s"]
        assert drafts == fresh.propose([("f", tokens, k)])["f"]
        fresh.release("f")
        table = proposer.block_manager.block_table("s")
        assert len(table) == -(-len(proposer.cached_tokens("s")) // 4)  # no block past the cache
        return drafts

    tokens = ByteTokenizer().encode("hello there, general")
    d = propose(tokens, 4)
    assert len(d) == 4 and proposer.cached_tokens("s") == tokens + d[:3]  # d4 has no KV yet
    # The target accepted d1 and chose its own next token, not d2.
    nxt = tokens + [d[0], (d[1] + 1) % 256]
    propose(nxt, 2)
    assert proposer.cached_tokens("s")[:len(nxt)] == nxt
    # Tokens that part from the cache before its end (a request id reused): only what they
    # share is kept.
    propose(ByteTokenizer().encode("hello where"), 3)
    propose([9, 9, 9], 1)
    proposer.release("s")
    assert proposer.block_manager.num_used_blocks == 0


def test_a_full_draft_pool_gives_fewer_drafts_never_an_error_or_a_leak():
    proposer = _proposer(tiny_model(), num_blocks=6, block_size=4)
    bm = proposer.block_manager
    long = list(range(3, 30))  # 27 tokens: 7 blocks, more than the pool
    assert proposer.propose([("long", long, 4)]) == {}
    short = list(range(3, 13))  # 10 tokens + 3 drafts with KV: 4 blocks
    assert len(proposer.propose([("a", short, 4)])["a"]) == 4
    # With a second request the 6 blocks hold both catch-ups, not all of their drafts.
    other = list(range(40, 48))
    got = proposer.propose([("a", short, 4), ("b", other, 4)])
    assert got["a"] and got["b"] and len(got["a"]) + len(got["b"]) < 8
    bm.check_invariants()
    # "a" is not speculating this step: its cache makes room for "c" (least recently used).
    assert len(proposer.propose([("c", short + [7], 4)])["c"]) == 4
    assert "a" not in proposer.cached_requests
    for seq_id in ("long", "a", "b", "c"):
        proposer.release(seq_id)
    bm.check_invariants()
    assert bm.num_used_blocks == 0


def test_an_error_inside_the_draft_drops_its_caches_and_the_step_goes_on(make_engine):
    (expected,) = expected_tokens(make_engine, PROMPTS[2:3])
    engine = make_engine(block_size=4, **DRAFT)
    runner = engine.proposer.runner
    real, calls = runner.run, []

    def failing(groups, path="gemm"):
        calls.append(len(groups))
        if len(calls) == 3:
            raise RuntimeError("injected draft failure")
        return real(groups, path)

    runner.run = failing
    assert engine.generate(PROMPTS[2], greedy()).token_ids == expected
    assert len(calls) > 3 and spec_totals(engine)[0] > 0
    assert_no_blocks_held(engine)


# ---- release and leaks -----------------------------------------------------------------------
def test_finish_and_cancel_release_the_drafts_blocks(make_engine):
    engine = make_engine(block_size=4, **DRAFT)
    held = []
    engine.before_forward = lambda plan: held.append(engine.proposer.block_manager.num_used_blocks)
    engine.generate(PROMPTS[1], greedy())
    assert max(held) > 0  # it did hold blocks while it ran
    assert_no_blocks_held(engine)
    handle = engine.submit(PROMPTS[4], greedy(200))
    for n, _ in enumerate(handle):
        if n == 6:
            handle.cancel()
            break
    assert handle.result().reason == "cancelled"
    assert_no_blocks_held(engine)


@pytest.mark.slow  # about 6 s; runs in `make test` (CI)
@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(draft=st.sampled_from(["layers:1", "copy"]), k=st.sampled_from([1, 3, 5]),
       sampled=st.booleans(), seed=st.integers(0, 1000),
       cancel_after=st.lists(st.integers(0, 12), min_size=0, max_size=3),
       num_blocks=st.sampled_from([20, 26, 64]))
def test_no_block_leaks_in_target_or_draft(make_engine, draft, k, sampled, seed, cancel_after,
                                          num_blocks):
    """Random accept patterns (a mostly wrong draft, an exact one, sampled requests), cancels
    between any two steps, and a small pool that preempts requests mid-verification and runs
    the draft's pool out: in the end neither block manager holds a block."""
    expected = dict(zip(PROMPTS, expected_tokens(make_engine), strict=True))
    engine = make_engine(block_size=4, num_kv_blocks=num_blocks, max_num_batched_tokens=24,
                         **{**DRAFT, "draft_model": draft, "num_speculative_tokens": k},
                         draft_loader=lambda spec: tiny_model())
    rng = random.Random(seed)
    params = [greedy(temperature=0.8, seed=rng.randrange(100)) if sampled and rng.random() < 0.5
              else greedy() for _ in PROMPTS]
    handles = [engine.submit(p, q) for p, q in zip(PROMPTS, params, strict=True)]
    cancel_after_tokens(handles, cancel_after)
    for prompt, p, h in zip(PROMPTS, params, handles, strict=True):
        f = h.result()
        assert f.reason in ("length", "cancelled")
        if p.greedy:
            n = len(f.token_ids) if f.reason == "cancelled" else len(expected[prompt])
            assert f.token_ids == expected[prompt][:n]
    assert_no_blocks_held(engine)


def test_preemption_keeps_the_drafts_cache_and_the_tokens(make_engine):
    expected = expected_tokens(make_engine)
    engine = make_engine(block_size=4, num_kv_blocks=20, max_num_batched_tokens=24, **DRAFT)
    kept = []  # per preempted request: whether the draft still holds its cache
    engine.before_forward = lambda plan: kept.extend(
        s.seq_id in engine.proposer.cached_requests for s in plan.preempted)
    handles = [engine.submit(p, greedy()) for p in PROMPTS]
    assert [h.result().token_ids for h in handles] == expected
    assert engine.scheduler.num_preemptions > 0 and any(kept)
    assert spec_totals(engine)[1] > 0
    assert_no_blocks_held(engine)


def test_a_model_without_a_context_length_still_drafts(make_engine):
    """A config naming no max_position_embeddings (the target's and so a layers:N draft's):
    drafts are not capped at a context of 0 tokens."""
    def loader():
        loaded = tiny_model()
        del loaded.config["max_position_embeddings"]
        return loaded

    engine = make_engine(loader=loader, **DRAFT)
    engine.generate(PROMPTS[2], greedy())
    drafted, _ = spec_totals(engine)
    assert drafted > 0
    assert_no_blocks_held(engine)
