"""steps: the recurrent-state pool of models with Gated DeltaNet layers

steps.state_slots_total, state_slots_used, state_checkpoints, state_checkpoint_capacity,
state_checkpoint_hits (cumulative) and state_slot_bytes (StepRecord's fields of the same
names). Rows written before them, and every step of a model without recurrent layers, read
as 0 (the server default): no state pool.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STATE_COLUMNS = ("state_slots_total", "state_slots_used", "state_checkpoints",
                 "state_checkpoint_capacity", "state_checkpoint_hits", "state_slot_bytes")


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        for name in STATE_COLUMNS:  # SQLite's INTEGER holds 64 bits: bytes fit
            batch.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        for name in reversed(STATE_COLUMNS):
            batch.drop_column(name)
