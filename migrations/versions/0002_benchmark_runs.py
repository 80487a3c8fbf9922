"""benchmark runs: one row per `batchscope bench serve`, with its summary and per-request data

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from app.db.models import JSONValue  # TEXT on PostgreSQL: see there

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "benchmark_runs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("label", sa.Text(), nullable=True),
        sa.Column("endpoint", sa.String(length=20), nullable=False),
        sa.Column("dataset", sa.Text(), nullable=False),
        sa.Column("num_prompts", sa.Integer(), nullable=False),
        sa.Column("request_rate", sa.Float(), nullable=True),
        sa.Column("max_concurrency", sa.Integer(), nullable=True),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("duration_s", sa.Float(), nullable=False),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("config_json", JSONValue, nullable=False),
        sa.Column("summary_json", JSONValue, nullable=False),
        sa.Column("requests_json", JSONValue, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_benchmark_runs")),
    )
    op.create_index("ix_benchmark_runs_created_at", "benchmark_runs", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_benchmark_runs_created_at", table_name="benchmark_runs")
    op.drop_table("benchmark_runs")
