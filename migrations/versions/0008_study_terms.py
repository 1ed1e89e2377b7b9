"""Study terms: `studies.config` becomes `studies.terms` (labels included), sites decline tasks, approvals renewed.

Tasks and offers embed a study's terms whole (protocol 5), and the digest a site approves is over
them (description format 2): every approval recorded before is of another digest, so each listed
site's operator approves its studies again before its agent trains for them. A site that declines
a task (it disagrees with the terms the site approved) is recorded in `task_declines`.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 16:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The classes every study's model predicts, in its output order: the `labels` of the terms of release 0.5.0.
FEDCVD_LABELS = [
    "NORM", "STACH", "SBRAD", "SARRH", "PAC", "AFIB", "AFLT", "SVTAC", "PVC", "1AVB",
    "2AVB", "3AVB", "LBBB", "RBBB", "LAO/LAE", "LVH", "RVH", "AMI", "IMI", "ASMI",
]  # fmt: skip

studies = sa.table("studies", sa.column("id", sa.Integer()), sa.column("terms", sa.JSON()))


def _rename_column(old: str, new: str) -> None:
    """Rename a column of `studies` in place (SQLite >= 3.25 does; copying the table would break the rounds' keys)."""
    op.execute(f"ALTER TABLE studies RENAME COLUMN {old} TO {new}")


def upgrade() -> None:
    _rename_column("config", "terms")
    connection = op.get_bind()
    for study_id, terms in connection.execute(sa.select(studies.c.id, studies.c.terms)).all():
        if "labels" not in terms:
            connection.execute(
                studies.update().where(studies.c.id == study_id).values(terms={**terms, "labels": FEDCVD_LABELS})
            )
    op.execute("UPDATE site_approvals SET state = 'awaiting_approval' WHERE state = 'approved'")
    op.create_table(
        "task_declines",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("round_id", sa.Integer(), sa.ForeignKey("rounds.id"), nullable=False),
        sa.Column("site_id", sa.Integer(), sa.ForeignKey("sites.id"), nullable=False),
        sa.Column("reason", sa.String(2000), nullable=False),
        sa.Column("declined_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("round_id", "site_id"),
    )
    op.create_index("ix_task_declines_round_id", "task_declines", ["round_id"])


def downgrade() -> None:
    op.drop_index("ix_task_declines_round_id", table_name="task_declines")
    op.drop_table("task_declines")
    connection = op.get_bind()
    for study_id, terms in connection.execute(sa.select(studies.c.id, studies.c.terms)).all():
        old = {key: value for key, value in terms.items() if key != "labels"}  # release 0.4.0 knows no labels
        connection.execute(studies.update().where(studies.c.id == study_id).values(terms=old))
    _rename_column("terms", "config")
    # approvals recorded since are of format-2 digests, which release 0.4.0 neither computes nor checks
    op.execute("UPDATE site_approvals SET state = 'awaiting_approval' WHERE state = 'approved'")
