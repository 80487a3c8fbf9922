"""initial schema: engine sessions, runs, run tokens, steps, step entries

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from app.db.models import JSONValue  # TEXT on PostgreSQL: see there

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "engine_sessions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("weights", sa.String(length=50), nullable=False),
        sa.Column("kernel_policy", sa.String(length=50), nullable=False),
        sa.Column("config_json", JSONValue, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_engine_sessions")),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.String(length=100), nullable=False),
        sa.Column("session_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("source", sa.String(length=20), nullable=False),
        sa.Column("endpoint", sa.String(length=20), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("weights", sa.String(length=50), nullable=False),
        sa.Column("kernel_policy", sa.String(length=50), nullable=False),
        sa.Column("prompt_text", sa.Text(), nullable=False),
        sa.Column("messages_json", JSONValue, nullable=True),
        sa.Column("prompt_token_ids_json", JSONValue, nullable=False),
        sa.Column("params_json", JSONValue, nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("finish_reason", sa.String(length=20), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("output_text", sa.Text(), nullable=False),
        sa.Column("output_token_ids_json", JSONValue, nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("preemptions", sa.Integer(), nullable=True),
        sa.Column("queued_at", sa.Float(), nullable=False),
        sa.Column("first_scheduled_at", sa.Float(), nullable=True),
        sa.Column("first_token_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["session_id"], ["engine_sessions.id"],
                                name=op.f("fk_runs_session_id_engine_sessions"),
                                ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
    )
    op.create_index("ix_runs_created_at", "runs", ["created_at"])
    op.create_index("ix_runs_model_created_at", "runs", ["model", "created_at"])
    op.create_index("ix_runs_kernel_policy_created_at", "runs", ["kernel_policy", "created_at"])
    op.create_index("ix_runs_finish_reason_created_at", "runs", ["finish_reason", "created_at"])
    op.create_index("ix_runs_status", "runs", ["status"])
    op.create_index(op.f("ix_runs_session_id"), "runs", ["session_id"])

    op.create_table(
        "run_tokens",
        sa.Column("run_id", sa.String(length=100), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("token_id", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("logprob", sa.Float(), nullable=True),
        sa.Column("top_logprobs_json", JSONValue, nullable=True),
        sa.Column("t", sa.Float(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_run_tokens_run_id_runs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "idx", name=op.f("pk_run_tokens")),
    )

    op.create_table(
        "steps",
        sa.Column("session_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("wall_time", sa.Float(), nullable=False),
        sa.Column("model_time", sa.Float(), nullable=False),
        sa.Column("scheduler_time", sa.Float(), nullable=False),
        sa.Column("total_rows", sa.Integer(), nullable=False),
        sa.Column("prefill_rows", sa.Integer(), nullable=False),
        sa.Column("decode_rows", sa.Integer(), nullable=False),
        sa.Column("kv_blocks_total", sa.Integer(), nullable=False),
        sa.Column("kv_blocks_used", sa.Integer(), nullable=False),
        sa.Column("kv_blocks_free", sa.Integer(), nullable=False),
        sa.Column("kv_blocks_cached", sa.Integer(), nullable=False),
        sa.Column("num_running", sa.Integer(), nullable=False),
        sa.Column("num_waiting", sa.Integer(), nullable=False),
        sa.Column("kernel_path", sa.String(length=20), nullable=False),
        sa.Column("linear_calls_per_layer", sa.Integer(), nullable=False),
        sa.Column("prefix_cache_queries", sa.Integer(), nullable=False),
        sa.Column("prefix_cache_hits", sa.Integer(), nullable=False),
        sa.Column("preempted_json", JSONValue, nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["session_id"], ["engine_sessions.id"],
                                name=op.f("fk_steps_session_id_engine_sessions"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("session_id", "step", name=op.f("pk_steps")),
    )
    op.create_index("ix_steps_started_at", "steps", ["started_at"])

    op.create_table(
        "step_entries",
        sa.Column("session_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(length=100), nullable=False),
        sa.Column("phase", sa.String(length=20), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("context_len", sa.Integer(), nullable=False),
        sa.Column("blocks_held", sa.Integer(), nullable=False),
        sa.Column("sampled", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["session_id", "step"], ["steps.session_id", "steps.step"],
                                name=op.f("fk_step_entries_session_id_step_steps"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("session_id", "step", "run_id", name=op.f("pk_step_entries")),
    )
    op.create_index("ix_step_entries_run_id", "step_entries", ["run_id"])


def downgrade() -> None:
    op.drop_table("step_entries")
    op.drop_table("steps")
    op.drop_table("run_tokens")
    op.drop_table("runs")
    op.drop_table("engine_sessions")
