"""Blobs kept in the database move into ordered parts of at most 64 MiB (blob_parts); blobs.data goes.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06 19:30:00

One database value is bounded (SQLite 1,000,000,000 bytes, PostgreSQL's bytea 1 GiB), so a model
of a gigabyte could not be stored in blobs.data. Each blob kept in the database is copied into parts
by SQL (substr / substring of its bytes, one statement per part index), then the column is dropped;
a blob in the blob store has no parts. Downgrading joins the parts back, one blob at a time.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PART_BYTES = 64 << 20  # as coordinator.storage.blob_parts.PART_BYTES when this revision was written


def upgrade() -> None:
    op.create_table(
        "blob_parts",
        sa.Column("sha256", sa.String(length=64), sa.ForeignKey("blobs.sha256", ondelete="CASCADE"), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("sha256", "seq"),
    )
    bind = op.get_bind()
    postgres = bind.dialect.name == "postgresql"
    if postgres:  # safetensors barely compress: store them uncompressed, as blobs.data was
        op.execute("ALTER TABLE blob_parts ALTER COLUMN data SET STORAGE EXTERNAL")
    part = "substring(data FROM :start + 1 FOR :length)" if postgres else "substr(data, :start + 1, :length)"
    largest = bind.execute(sa.text("SELECT max(size) FROM blobs WHERE location = 'database'")).scalar() or 0
    for seq, start in enumerate(range(0, largest, PART_BYTES)):
        bind.execute(
            sa.text(
                f"INSERT INTO blob_parts (sha256, seq, data) SELECT sha256, :seq, {part} FROM blobs"
                " WHERE location = 'database' AND size > :start"
            ),
            {"seq": seq, "start": start, "length": PART_BYTES},
        )
    op.execute("ALTER TABLE blobs DROP COLUMN data")  # SQLite 3.35+ drops it in place: no table to rebuild


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        op.add_column("blobs", sa.Column("data", sa.LargeBinary(), nullable=True))
    else:  # SQLite adds a NOT NULL column only with a default, and alters one only by rebuilding the table
        op.execute("ALTER TABLE blobs ADD COLUMN data BLOB NOT NULL DEFAULT x''")
    digests = bind.execute(sa.text("SELECT DISTINCT sha256 FROM blob_parts")).scalars().all()
    for digest in digests:
        parts = bind.execute(
            sa.text("SELECT data FROM blob_parts WHERE sha256 = :sha ORDER BY seq"), {"sha": digest}
        ).scalars()
        bind.execute(
            sa.text("UPDATE blobs SET data = :data WHERE sha256 = :sha"),
            {"data": b"".join(bytes(data) for data in parts), "sha": digest},
        )
    if bind.dialect.name == "postgresql":
        bind.execute(sa.text("UPDATE blobs SET data = :empty WHERE data IS NULL"), {"empty": b""})
        op.execute("ALTER TABLE blobs ALTER COLUMN data SET NOT NULL")
        op.execute("ALTER TABLE blobs ALTER COLUMN data SET STORAGE EXTERNAL")
    op.drop_table("blob_parts")
