"""Every command's --help prints its square brackets as written (`cardiofl[mlflow]`), not as rich markup."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import typer
from typer.testing import CliRunner

from cardiofl.cli import app

BRACKETED = re.compile(r"[\w.'-]*\[[^\[\]]+\][\w.'-]*")


def _commands(command: object, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], object]]:
    """(arguments after `cardiofl`, click command) of every command and group, depth first."""
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _commands(sub, (*path, name))


def _squeeze(text: str) -> str:
    return " ".join(text.split())


def _bracketed(command: object) -> list[str]:
    """The bracketed words of a command's own help and of its parameters', as the source writes them."""
    texts = [getattr(holder, "help", None) for holder in (command, *getattr(command, "params", ()))]
    return sorted({_squeeze(found) for text in texts if text for found in BRACKETED.findall(text)})


CASES = [(path, words) for path, command in _commands(typer.main.get_command(app)) if (words := _bracketed(command))]


def test_the_extras_are_among_the_cases() -> None:
    cases = dict(CASES)
    assert {"cardiofl[mlflow]", "cardiofl[tensorboard]"} <= set(cases[("study", "track")]), CASES
    assert "[evaluation]" in cases[("study", "create")], CASES


@pytest.mark.parametrize(("path", "words"), CASES, ids=[" ".join(path) for path, _ in CASES])
def test_help_keeps_square_brackets(path: tuple[str, ...], words: list[str]) -> None:
    shown = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "400"})
    assert shown.exit_code == 0, shown.output
    text = _squeeze(shown.output.replace("│", " "))
    for word in words:
        assert word in text, (word, text)


def test_track_help_names_the_extras_piped_at_80_columns() -> None:
    shown = CliRunner().invoke(app, ["study", "track", "--help"], env={"COLUMNS": "80"})
    assert shown.exit_code == 0, shown.output
    text = "".join(shown.output.replace("│", " ").split())  # wrapped at 80: the words may break across lines
    assert "cardiofl[mlflow]" in text and "cardiofl[tensorboard]" in text
