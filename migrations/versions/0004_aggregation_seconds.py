"""Rounds record how long their aggregation took (Prometheus: cardiofl_aggregation_seconds).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 21:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("rounds", recreate="never") as batch:
        batch.add_column(sa.Column("aggregation_seconds", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rounds", recreate="never") as batch:
        batch.drop_column("aggregation_seconds")
