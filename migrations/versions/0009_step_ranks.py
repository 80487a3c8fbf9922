"""steps: each tensor-parallel rank's times

steps.ranks_json (StepRecord.ranks): per rank its seconds in the step, {"rank", "wall_s",
"model_s", "broadcast_s"}, for a server with --tensor-parallel-size > 1; NULL for one rank and
for rows written before it.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from app.db.models import NullableJSON

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("ranks_json", NullableJSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("ranks_json")
