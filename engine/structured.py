"""Structured outputs: a request's output held to a grammar (llguidance), inside the batch.

A request with `SamplingParams.structured` gets one more logits processor (engine/sampler.py
applies it to its sampled row, before the log-softmax, as the penalties): a per-request
llguidance matcher, compiled when the request is submitted. At each of the request's sampled
rows the processor first feeds the matcher the tokens the request has committed since its
last row (the processor sees the sequence through its row: the generated tokens are the
truth, so a preempted and recomputed request feeds nothing twice), then computes the token
bitmask on the CPU (llguidance's numpy API) and sets every token the grammar forbids to -inf
with MLX ops. Rows of other requests in the same step are untouched: a constrained request
shares the step with free ones, and each gets the tokens it gets alone.

With speculative decoding a constrained request takes drafts too. Before they are verified
they are cut to the prefix the grammar allows after the committed tokens (`valid_drafts`,
called by engine/speculative.py's `propose`): a draft the grammar forbids is never verified.
Each verify row is then masked at its own position: the processor sees the sequence through
the row (the committed tokens, then the drafts before it), so the matcher advances through
the drafts row by row. The matcher always follows the tokens it is shown: what it consumed
past their common prefix (drafts the step did not accept) is rolled back first, before any
mask or cut reads it. Row j's mask is the one the request gets without speculation after
the same tokens, so greedy tokens are those without speculation
(tests/engine/test_structured_speculative.py).

When the grammar is complete the matcher allows only end-of-sequence: the request samples it
and stops with finish_reason "stop". JSON is compact (no whitespace between tokens, "," and
":" separators): a model cannot loop on whitespace.
"""

from __future__ import annotations

import time
from typing import Any
from weakref import WeakKeyDictionary

import mlx.core as mx
import numpy as np

from engine.errors import RequestError
from engine.model_loader import LoadedModel
from engine.sampling import StructuredOutput
from engine.sequence import LogitsProcessor
from engine.token_bytes import TokenBytes

# llguidance's JSON options: no whitespace anywhere, compact separators.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
ANY_JSON_OBJECT = '{"type": "object"}'

# tokenizer -> {vocabulary size: its LLTokenizer} (building one reads the whole vocabulary).
_TOKENIZERS: WeakKeyDictionary[Any, dict[int, Any]] = WeakKeyDictionary()


class MaskClock:
    """Constrained rows and the seconds spent feeding their matchers and computing their
    masks, summed until read (the engine reads it once a step: StepRecord)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.rows = 0

    def take(self) -> dict[str, int | float]:
        """The StepRecord fields for what was summed since the last take (one step)."""
        out = {"constrained_rows": self.rows, "mask_ms": self.seconds * 1000.0}
        self.rows, self.seconds = 0, 0.0
        return out


class _VocabularyTokenizer:
    """What llguidance's TokenizerWrapper reads from a tokenizer that is not a Hugging Face
    fast one (the tests' byte tokenizer): each token's bytes, its specials, encode."""

    def __init__(self, tokenizer: Any, vocab: int):
        token_bytes = TokenBytes(tokenizer)
        self.tokens = [token_bytes(i) for i in range(vocab)]
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        # Tokens without bytes (<unk>, <bos>, <eos>) are specials: never part of the text.
        self.special_token_ids = [i for i, b in enumerate(self.tokens) if not b]
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return list(self._encode(text))


def ll_tokenizer(tokenizer: Any, vocab: int) -> Any:
    """The llguidance tokenizer for an engine's tokenizer (mlx-lm's TokenizerWrapper around a
    Hugging Face fast tokenizer, or any with token bytes), masks `vocab` wide (cached)."""
    import llguidance
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    cached = _TOKENIZERS.setdefault(tokenizer, {})
    if vocab not in cached:
        eos = sorted(tokenizer.eos_token_ids)
        hf = getattr(tokenizer, "_tokenizer", None)
        if isinstance(hf, PreTrainedTokenizerFast):
            cached[vocab] = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos)
        else:
            wrapper = llguidance.TokenizerWrapper(_VocabularyTokenizer(tokenizer, vocab))
            cached[vocab] = llguidance.LLTokenizer(wrapper, n_vocab=vocab, eos_token=eos)
    return cached[vocab]


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar for a spec; ValueError when its text cannot be read."""
    from llguidance import LLMatcher, grammar_from

    if spec.kind == "json":
        return LLMatcher.grammar_from_json_schema(spec.spec, defaults=JSON_OPTIONS)
    return grammar_from(spec.kind, spec.spec)


def compile_matcher(spec: StructuredOutput, tokenizer: Any, vocab: int) -> Any:
    """A fresh llguidance matcher for the spec; RequestError (param "structured") naming what
    the library could not compile."""
    from llguidance import LLMatcher

    try:
        grammar = grammar_text(spec)
    except ValueError as e:
        raise RequestError(f"the {spec.kind} could not be read: {e}", "structured") from None
    matcher = LLMatcher(ll_tokenizer(tokenizer, vocab), grammar, log_level=0)
    if matcher.is_error():
        # llguidance's message spans lines (the grammar, a caret): one line of it.
        error = " ".join(line.strip() for line in matcher.get_error().splitlines()
                         if line.strip() and not set(line.strip()) <= {"^"})
        raise RequestError(f"the {spec.kind} could not be compiled: {error}",
                           "structured") from None
    return matcher


class GrammarProcessor:
    """The logits processor of one constrained request (see the module's docstring)."""

    def __init__(self, matcher: Any, prompt_len: int, vocab: int, clock: MaskClock | None):
        from llguidance.numpy import allocate_token_bitmask

        self.matcher, self.prompt_len, self.vocab, self.clock = matcher, prompt_len, vocab, clock
        # The generated tokens the matcher has consumed, in order (drafts among them until the
        # next row or cut shows which were accepted).
        self.fed = np.zeros(0, dtype=np.int64)
        self._bitmask = allocate_token_bitmask(1, vocab)

    def _follow(self, tokens: Any) -> None:
        """Bring the matcher to the state after `tokens` (the sequence so far): roll back what
        it consumed past their common prefix, then consume the rest."""
        generated = np.array(tokens, dtype=np.int64)[self.prompt_len:]
        m = min(len(self.fed), len(generated))
        differ = np.flatnonzero(self.fed[:m] != generated[:m])
        keep = int(differ[0]) if differ.size else m
        if keep < len(self.fed) and not self.matcher.rollback(len(self.fed) - keep):
            raise RuntimeError(f"grammar matcher could not roll back "
                               f"{len(self.fed) - keep} tokens: {self.matcher.get_error()}")
        new = generated[keep:].tolist()
        if new and not self.matcher.consume_tokens(new):
            # Only tokens the mask allowed are committed, and drafts are cut to what the
            # grammar allows (valid_drafts): a bug, not the request's fault.
            raise RuntimeError(f"grammar matcher refused tokens {new}: "
                               f"{self.matcher.get_error()}")
        self.fed = generated

    def valid_drafts(self, tokens: list[int], drafts: list[int]) -> int:
        """How many leading drafts the grammar allows after `tokens` (the sequence so far,
        committed): engine/speculative.py verifies only those."""
        t0 = time.perf_counter()
        self._follow(tokens)
        # One at a time, as the verify rows will feed them: a grammar that has ended by
        # itself takes no end-of-sequence after it (in one call with the token that ended it,
        # the matcher would).
        n = 0
        while n < len(drafts) and self.matcher.try_consume_tokens([drafts[n]]) == 1:
            n += 1
        if n and not self.matcher.rollback(n):
            raise RuntimeError(f"grammar matcher could not roll back {n} drafts: "
                               f"{self.matcher.get_error()}")
        if self.clock is not None:
            self.clock.seconds += time.perf_counter() - t0
        return n

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        from llguidance.numpy import fill_next_token_bitmask

        t0 = time.perf_counter()
        self._follow(tokens)
        fill_next_token_bitmask(self.matcher, self._bitmask)
        # Bit i of the little-endian words is token i.
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        width = logits.shape[-1]
        allowed = np.zeros(width, dtype=bool)
        n = min(width, self.vocab)
        allowed[:n] = bits[:n]
        if self.clock is not None:
            self.clock.rows += 1
            self.clock.seconds += time.perf_counter() - t0
        return mx.where(mx.array(allowed), logits, mx.array(float("-inf"), dtype=logits.dtype))


def grammar_processors(spec: StructuredOutput | None, prompt_len: int, loaded: LoadedModel,
                       clock: MaskClock | None = None) -> tuple[LogitsProcessor, ...]:
    """The request's grammar processor (none without a spec). Raises RequestError when the
    spec does not compile."""
    if spec is None:
        return ()
    config = loaded.config
    # The logits' width; tokens past a smaller vocabulary stay masked (GrammarProcessor).
    vocab = (config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
             or len(loaded.tokenizer.vocab))
    matcher = compile_matcher(spec, loaded.tokenizer, vocab)
    return (GrammarProcessor(matcher, prompt_len, vocab, clock),)
