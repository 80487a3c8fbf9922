"""Speculative decoding inside the continuous batch: who proposes drafts, and which of them a
step keeps.

A speculating request brings 1 + k rows to a normal step: its last token and k drafted tokens.
They are attended like decode rows, each at its own position, so a verified token carries the
bits a decoded one would (engine/attention.py, engine/native/paged_attention.h). The sampler
(engine/sampler.py) then keeps the longest prefix of drafts the target agrees with, plus
the target's own next token; the engine trims the blocks the rejected rows took.

Prompt lookup is pure Python (no MLX): it matches the last n tokens of a request against its
own earlier tokens, as vLLM's "ngram" method does. The draft-model proposer (engine/draft.py)
runs a smaller model on the engine thread, with its own paged KV.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

METHODS = ("off", "ngram", "draft")
# --draft-model LAYERS_PREFIX + N: the target's own first N decoder layers, final norm and head
# (engine/draft.py); anything else is "embedded" or a local mlx-lm folder.
LAYERS_PREFIX = "layers:"


@dataclass(frozen=True)
class SpeculativeConfig:
    """The speculation settings, checked (their defaults live in EngineConfig alone)."""

    method: str  # "off", "ngram" or "draft"
    num_tokens: int  # drafts per step per request (k)
    lookup_min: int  # shortest n-gram matched (prompt lookup)
    lookup_max: int  # longest n-gram matched, tried first
    # Speculate only while at most this many requests run (on open questions drafts cost
    # throughput once a few streams share the step: benchmarks/results/speculative_open.md).
    max_batch: int
    # method "draft": "layers:N" (the target's first N layers), "embedded" or a model folder.
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        for name in ("num_tokens", "lookup_min", "lookup_max", "max_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.lookup_min > self.lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.lookup_min}) is more than "
                             f"prompt_lookup_max ({self.lookup_max})")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative 'draft' needs a draft model: --draft-model PATH, "
                             "'embedded' or layers:N")
        if self.draft_model is not None and self.method != "draft":
            raise ValueError(f"a draft model ({self.draft_model!r}) is used by speculative "
                             f"'draft' only, got speculative {self.method!r}")
        if self.draft_model is not None:
            draft_layers(self.draft_model)  # raises on a bad layers:N

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    def describe(self) -> str:
        if not self.enabled:
            return "off"
        how = (f"n-gram {self.lookup_min}-{self.lookup_max}" if self.method == "ngram"
               else f"draft model {self.draft_model}")
        return f"{self.method}, k={self.num_tokens}, {how}, up to {self.max_batch} running requests"


def draft_layers(draft_model: str) -> int | None:
    """N of a "layers:N" draft (None: a model to load); ValueError when N is not a positive
    whole number."""
    if not draft_model.startswith(LAYERS_PREFIX):
        return None
    n = draft_model[len(LAYERS_PREFIX):]
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"draft model {draft_model!r}: layers:N takes a positive number of "
                         "the target's decoder layers")
    return int(n)


class Proposer(Protocol):
    def propose(self, wanted: Seq[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        """wanted: (seq_id, its tokens so far, most drafts it may take) for every request that
        speculates this step; returns seq_id -> drafts (absent or [] for none). Called on the
        engine thread, before the step is scheduled."""

    def release(self, seq_id: str) -> None:
        """The request has finished (any reason: also cancelled or failed): drop what is kept
        for it. The engine calls it for every request it finishes."""


@runtime_checkable
class DraftFilter(Protocol):
    """A logits processor that also says which drafts it allows (a grammar's:
    engine/structured.py): `propose` cuts a request's drafts to what each such processor
    allows, so a draft it forbids is never verified."""

    def valid_drafts(self, tokens: list[int], drafts: list[int]) -> int:
        """How many leading drafts may follow `tokens` (the request's sequence so far)."""


class NgramProposer:
    """Prompt lookup (--speculative ngram)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, wanted: Seq[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        c = self.config
        return {seq_id: propose_ngram(tokens, k, c.lookup_min, c.lookup_max)
                for seq_id, tokens, k in wanted}

    def release(self, seq_id: str) -> None:
        pass  # keeps nothing per request


def proposer_for(config: SpeculativeConfig) -> Proposer | None:
    """The method's proposer when it needs no model; "draft" is made by the engine once its
    model is loaded (engine/draft.py)."""
    return NgramProposer(config) if config.method == "ngram" else None


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: for n from n_max down to n_min, find the latest earlier occurrence of the
    last n tokens and return (up to) the k tokens that followed it; [] when none matches."""
    if k < 1 or len(tokens) < n_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        pattern = arr[-n:]
        # Windows that start before the suffix itself and leave at least one token after them.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


def common_prefix(a: Seq, b: Seq) -> int:
    """How many leading items a and b share (token lists, or strings)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def accepted_prefix(drafts: list[int], targets: list[int]) -> int:
    """Greedy verification: how many leading drafts equal the target's choices (targets[i] is
    what the target picks after drafts[:i])."""
    return common_prefix(drafts, targets)


def propose(spec: SpeculativeConfig, proposer: Proposer, running: Seq,
            max_model_len: int) -> tuple[dict[str, list[int]], str, float]:
    """Drafts for the running sequences in decode (each cut to what its DraftFilter
    processors allow), the step's speculation state (see StepRecord.speculation) and the
    seconds the proposer took: past `max_batch` running requests, none."""
    if not spec.enabled:
        return {}, "", 0.0
    if len(running) > spec.max_batch:
        return {}, f"off: {len(running)} running > {spec.max_batch}", 0.0
    wanted = []
    for seq in running:
        if not seq.in_decode or not seq.params.speculative:
            continue
        # Never draft past max_tokens or the context: the target's own token comes last.
        room = min(spec.num_tokens, seq.params.max_tokens - len(seq.output_ids) - 1,
                   max_model_len - seq.num_tokens - 1)
        if room >= 1:
            wanted.append((seq.seq_id, seq.token_ids, room))
    t0 = time.perf_counter()
    drafts = proposer.propose(wanted) if wanted else {}
    seconds = time.perf_counter() - t0
    rooms = {seq_id: room for seq_id, _, room in wanted}
    seqs = {seq.seq_id: seq for seq in running}
    kept = {}
    for s, d in drafts.items():
        d = d[:rooms[s]] if s in rooms else []
        for check in seqs[s].logits_processors if d else ():
            if isinstance(check, DraftFilter):
                d = d[:check.valid_drafts(seqs[s].token_ids, d)]
        if d:
            kept[s] = d
    return kept, "on", seconds
