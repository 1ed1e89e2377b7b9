import io
import json
import logging
import re
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta

import pytest

from shared.logs import (
    LOG_FORMATS,
    LOG_LEVELS,
    LogContextFilter,
    LogSettingError,
    check_log_format,
    check_log_level,
    log_context,
    log_formatter,
    setup_logging,
)

REQUIRED = ("time", "level", "logger", "message")


@contextmanager
def bare_root() -> Iterator[io.StringIO]:
    """A root logger without handlers, as in a fresh process (not pytest's), put back afterwards; a stream to log to."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()
    try:
        yield io.StringIO()
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.captureWarnings(False)


@contextmanager
def captured_json_lines(name: str) -> Iterator[io.StringIO]:
    """The JSON lines logger `name` writes at INFO inside the block, as a JSON service writes them."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(log_formatter("json"))
    handler.addFilter(LogContextFilter())
    logger = logging.getLogger(name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def json_lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_time_level_logger_and_message() -> None:
    with bare_root() as stream:
        # Prepare
        assert setup_logging("json", "INFO", stream=stream)
        # Execute
        logging.getLogger("cardiofl.test").info("round %d of %s", 3, "study 7")
    # Assert
    (line,) = json_lines(stream)
    assert list(line)[:4] == list(REQUIRED)
    assert (line["level"], line["logger"], line["message"]) == ("INFO", "cardiofl.test", "round 3 of study 7")
    stamp = datetime.fromisoformat(line["time"])  # ISO 8601, in UTC
    assert stamp.utcoffset() == timedelta(0) and abs(datetime.now(stamp.tzinfo) - stamp) < timedelta(minutes=1)


def test_study_round_and_site_appear_when_given() -> None:
    with bare_root() as stream:
        setup_logging("json", "INFO", stream=stream, fields={"site": "lyon"})
        log = logging.getLogger("cardiofl.test")
        log.info("no task")
        with log_context(study=7, round=2):
            log.info("training")
            with log_context(round=3):
                log.info("next round")
            log.info("given", extra={"round": 9, "site": "oslo"})  # extra= wins over the context and the fields
        log.info("after")
    lines = json_lines(stream)
    about = [{key: line.get(key) for key in ("study", "round", "site")} for line in lines]
    assert about == [
        {"study": None, "round": None, "site": "lyon"},
        {"study": 7, "round": 2, "site": "lyon"},
        {"study": 7, "round": 3, "site": "lyon"},
        {"study": 7, "round": 9, "site": "oslo"},
        {"study": None, "round": None, "site": "lyon"},
    ]
    assert all(set(REQUIRED) <= set(line) for line in lines)


def test_the_context_is_per_thread() -> None:
    with bare_root() as stream:
        setup_logging("json", "INFO", stream=stream)
        log = logging.getLogger("cardiofl.test")
        with log_context(study=1, round=1):
            other = threading.Thread(target=lambda: log.info("elsewhere"))
            other.start()
            other.join()
            log.info("here")
    elsewhere, here = json_lines(stream)
    assert "study" not in elsewhere and (here["study"], here["round"]) == (1, 1)


def test_an_exception_stays_on_its_one_line() -> None:
    with bare_root() as stream:
        setup_logging("json", "INFO", stream=stream)
        try:
            raise RuntimeError("disk full")
        except RuntimeError:
            logging.getLogger("cardiofl.test").exception("aggregation failed")
    (line,) = json_lines(stream)
    assert line["level"] == "ERROR" and "RuntimeError: disk full" in line["exc_info"]


@pytest.mark.parametrize(
    ("level", "shown"),
    [
        ("DEBUG", ["DEBUG", "INFO", "WARNING", "ERROR"]),
        ("info", ["INFO", "WARNING", "ERROR"]),
        ("WARNING", ["WARNING", "ERROR"]),
        ("Error", ["ERROR"]),
    ],
)
def test_the_level_filters_lines_below_it(level: str, shown: list[str]) -> None:
    with bare_root() as stream:
        setup_logging("json", level, stream=stream)
        log = logging.getLogger("cardiofl.test")
        for name in LOG_LEVELS:
            log.log(logging.getLevelName(name), "a %s line", name)
    assert [line["level"] for line in json_lines(stream)] == shown


def test_text_lines_look_as_they_always_did() -> None:
    with bare_root() as stream:
        setup_logging("text", "INFO", stream=stream, fields={"site": "lyon"})
        with log_context(study=7, round=2):
            logging.getLogger("site_agent.worker").info("study %s round %d: uploaded", 7, 2)
        logging.getLogger("site_agent.worker").debug("not shown")
    line = stream.getvalue()
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO site_agent\.worker: study 7 round 2: uploaded\n", line
    ), line


def test_warnings_become_json_lines() -> None:
    with bare_root() as stream:
        setup_logging("json", "INFO", stream=stream)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("an old option", UserWarning, stacklevel=1)
    (line,) = json_lines(stream)
    assert line["logger"] == "py.warnings" and "an old option" in line["message"]


def test_logging_set_up_already_is_left_alone() -> None:
    with bare_root() as stream:
        own = logging.StreamHandler(io.StringIO())
        logging.getLogger().addHandler(own)
        assert not setup_logging("json", "DEBUG", stream=stream)
        assert logging.getLogger().handlers == [own]
        logging.getLogger("cardiofl.test").warning("to the handler that was there")
    assert stream.getvalue() == ""


@pytest.mark.parametrize(
    ("log_format", "level", "message"),
    [
        ("xml", "INFO", "CARDIOFL_LOG_FORMAT must be one of text, json, not 'xml'"),
        ("json", "LOUD", "CARDIOFL_LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, not 'LOUD'"),
        ("json", "CRITICAL", "CARDIOFL_LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, not 'CRITICAL'"),
        ("", "INFO", "CARDIOFL_LOG_FORMAT must be one of text, json, not ''"),
    ],
)
def test_a_bad_format_or_level_is_refused_naming_the_allowed_values(log_format: str, level: str, message: str) -> None:
    with pytest.raises(LogSettingError) as refused:  # refused even where logging is set up already (pytest's)
        setup_logging(log_format, level, stream=io.StringIO())
    assert str(refused.value) == message and "\n" not in message


def test_the_checks_accept_any_case_and_name_the_setting_given() -> None:
    assert [check_log_format(f.upper()) for f in LOG_FORMATS] == list(LOG_FORMATS)
    assert [check_log_level(f" {level.lower()} ") for level in LOG_LEVELS] == list(LOG_LEVELS)
    with pytest.raises(ValueError, match=r"^setting 'log_level' must be one of DEBUG, INFO, WARNING, ERROR, not 'x'$"):
        check_log_level("x", "setting 'log_level'")
