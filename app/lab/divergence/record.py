"""The divergence record, typed: what compare() finds, what the page and the command show, and
what the runs database stores.

to_dict() gives the record's JSON exactly as it has always been written (keys in the same
order), and from_dict() reads it back, records saved by older builds included: a field they
did not have yet takes its default. The telemetry of a side (its steps, token events, engine
steps and configuration) stays as the engine reported it: plain dicts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from app.lab.divergence.sides import SideConfig


def _plain(value: Any) -> Any:
    if isinstance(value, RecordPart):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _many(cls: type[RecordPart]) -> Callable[[list], list]:
    return lambda values: [cls.from_dict(v) for v in values]


class RecordPart:
    """to_dict()/from_dict() over the dataclass fields, in their order."""

    @classmethod
    def _nested(cls) -> dict[str, Callable[[Any], Any]]:
        """Field name -> reader of its JSON value (a typed part of the record)."""
        return {}

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> Any:
        nested = cls._nested()
        values = {}
        for f in fields(cls):
            if f.name not in data:  # a record from before this field: its default
                continue
            value = data[f.name]
            read = nested.get(f.name)
            values[f.name] = read(value) if read is not None and value is not None else value
        return cls(**values)


@dataclass(kw_only=True)
class Writer(RecordPart):
    """The step that wrote a position's keys and values on one side."""

    step: int
    path: str
    step_rows: int
    phase: str
    start: int
    rows: int
    prefill_rows: int | None = None
    decode_rows: int | None = None
    requests: int | None = None


@dataclass(kw_only=True)
class KvFirstDifference(RecordPart):
    position: int
    token_id: int
    in_prompt: bool
    output_index: int | None
    a: Writer | None
    b: Writer | None
    max_abs_delta: float
    keys_max_abs_delta: float
    values_max_abs_delta: float
    max_abs_delta_per_layer: list[float]

    @classmethod
    def _nested(cls) -> dict:
        return {"a": Writer.from_dict, "b": Writer.from_dict}


@dataclass(kw_only=True)
class Segment(RecordPart):
    """Consecutive positions written by the same step on each side."""

    first: int
    last: int
    a: Writer | None
    b: Writer | None
    max_abs_delta: float = 0.0
    first_difference: int | None = None

    @classmethod
    def _nested(cls) -> dict:
        return {"a": Writer.from_dict, "b": Writer.from_dict}


@dataclass(kw_only=True)
class TimelineRow(Segment):
    """Segments merged for printing: `count` of them, written by steps_a / steps_b [first, last]."""

    count: int = 1
    steps_a: list[int | None] = field(default_factory=lambda: [None, None])
    steps_b: list[int | None] = field(default_factory=lambda: [None, None])


@dataclass(kw_only=True)
class KvComparison(RecordPart):
    compared_positions: int
    max_abs_delta: float
    max_abs_delta_per_layer: list[float]
    first_difference: KvFirstDifference | None
    by_position: list[float]
    rewritten_positions: dict[str, int]  # {"a": n, "b": n}: positions written more than once
    segments: list[Segment]

    @classmethod
    def _nested(cls) -> dict:
        return {"first_difference": KvFirstDifference.from_dict, "segments": _many(Segment)}


@dataclass(kw_only=True)
class StateStep(RecordPart):
    """Models with recurrent layers: the recurrent state both sides held after the same
    `tokens` tokens (the prompt's and the output's fed back), each after its own step."""

    tokens: int
    step_a: int
    step_b: int
    path_a: str
    path_b: str
    rows_a: int  # the step's rows
    rows_b: int
    max_abs_delta: float  # over every recurrent layer
    max_abs_delta_per_layer: list[float]


@dataclass(kw_only=True)
class StateComparison(RecordPart):
    """The recurrent state after each step, where both sides stopped a step after the same
    tokens (while they hold the same tokens). Unlike a position's keys and values, a state
    difference is carried forward: every later state is computed from it."""

    compared_steps: int
    max_abs_delta: float
    max_abs_delta_per_layer: list[float]  # over the compared steps
    first_difference: int | None  # the `tokens` of the first differing state
    per_step: list[StateStep]

    @classmethod
    def _nested(cls) -> dict:
        return {"per_step": _many(StateStep)}


@dataclass(kw_only=True)
class TokenLogits(RecordPart):
    """One output token's logits on both sides: the largest difference and the top-2 margins."""

    index: int
    max_abs_delta: float
    margin_a: float
    margin_b: float
    top1_a: int
    top1_b: int
    top1_logit_a: float
    top1_logit_b: float
    step_a: int
    step_b: int
    path_a: str
    path_b: str
    rows_a: int
    rows_b: int


@dataclass(kw_only=True)
class MinMargin(RecordPart):
    index: int
    side: str  # "a" or "b"
    value: float


@dataclass(kw_only=True)
class LogitComparison(RecordPart):
    compared_tokens: int
    max_abs_delta: float
    first_difference: int | None
    min_margin: MinMargin | None
    per_token: list[TokenLogits]

    @classmethod
    def _nested(cls) -> dict:
        return {"min_margin": MinMargin.from_dict, "per_token": _many(TokenLogits)}


@dataclass(kw_only=True)
class ForkRow(RecordPart):
    """A leading token at the fork, on both sides."""

    token_id: int
    text: str
    logit_a: float
    logit_b: float
    delta: float
    logprob_a: float
    logprob_b: float
    rank_a: int
    rank_b: int


@dataclass(kw_only=True)
class Fork(RecordPart):
    token_index: int
    char_offset: int
    shared_text: str
    continuation_a: str
    continuation_b: str
    token_a: int | None
    token_b: int | None
    text_a: str | None
    text_b: str | None
    margin_a: float | None = None
    margin_b: float | None = None
    step_a: int | None = None
    step_b: int | None = None
    table: list[ForkRow] = field(default_factory=list)

    @classmethod
    def _nested(cls) -> dict:
        return {"table": _many(ForkRow)}


@dataclass(kw_only=True)
class Speculation(RecordPart):
    """The target's drafts over a run."""

    method: str
    k: int
    draft_model: str | None
    verify_steps: int
    drafted: int
    accepted: int
    acceptance: float | None


@dataclass(kw_only=True)
class SideRecord(RecordPart):
    """One side's run: its set-up, output and telemetry."""

    config: dict  # SideConfig.to_dict(), as the side ran (its label included)
    label: str
    model: str
    weights: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    chosen: list[int]  # the token chosen at each sampled step (a final EOS included)
    others_joined: bool
    steps: list[dict]
    tokens: list[dict] = field(default_factory=list)
    preemptions: int | None = None
    times: dict | None = None  # queued, first_scheduled, first_token, finished
    engine_steps: list[dict] = field(default_factory=list)
    request_ids: dict = field(default_factory=dict)  # {"target": id, "alongside": [ids]}
    engine: dict = field(default_factory=dict)
    speculation: Speculation | None = None

    @classmethod
    def _nested(cls) -> dict:
        return {"speculation": Speculation.from_dict}

    @property
    def side(self) -> SideConfig:
        return SideConfig.from_dict(self.config)


@dataclass(kw_only=True)
class Sides(RecordPart):
    a: SideRecord
    b: SideRecord

    @classmethod
    def _nested(cls) -> dict:
        return {"a": SideRecord.from_dict, "b": SideRecord.from_dict}

    def items(self) -> tuple[tuple[str, SideRecord], tuple[str, SideRecord]]:
        return ("a", self.a), ("b", self.b)


@dataclass(kw_only=True)
class DivergenceRecord(RecordPart):
    """One experiment: the two sides, the fork, the logits and keys/values compared, the prose.
    The fields after `chain` are the run's (None for a bare compare())."""

    version: int = 1
    model: str
    prompt_ids: list[int]
    prompt_tokens: int
    sides: Sides
    identical: bool
    bit_identical: bool
    fork: Fork | None
    logits: LogitComparison
    kv: KvComparison
    state: StateComparison | None = None  # models with recurrent layers only
    verdict: str = ""
    chain: list[str] = field(default_factory=list)
    prompt: str | None = None
    chat: bool | None = None
    max_tokens: int | None = None
    ignore_eos: bool | None = None
    elapsed_s: float | None = None
    backend: dict | None = None

    @classmethod
    def _nested(cls) -> dict:
        return {"sides": Sides.from_dict, "fork": Fork.from_dict,
                "logits": LogitComparison.from_dict, "kv": KvComparison.from_dict,
                "state": StateComparison.from_dict}

    def to_dict(self) -> dict:
        data = super().to_dict()
        if self.state is None:  # a model without recurrent layers: the JSON it always had
            del data["state"]
        return data


@dataclass(kw_only=True)
class SearchSummary(RecordPart):
    """Many prompts on both sides: how often and where they fork; full records of the first
    forks. `results` holds one row per prompt (or its error)."""

    version: int = 1
    prompts: int
    max_tokens: int
    chat: bool
    a: dict
    b: dict
    forked: int
    same_tokens_numbers_differ: int
    bit_identical: int
    errors: int
    fork_indices: list[int]
    tokens_compared: int
    close_calls: int
    smallest_margins: list[dict]
    results: list[dict]
    forks: list[DivergenceRecord]
    elapsed_s: float
    backend: dict

    @classmethod
    def _nested(cls) -> dict:
        return {"forks": _many(DivergenceRecord)}
