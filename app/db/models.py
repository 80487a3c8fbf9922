"""The runs database: one row per engine session, run, output token, engine step and step entry.

Times are epoch seconds (floats) as the engine reports them. JSON columns hold small structured
values that are only ever read whole (params, token id lists, top logprobs).
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    false,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Named constraints so that batch migrations on SQLite can refer to them by name.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


# Values past 2**31: SQLite's INTEGER holds 64 bits already, PostgreSQL's needs BIGINT.
Int64 = Integer().with_variant(BigInteger(), "postgresql")


class _TextJSON(TypeDecorator):
    """A JSON column on PostgreSQL: Python's JSON text in TEXT, as SQLite keeps it. PostgreSQL's
    json type refuses NaN and infinities (a masked token's -inf top logprob), which Python's
    json module writes and reads back."""

    impl = Text
    cache_ok = True

    def __init__(self, none_as_null: bool = False):
        super().__init__()
        self.none_as_null = none_as_null

    def process_bind_param(self, value: Any, dialect: Dialect) -> str | None:
        if value is None and self.none_as_null:
            return None
        return json.dumps(value)

    def process_result_value(self, value: str | None, dialect: Dialect) -> Any:
        return None if value is None else json.loads(value)


JSONValue = JSON().with_variant(_TextJSON(), "postgresql")
# None is stored as SQL NULL rather than the JSON text 'null'.
NullableJSON = JSON(none_as_null=True).with_variant(_TextJSON(none_as_null=True), "postgresql")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class EngineSession(Base):
    """One server start: engine step numbers restart with each, so steps are keyed by session."""

    __tablename__ = "engine_sessions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    started_at: Mapped[float] = mapped_column(Float)
    model: Mapped[str] = mapped_column(String(200))
    weights: Mapped[str] = mapped_column(String(50))
    kernel_policy: Mapped[str] = mapped_column(String(50))
    config_json: Mapped[dict] = mapped_column(JSONValue)


class Run(Base):
    """One request served; its id is the engine request id."""

    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(100), primary_key=True)
    session_id: Mapped[int | None] = mapped_column(
        ForeignKey("engine_sessions.id", ondelete="SET NULL"), index=True)
    created_at: Mapped[float] = mapped_column(Float)
    source: Mapped[str] = mapped_column(String(20))  # playground | api | cli | bench | divergence
    endpoint: Mapped[str] = mapped_column(String(20))  # completions | chat
    model: Mapped[str] = mapped_column(String(200))
    weights: Mapped[str] = mapped_column(String(50))
    kernel_policy: Mapped[str] = mapped_column(String(50))
    prompt_text: Mapped[str] = mapped_column(Text)
    messages_json: Mapped[list | None] = mapped_column(NullableJSON)
    prompt_token_ids_json: Mapped[list] = mapped_column(JSONValue)
    params_json: Mapped[dict] = mapped_column(JSONValue)
    # running | finished | interrupted (the server stopped before the run finished)
    status: Mapped[str] = mapped_column(String(20), default="running")
    finish_reason: Mapped[str | None] = mapped_column(String(20))  # stop|length|cancelled|error
    error: Mapped[str | None] = mapped_column(Text)
    # Appended token by token, so a run whose finish never arrives still shows its text.
    output_text: Mapped[str] = mapped_column(Text, default="")
    output_token_ids_json: Mapped[list | None] = mapped_column(NullableJSON)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    preemptions: Mapped[int | None] = mapped_column(Integer)
    queued_at: Mapped[float] = mapped_column(Float)
    first_scheduled_at: Mapped[float | None] = mapped_column(Float)
    first_token_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)

    __table_args__ = (
        # The runs page lists newest first, optionally filtered by one of these columns.
        Index("ix_runs_created_at", "created_at"),
        Index("ix_runs_model_created_at", "model", "created_at"),
        Index("ix_runs_kernel_policy_created_at", "kernel_policy", "created_at"),
        Index("ix_runs_finish_reason_created_at", "finish_reason", "created_at"),
        Index("ix_runs_status", "status"),  # mark_interrupted at startup
    )


class RunToken(Base):
    """One output token of a run, as the engine released it."""

    __tablename__ = "run_tokens"

    run_id: Mapped[str] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    token_id: Mapped[int] = mapped_column(Integer)
    text: Mapped[str] = mapped_column(Text)
    logprob: Mapped[float | None] = mapped_column(Float)
    # [[token_id, logprob], ...], most likely first
    top_logprobs_json: Mapped[list | None] = mapped_column(NullableJSON)
    t: Mapped[float] = mapped_column(Float)
    step: Mapped[int | None] = mapped_column(Integer)
    # Speculative decoding: a drafted token the target accepted (TokenEvent.drafted).
    drafted: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class Step(Base):
    """One engine step (StepRecord), keyed by (session, step number)."""

    __tablename__ = "steps"

    session_id: Mapped[int] = mapped_column(
        ForeignKey("engine_sessions.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    started_at: Mapped[float] = mapped_column(Float)
    wall_time: Mapped[float] = mapped_column(Float)
    model_time: Mapped[float] = mapped_column(Float)
    scheduler_time: Mapped[float] = mapped_column(Float)
    total_rows: Mapped[int] = mapped_column(Integer)
    prefill_rows: Mapped[int] = mapped_column(Integer)
    decode_rows: Mapped[int] = mapped_column(Integer)
    kv_blocks_total: Mapped[int] = mapped_column(Integer)
    kv_blocks_used: Mapped[int] = mapped_column(Integer)
    kv_blocks_free: Mapped[int] = mapped_column(Integer)
    kv_blocks_cached: Mapped[int] = mapped_column(Integer)
    num_running: Mapped[int] = mapped_column(Integer)
    num_waiting: Mapped[int] = mapped_column(Integer)
    kernel_path: Mapped[str] = mapped_column(String(20))
    linear_calls_per_layer: Mapped[int] = mapped_column(Integer)
    prefix_cache_queries: Mapped[int] = mapped_column(Integer, default=0)  # cumulative, tokens
    prefix_cache_hits: Mapped[int] = mapped_column(Integer, default=0)  # cumulative, tokens
    preempted_json: Mapped[list] = mapped_column(JSONValue)
    error: Mapped[str | None] = mapped_column(Text)
    # Mixture-of-experts models: {"layer index": [rows per expert]} (StepRecord.expert_rows);
    # NULL for a dense model.
    expert_rows_json: Mapped[dict | None] = mapped_column(NullableJSON)
    # Speculative decoding: rows of verify groups, drafts proposed and accepted, and the
    # step's speculation state ("" without speculation, "on", or why it was off).
    verify_rows: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    draft_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    accepted_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    speculation: Mapped[str] = mapped_column(String(100), default="", server_default="")
    # Models with recurrent layers (Gated DeltaNet): the state pool as the step ran; all 0
    # for a model without them (StepRecord's state_* fields).
    state_slots_total: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    state_slots_used: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    state_checkpoints: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    state_checkpoint_capacity: Mapped[int] = mapped_column(Integer, default=0,
                                                           server_default="0")
    # cumulative, like prefix_cache_hits: admissions that resumed from a checkpoint
    state_checkpoint_hits: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    state_slot_bytes: Mapped[int] = mapped_column(Int64, default=0, server_default="0")
    # Structured outputs: the step's rows held to a grammar, and the milliseconds their
    # matchers took (StepRecord.constrained_rows, mask_ms); 0 for an unconstrained step.
    constrained_rows: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    mask_ms: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    # Tensor parallelism: per rank {"rank", "wall_s", "model_s", "broadcast_s", "all_sum_s"}
    # (StepRecord.ranks; all_sum_s since it was measured); NULL for one rank.
    ranks_json: Mapped[list | None] = mapped_column(NullableJSON)
    # Async scheduling: built and queued while the step before computed, and the rows it
    # computed for requests that had ended (StepRecord.overlapped, discarded_rows).
    overlapped: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    discarded_rows: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    __table_args__ = (Index("ix_steps_started_at", "started_at"),)


class StepEntry(Base):
    """One request's part in one step.

    run_id is deliberately not a foreign key: steps are engine telemetry and may include
    requests that were never recorded as runs (or whose run row was written later).
    """

    __tablename__ = "step_entries"

    session_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(String(100), primary_key=True)
    phase: Mapped[str] = mapped_column(String(20))  # prefill | decode | verify
    rows: Mapped[int] = mapped_column(Integer)
    context_len: Mapped[int] = mapped_column(Integer)
    blocks_held: Mapped[int] = mapped_column(Integer)
    sampled: Mapped[bool] = mapped_column(Boolean)
    drafted: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # verify
    accepted: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # verify

    __table_args__ = (
        ForeignKeyConstraint(["session_id", "step"], ["steps.session_id", "steps.step"],
                             ondelete="CASCADE"),
        Index("ix_step_entries_run_id", "run_id"),
    )


class BenchmarkRun(Base):
    """One `batchscope bench serve` run against an OpenAI-compatible server.

    summary_json holds the report's numbers (counts, tokens, throughputs, latency statistics,
    goodput); requests_json one entry per request (lengths, timings, ITLs, error text), so plots
    are drawn from the recorded measurements themselves.
    """

    __tablename__ = "benchmark_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[float] = mapped_column(Float)
    url: Mapped[str] = mapped_column(Text)
    model: Mapped[str] = mapped_column(String(200))
    label: Mapped[str | None] = mapped_column(Text)
    endpoint: Mapped[str] = mapped_column(String(20))  # completions | chat
    dataset: Mapped[str] = mapped_column(Text)  # "mixed" or the file's name
    num_prompts: Mapped[int] = mapped_column(Integer)
    request_rate: Mapped[float | None] = mapped_column(Float)  # None: all at once (inf)
    max_concurrency: Mapped[int | None] = mapped_column(Integer)  # None: unlimited
    seed: Mapped[int] = mapped_column(Int64)
    duration_s: Mapped[float] = mapped_column(Float)
    completed: Mapped[int] = mapped_column(Integer)
    failed: Mapped[int] = mapped_column(Integer)
    config_json: Mapped[dict] = mapped_column(JSONValue)
    summary_json: Mapped[dict] = mapped_column(JSONValue)
    requests_json: Mapped[list] = mapped_column(JSONValue)

    __table_args__ = (Index("ix_benchmark_runs_created_at", "created_at"),)


class DivergenceExperiment(Base):
    """One finished (or failed) divergence experiment (app/lab/divergence.py): its parameters,
    the verdict, and the whole record the /divergence page renders. Its two sides are runs
    (source "divergence"); a failed experiment has no runs, only its error."""

    __tablename__ = "divergence_experiments"

    id: Mapped[str] = mapped_column(String(100), primary_key=True)
    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    source: Mapped[str] = mapped_column(String(20))  # web | cli
    status: Mapped[str] = mapped_column(String(20))  # done | error
    prompt_text: Mapped[str] = mapped_column(Text)
    params_json: Mapped[dict] = mapped_column(JSONValue)
    run_a_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
    run_b_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
    verdict: Mapped[str | None] = mapped_column(String(20))  # identical | same_tokens | forked
    verdict_text: Mapped[str | None] = mapped_column(Text)  # the record's sentence
    fork_token_index: Mapped[int | None] = mapped_column(Integer)  # first differing token
    error: Mapped[str | None] = mapped_column(Text)
    record_json: Mapped[dict | None] = mapped_column(NullableJSON)

    __table_args__ = (Index("ix_divergence_experiments_created_at", "created_at"),)
