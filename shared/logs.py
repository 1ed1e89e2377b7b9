"""Both services' log lines: text as always, or one JSON object per line (CARDIOFL_LOG_FORMAT, CARDIOFL_LOG_LEVEL)."""

from __future__ import annotations

import contextvars
import logging
import logging.config
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import IO, Any, Literal, cast

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

from shared.errors import SharedError

__all__ = [
    "LOG_FORMATS",
    "LOG_LEVELS",
    "TEXT_FORMAT",
    "LogContextFilter",
    "LogFormat",
    "LogLevel",
    "LogSettingError",
    "check_log_format",
    "check_log_level",
    "log_context",
    "log_formatter",
    "logging_config",
    "setup_logging",
]

LogFormat = Literal["text", "json"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
LOG_LEVELS: tuple[LogLevel, ...] = ("DEBUG", "INFO", "WARNING", "ERROR")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the text lines, as they always were

# Record attributes that never become JSON keys: the standard ones, and uvicorn's coloured copy of its message.
_HIDDEN = [*RESERVED_ATTRS, "color_message"]
_context: contextvars.ContextVar[Mapping[str, object]] = contextvars.ContextVar(
    "cardiofl_log_context", default=MappingProxyType({})
)


class LogSettingError(SharedError):
    """A log format or level that is not one of the allowed values."""


def check_log_format(value: str, setting: str = "CARDIOFL_LOG_FORMAT") -> LogFormat:
    """`value` as a log format (any case); LogSettingError names `setting` and the allowed values."""
    if value.strip().lower() not in LOG_FORMATS:
        raise LogSettingError(f"{setting} must be one of {', '.join(LOG_FORMATS)}, not {value!r}")
    return cast(LogFormat, value.strip().lower())


def check_log_level(value: str, setting: str = "CARDIOFL_LOG_LEVEL") -> LogLevel:
    """`value` as a log level (any case); LogSettingError names `setting` and the allowed values."""
    if value.strip().upper() not in LOG_LEVELS:
        raise LogSettingError(f"{setting} must be one of {', '.join(LOG_LEVELS)}, not {value!r}")
    return cast(LogLevel, value.strip().upper())


@contextmanager
def log_context(**fields: object) -> Iterator[None]:
    """Every line logged inside the block (this thread or task) carries `fields` (study, round, site) in JSON."""
    token = _context.set({**_context.get(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


class LogContextFilter(logging.Filter):
    """Adds the fields of `log_context` (then `fields`, fixed for the process) to a record that lacks them.

    A field given with `extra=` wins. Text lines do not show the fields; JSON lines carry them as keys.
    """

    def __init__(self, fields: Mapping[str, object] | None = None) -> None:
        super().__init__()
        self.fields = dict(fields or {})

    def filter(self, record: logging.LogRecord) -> bool:
        """Always keep the record; add what it lacks."""
        for key, value in {**self.fields, **_context.get()}.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class _JsonLines(JsonFormatter):
    """python-json-logger's formatter with `time` first: time, level, logger, message, then the fields."""

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        return {"time": log_data.pop("time"), **log_data}


def log_formatter(log_format: LogFormat) -> logging.Formatter:
    """The lines of `log_format`: TEXT_FORMAT, or a JSON object of time, level, logger, message and the fields."""
    if log_format == "text":
        return logging.Formatter(TEXT_FORMAT)
    return _JsonLines(
        "%(levelname)s %(name)s %(message)s",
        rename_fields={"levelname": "level", "name": "logger"},
        timestamp="time",  # ISO 8601 in UTC, with microseconds
        reserved_attrs=_HIDDEN,
    )


def logging_config(
    log_format: LogFormat,
    level: LogLevel,
    *,
    stream: IO[str] | None = None,
    fields: Mapping[str, object] | None = None,
) -> dict[str, Any]:
    """The `logging.config.dictConfig` of a process: one handler on the root logger, to stderr by default.

    Its formatter is named "cardiofl" and its handler "cardiofl", so a caller (uvicorn's log config)
    can point more loggers at them. `fields` are carried by every JSON line of the process.
    """
    return {
        "version": 1,
        "disable_existing_loggers": False,  # loggers made at import (alembic's, uvicorn's, ours) keep logging
        "formatters": {"cardiofl": {"()": f"{__name__}.log_formatter", "log_format": log_format}},
        "filters": {"context": {"()": f"{__name__}.LogContextFilter", "fields": dict(fields or {})}},
        "handlers": {
            "cardiofl": {
                "class": "logging.StreamHandler",
                "formatter": "cardiofl",
                "filters": ["context"],
                "stream": stream if stream is not None else "ext://sys.stderr",
            }
        },
        "root": {"level": level, "handlers": ["cardiofl"]},
    }


def setup_logging(
    log_format: str,
    level: str,
    *,
    stream: IO[str] | None = None,
    fields: Mapping[str, object] | None = None,
) -> bool:
    """Log every line of this process in `log_format` at `level` and above; False when logging was set up already.

    Like `logging.basicConfig`, it changes nothing when the root logger has a handler (a host
    process or a test runner configured logging), but a bad format or level is refused first
    (LogSettingError). In JSON, Python's warnings become log lines too.
    """
    chosen_format, chosen_level = check_log_format(log_format), check_log_level(level)
    if logging.getLogger().handlers:
        return False
    logging.config.dictConfig(logging_config(chosen_format, chosen_level, stream=stream, fields=fields))
    logging.captureWarnings(chosen_format == "json")
    return True
