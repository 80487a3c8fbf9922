"""PostgreSQL: 64-bit integers where values pass 2**31

steps.state_slot_bytes (a recurrent state slot's bytes) and benchmark_runs.seed (any integer
`batchscope bench serve --seed` takes) become BIGINT. SQLite's INTEGER already holds 64 bits
and compares BIGINT alike, so there this revision changes nothing.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (("steps", "state_slot_bytes"), ("benchmark_runs", "seed"))


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, name in COLUMNS:
        op.alter_column(table, name, type_=sa.BigInteger(), existing_type=sa.Integer(),
                        existing_nullable=False)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, name in COLUMNS:
        op.alter_column(table, name, type_=sa.Integer(), existing_type=sa.BigInteger(),
                        existing_nullable=False)
