"""`cardiofl plugins`: what is installed to extend cardiofl, where, and the identity a study would name."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console

from shared.plugins import installed_plugins
from shared.tables import Table

__all__ = ["plugins_app"]

plugins_app = typer.Typer(help="Plug-ins: rules installed distributions register (entry points).", no_args_is_help=True)


@plugins_app.command("list")
def list_plugins(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON array, an object per entry point.")] = False,
) -> None:
    """Every registered rule: its group and name, its distribution's version and files' hash, where it lies.

    A plug-in without an identity (its distribution has no RECORD, or an empty or unreadable one) is
    listed as refused, and why is printed below the table (`problem` in --json).
    """
    plugins = installed_plugins()
    if as_json:
        typer.echo(json.dumps([plugin.model_dump(mode="json") for plugin in plugins], indent=2))
        return
    table = Table("group", "name", "distribution", "version", "files sha256", "location", "")
    for plugin in plugins:
        identity = plugin.identity
        flags = ", ".join(
            flag
            for flag, on in (
                ("built-in", plugin.builtin),
                ("editable", plugin.editable),
                ("refused: no identity", plugin.problem is not None),
            )
            if on
        )
        table.add_row(
            plugin.group,
            plugin.name,
            plugin.distribution,
            plugin.version,
            identity.sha256[:16] if identity else "-",
            plugin.location,
            flags,
        )
    console = Console()
    console.print(table)
    for problem in dict.fromkeys(plugin.problem for plugin in plugins if plugin.problem is not None):
        console.print(f"refused: {problem}", style="red", markup=False, highlight=False, soft_wrap=True)
