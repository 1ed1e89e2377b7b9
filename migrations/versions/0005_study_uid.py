"""Studies get a random uid, unique across databases: sites key their local state by it.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 23:00:00
"""

import uuid
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # SQLite adds a NOT NULL column in place only with a constant default; the rows then get their
    # uids, and new studies always bring one. Copying the table instead would break the foreign
    # keys of the rounds that point at it.
    with op.batch_alter_table("studies", recreate="never") as batch:
        batch.add_column(sa.Column("uid", sa.String(length=32), nullable=False, server_default=""))
    connection = op.get_bind()
    studies = sa.table("studies", sa.column("id", sa.Integer()), sa.column("uid", sa.String(32)))
    for (study_id,) in connection.execute(sa.select(studies.c.id)).all():
        connection.execute(studies.update().where(studies.c.id == study_id).values(uid=uuid.uuid4().hex))
    op.create_index("ix_studies_uid", "studies", ["uid"], unique=True)
    if connection.dialect.name != "sqlite":
        op.alter_column("studies", "uid", server_default=None)


def downgrade() -> None:
    op.drop_index("ix_studies_uid", table_name="studies")
    with op.batch_alter_table("studies", recreate="never") as batch:
        batch.drop_column("uid")
