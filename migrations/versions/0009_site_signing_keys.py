"""Sites' signing keys: each agent registers its long-term Ed25519 public key, which secure studies' terms name.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 19:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sites", recreate="never") as batch:
        batch.add_column(sa.Column("signing_key", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sites", recreate="never") as batch:
        batch.drop_column("signing_key")
