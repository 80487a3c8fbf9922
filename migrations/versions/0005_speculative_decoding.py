"""speculative decoding: drafted tokens, verify rows, drafts and accepted tokens per step

run_tokens.drafted (a drafted token the target accepted); steps.verify_rows, draft_tokens,
accepted_tokens and speculation (the step's state); step_entries.drafted and accepted. Rows
written before speculation existed read as no drafts (the server defaults).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STEP_COUNTS = ("verify_rows", "draft_tokens", "accepted_tokens")
ENTRY_COUNTS = ("drafted", "accepted")


def upgrade() -> None:
    with op.batch_alter_table("run_tokens") as batch:
        batch.add_column(sa.Column("drafted", sa.Boolean(), nullable=False,
                                   server_default=sa.false()))
    with op.batch_alter_table("steps") as batch:
        for name in STEP_COUNTS:
            batch.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("speculation", sa.String(length=100), nullable=False,
                                   server_default=""))
    with op.batch_alter_table("step_entries") as batch:
        for name in ENTRY_COUNTS:
            batch.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("step_entries") as batch:
        for name in ENTRY_COUNTS:
            batch.drop_column(name)
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("speculation")
        for name in STEP_COUNTS:
            batch.drop_column(name)
    with op.batch_alter_table("run_tokens") as batch:
        batch.drop_column("drafted")
