"""steps: structured outputs' constrained rows and grammar-mask time

steps.constrained_rows (the step's rows held to a grammar) and steps.mask_ms (the milliseconds
their matchers took to take the new tokens and compute the masks), StepRecord's fields of the
same names. Rows written before them read as 0 (the server default): no constrained row.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("constrained_rows", sa.Integer(), nullable=False,
                                   server_default="0"))
        batch.add_column(sa.Column("mask_ms", sa.Float(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("mask_ms")
        batch.drop_column("constrained_rows")
