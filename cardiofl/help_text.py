"""Help printed as written: square brackets (`cardiofl[mlflow]`, `[evaluation]`) survive typer's rich markup."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from typer.core import TyperGroup

__all__ = ["LiteralHelpGroup", "escape_help"]

_TEXTS = ("help", "short_help", "epilog")


def escape_help(command: object) -> None:
    """Escape the rich markup in the help of a click `command`, of its parameters and of every command below it."""
    for holder in (command, *getattr(command, "params", ())):
        for name in _TEXTS:
            text = getattr(holder, name, None)
            if isinstance(text, str):
                setattr(holder, name, escape(text))
    for sub in getattr(command, "commands", {}).values():  # a group's (typer's click, vendored or not)
        escape_help(sub)


class LiteralHelpGroup(TyperGroup):
    """The root command group: as it runs, the help texts of its tree are escaped once, so rich prints them verbatim.

    The source keeps its help plain (the CLI reference reads it from the same commands); only what typer
    renders with rich markup sees the escapes.
    """

    _escaped = False

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """Run the command line, the help texts escaped first."""
        if not self._escaped:
            escape_help(self)
            self._escaped = True
        return super().main(*args, **kwargs)
