"""steps: async scheduling's overlapped steps and discarded rows

steps.overlapped (the step was built and queued while the one before it computed) and
steps.discarded_rows (rows it computed for requests that had ended on the step before),
StepRecord's fields of the same names. Rows written before them read as a step built after
the one before, with nothing discarded (the server defaults).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("overlapped", sa.Boolean(), nullable=False,
                                   server_default=sa.false()))
        batch.add_column(sa.Column("discarded_rows", sa.Integer(), nullable=False,
                                   server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("discarded_rows")
        batch.drop_column("overlapped")
