"""Buffered studies: an update records the round attempt whose task it answers and the version it trained from.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07 09:40:00

In a buffered study (FedBuff) an update may arrive after the round it was tasked in closed: it then
joins the open buffer, and its change is taken against the version it trained from. Both columns
are NULL for synchronous studies' updates, those already stored included.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("updates") as batch:
        batch.add_column(sa.Column("task_round_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("base_round", sa.Integer(), nullable=True))
        batch.create_foreign_key("fk_updates_task_round_id_rounds", "rounds", ["task_round_id"], ["id"])


def downgrade() -> None:
    with op.batch_alter_table("updates") as batch:
        batch.drop_constraint("fk_updates_task_round_id_rounds", type_="foreignkey")
        batch.drop_column("base_round")
        batch.drop_column("task_round_id")
