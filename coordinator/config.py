"""Coordinator settings, read from CARDIOFL_* environment variables (or a .env file) and passed in."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url

__all__ = ["CoordinatorSettings", "blob_dir_for"]


MIN_ADMIN_TOKEN_CHARS = 16


class CoordinatorSettings(BaseSettings):
    """Everything the coordinator can be told; build once and hand to `create_app`."""

    model_config = SettingsConfigDict(env_prefix="CARDIOFL_", env_file=".env", extra="ignore", env_ignore_empty=True)

    database_url: str = "sqlite:///./cardiofl-coordinator.db"  # PostgreSQL: postgresql+psycopg://user@host/db
    # Where uploaded updates are kept, as files named by sha256, shared by every worker. Unset: beside
    # a SQLite database file (`<database>.blobs`); in the database itself for other databases.
    blob_dir: str | None = None
    admin_token: SecretStr | None = None  # bootstrap admin token (no database row); empty disables it

    @field_validator("admin_token")
    @classmethod
    def _a_real_secret(cls, token: SecretStr | None) -> SecretStr | None:
        """Refuse what cannot be a generated secret: short, or with spaces or '#' (an env file's comment read as it)."""
        if token is None or not token.get_secret_value():
            return token
        value = token.get_secret_value()
        if len(value) < MIN_ADMIN_TOKEN_CHARS or any(c.isspace() or c == "#" for c in value):
            raise ValueError(
                f"must be at least {MIN_ADMIN_TOKEN_CHARS} characters with no spaces or '#' (was a comment read as "
                "the token?); generate one with `openssl rand -base64 32`"
            )
        return token

    migrate_on_start: bool = True  # run Alembic `upgrade head` when the app starts
    max_upload_bytes: int = Field(1 << 30, ge=1024)  # largest update body accepted
    upload_spool_dir: str | None = None  # where update bodies wait on disk while they arrive; None: the temp dir
    upload_slots: int = Field(2, ge=1)  # updates checked and stored at once (each maps its body into memory)
    download_cache_bytes: int = Field(256 << 20, ge=0)  # models kept in memory while sites download them
    max_num_examples: int = Field(100_000_000, ge=1)  # an n_k above this is refused as absurd
    max_poll_wait_s: float = Field(30.0, ge=0)  # cap on GET /tasks/next?wait=
    task_poll_interval_s: float = Field(1.0, gt=0)  # how often a waiting long-poll looks for a task
    tick_interval_s: float = Field(2.0, ge=0)  # deadline ticker period; 0 turns the ticker off
    # An aggregating worker renews its lease every third of this; one that stops renewing (it died) is
    # taken over by another worker after it.
    aggregation_lease_s: float = Field(30.0, gt=0)
    # HTTPS (README "TLS"): the folder of `cardiofl coordinator tls init`. Set, `serve` speaks HTTPS with
    # its server certificate and picks up renewed certificates and CRLs at the next handshake.
    tls_dir: str | None = None
    tls_mutual: bool = False  # also require a client certificate from tls_dir's CA, checked against its CRL
    public_url: str | None = None  # how sites reach the coordinator (https://host:port); written into site kits


def blob_dir_for(settings: CoordinatorSettings) -> Path | None:
    """The blob store's directory: `blob_dir`, else `<database file>.blobs` for SQLite, else none (database)."""
    if settings.blob_dir:
        return Path(settings.blob_dir)
    url = make_url(settings.database_url)
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        database = Path(url.database)
        return database.with_name(database.name.removesuffix(".db") + ".blobs")
    return None
