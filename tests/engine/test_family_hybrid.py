"""Hybrid families (qwen3_5, qwen3_5_moe, qwen3_next: Gated DeltaNet layers beside gated
attention) against mlx-lm's own generation on tiny folders, and the whole engine around their
recurrent state: batching, chunked prefill, prefix checkpoints, speculation, preemption and
the state slots' bookkeeping."""

from __future__ import annotations

import importlib
import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.model_loader import load_model
from engine.models import UnsupportedModelError, family_for
from engine.sampling import SamplingParams
from engine.speculative import NgramProposer
from engine.testing import FAMILY_CONFIGS, cancel_after_tokens
from tests.family_models import (
    check_batch_equals_alone,
    check_cli_equals_mlx_lm,
    embedded_tokenizer,
    make_folder,
)
from tests.speculation import ScriptedDrafts

HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def _folder(root, name, quantize):
    module_name, config = FAMILY_CONFIGS[name]
    return make_folder(root / f"{name}-{'q4' if quantize else 'f32'}",
                       importlib.import_module(f"mlx_lm.models.{module_name}"), config,
                       quantize=quantize)


@pytest.fixture(scope="module", params=HYBRIDS)
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return request.param, _folder(root, request.param, False), _folder(root, request.param, True)


@pytest.fixture(scope="module")
def q4_folder(tmp_path_factory):
    return _folder(tmp_path_factory.mktemp("hybrid"), "qwen3_5", True)


def greedy(n=24, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def prompt_ids(n: int, offset: int = 0) -> list[int]:
    base = embedded_tokenizer().encode(" ".join(f"word{i} is number {i}." for i in range(300)))
    return base[offset:offset + n]


@pytest.fixture
def hybrid(make_engine, q4_folder):
    """Engines on the 4-bit qwen3_5 folder (its rows are computed each on its own: batched,
    chunked and speculative runs must give exactly the same tokens)."""

    def factory(**config):
        config.setdefault("block_size", 16)
        return make_engine(loader=lambda: load_model(str(q4_folder), "q4"), **config)

    return factory


def outputs(handle):
    """A request's (token ids, logprobs), read from its events."""
    tokens = [e for e in handle if hasattr(e, "token_id")]
    return [e.token_id for e in tokens], [e.logprob for e in tokens]


def run(engine, prompt, params=None):
    return outputs(engine.submit(prompt, params or greedy()))


def finish_and_outputs(engine, prompt):
    handle = engine.submit(prompt, greedy())
    out = outputs(handle)
    return handle.result(), out


def assert_nothing_held(engine):
    slots = engine.state_slots
    slots.check_invariants()
    assert slots.holders() == {} and slots.usage()["state_slots_used"] == 0
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_blocks == 0


# ---- against mlx-lm --------------------------------------------------------------------------
@pytest.mark.slow
def test_greedy_equals_mlx_lm_f32(family):
    check_cli_equals_mlx_lm(family[1], "f32")


@pytest.mark.slow
def test_greedy_equals_mlx_lm_q4(family):
    check_cli_equals_mlx_lm(family[2], "q4")


@pytest.mark.slow
def test_greedy_equals_mlx_lm_on_mlx_ops(family):
    """The MLX-ops recurrence and attention (what Metal and CUDA run) give mlx-lm's tokens."""
    check_cli_equals_mlx_lm(family[1], "f32", 32, "--attention", "mlx", "--row-kernels", "mlx")


@pytest.mark.slow
def test_batched_equals_alone_q4(family):
    """8 requests at once equal each alone; a prefix-cache hit (from a checkpoint every 16
    tokens) and preempted-and-resumed requests give the same tokens."""
    check_batch_equals_alone(family[2], "q4", long_prompt_tokens=90,
                             state_checkpoint_interval=16)


@pytest.mark.slow
def test_batched_equals_alone_f32_batch_invariant(family):
    check_batch_equals_alone(family[1], "f32", long_prompt_tokens=90, batch_invariant=True,
                             state_checkpoint_interval=16)


# ---- the state through chunks, checkpoints and speculation -----------------------------------
def test_a_prompt_prefilled_in_chunks_equals_it_whole(hybrid):
    prompt = prompt_ids(150)
    whole = run(hybrid(max_num_batched_tokens=512), prompt)
    for chunk in (1, 7, 64):
        engine = hybrid(max_num_batched_tokens=chunk)
        assert run(engine, prompt) == whole, f"chunks of {chunk}"
        assert_nothing_held(engine)


def test_a_prefix_hit_resumes_from_the_deepest_checkpoint_bit_for_bit(hybrid):
    prompt = prompt_ids(100)
    other = prompt[:80] + prompt_ids(30, offset=200)
    cold = {tuple(p): run(hybrid(enable_prefix_caching=False), p)
            for p in (prompt, other)}
    engine = hybrid(state_checkpoint_interval=32)
    first, out = finish_and_outputs(engine, prompt)
    assert first.cached_prompt_tokens == 0 and out == cold[tuple(prompt)]
    again, out = finish_and_outputs(engine, prompt)
    # Checkpoints at 32, 64 and 96: the blocks reach 96 (one token is always computed).
    assert again.cached_prompt_tokens == 96 and out == cold[tuple(prompt)]
    step = next(r for r in engine.steps.recent() if r.step == again.steps[0])
    assert step.state_checkpoint_hits == 1
    assert step.entries[0].rows == 4 and step.entries[0].context_len == 100
    shared, out = finish_and_outputs(engine, other)
    # 80 shared tokens: the deepest checkpoint inside them is at 64.
    assert shared.cached_prompt_tokens == 64 and out == cold[tuple(other)]
    assert engine.state_slots.hits == 2
    assert_nothing_held(engine)


def test_without_a_checkpoint_a_cached_prefix_is_recomputed(hybrid):
    """Blocks alone cannot resume a recurrent state: no checkpoint (a budget of 0), no hit."""
    prompt = prompt_ids(100)
    engine = hybrid(state_checkpoint_mib=0)
    first = finish_and_outputs(engine, prompt)[1]
    again, out = finish_and_outputs(engine, prompt)
    assert again.cached_prompt_tokens == 0 and out == first
    assert_nothing_held(engine)


def test_scripted_speculation_gives_plain_greedy_tokens_alone_and_batched(hybrid):
    prompts = [prompt_ids(n, offset=i * 7) for i, n in enumerate((5, 23, 40, 61))]
    plain = hybrid()
    expected = [run(plain, p) for p in prompts]
    drafts = ScriptedDrafts(wrong=3)
    for p, (ids, _) in zip(prompts, expected, strict=True):
        drafts.learn(p, ids)
    engine = hybrid(speculative="ngram", num_speculative_tokens=4, speculative_max_batch=16,
                    proposer=drafts)
    assert [run(engine, p) for p in prompts] == expected
    handles = [engine.submit(p, greedy()) for p in prompts]
    assert [outputs(h) for h in handles] == expected
    records = engine.steps.recent()
    accepted = sum(r.accepted_tokens for r in records)
    assert 0 < accepted < sum(r.draft_tokens for r in records)  # some kept, some rejected
    assert_nothing_held(engine)


@pytest.mark.slow  # ~5 s, several engines (`make test` runs it)
def test_prompt_lookup_on_a_hybrid_gives_plain_greedy_tokens(hybrid):
    """Prompt lookup itself. The random model never repeats its own tokens, so the prompt is
    1,500 distinct token ids: an output token found among them drafts what followed it (and
    is rejected: the scripted test above covers kept drafts)."""
    prompt = list(range(100, 3100, 2))
    expected = run(hybrid(), prompt, greedy(150))
    engine = hybrid(speculative="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    assert isinstance(engine.proposer, NgramProposer)
    assert run(engine, prompt, greedy(150)) == expected
    assert sum(r.draft_tokens for r in engine.steps.recent()) > 0


def test_a_request_waits_for_a_free_state_slot(hybrid):
    prompts = [prompt_ids(20, offset=i * 5) for i in range(5)]
    plain = hybrid()
    expected = [run(plain, p) for p in prompts]
    engine = hybrid(state_slots=2)
    handles = [engine.submit(p, greedy()) for p in prompts]
    assert [outputs(h) for h in handles] == expected
    records = engine.steps.recent()
    assert max(r.num_running for r in records) == 2
    assert max(r.state_slots_used for r in records) == 2
    assert all(r.state_slots_total == 2 for r in records)
    assert_nothing_held(engine)


def test_the_state_pool_size_is_the_configs_arithmetic(hybrid):
    """Per GDN layer: a conv state of (K - 1) x conv_dim float32 values and a recurrent state
    of Hv x Dv x Dk float32 values, conv_dim = 2 Hk Dk + Hv Dv."""
    config = FAMILY_CONFIGS["qwen3_5"][1]
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    k = config["linear_conv_kernel_dim"]
    layers = sum((i + 1) % config["full_attention_interval"] != 0
                 for i in range(config["num_hidden_layers"]))
    per_layer = (k - 1) * (2 * hk * dk + hv * dv) * 4 + hv * dv * dk * 4
    engine = hybrid(max_num_seqs=3, speculative="ngram", num_speculative_tokens=2,
                    speculative_max_batch=2)
    slots = engine.state_slots
    assert slots.slot_bytes == layers * per_layer
    assert (slots.live, slots.scratch) == (3, 2 * 2)
    assert engine.runner.states.nbytes() == slots.total * layers * per_layer


def _nested_copy(flat, tmp_path, **text_extra):
    """The flat folder with its config laid out as a real Qwen3.5 folder's: the text model's
    keys under text_config (with layer_types), beside a vision_config."""
    folder = tmp_path / "nested"
    shutil.copytree(flat, folder)
    config = json.loads((flat / "config.json").read_text())
    text = {k: v for k, v in config.items() if k not in ("model_type", "quantization")}
    text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                           for i in range(text["num_hidden_layers"])]
    text.update(text_extra)
    nested = {"model_type": config["model_type"], "text_config": text,
              "vision_config": {"depth": 2, "hidden_size": 32}, "image_token_id": 248056,
              **({"quantization": config["quantization"]} if "quantization" in config else {})}
    (folder / "config.json").write_text(json.dumps(nested))
    return folder


def test_a_nested_config_with_a_vision_config_serves_the_text_model(hybrid, q4_folder,
                                                                    make_engine, tmp_path):
    nested = _nested_copy(q4_folder, tmp_path)
    prompt = prompt_ids(30)
    expected = run(hybrid(), prompt)
    engine = make_engine(loader=lambda: load_model(str(nested), "q4"))
    assert run(engine, prompt) == expected
    assert any("vision tower" in line for line in engine.runner.family.describe_layers())


def test_layer_types_that_disagree_with_the_interval_are_refused(q4_folder, tmp_path):
    types = ["linear_attention"] * 7 + ["full_attention"]  # layer 3 should attend
    nested = _nested_copy(q4_folder, tmp_path, layer_types=types)
    loaded = load_model(str(nested), "q4")
    with pytest.raises(UnsupportedModelError, match="layer 3 is 'linear_attention'"):
        family_for(loaded.model, loaded.config)


@pytest.mark.slow
def test_a_draft_model_without_recurrent_layers_drafts_for_a_hybrid(hybrid, tmp_path):
    """A llama draft on the same vocabulary proposes; the hybrid target verifies."""
    from mlx_lm.models import llama

    draft = make_folder(tmp_path / "draft", llama, FAMILY_CONFIGS["llama"][1], quantize=True)
    prompts = [prompt_ids(n, offset=3 * n) for n in (12, 31)]
    plain = hybrid()
    expected = [run(plain, p) for p in prompts]
    engine = hybrid(speculative="draft", draft_model=str(draft), num_speculative_tokens=3)
    handles = [engine.submit(p, greedy()) for p in prompts]
    assert [outputs(h) for h in handles] == expected
    assert sum(r.draft_tokens for r in engine.steps.recent()) > 0
    assert_nothing_held(engine)


@pytest.mark.parametrize("draft", ["layers:5", pytest.param("folder", marks=pytest.mark.slow)])
def test_a_hybrid_draft_resumes_its_state_after_the_accepted_drafts(hybrid, tmp_path, draft):
    """A draft with recurrent layers (the target's first 5 layers, or another hybrid folder)
    keeps its state after each of its forwards and resumes after whichever drafts the target
    accepted: plain greedy's tokens, drafts kept and rejected."""
    if draft == "folder":
        module_name, config = FAMILY_CONFIGS["qwen3_5"]
        draft = str(make_folder(tmp_path / "draft", importlib.import_module(
            f"mlx_lm.models.{module_name}"), {**config, "num_hidden_layers": 4}, seed=1,
            quantize=True))
    prompts = [prompt_ids(n, offset=3 * n) for n in (12, 31, 50)]
    plain = hybrid()
    expected = [run(plain, p) for p in prompts]
    engine = hybrid(speculative="draft", draft_model=draft, num_speculative_tokens=3)
    assert [run(engine, p) for p in prompts] == expected
    handles = [engine.submit(p, greedy()) for p in prompts]
    assert [outputs(h) for h in handles] == expected
    records = engine.steps.recent()
    drafted, accepted = (sum(r.draft_tokens for r in records),
                         sum(r.accepted_tokens for r in records))
    assert drafted > 0 and accepted < drafted
    assert_nothing_held(engine)


@pytest.mark.slow  # ~5 s, several engines (`make test` runs it)
def test_a_hybrid_drafts_after_rollbacks_equal_a_fresh_drafts(hybrid, q4_folder):
    """The draft's state after each accept length (drafts corrupted on the way to the engine,
    so every length happens) gives the draft model's own greedy continuation, as a proposer
    with nothing cached makes it: the resumed state is the right one, not just harmless."""
    from engine.config import EngineConfig
    from engine.draft import draft_proposer
    from engine.model_runner import ModelRunner, pool_for, state_pool_for
    from tests.engine.test_draft import Recording

    # The target's own folder as the draft: its drafts are right until Recording corrupts one.
    engine = hybrid(speculative="draft", draft_model=str(q4_folder), num_speculative_tokens=4,
                    max_num_batched_tokens=16)
    recording = Recording(engine.proposer, wrong=0.3)
    engine.proposer = recording
    for h in [engine.submit(prompt_ids(n, offset=n), greedy()) for n in (9, 20, 41)]:
        h.result()
    lengths = {e.accepted for r in engine.steps.recent() for e in r.entries
               if e.phase == "verify"}
    assert lengths == set(range(5))
    target = load_model(str(q4_folder), "q4")
    cfg = EngineConfig(model=str(q4_folder), speculative="draft", draft_model=str(q4_folder),
                       num_speculative_tokens=4, max_num_batched_tokens=4096, block_size=16)
    family = family_for(target.model, target.config)
    _, states = state_pool_for(family, cfg)
    runner = ModelRunner(target.model, pool_for(family, cfg.num_kv_blocks, 16), family=family,
                         states=states)
    fresh = draft_proposer(cfg, target, runner, None, lambda rows: "gemm")
    for i, (tokens, k, drafts) in enumerate(recording.calls):
        again = fresh.propose([(f"fresh-{i}", tokens, k)]).get(f"fresh-{i}", [])
        fresh.release(f"fresh-{i}")
        assert drafts == again[:len(drafts)], f"call {i}: {drafts} != {again}"
    assert_nothing_held(engine)


@pytest.mark.slow
@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cancel_after=st.lists(st.integers(0, 10), max_size=3),
       num_blocks=st.sampled_from([12, 16, 64]), state_slots=st.sampled_from([2, 8]),
       speculate=st.booleans())
def test_no_slot_or_checkpoint_leaks(hybrid, cancel_after, num_blocks, state_slots, speculate):
    """Cancels between any two steps, preemptions in a small KV pool, drafts kept and rejected,
    shared prefixes checkpointed: every slot comes back."""
    prompts = [prompt_ids(n, offset=o) for n, o in ((40, 0), (35, 0), (20, 50), (9, 3))]
    spec = {}
    if speculate:
        drafts = ScriptedDrafts(wrong=2)
        for p in prompts:
            if tuple(p) not in EXPECTED:
                EXPECTED[tuple(p)] = hybrid().generate(p, greedy(12)).token_ids
            drafts.learn(p, EXPECTED[tuple(p)])
        spec = dict(speculative="ngram", num_speculative_tokens=3, speculative_max_batch=16,
                    proposer=drafts)
    engine = hybrid(num_kv_blocks=num_blocks, state_slots=state_slots,
                    max_num_batched_tokens=24, state_checkpoint_interval=16, **spec)
    handles = [engine.submit(p, greedy(12)) for p in prompts]
    cancel_after_tokens(handles, cancel_after)
    for h in handles:
        h.result()
    assert_nothing_held(engine)


EXPECTED: dict[tuple[int, ...], list[int]] = {}
