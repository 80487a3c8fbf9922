"""Divergence experiments on the tiny model: bit-identical where the backend computes rows alone
(4-bit), and with float32 + OpenBLAS the trace must point at the one step that took the other
kernel path. Plus the comparison itself on hand-made traces (a real fork at a near-tie)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.lab.divergence import (
    BUILTIN_PROMPTS,
    DivergenceRecord,
    DivergenceRunner,
    SideConfig,
    SideRun,
    compare,
    load_prompts,
    run_experiment,
    search,
    timeline,
)
from engine.events import FinishEvent
from engine.platform import blas_loaded
from engine.testing import ByteTokenizer, tiny_model

PROMPT = "Hello world, this is"  # 20 byte tokens
TOKENIZER = ByteTokenizer()


def loader(weights: str):
    return tiny_model(quantize=weights == "q4")


def test_four_bit_gemm_and_gemv_are_bit_identical_alone_and_alongside():
    """On MLX's quantized_matmul (row_kernels "mlx"), which computes each row alone. The
    native quantized kernel (gemm steps by default) is row-independent too, but sums in
    another order than MLX's, which the gemv path keeps: tests/engine/test_decode_quantized.py."""
    a = SideConfig(weights="q4", kernel_policy="gemm", alongside=(40, 25), row_kernels="mlx")
    b = SideConfig(weights="q4", kernel_policy="gemv", row_kernels="mlx")
    r = run_experiment(PROMPT, a, b, max_tokens=12, loader=loader)
    assert r.identical and r.bit_identical
    assert r.fork is None
    assert r.logits.max_abs_delta == 0.0 and r.logits.compared_tokens == 12
    assert r.logits.first_difference is None
    assert r.kv.max_abs_delta == 0.0 and r.kv.first_difference is None
    assert r.kv.compared_positions == 20 + 11  # the last token is never written
    assert all(x == 0.0 for x in r.kv.max_abs_delta_per_layer)
    assert r.verdict.startswith("bit-identical")
    assert r.chain[0].startswith("KV identical")
    # The batch really was mixed on side A, and row-wise on side B.
    first_a, first_b = r.sides.a.steps[0], r.sides.b.steps[0]
    assert (first_a["rows"], first_a["requests"], first_a["path"]) == (85, 3, "gemm")
    assert (first_b["rows"], first_b["requests"], first_b["path"]) == (20, 1, "gemv")
    # Each side keeps its target's token events (recorded as a run by app/db/experiments.py).
    for side in (r.sides.a, r.sides.b):
        assert [t["token_id"] for t in side.tokens] == side.token_ids
        assert side.text.startswith("".join(t["text"] for t in side.tokens))
        assert [t["step"] for t in side.tokens] == [s["step"] for s in side.steps]
        times = side.times
        assert times["queued"] <= times["first_token"] <= times["finished"]


@pytest.mark.parametrize("join_at", [0, 3])
def test_float32_trace_finds_the_one_injected_gemm_step(join_at):
    """Both sides share the batch (target + two prompts of 60 and 40 tokens); A runs every step
    row-wise, B only the big mixed step as one GEMM (threshold above every other step's rows)."""
    others = (60, 40)
    a = SideConfig(weights="f32", kernel_policy="gemv", alongside=others, join_at=join_at)
    b = SideConfig(weights="f32", kernel_policy="auto", kernel_threshold=20, alongside=others,
                   join_at=join_at)
    r = run_experiment(PROMPT, a, b, max_tokens=12, loader=loader)
    steps_b = r.sides.b.steps
    gemm_steps = [s for s in steps_b if s["path"] == "gemm"]
    assert len(gemm_steps) == 1  # the injection is exactly one step
    mixed = gemm_steps[0]
    assert mixed["prefill_rows"] >= 100 and mixed["requests"] == 3
    assert all(s["path"] == "gemv" for s in r.sides.a.steps)
    # the reference BLAS computes GEMM rows like GEMV rows (docs/kernel-paths.md)
    if not blas_loaded():
        assert r.bit_identical, r.verdict
        return
    first = r.kv.first_difference
    assert first is not None, r.verdict
    # The target's first position written in the mixed step: its prompt when it joined with
    # the others, else the decode row of its token #(join_at - 1) fed back.
    expected = 0 if join_at == 0 else 20 + join_at - 1
    assert first.position == expected
    assert first.b.step == mixed["step"] and first.b.path == "gemm"
    assert first.b.step_rows == mixed["rows"]
    assert first.a.step == mixed["step"] and first.a.path == "gemv"
    assert first.max_abs_delta > 0
    assert all(d == 0.0 for d in r.kv.by_position[:expected])
    # Logits first differ at the token the mixed step sampled, and stay different after it,
    # on steps that were row-wise on both sides: the contamination came through the cache.
    assert r.logits.first_difference == join_at
    later = [p for p in r.logits.per_token if p.index > join_at]
    assert later and all(p.path_a == p.path_b == "gemv" for p in later)
    assert any(p.max_abs_delta > 0 for p in later)
    assert f"step {mixed['step']} (gemm, {mixed['rows']} rows) on B" in r.chain[0]
    rows = timeline(r)
    assert rows[0].first == 0 and rows[-1].last == r.kv.compared_positions - 1


def test_the_same_side_twice_is_bit_identical():
    """Determinism of the harness itself: one engine, reused, same batch, same bits."""
    side = SideConfig(weights="f32", kernel_policy="gemm", alongside=(30,), join_at=2)
    r = run_experiment(PROMPT, side, side, max_tokens=8, loader=loader)
    assert r.bit_identical, r.verdict
    assert r.sides.a.others_joined and r.sides.a.steps[2]["requests"] == 2


def test_others_that_would_join_after_the_end_never_join():
    late = SideConfig(weights="q4", alongside=(30,), join_at=20)
    r = run_experiment(PROMPT, late, SideConfig(weights="q4"), max_tokens=5, loader=loader)
    assert not r.sides.a.others_joined
    assert all(s["requests"] == 1 for s in r.sides.a.steps)
    assert r.bit_identical


def test_side_spec_parsing():
    s = SideConfig.parse("weights=f32, policy=auto,threshold=8,alongside=120,60,30,join=4")
    assert (s.weights, s.kernel_policy, s.kernel_threshold) == ("f32", "auto", 8)
    assert s.alongside == (120, 60, 30) and s.join_at == 4
    assert SideConfig.parse("alongside=120+30").alongside == (120, 30)
    base = SideConfig(weights="q4", alongside=(5,))
    assert SideConfig.parse("policy=gemv", base) == SideConfig(weights="q4", alongside=(5,),
                                                               kernel_policy="gemv")
    assert SideConfig.parse("alongside=none", base).alongside == ()
    assert "alongside 120,30 from token 2" in SideConfig.parse("alongside=120,30,join=2").label()
    mlx = SideConfig.parse("weights=f32,row_kernels=mlx")
    assert mlx.row_kernels == "mlx" and "row kernels mlx" in mlx.label()
    assert mlx.engine_key() != SideConfig(weights="f32").engine_key()  # not one shared engine
    assert SideConfig.from_dict({"weights": "f32"}).row_kernels == "auto"  # older records
    for bad in ("policy=fast", "weights=f64", "bogus=1", "threshold=x", "7", "alongside=0",
                "join=-1", "row_kernels=blas", "matmul=blas"):
        with pytest.raises(ValueError):
            SideConfig.parse(bad)


def test_row_kernels_keeps_its_older_names():
    """The setting was called decode_matmul (key matmul=): old commands still parse, and
    records saved under the old key read back; new records hold the new key only."""
    mlx = SideConfig(weights="f32", row_kernels="mlx")
    for spec in ("weights=f32,matmul=mlx", "weights=f32,decode_matmul=mlx",
                 "weights=f32,decode-matmul=mlx"):
        assert SideConfig.parse(spec) == mlx, spec
    saved = mlx.to_dict()
    assert saved["row_kernels"] == "mlx" and "decode_matmul" not in saved
    older = {k: v for k, v in saved.items() if k != "row_kernels"} | {"decode_matmul": "mlx"}
    assert SideConfig.from_dict(older) == mlx
    assert SideConfig.from_dict(saved) == mlx


def test_search_counts_and_prompt_files(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text('Once upon a time\n\n"two\\nlines"\nx' + "y" * 600 + "\n", encoding="utf-8")
    prompts = load_prompts(path)
    assert prompts[1] == "two\nlines" and len(prompts) == 3
    q4 = SideConfig(weights="q4", row_kernels="mlx")  # MLX's kernel on both: the same bits
    out = search(prompts, q4, SideConfig(weights="q4", kernel_policy="gemv", row_kernels="mlx"),
                 max_tokens=6, loader=loader)
    assert out.prompts == 3 and out.errors == 1  # the last one is too long for 512
    assert out.bit_identical == 2 and out.forked == 0 and out.forks == []
    assert "context window" in out.results[2]["error"]
    assert len(out.smallest_margins) == 2
    assert out.tokens_compared == 12 and out.close_calls == 0  # no noise, no close call
    assert len(BUILTIN_PROMPTS) == 20 and len(set(BUILTIN_PROMPTS)) == 20


def test_each_side_keeps_every_step_its_engine_ran():
    """The record holds each side's full StepRecords (the runs database's steps): the target's
    steps and the others' after it finished, nothing from the other side's run."""
    a = SideConfig(weights="q4", kernel_policy="gemm", alongside=(40, 25),
                   alongside_max_tokens=9)  # the others outlive the 5-token target
    b = SideConfig(weights="q4", kernel_policy="gemv", alongside=(30,), join_at=2)
    with DivergenceRunner(loader) as runner:
        r = runner.run(PROMPT, a, b, max_tokens=5)
        engine = runner.engines[a.engine_key()]  # both sides ran on this one, A then B
        assert engine is runner.engines[b.engine_key()]
        ring = {rec.step: rec.to_dict() for rec in engine.steps.recent()}
        ran = engine.step_count
    sa, sb = r.sides.a, r.sides.b
    numbers = [s["engine_step"] for s in sa.engine_steps + sb.engine_steps]
    assert numbers == list(range(1, ran + 1))  # every step the engine ran, each once
    for side, n_others in ((sa, 2), (sb, 1)):
        ids = side.request_ids
        assert len(ids["alongside"]) == n_others and ids["target"] not in ids["alongside"]
        by_number = {s["step"]: s for s in side.engine_steps}
        for s in side.engine_steps:
            assert {**s, "step": s["engine_step"]} == {**ring[s["engine_step"]],
                                                       "engine_step": s["engine_step"]}
            assert {e["request_id"] for e in s["entries"]} <= {ids["target"], *ids["alongside"]}
        # The summary steps are the target's, numbered alike, with the same path and rows.
        for t in side.steps:
            full = by_number[t["step"]]
            assert (full["kernel_path"], full["total_rows"]) == (t["path"], t["rows"])
            assert ids["target"] in {e["request_id"] for e in full["entries"]}
        assert side.engine["kernel_policy"] == side.config["kernel_policy"]
        assert side.engine["enable_prefix_caching"] is False
    # On A the others ran on alone after the target's last step.
    after = [s for s in sa.engine_steps if s["step"] > sa.steps[-1]["step"]]
    assert after and all(sa.request_ids["target"] not in
                         {e["request_id"] for e in s["entries"]} for s in after)
    assert {e["request_id"] for e in sa.engine_steps[0]["entries"]} == \
        {sa.request_ids["target"], *sa.request_ids["alongside"]}
    # On B the other joins at the target's token #2: the first steps are the target's alone.
    assert [e["request_id"] for e in sb.engine_steps[0]["entries"]] == \
        [sb.request_ids["target"]]
    assert all(s["kernel_path"] == "gemv" for s in sb.engine_steps)


# ---- the comparison on hand-made traces ----------------------------------------------------
def fake_run(outputs: list[int], logits: list[np.ndarray], kv_noise_at: int | None,
             paths: list[str]) -> SideRun:
    """A 3-token prompt, then one decode step per output token; 1 layer, 1 head, dim 2."""
    prompt = [10, 11, 12]
    trace, steps = [], []
    start, rows = 0, 3
    for i, vec in enumerate(logits):
        kv = np.full((1, 2, 1, rows, 2), 0.5, dtype=np.float32)
        if kv_noise_at is not None and start <= kv_noise_at < start + rows:
            kv[0, 1, 0, kv_noise_at - start, 1] += 1e-6
        trace.append({"step": i + 1, "path": paths[i], "step_rows": rows + 4 * (i == 1),
                      "phase": "prefill" if i == 0 else "decode", "start": start, "rows": rows,
                      "kv": kv, "logits": vec})
        steps.append({"step": i + 1, "path": paths[i], "rows": rows, "prefill_rows": rows,
                      "decode_rows": 0, "requests": 1})
        start, rows = start + rows, 1
    text = TOKENIZER.decode(outputs)
    finish = FinishEvent("r", "length", text, "", outputs, 3, len(outputs), 0, 0, 0.0, None,
                         None, 0.0, trace=trace)
    return SideRun(SideConfig(), prompt, finish, trace, steps, False, "fake", "f32")


def onehot(best: int, second: int, margin: float) -> np.ndarray:
    v = np.zeros(TOKENIZER.vocab_size, dtype=np.float32)
    v[best], v[second] = 25.5712, 25.5712 - margin
    return v


def test_compare_reports_the_chain_from_cache_write_to_fork():
    a_tok, b_tok = ord("a") + 3, ord("b") + 3
    shared = [onehot(ord("x") + 3, 50, 2.0), onehot(ord("y") + 3, 50, 1.0)]
    la = [*shared, onehot(a_tok, b_tok, 0.0055)]
    lb = [shared[0], shared[1] + np.float32(1e-5), onehot(b_tok, a_tok, 0.0126)]
    run_a = fake_run([ord("x") + 3, ord("y") + 3, a_tok], la, None, ["gemv"] * 3)
    run_b = fake_run([ord("x") + 3, ord("y") + 3, b_tok], lb, 3, ["gemv", "gemm", "gemv"])
    r = compare(run_a, run_b, TOKENIZER.decode, top_k=2)
    assert not r.identical and not r.bit_identical
    fork = r.fork
    assert fork.token_index == 2 and fork.char_offset == 2 and fork.shared_text == "xy"
    assert (fork.continuation_a, fork.continuation_b) == ("a", "b")
    assert fork.margin_a == pytest.approx(0.0055, abs=1e-5)
    assert [row.token_id for row in fork.table] == [a_tok, b_tok]
    assert fork.table[0].logit_a == pytest.approx(25.5712)
    assert fork.table[0].rank_b == 2 and fork.table[1].rank_b == 1
    # KV: position 3 (output token #0 fed back) was written by step 2, gemm on B.
    first = r.kv.first_difference
    assert first.position == 3 and first.output_index == 0
    assert first.b.path == "gemm" and first.a.path == "gemv"
    assert first.values_max_abs_delta > 0 and first.keys_max_abs_delta == 0
    assert r.kv.compared_positions == 3 + 2  # up to the fork's position
    assert r.logits.first_difference == 1 and r.logits.compared_tokens == 3
    assert [line.split(" ")[0] for line in r.chain] == ["KV", "first", "fork"]
    assert "position 3" in r.chain[0] and "fork at output token 2" in r.chain[2]


def test_a_record_reads_back_from_its_json_as_saved_by_older_builds():
    """to_dict() is the record's JSON (what the runs database stores), from_dict() reads it
    back to the same record; a record from before the sides kept their engine steps, request
    ids, engine and speculation still reads, with those empty."""
    run_a = fake_run([ord("x") + 3, ord("a") + 3], [onehot(ord("x") + 3, 50, 2.0),
                                                    onehot(ord("a") + 3, 51, 0.5)], None,
                     ["gemv"] * 2)
    run_b = fake_run([ord("x") + 3, ord("b") + 3], [onehot(ord("x") + 3, 50, 2.0),
                                                    onehot(ord("b") + 3, 51, 0.5)], 3,
                     ["gemv", "gemm"])
    r = compare(run_a, run_b, TOKENIZER.decode, top_k=2)
    data = json.loads(json.dumps(r.to_dict()))
    assert list(data) == ["version", "model", "prompt_ids", "prompt_tokens", "sides",
                          "identical", "bit_identical", "fork", "logits", "kv", "verdict",
                          "chain", "prompt", "chat", "max_tokens", "ignore_eos", "elapsed_s",
                          "backend"]
    assert data["fork"]["table"][0]["token_id"] == r.fork.table[0].token_id
    assert data["kv"]["first_difference"]["b"]["path"] == "gemm"
    again = DivergenceRecord.from_dict(data)
    assert again == r and again.to_dict() == data
    for side in data["sides"].values():
        for key in ("engine_steps", "request_ids", "engine", "speculation"):
            del side[key]
    old = DivergenceRecord.from_dict(data)
    assert old.sides.a.engine_steps == [] and old.sides.a.speculation is None
    assert old.fork == r.fork and old.kv == r.kv and old.verdict == r.verdict


# ---- models with recurrent layers: the state after each step ----------------------------------
def with_state(run: SideRun, noise_from: int | None = None) -> SideRun:
    """The run as a hybrid model's: its trace entries carry a (2 layers, Hv 1, Dv 2, Dk 2)
    state after each step; from trace entry `noise_from` on, layer 1 holds 1e-3 more (once in
    the state, a difference stays in every later one)."""
    for i, t in enumerate(run.trace):
        state = np.full((2, 1, 2, 2), 0.25 * (i + 1), dtype=np.float32)
        if noise_from is not None and i >= noise_from:
            state[1, 0, 1, 0] += np.float32(1e-3)
        t["state"] = state
    return run


def two_tokens(noise_from: int | None = None) -> SideRun:
    out = [ord("x") + 3, ord("y") + 3]
    logits = [onehot(out[0], 50, 2.0), onehot(out[1], 50, 1.0)]
    return with_state(fake_run(out, logits, None, ["gemv", "gemv"]), noise_from)


def test_the_state_after_each_step_is_compared_while_the_tokens_agree():
    a_tok, b_tok = ord("a") + 3, ord("b") + 3
    shared = [onehot(ord("x") + 3, 50, 2.0), onehot(ord("y") + 3, 50, 1.0)]
    after = onehot(50, 51, 1.0)  # a token after the fork: its state is not compared
    run_a = with_state(fake_run([ord("x") + 3, ord("y") + 3, a_tok, 50],
                                [*shared, onehot(a_tok, b_tok, 0.01), after], None,
                                ["gemv"] * 4))
    run_b = with_state(fake_run([ord("x") + 3, ord("y") + 3, b_tok, 50],
                                [*shared, onehot(b_tok, a_tok, 0.01), after], None,
                                ["gemv", "gemm", "gemv", "gemv"]), noise_from=1)
    r = compare(run_a, run_b, TOKENIZER.decode, top_k=2)
    state = r.state
    # After the prompt (3 tokens), then after output tokens #0 and #1 fed back: the state
    # after 5 tokens still holds the same tokens on both sides (#2 is where they fork), the
    # one after 6 holds the differing token.
    assert [p.tokens for p in state.per_step] == [3, 4, 5] and state.compared_steps == 3
    assert state.first_difference == 4
    first = state.per_step[1]
    assert (first.step_a, first.step_b, first.path_a, first.path_b) == (2, 2, "gemv", "gemm")
    assert first.rows_b == 1 + 4  # the step's rows, not the target's
    assert state.per_step[0].max_abs_delta == 0
    assert [p.max_abs_delta_per_layer[0] for p in state.per_step] == [0, 0, 0]
    assert [p.max_abs_delta_per_layer[1] for p in state.per_step] == \
        pytest.approx([0, 1e-3, 1e-3], rel=1e-3)
    assert state.max_abs_delta_per_layer == pytest.approx([0, 1e-3], rel=1e-3)
    assert state.max_abs_delta == pytest.approx(1e-3, rel=1e-3)
    assert r.kv.max_abs_delta == 0 and r.logits.first_difference == 2  # at the fork
    assert [line.split(" ")[0] for line in r.chain] == ["KV", "recurrent", "first", "fork"]
    assert "first differs after 4 tokens (step 2 gemv 5 rows on A, step 2 gemm 5 rows" \
        in r.chain[1] and "carried into every later state" in r.chain[1]


def test_a_state_difference_alone_is_a_difference():
    same = compare(two_tokens(), two_tokens(), TOKENIZER.decode)
    assert same.bit_identical and same.state.compared_steps == 2
    assert same.verdict.endswith("and max |Δstate| = 0 over 2 steps")
    assert same.chain[1] == ("recurrent state identical after all 2 compared steps "
                             "(max |Δstate| = 0)")
    differ = compare(two_tokens(), two_tokens(noise_from=1), TOKENIZER.decode)
    assert differ.identical and not differ.bit_identical
    assert differ.verdict.startswith("same tokens, different numbers") and \
        differ.verdict.endswith("max |Δstate| = 0.001")


def test_a_record_with_states_reads_back_and_one_without_has_no_state_key():
    r = compare(two_tokens(), two_tokens(noise_from=0), TOKENIZER.decode)
    data = json.loads(json.dumps(r.to_dict()))
    assert list(data)[9:11] == ["kv", "state"]
    assert data["state"]["per_step"][0]["max_abs_delta_per_layer"][1] > 0
    assert DivergenceRecord.from_dict(data) == r
    dense = compare(fake_run([ord("x") + 3], [onehot(ord("x") + 3, 50, 2.0)], None, ["gemv"]),
                    fake_run([ord("x") + 3], [onehot(ord("x") + 3, 50, 2.0)], None, ["gemv"]),
                    TOKENIZER.decode)
    assert dense.state is None and "state" not in dense.to_dict()
    assert DivergenceRecord.from_dict(dense.to_dict()).state is None


def test_states_on_one_side_only_are_refused():
    dense = fake_run([ord("x") + 3, ord("y") + 3],
                     [onehot(ord("x") + 3, 50, 2.0), onehot(ord("y") + 3, 50, 1.0)], None,
                     ["gemv", "gemv"])
    with pytest.raises(ValueError, match="side B's trace has no recurrent state"):
        compare(two_tokens(), dense, TOKENIZER.decode)


def test_a_record_names_the_blas_library_not_its_path():
    from app.lab.divergence.runner import backend

    blas = backend()["blas"]
    assert blas is None or "/" not in blas


def test_speculating_sides_are_bit_identical_to_plain_decoding_on_four_bit_rows():
    """Speculation changes how many rows a step holds, never a row's bits (native kernels):
    the trace keeps only the rows a verify step kept, and every emitted token's logits."""
    prompt = "0101010101"  # the tiny model repeats itself here: prompt lookup gets accepted
    a = SideConfig.parse("weights=q4,speculative=ngram,k=3")
    b = SideConfig.parse("weights=q4,alongside=40,join=3")
    assert (a.speculative, a.num_speculative_tokens) == ("ngram", 3)
    assert "ngram k=3" in a.label() and a.engine_key() != b.engine_key()
    r = run_experiment(prompt, a, b, max_tokens=24, loader=loader)
    assert r.bit_identical, r.verdict
    assert r.logits.compared_tokens == 24
    assert r.kv.compared_positions == 10 + 23
    assert r.kv.rewritten_positions == {"a": 0, "b": 0}
    spec = r.sides.a.speculation
    assert spec.accepted > 0 and spec.drafted > spec.accepted
    steps = r.sides.a.steps
    assert spec.drafted == sum(s["target_drafted"] for s in steps)
    assert len(steps) < 24  # verify steps emitted several tokens
    drafted_tokens = [t["drafted"] for t in r.sides.a.tokens]
    assert sum(drafted_tokens) == spec.accepted
    assert r.sides.b.speculation is None


def test_a_draft_model_side_is_bit_identical_to_a_prompt_lookup_side():
    """speculative=draft: the target's first layer drafts (layers:1); the side's engine gets
    the draft model, and its drafts change no bit of the target's rows."""
    prompt = "0101010101"
    a = SideConfig.parse("weights=q4,speculative=draft,k=3,draft=layers:1")
    b = SideConfig.parse("weights=q4,speculative=ngram,k=3")
    assert "draft k=3 (layers:1)" in a.label() and a.engine_key() != b.engine_key()
    assert SideConfig.parse("weights=q4,speculative=ngram,k=3",
                            SideConfig(draft_model="layers:1")).engine_key() \
        == b.engine_key()  # a draft model given to every side matters to draft sides only
    r = run_experiment(prompt, a, b, max_tokens=24, loader=loader)
    assert r.bit_identical, r.verdict
    spec = r.sides.a.speculation
    assert spec.method == "draft" and spec.draft_model == "layers:1"
    assert spec.drafted > spec.accepted > 0
    assert r.sides.a.engine["draft_model"] == "layers:1"


def test_the_commands_draft_model_reaches_the_draft_sides():
    from app.cli import build_parser
    from app.cli.diverge import sides

    parser = build_parser()
    args = parser.parse_args(["diverge", "hi", "--draft-model", "layers:1",
                              "--a", "speculative=draft,k=2", "--b", "speculative=ngram"])
    a, b = sides(args)
    assert (a.engine_draft_model, b.engine_draft_model) == ("layers:1", None)
    args = parser.parse_args(["diverge", "hi", "--draft-model", "layers:1",
                              "--a", "speculative=draft,draft=layers:2"])
    assert sides(args)[0].engine_draft_model == "layers:2"  # the side's own comes first
    with pytest.raises(ValueError, match="speculative=draft needs a draft model"):
        sides(parser.parse_args(["diverge", "hi", "--a", "speculative=draft"]))


def test_bad_speculative_side_settings_are_refused():
    with pytest.raises(ValueError, match="speculative must be one of"):
        SideConfig.parse("speculative=medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive"):
        SideConfig.parse("speculative=ngram,k=0")
    with pytest.raises(ValueError, match="speculative=draft needs a draft model"):
        SideConfig.parse("speculative=draft")
    with pytest.raises(ValueError, match="layers:N takes a positive number"):
        SideConfig.parse("speculative=draft,draft=layers:none")
