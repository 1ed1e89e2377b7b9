"""Coordinator settings, read from CARDIOFL_* environment variables (or a .env file) and passed in."""

from __future__ import annotations

import re
import secrets
from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url

from shared.logs import LogFormat, LogLevel, check_log_format, check_log_level

__all__ = ["CoordinatorSettings", "admin_token_problem", "blob_dir_for", "generate_admin_token"]


# The bootstrap admin token: what `secrets.token_urlsafe` makes, long enough, and not a repeated pattern.
MIN_ADMIN_TOKEN_CHARS = 32
MIN_ADMIN_TOKEN_DISTINCT = 16
ADMIN_TOKEN_BYTES = 32  # secrets.token_urlsafe(32): 43 characters
_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")
GENERATE_ADMIN_TOKEN = "cardiofl coordinator token generate"


def admin_token_problem(token: str) -> str | None:
    """What makes `token` unfit to be the bootstrap admin token (None: it is fit)."""
    if not _BASE64URL.fullmatch(token):
        return "must hold only the characters A-Z a-z 0-9 - _ (base64url: no spaces, '#', '+', '/' or '=')"
    if len(token) < MIN_ADMIN_TOKEN_CHARS:
        return f"must be at least {MIN_ADMIN_TOKEN_CHARS} characters long, not {len(token)}"
    if len(set(token)) < MIN_ADMIN_TOKEN_DISTINCT:
        return f"must hold at least {MIN_ADMIN_TOKEN_DISTINCT} distinct characters, not {len(set(token))}"
    return None


def generate_admin_token() -> str:
    """A new random bootstrap admin token that the rule accepts (`cardiofl coordinator token generate`)."""
    while True:
        token = secrets.token_urlsafe(ADMIN_TOKEN_BYTES)
        if admin_token_problem(token) is None:  # a draw fails about once in 2 * 10^13
            return token


class CoordinatorSettings(BaseSettings):
    """Everything the coordinator can be told; build once and hand to `create_app`."""

    model_config = SettingsConfigDict(env_prefix="CARDIOFL_", env_file=".env", extra="ignore", env_ignore_empty=True)

    database_url: str = "sqlite:///./cardiofl-coordinator.db"  # PostgreSQL: postgresql+psycopg://user@host/db
    # Connections a server process opens at most (each worker and replica is one process: PostgreSQL's
    # max_connections must cover them all). Below 41, requests of the 40 request threads may wait for one.
    database_max_connections: int = Field(45, ge=2)
    # Where uploaded updates are kept, as files named by sha256, shared by every worker. Unset: beside
    # a SQLite database file (`<database>.blobs`); in the database itself for other databases.
    blob_dir: str | None = None
    # Released update files kept (up to this many bytes) for later uploads to be written over: on
    # disk, their pages stay cached; 0 unlinks every released file at once.
    blob_spare_bytes: int = Field(8 << 30, ge=0)
    admin_token: SecretStr | None = None  # bootstrap admin token (no database row); empty disables it

    @field_validator("admin_token")
    @classmethod
    def _a_real_secret(cls, token: SecretStr | None) -> SecretStr | None:
        """Refuse what is not a generated secret: short, a repeated pattern, or outside base64url (a comment?)."""
        if token is None or not token.get_secret_value():
            return token
        problem = admin_token_problem(token.get_secret_value())
        if problem is not None:
            raise ValueError(
                f"CARDIOFL_ADMIN_TOKEN (the bootstrap admin token) {problem}; make one with `{GENERATE_ADMIN_TOKEN}`"
            )
        return token

    migrate_on_start: bool = True  # run Alembic `upgrade head` when the app starts
    # An update may be as large as its round's terms declare (its tensors and a header's room:
    # coordinator.rounds.updates.upload_limit), whatever the model's size. Set, a cap on any body besides.
    max_upload_bytes: int | None = Field(None, ge=1024)
    max_model_file_bytes: int = Field(4 << 30, ge=1024)  # largest model file a researcher uploads (POST /models)
    upload_spool_dir: str | None = None  # where update bodies wait on disk while they arrive; None: the temp dir
    # An upload session (an update sent in chunks) that received no byte for this long is swept, as is one
    # whose round attempt is no longer open; the agent then starts over with a new one.
    upload_session_ttl_s: float = Field(6 * 3600.0, gt=0)
    upload_slots: int = Field(2, ge=1)  # updates checked and stored at once (each maps its body into memory)
    # Of a process's 40 request threads, those kept for every caller but sites (operators, researchers,
    # dashboards, health checks): their authentication and status reads never queue behind a wave of
    # sites' requests, such as the K polls that a round's opening wakes at once. Sites use the rest.
    operator_threads: int = Field(4, ge=1, le=32)
    download_cache_bytes: int = Field(256 << 20, ge=0)  # models kept in memory while sites download them
    max_num_examples: int = Field(100_000_000, ge=1)  # an n_k above this is refused as absurd
    # The most epsilon (at its own delta, over all its rounds) a study may spend: set, a study without
    # differential privacy or above it is refused at creation. Unset: each study's own budget only.
    max_epsilon: float | None = Field(None, gt=0)
    max_poll_wait_s: float = Field(30.0, ge=0)  # cap on GET /tasks/next?wait=
    # While a long-poll waits, how often the process reads the database's work version: work that another
    # process (worker, replica) gave reaches waiting polls within this; this process's own, at once.
    task_poll_interval_s: float = Field(1.0, gt=0)
    tick_interval_s: float = Field(2.0, ge=0)  # deadline ticker period; 0 turns the ticker off
    # An aggregating worker renews its lease every third of this; one that stops renewing (it died) is
    # taken over by another worker after it.
    aggregation_lease_s: float = Field(30.0, gt=0)
    # HTTPS (docs/hospital-it/tls.md): the folder of `cardiofl coordinator tls init`. Set, `serve` speaks HTTPS with
    # its server certificate and picks up renewed certificates and CRLs at the next handshake.
    tls_dir: str | None = None
    tls_mutual: bool = False  # also require a client certificate from tls_dir's CA, checked against its CRL
    public_url: str | None = None  # how sites reach the coordinator (https://host:port); written into site kits
    # The lines of the coordinator, uvicorn and Alembic (shared/logs.py): text as always, or json (one object a line).
    log_format: LogFormat = "text"
    log_level: LogLevel = "INFO"  # DEBUG, INFO, WARNING or ERROR

    @field_validator("log_format", mode="before")
    @classmethod
    def _a_log_format(cls, value: object) -> object:
        """Any case; another value is refused naming CARDIOFL_LOG_FORMAT and the allowed ones."""
        return check_log_format(value) if isinstance(value, str) else value

    @field_validator("log_level", mode="before")
    @classmethod
    def _a_log_level(cls, value: object) -> object:
        """Any case; another value is refused naming CARDIOFL_LOG_LEVEL and the allowed ones."""
        return check_log_level(value) if isinstance(value, str) else value


def blob_dir_for(settings: CoordinatorSettings) -> Path | None:
    """The blob store's directory: `blob_dir`, else `<database file>.blobs` for SQLite, else none (database)."""
    if settings.blob_dir:
        return Path(settings.blob_dir)
    url = make_url(settings.database_url)
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        database = Path(url.database)
        return database.with_name(database.name.removesuffix(".db") + ".blobs")
    return None
