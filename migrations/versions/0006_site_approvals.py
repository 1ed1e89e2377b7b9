"""Sites report whether their operator approved each study that lists them.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 01:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "site_approvals",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("study_id", sa.Integer(), sa.ForeignKey("studies.id"), nullable=False),
        sa.Column("site_id", sa.Integer(), sa.ForeignKey("sites.id"), nullable=False),
        sa.Column("state", sa.String(length=24), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("reported_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("study_id", "site_id"),
    )
    op.create_index("ix_site_approvals_study_id", "site_approvals", ["study_id"])


def downgrade() -> None:
    op.drop_index("ix_site_approvals_study_id", table_name="site_approvals")
    op.drop_table("site_approvals")
