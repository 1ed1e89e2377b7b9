"""The `cardiofl` command: assembles the commands each service exports; `cardiofl site` merges both sides'."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

import cardiofl.card_cli  # noqa: F401  (registers `cardiofl study card` on the study group)
import cardiofl.client.survey_cli  # noqa: F401  (registers `cardiofl study survey` on the study group)
import cardiofl.tracking_cli  # noqa: F401  (registers `cardiofl study track` on the study group)
import site_agent.cli.survey  # noqa: F401  (registers `cardiofl data survey` on the data group)
from cardiofl.client.cli import site_admin_app, study_app, token_app
from cardiofl.demo import demo_app
from cardiofl.experiment.cli import experiment_app
from cardiofl.help_text import LiteralHelpGroup
from cardiofl.model_export import export_global_model
from cardiofl.plugins_cli import plugins_app
from coordinator.cli.app import coordinator_app
from shared.release import release_version
from shared.tables import Table
from shared.terms.model_config import head_splits, preset
from shared.wire.protocol import PROTOCOL_VERSION
from site_agent.cli.app import site_app
from site_agent.cli.data import data_app


def merged_group(first: typer.Typer, *others: typer.Typer) -> typer.Typer:
    """One command group holding the commands of several, under the first one's help; names must not clash."""
    group = typer.Typer(help=first.info.help, no_args_is_help=True)
    names: set[str | None] = set()
    for part in (first, *others):
        for command in part.registered_commands:
            name = command.name or (command.callback.__name__.replace("_", "-") if command.callback else None)
            if name in names:
                raise ValueError(f"two commands named {name!r} in one group")
            names.add(name)
            group.registered_commands.append(command)
        group.registered_groups.extend(part.registered_groups)
    return group


app = typer.Typer(
    cls=LiteralHelpGroup, help="cardiofl: federated ECG classification across hospitals.", no_args_is_help=True
)


def _print_version(shown: bool) -> None:
    if shown:
        typer.echo(f"cardiofl {release_version()} (protocol {PROTOCOL_VERSION})")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the release and protocol."),
    ] = False,
) -> None:
    """cardiofl: federated ECG classification across hospitals."""


model_app = typer.Typer(help="Inspect the DualAttentionResNet1D model and export a study's.", no_args_is_help=True)
model_app.command("export")(export_global_model)
app.add_typer(model_app, name="model")
app.add_typer(coordinator_app, name="coordinator")
app.add_typer(data_app, name="data")
# The agent's commands (run, keygen, health) and the hub admin's (enroll, list, revoke) under one `site`.
app.add_typer(merged_group(site_app, site_admin_app), name="site")
app.add_typer(study_app, name="study")
app.add_typer(token_app, name="token")
app.add_typer(demo_app, name="demo")
app.add_typer(experiment_app, name="experiment")
app.add_typer(plugins_app, name="plugins")

console = Console()


@model_app.command("summary")
def model_summary(
    preset_name: Annotated[
        str, typer.Option("--preset", help="Model preset: paper, small, tiny or resnet1d34.")
    ] = "paper",
    heads: Annotated[
        str | None, typer.Option("--heads", help="Head split H_g:H_l, e.g. 6:2 (default: the preset's).")
    ] = None,
) -> None:
    """Print the architecture and the sizes of theta^g and phi_k for every head split."""
    from cardiofl.summary import module_rows, summarize  # torch: this command's, not `cardiofl --help`'s

    try:
        config = preset(preset_name, heads)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    console.print(
        f"[bold]DualAttentionResNet1D[/bold] preset={preset_name} heads={config.heads} "
        f"input=({config.n_leads}, {config.signal_len}) tokens={config.n_tokens} d={config.d_model} "
        f"head_dim={config.head_dim} blocks={config.n_blocks} classes={config.n_classes}"
    )
    parts = Table("module", "theta^g elements", "phi_k elements", title="Architecture")
    for group, shared, local in module_rows(config):
        parts.add_row(group, f"{shared:,}", f"{local:,}" if local else "")
    console.print(parts)

    ratios = Table(
        "H_g:H_l",
        "theta^g params",
        "theta^g buffers",
        "theta^g MB",
        "phi_k params",
        "phi_k MB",
        title=f"All head splits of the {preset_name} preset (MB = 10^6 bytes, fp32)",
    )
    for ratio in head_splits(config):
        s = summarize(config.with_heads(ratio))
        mark = " *" if ratio == config.heads else ""
        ratios.add_row(
            ratio + mark,
            f"{s.shared.parameters:,}",
            f"{s.shared.buffer_elements:,}",
            f"{s.shared.megabytes:.2f}",
            f"{s.local.parameters:,}",
            f"{s.local.megabytes:.2f}",
        )
    console.print(ratios)


def main() -> None:
    """Run the command line."""
    app()


if __name__ == "__main__":
    main()
