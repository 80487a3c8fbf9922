"""Structured outputs in the engine (engine/structured.py): the grammar's mask against the
grammar itself, constrained rows beside free rows, the end of a grammar, and specs the
library cannot compile (tiny model: its byte tokenizer is one token per byte). Speculative
decoding: tests/engine/test_structured_speculative.py."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np
import pytest

from engine.errors import RequestError
from engine.sampling import SamplingParams, StructuredOutput
from engine.structured import GrammarProcessor, compile_matcher
from engine.testing import ByteTokenizer, tiny_model

PROMPTS = ["abcabcabc", "hello there", "The quick brown fox", "x" * 20]
SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0, "maximum": 20},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["kind", "age", "tags"], "additionalProperties": False}


def constrained(kind: str, spec: str, max_tokens: int = 64, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured=StructuredOutput(kind, spec),
                          **kwargs)


def free() -> SamplingParams:
    return SamplingParams(max_tokens=12, ignore_eos=True)


def test_the_mask_allows_exactly_the_tokens_the_grammar_can_take_next():
    tokenizer = ByteTokenizer()
    matcher = compile_matcher(StructuredOutput("regex", "(ab|ac)d"), tokenizer, 259)
    processor = GrammarProcessor(matcher, prompt_len=2, vocab=259, clock=None)
    logits = mx.zeros((1, 259))
    prompt = tokenizer.encode("zz")

    def allowed(generated: str) -> set[int]:
        out = np.array(processor(mx.array(prompt + tokenizer.encode(generated)), logits))
        return set(np.flatnonzero(np.isfinite(out[0])).tolist())

    assert allowed("") == set(tokenizer.encode("a"))
    assert allowed("a") == set(tokenizer.encode("bc"))
    assert allowed("ac") == set(tokenizer.encode("d"))
    assert allowed("acd") == {tokenizer.eos_token_id}  # complete: only the end is left


def test_constrained_rows_beside_free_rows_get_the_tokens_they_get_alone(make_engine):
    engine = make_engine(max_num_seqs=8)
    specs = [constrained("regex", "[a-e]{2,6}(x|y)"),
             constrained("choice", json.dumps(["yes", "no", "maybe"])),
             constrained("json", json.dumps(SCHEMA))]
    alone = [engine.generate(p, s).token_ids for p, s in zip(PROMPTS, specs, strict=False)]
    alone_free = [engine.generate(p, free()).token_ids for p in PROMPTS]
    from engine.engine import Submission

    subs = [Submission(p, s) for p, s in zip(PROMPTS, specs, strict=False)]
    subs += [Submission(p, free()) for p in PROMPTS]
    before = engine.step_count
    results = [h.result() for h in engine.submit_many(subs)]
    assert [r.token_ids for r in results[:3]] == alone
    assert [r.token_ids for r in results[3:]] == alone_free
    assert re.fullmatch("[a-e]{2,6}(x|y)", results[0].text)
    assert results[1].text in ("yes", "no", "maybe")
    value = json.loads(results[2].text)
    assert value["kind"] in ("cat", "dog") and 0 <= value["age"] <= 20
    assert len(value["tags"]) <= 2
    assert not re.search(r"\s", results[2].text)  # compact JSON: no whitespace at all
    # The steps they shared counted the constrained rows (one per token each samples, its
    # end-of-sequence too) and timed the masks.
    shared = [r for r in engine.steps.recent() if r.step > before]
    assert sum(r.constrained_rows for r in shared) == sum(len(r.token_ids) + 1
                                                         for r in results[:3])
    assert max(r.constrained_rows for r in shared) == 3
    assert all(r.mask_ms > 0 for r in shared if r.constrained_rows)
    assert all(r.mask_ms == 0 for r in shared if not r.constrained_rows)


def test_a_complete_grammar_stops_with_stop(make_engine):
    engine = make_engine()
    result = engine.generate(PROMPTS[1], constrained("regex", "ok!", max_tokens=50))
    assert (result.reason, result.text) == ("stop", "ok!")
    assert result.token_ids == ByteTokenizer().encode("ok!")  # the EOS is not emitted


@pytest.mark.parametrize(("kind", "spec", "words"), [
    ("regex", "a(b", "unclosed group"),
    ("json", '{"type": "foo"}', "foo"),
    ("json", "{not json", "could not be read"),
    ("grammar", "start: x y", "unknown name"),
])
def test_specs_that_do_not_compile_are_refused_and_nothing_is_queued(make_engine, kind, spec,
                                                                     words):
    engine = make_engine()
    from engine.engine import Submission

    with pytest.raises(RequestError, match=words) as caught:
        engine.submit_many([Submission("hi", constrained("regex", "a")),
                            Submission("hi", constrained(kind, spec))])
    assert caught.value.param == "structured"
    assert not engine.scheduler.has_work() and engine.block_manager.num_used_blocks == 0


def test_ignore_eos_is_refused_with_a_grammar():
    with pytest.raises(ValueError, match="ignore_eos"):
        constrained("regex", "a", ignore_eos=True)


def test_the_tiny_model_loader_serves_grammars():
    """The byte tokenizer is not a Hugging Face one: its vocabulary is read token by token."""
    loaded = tiny_model()
    matcher = compile_matcher(StructuredOutput("choice", '["a"]'), loaded.tokenizer, 259)
    assert matcher.consume_tokens(ByteTokenizer().encode("a")) and matcher.is_accepting()
