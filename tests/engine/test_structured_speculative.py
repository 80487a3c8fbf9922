"""Structured outputs under speculative decoding (engine/structured.py, engine/speculative.py):
drafts are cut to the prefix the grammar allows, each verify row is masked at its own position,
and the matcher rolls back the drafts a step did not accept. Greedy constrained tokens with
speculation are those without it (tiny model: one token per byte, random weights; a
grammar-constrained output is well-formed all the same)."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.engine import Engine, Submission
from engine.sampling import SamplingParams, StructuredOutput
from engine.sequence import Sequence
from engine.speculative import NgramProposer, SpeculativeConfig, propose
from engine.structured import GrammarProcessor, compile_matcher
from engine.testing import ByteTokenizer, ScriptedDrafts, tiny_model

VOCAB = ByteTokenizer.vocab_size
EOS = ByteTokenizer().eos_token_id
SPEC = {"speculative": "ngram", "num_speculative_tokens": 4, "speculative_max_batch": 16}
SCHEMA = {"type": "object", "properties": {
    "pet": {"enum": ["cat", "dog", "catfish"]}, "n": {"type": "integer", "minimum": 0,
                                                      "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["ab", "abab"]}, "maxItems": 3}},
    "required": ["pet", "n", "tags"], "additionalProperties": False}
# (kind, spec, a pattern every complete output matches; None for JSON: it is parsed)
CASES = [
    ("regex", "[a-e]{2,6}(x|y)", "[a-e]{2,6}(x|y)"),
    ("regex", "(ab|abc){2,9}!", "(ab|abc){2,9}!"),
    ("choice", json.dumps(["yes", "no", "maybe", "yesterday"]), "yes|no|maybe|yesterday"),
    ("json", json.dumps(SCHEMA), None),
    ("grammar", 'start: "(" item ("," item)* ")"\nitem: /[0-9]{1,2}/', r"\(\d{1,2}(,\d{1,2})*\)"),
]
PROMPTS = ["abcabcabc", "hello there", "((1,2),(3,4))", "x" * 20, '{"pet":"cat"}']


def constrained(kind: str, spec: str, max_tokens: int = 40, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured=StructuredOutput(kind, spec),
                          **kwargs)


def well_formed(case: tuple[str, str, str | None], text: str) -> bool:
    _, _, pattern = case
    if pattern is not None:
        return re.fullmatch(pattern, text) is not None
    value = json.loads(text)
    return value["pet"] in ("cat", "dog", "catfish") and 0 <= value["n"] <= 99


class Recorded:
    """A proposer that keeps, per call, the tokens and room it was given and what it drafted."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[list[int], int, list[int]]] = []

    def propose(self, wanted):
        out = self.inner.propose(wanted)
        self.calls += [(list(tokens), k, out.get(seq_id, [])) for seq_id, tokens, k in wanted]
        return out


def grammar_prefix(spec: SamplingParams, prompt_len: int, tokens: list[int],
                   drafts: list[int]) -> int:
    """How many leading drafts the grammar allows after tokens: draft n is allowed when a
    fresh matcher fed the tokens and the drafts before it validates it (a grammar that has
    ended takes nothing more, not even end-of-sequence)."""
    n = 0
    while n < len(drafts):
        matcher = compile_matcher(spec.structured, ByteTokenizer(), VOCAB)
        assert matcher.consume_tokens(tokens[prompt_len:] + drafts[:n])
        if matcher.validate_tokens(drafts[n:n + 1]) != 1:
            break
        n += 1
    return n


def drafted(engine, request_id: str) -> list[int]:
    return [e.drafted for r in engine.steps.recent() for e in r.entries
            if e.request_id == request_id and e.phase == "verify"]


def test_verify_rows_are_masked_at_their_own_positions_and_rejected_drafts_roll_back():
    """The processor shown committed tokens, then drafts row by row, then the next step's
    tokens (a draft rejected) gives each row the mask a fresh matcher gives after the same
    tokens; and the cut keeps only the drafts the grammar allows."""
    tokenizer = ByteTokenizer()
    spec = StructuredOutput("regex", "(ab|ac)(d|e)+z")
    processor = GrammarProcessor(compile_matcher(spec, tokenizer, VOCAB), 2, VOCAB, None)
    prompt = tokenizer.encode("zz")
    logits = mx.zeros((1, VOCAB))

    def allowed(generated: str) -> set[int]:
        out = np.array(processor(mx.array(prompt + tokenizer.encode(generated)), logits))
        return set(np.flatnonzero(np.isfinite(out[0])).tolist())

    def fresh(generated: str) -> set[int]:
        other = GrammarProcessor(compile_matcher(spec, tokenizer, VOCAB), 2, VOCAB, None)
        out = np.array(other(mx.array(prompt + tokenizer.encode(generated)), logits))
        return set(np.flatnonzero(np.isfinite(out[0])).tolist())

    # Committed "a"; drafts "b", "d", "x": the grammar allows two of them.
    committed = prompt + tokenizer.encode("a")
    assert processor.valid_drafts(committed, tokenizer.encode("bdx")) == 2
    for generated in ("a", "ab", "abd"):  # the verify rows, in order
        assert allowed(generated) == fresh(generated)
    # The step accepted "b" only, then the target's own "e": "d" is rolled back.
    assert allowed("abe") == fresh("abe") == set(tokenizer.encode("dez"))
    assert processor.valid_drafts(prompt + tokenizer.encode("abe"), [EOS]) == 0
    # A preempted request recomputed from its prompt feeds nothing twice.
    assert allowed("abez") == {EOS}
    assert allowed("ab") == fresh("ab")


def test_propose_cuts_drafts_to_the_grammar_valid_prefix():
    spec = constrained("regex", "[a-c]{3}d")
    tokenizer = ByteTokenizer()
    prompt = tokenizer.encode("abcab")  # and "ab" generated: prompt lookup drafts "ab"
    seq = Sequence("r", prompt, spec, output_ids=tokenizer.encode("ab"), logits_processors=(
        GrammarProcessor(compile_matcher(spec.structured, tokenizer, VOCAB), len(prompt),
                         VOCAB, None),))
    seq.num_computed = seq.num_tokens - 1  # in decode
    config = SpeculativeConfig("ngram", 3, 1, 3, 4)
    free = Sequence("f", prompt, SamplingParams(), output_ids=tokenizer.encode("ab"))
    free.num_computed = free.num_tokens - 1
    drafts, state, _ = propose(config, NgramProposer(config), [seq, free], 64)
    # "a" is the third letter; "b" would be a fourth: the grammar wants "d".
    assert drafts == {"r": tokenizer.encode("a"), "f": tokenizer.encode("ab")}
    assert state == "on"


@pytest.mark.parametrize("wrong", [1, 2, 3, 1000])
def test_scripted_drafts_right_wrong_and_forbidden_give_the_tokens_without_them(make_engine,
                                                                              wrong):
    """ScriptedDrafts drafts the true continuation (its end-of-sequence too) with every
    wrong-th draft off by one byte: often one the grammar forbids. The engine verifies exactly
    the grammar-valid prefix of each proposal, and the tokens are those without drafts."""
    case = CASES[3]
    spec = constrained(case[0], case[1])
    plain = make_engine()
    scripted = ScriptedDrafts(wrong=wrong)
    proposer = Recorded(scripted)
    engine = make_engine(**SPEC, proposer=proposer)
    prompt_ids = engine.encode(PROMPTS[4])
    alone = plain.generate(prompt_ids, spec)
    assert alone.reason == "stop" and well_formed(case, alone.text)
    scripted.learn(prompt_ids, [*alone.token_ids, EOS])
    out = engine.generate(prompt_ids, spec)
    assert (out.token_ids, out.reason) == (alone.token_ids, alone.reason)
    verified = drafted(engine, out.request_id)
    expected = [grammar_prefix(spec, len(prompt_ids), tokens, d[:k])
                for tokens, k, d in proposer.calls]
    assert verified == [n for n in expected if n]
    if wrong == 1:  # off by one byte at every place: JSON forbids most of them
        assert sum(expected) < sum(len(d[:k]) for _, k, d in proposer.calls)
    if wrong == 1000:  # all right: most tokens are drafted and accepted
        accepted = sum(e.accepted for r in engine.steps.recent() for e in r.entries
                       if e.request_id == out.request_id)
        assert accepted > len(out.token_ids) // 2


@pytest.fixture(scope="module")
def engines():
    """Engines without speculation, with prompt lookup, and with scripted drafts (the
    hypothesis examples share them)."""
    scripted = ScriptedDrafts()
    started = [Engine(EngineConfig(num_kv_blocks=128, **config), loader=tiny_model,
                      proposer=proposer).start()
               for config, proposer in (({}, None), (SPEC, None), (SPEC, scripted))]
    yield (*started, scripted)
    for engine in started:
        engine.stop()


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(CASES), prompt=st.sampled_from(PROMPTS),
       wrong=st.sampled_from([1, 2, 4]))
def test_greedy_constrained_with_speculation_equals_without(engines, case, prompt, wrong):
    plain, ngram, with_script, scripted = engines
    spec = constrained(case[0], case[1])
    alone = plain.generate(prompt, spec)
    assert alone.reason == "length" or well_formed(case, alone.text)
    # Prompt lookup (whatever it finds in the prompt and the output)...
    out = ngram.generate(prompt, spec)
    assert (out.token_ids, out.reason) == (alone.token_ids, alone.reason)
    # ...and scripted drafts, right and wrong.
    scripted.wrong = wrong
    scripted.learn(plain.encode(prompt), [*alone.token_ids, EOS])
    out = with_script.generate(prompt, spec)
    assert (out.token_ids, out.reason) == (alone.token_ids, alone.reason)
    if wrong > 1 and len(alone.token_ids) > 3:  # some right drafts: some were verified
        assert drafted(with_script, out.request_id)


def test_constrained_beside_free_both_speculating_each_equals_its_alone_run(make_engine):
    plain = make_engine(max_num_seqs=8)
    scripted = ScriptedDrafts(wrong=3)
    engine = make_engine(max_num_seqs=8, **SPEC, proposer=scripted)
    subs = [Submission(p, constrained(c[0], c[1])) for c, p in zip(CASES, PROMPTS, strict=True)]
    # Other prompts: ScriptedDrafts knows one continuation per prompt.
    subs += [Submission(p + "?", SamplingParams(max_tokens=16, ignore_eos=True))
             for p in PROMPTS]
    alone = [plain.generate(s.prompt, s.params) for s in subs]
    for s, a in zip(subs, alone, strict=True):
        scripted.learn(plain.encode(s.prompt), [*a.token_ids, EOS])
    together = [h.result() for h in engine.submit_many(subs)]
    assert [r.token_ids for r in together] == [a.token_ids for a in alone]
    assert all(well_formed(c, r.text) for c, r in zip(CASES, together, strict=False)
               if r.reason == "stop")
    # Both kinds verified drafts in the steps they shared.
    assert all(drafted(engine, r.request_id) for r in together)


def test_sampled_constrained_requests_with_drafts_stay_well_formed(make_engine):
    """Speculative sampling over masked rows: every output follows its grammar."""
    scripted = ScriptedDrafts(wrong=2)
    engine = make_engine(**SPEC, proposer=scripted)
    for i, (case, prompt) in enumerate(zip(CASES, PROMPTS, strict=True)):
        spec = constrained(case[0], case[1], max_tokens=64, temperature=0.9, seed=i)
        first = engine.generate(prompt, spec)
        scripted.learn(engine.encode(prompt), [*first.token_ids, EOS])
        out = engine.generate(prompt, spec)
        assert out.reason == "length" or well_formed(case, out.text), out.text
        assert drafted(engine, out.request_id)
