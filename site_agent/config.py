"""The agent's settings: a TOML file, overridden by CARDIOFL_SITE_* environment variables; checked at start."""

from __future__ import annotations

import itertools
import logging
import os
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import AnyHttpUrl, Field, PrivateAttr, SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from shared.logs import LogSettingError, check_log_format, check_log_level, setup_logging
from shared.terms import SiteName
from shared.terms.field_names import did_you_mean
from site_agent.data import SourceError
from site_agent.data.config import DataSourceConfig
from site_agent.device import Runtime, resolve_runtime
from site_agent.errors import ConfigError
from site_agent.store import SiteStore, StoreError, load_key
from site_agent.store_files import StaleStore
from site_agent.tls import AgentTls

if TYPE_CHECKING:
    from site_agent.data import SiteData

__all__ = [
    "AgentSettings",
    "approvals_version_file",
    "check_settings",
    "check_tls",
    "configure_logging",
    "health_limit",
    "load_settings",
    "open_data",
    "open_store",
    "read_token",
    "runtime_of",
    "store_key",
]

ENV_PREFIX = "CARDIOFL_SITE_"
# Variables the coordinator reads too, for the agent's fields of the same meaning (below CARDIOFL_SITE_*).
SHARED_VARIABLES = {"log_format": "CARDIOFL_LOG_FORMAT", "log_level": "CARDIOFL_LOG_LEVEL"}

log = logging.getLogger(__name__)


class AgentSettings(BaseSettings):
    """Everything a site agent needs; every field can come from the config file or the environment."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", env_nested_delimiter="__", env_ignore_empty=True
    )

    _config_file: Path | None = PrivateAttr(default=None)  # the file they were read from, for hints to paste
    name: SiteName  # this site's name, as enrolled at the coordinator
    coordinator_url: AnyHttpUrl  # e.g. https://coordinator.example.org
    token: SecretStr | None = None  # the site token (or token_file)
    token_file: Path | None = None  # a file holding the site token
    ca_bundle: Path | None = None  # CA certificates that sign the coordinator's TLS certificate
    verify_tls: bool = True  # never turn off outside a laboratory
    client_cert: Path | None = None  # optional mutual TLS: this site's certificate (PEM)
    client_key: Path | None = None  # ... and its private key (PEM)
    data: list[DataSourceConfig] = Field(min_length=1)  # the site's ECG sources
    cache_dir: Path = Path("cardiofl-site/cache")  # preprocessed, memory-mapped arrays
    store_dir: Path = Path("cardiofl-site/store")  # the encrypted store of phi_k and pending uploads
    store_key: SecretStr | None = None  # base64 AES-256 key (or store_key_file)
    store_key_file: Path | None = None  # a key file made by `cardiofl site keygen`, mode 600
    keep_rounds: int = Field(3, ge=1)  # committed phi_k rounds kept in the store
    # The version of the store's approvals, kept outside the store so that an older copy of it, restored, is
    # refused at start (it may hold approvals revoked since). Unset: beside the key file
    # (`<store_key_file>.approvals-version`), or with the key in `store_key` beside the store
    # (`<store_dir>.approvals-version`). Its folder must be writable; keep it with the key, not with the store.
    approvals_version_file: Path | None = None
    # Approve every study offered to this site without asking its operator: demos and tests ONLY. A
    # hospital approves each study with `cardiofl site approve` after reading `cardiofl site studies`.
    auto_approve: bool = False
    device: str = "auto"  # auto (CUDA when present), cpu, cuda, cuda:N
    mixed_precision: bool = True  # bf16 autocast on GPUs that support it
    # > 1 trains this many times slower than the machine can (a pause after each local round's training): to try
    # a slow site, e.g. in a buffered study's demonstration; 1 in production
    slowdown: float = Field(1.0, ge=1.0, le=1000.0)
    poll_wait_s: float = Field(30.0, gt=0, le=300)  # long-poll duration the coordinator may hold a request
    poll_interval_s: float = Field(5.0, gt=0)  # pause between polls that found nothing, and the first backoff
    max_backoff_s: float = Field(300.0, gt=0)  # longest wait while the coordinator is unreachable
    heartbeat_file: Path | None = None  # touched after every poll; `cardiofl site health` reads it
    progress_bar: bool | None = None  # None: a bar on a terminal, log lines otherwise
    # Checked when the agent starts logging (configure_logging), so that a wrong one is told in one line.
    log_level: str = "INFO"  # DEBUG, INFO, WARNING or ERROR (or CARDIOFL_LOG_LEVEL, as the coordinator's)
    log_format: str = "text"  # text, or json: one JSON object a line (or CARDIOFL_LOG_FORMAT)

    @property
    def tls(self) -> AgentTls:
        """The TLS settings, as the agent's connections use them."""
        return AgentTls(self.ca_bundle, self.client_cert, self.client_key, verify=self.verify_tls)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Explicit values, then the environment (CARDIOFL_SITE_* before SHARED_VARIABLES), then the TOML file."""
        return init_settings, env_settings, _SharedVariables(settings_cls), TomlConfigSettingsSource(settings_cls)


class _SharedVariables(PydanticBaseSettingsSource):
    """The SHARED_VARIABLES that are set and not empty, as the fields they stand for."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        """The variable's value for `field_name` (None when it is unset, empty, or no shared variable)."""
        variable = SHARED_VARIABLES.get(field_name)
        return (os.environ.get(variable) or None) if variable else None, field_name, False

    def __call__(self) -> dict[str, Any]:
        values = {name: os.environ.get(variable) for name, variable in SHARED_VARIABLES.items()}
        return {name: value for name, value in values.items() if value}


def _describe(loc: tuple[Any, ...]) -> str:
    """A setting by its field, its variable (a list's items come as one JSON value) and its config key."""
    field = ".".join(str(part) for part in loc)
    env = ENV_PREFIX + "__".join(itertools.takewhile(lambda part: isinstance(part, str), loc)).upper()
    return f"setting '{field}' ({env} or `{loc[0]}` in the config file)"


def load_settings(config_file: Path | None = None, **overrides: Any) -> AgentSettings:
    """Read the settings; a missing or invalid one raises ConfigError naming it."""
    if config_file is not None and not config_file.is_file():
        raise ConfigError(f"config file {config_file} does not exist")

    class FileSettings(AgentSettings):
        model_config = SettingsConfigDict(toml_file=config_file)

    try:
        settings = FileSettings(**overrides)
    except ValidationError as exc:
        lines = [
            f"{_describe(tuple(err['loc']))}: {err['msg']}"
            + (did_you_mean(AgentSettings, err["loc"]) if err["type"] == "extra_forbidden" else "")
            for err in exc.errors(include_url=False)
        ]
        raise ConfigError("invalid site agent settings:\n  " + "\n  ".join(lines)) from None
    settings._config_file = config_file
    return settings


def health_limit(settings: AgentSettings) -> float:
    """How old the heartbeat may be before `cardiofl site health` calls the agent stuck: 3 polls, at least 30 s.

    The loop (site_agent/loop.py) touches it after every poll (at most poll_wait_s), and every poll_interval_s
    while a task trains or the agent backs off.
    """
    return max(30.0, 3 * (settings.poll_wait_s + settings.poll_interval_s))


def configure_logging(settings: AgentSettings) -> None:
    """Log as the settings say (shared/logs.py), every line carrying the site's name in JSON.

    A wrong format or level raises ConfigError, one line naming its variables and the allowed values.
    httpx logs every poll at INFO: only DEBUG shows it.
    """
    variables = {
        name: f"setting '{name}' ({variable}, {ENV_PREFIX}{name.upper()} or `{name}` in the config file)"
        for name, variable in SHARED_VARIABLES.items()
    }
    try:
        log_format = check_log_format(settings.log_format, variables["log_format"])
        level = check_log_level(settings.log_level, variables["log_level"])
    except LogSettingError as exc:
        raise ConfigError(str(exc)) from None
    setup_logging(log_format, level, fields={"site": settings.name})
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)


def read_token(settings: AgentSettings) -> str:
    """The site token from `token` or `token_file`."""
    if settings.token is not None:
        return settings.token.get_secret_value().strip()
    if settings.token_file is None:
        raise ConfigError("setting 'token' is missing: set CARDIOFL_SITE_TOKEN or CARDIOFL_SITE_TOKEN_FILE")
    try:
        token = settings.token_file.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"setting 'token_file': cannot read {settings.token_file}: {exc.strerror}") from None
    if not token:
        raise ConfigError(f"setting 'token_file': {settings.token_file} is empty")
    return token


def _writable_dir(path: Path, setting: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"setting '{setting}': cannot create {path}: {exc.strerror}") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(f"setting '{setting}': {path} is not writable")


def check_tls(settings: AgentSettings) -> None:
    """The TLS files exist, go together and can be used (AgentTls.check); ConfigError names the setting."""
    for setting in ("ca_bundle", "client_cert", "client_key"):
        path = getattr(settings, setting)
        if path is not None and not path.is_file():
            raise ConfigError(f"setting '{setting}': {path} does not exist")
    if (settings.client_cert is None) != (settings.client_key is None):
        raise ConfigError("settings 'client_cert' and 'client_key' go together for mutual TLS")
    settings.tls.check(settings.name)


def runtime_of(settings: AgentSettings) -> Runtime:
    """The device the agent trains on; ConfigError names setting 'device' when it cannot be used."""
    try:
        return resolve_runtime(settings.device, mixed_precision=settings.mixed_precision, slowdown=settings.slowdown)
    except ValueError as exc:
        raise ConfigError(f"setting 'device': {exc}") from None


def store_key(settings: AgentSettings) -> bytes:
    """The store key from `store_key` or `store_key_file` (mode 600); ConfigError names the setting."""
    try:
        return load_key(
            env_value=settings.store_key.get_secret_value() if settings.store_key is not None else None,
            key_file=settings.store_key_file,
        )
    except StoreError as exc:
        raise ConfigError(f"setting 'store_key' / 'store_key_file': {exc}") from None


def approvals_version_file(settings: AgentSettings) -> Path:
    """Where the store's approvals' version is recorded: the setting, else beside the key file, else the store."""
    if settings.approvals_version_file is not None:
        return settings.approvals_version_file
    from_environment = settings.store_key is not None and settings.store_key.get_secret_value()
    if settings.store_key_file is not None and not from_environment:  # the key file is the key load_key reads
        return settings.store_key_file.with_name(settings.store_key_file.name + ".approvals-version")
    store = settings.store_dir.resolve()
    return store.with_name(store.name + ".approvals-version")


def check_settings(settings: AgentSettings) -> bytes:
    """Fail fast on anything that would stop the agent later; returns the store key."""
    read_token(settings)
    check_tls(settings)
    _writable_dir(settings.cache_dir, "cache_dir")
    runtime_of(settings)
    key = store_key(settings)
    _writable_dir(settings.store_dir.parent if not settings.store_dir.exists() else settings.store_dir, "store_dir")
    _writable_dir(approvals_version_file(settings).parent, "approvals_version_file")
    return key


def open_store(settings: AgentSettings, key: bytes) -> SiteStore:
    """The site's store, opened with `key` and checked against its approvals' version (StaleStore: an older copy)."""
    try:
        return SiteStore(
            settings.store_dir,
            key,
            settings.name,
            keep=settings.keep_rounds,
            version_file=approvals_version_file(settings),
        )
    except StaleStore as exc:  # its way out, as a command this very configuration runs
        raise StaleStore(f"{exc} (`{site_command(settings, 'studies')}` lists them)") from None


def site_command(settings: AgentSettings, args: str) -> str:
    """`cardiofl site ARGS` as a person pastes it to act on these settings: with their config file, if any."""
    config = settings._config_file
    return f"cardiofl site {args}" + (f" --config {shlex.quote(str(config))}" if config is not None else "")


def open_data(settings: AgentSettings) -> SiteData:
    """Open every data source and build (or reuse) the cache training maps; log what loaded, per source.

    A source that cannot be read as configured, or that yields no usable record, raises ConfigError
    naming its setting (`data.<index>.<field>`).
    """
    from site_agent.data import open_site_data, require_records

    start = time.monotonic()
    log.info(
        "opening %d data source(s); the cache in %s is built if they changed", len(settings.data), settings.cache_dir
    )
    try:
        site = open_site_data(settings.data, settings.cache_dir)
        require_records(settings.data, site.report)
    except SourceError as exc:
        index = next(i for i, source in enumerate(settings.data) if source is exc.source)
        where = f"{_describe(('data', index, exc.setting))}, source {exc.source.display_name!r}"
        raise ConfigError(f"{where}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"setting 'cache_dir': cannot write the cache in {settings.cache_dir}: {exc}") from None
    _log_data_summary(site, time.monotonic() - start)
    return site


def _log_data_summary(site: SiteData, seconds: float) -> None:
    """One log line per summary line of each source, prefixed with its setting, then the totals."""
    for index, source in enumerate(site.report.sources):
        for line in source.summary_lines():
            log.info("data.%d %s", index, line.strip())
    log.info(
        "data ready in %.1fs: %d train and %d test records, cache %s",
        seconds,
        len(site.train),
        len(site.test),
        site.cache_path,
    )
