"""Rounds get a kind: training rounds, and the final evaluation round of a study.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 05:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("rounds") as batch:
        batch.add_column(sa.Column("kind", sa.String(length=16), server_default="train", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("rounds") as batch:
        batch.drop_column("kind")
