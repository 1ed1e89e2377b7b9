"""Blobs say where their bytes are: in the database (as before) or in the blob store, with block checksums.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 20:10:00

Existing rows keep their bytes in the database (`location` "database"), so a coordinator that was
storing updates in the table reads them as before; only new uploads go to the blob store.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # `data` stays NOT NULL (SQLite cannot change that without rebuilding the table, which would copy
    # every stored model): a blob whose bytes are in the blob store holds an empty `data`.
    with op.batch_alter_table("blobs", recreate="never") as batch:
        batch.add_column(sa.Column("location", sa.String(length=16), server_default="database", nullable=False))
        batch.add_column(sa.Column("checksums", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("blobs", recreate="never") as batch:
        batch.drop_column("checksums")
        batch.drop_column("location")
