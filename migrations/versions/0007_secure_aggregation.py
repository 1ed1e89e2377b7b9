"""Secure aggregation: a secure round's phase, phase deadline and setup; the sites' phase messages.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-08 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("rounds") as batch:
        batch.add_column(sa.Column("secagg_phase", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("secagg_deadline_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("secagg_state", sa.JSON(), nullable=True))
    op.create_table(
        "secagg_messages",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("round_id", sa.Integer(), sa.ForeignKey("rounds.id"), nullable=False),
        sa.Column("site_id", sa.Integer(), sa.ForeignKey("sites.id"), nullable=False),
        sa.Column("phase", sa.Integer(), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("round_id", "site_id", "phase"),
    )
    op.create_index("ix_secagg_messages_round_id", "secagg_messages", ["round_id"])


def downgrade() -> None:
    op.drop_index("ix_secagg_messages_round_id", table_name="secagg_messages")
    op.drop_table("secagg_messages")
    with op.batch_alter_table("rounds") as batch:
        batch.drop_column("secagg_state")
        batch.drop_column("secagg_deadline_at")
        batch.drop_column("secagg_phase")
