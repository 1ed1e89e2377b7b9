"""Site reports: what sites send for jobs outside rounds (surveys, external validation, evaluations).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06 12:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "site_reports",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("study_id", sa.Integer(), sa.ForeignKey("studies.id"), nullable=False),
        sa.Column("site_id", sa.Integer(), sa.ForeignKey("sites.id"), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("round_number", sa.Integer(), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("study_id", "site_id", "kind", "round_number"),
    )
    op.create_index("ix_site_reports_study_id", "site_reports", ["study_id"])


def downgrade() -> None:
    op.drop_index("ix_site_reports_study_id", table_name="site_reports")
    op.drop_table("site_reports")
