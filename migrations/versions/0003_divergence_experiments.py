"""divergence experiments: one row per finished or failed experiment, its two sides as runs

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from app.db.models import JSONValue  # TEXT on PostgreSQL: see there

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "divergence_experiments",
        sa.Column("id", sa.String(length=100), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("source", sa.String(length=20), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("prompt_text", sa.Text(), nullable=False),
        sa.Column("params_json", JSONValue, nullable=False),
        sa.Column("run_a_id", sa.String(length=100), nullable=True),
        sa.Column("run_b_id", sa.String(length=100), nullable=True),
        sa.Column("verdict", sa.String(length=20), nullable=True),
        sa.Column("verdict_text", sa.Text(), nullable=True),
        sa.Column("fork_token_index", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("record_json", JSONValue, nullable=True),
        sa.ForeignKeyConstraint(["run_a_id"], ["runs.id"],
                                name=op.f("fk_divergence_experiments_run_a_id_runs"),
                                ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["run_b_id"], ["runs.id"],
                                name=op.f("fk_divergence_experiments_run_b_id_runs"),
                                ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_divergence_experiments")),
    )
    op.create_index("ix_divergence_experiments_created_at", "divergence_experiments",
                    ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_divergence_experiments_created_at", table_name="divergence_experiments")
    op.drop_table("divergence_experiments")
