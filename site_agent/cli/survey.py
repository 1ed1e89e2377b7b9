"""`cardiofl data survey`: a site's data-readiness survey, exact (it stays here) and as it would leave the site.

The sources are named as for `cardiofl data inspect` (paths, `--kind` ...), or taken from the agent's
config file (`--config`: its `[[data]]`), or both. The exact survey is site_agent/data/survey.py's;
the released one is shared/wire/survey_release.py's `release` with these settings, the very function
a survey goes through before it leaves; its epsilon is shared/study/survey.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from shared.evaluation.survey import HIDDEN
from shared.terms.study_terms import DifferentialPrivacy, PrivacyConfig
from shared.wire.survey import GROUPS, TABLES, SiteSurvey
from site_agent.cli.app import ConfigOption
from site_agent.cli.data import KindOption, LabelColumnOption, ResolutionOption, data_app, source_for

if TYPE_CHECKING:
    from site_agent.data.config import DataSourceConfig

MIN_RECORDS = int(PrivacyConfig.model_fields["min_records"].default)  # a study's default, 20
DELTA = float(DifferentialPrivacy.model_fields["delta"].default)  # a study's default, 1e-5


def survey_table(survey: SiteSurvey) -> str:
    """The survey as plain text: a row per table key, a column per group; HIDDEN where a count is suppressed."""
    cells = survey.cells()
    rows = [["table", "key", *GROUPS]]
    keys = [("records", "records")] + [(table.name, key) for table in TABLES for key in table.keys]
    for table, key in keys:
        counts = [cells.get((group, table, key), "") for group in GROUPS]
        rows.append([table, key, *(HIDDEN if count is None else str(count) for count in counts)])
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = [
        "  ".join(
            [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
            + [cell.rjust(width) for cell, width in zip(row[2:], widths[2:], strict=True)]
        ).rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def _sources(
    paths: list[Path], config: Path | None, kind: str, resolution: str, labels: list[str] | None
) -> list[DataSourceConfig]:
    """The sources to survey: the config file's `[[data]]`, then those named on the command line."""
    sources: list[DataSourceConfig] = []
    if config is not None:
        from site_agent.config import load_settings
        from site_agent.errors import ConfigError

        try:
            sources.extend(load_settings(config).data)
        except ConfigError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
    sources.extend(source_for(path, kind, resolution, labels) for path in paths)
    if not sources:
        raise typer.BadParameter("name source folders (or manifest files), or a site config file with --config")
    return sources


def _noise_lines(sigma: float, delta: float, sources: list[DataSourceConfig]) -> list[str]:
    """What the noise adds and the epsilon it spends; a note where a source's split makes that epsilon not hold."""
    from shared.study.survey import SURVEY_RELATION, survey_epsilon
    from shared.wire.survey import all_cells

    epsilon = survey_epsilon(sigma, delta)
    lines = [
        f"noise: discrete Gaussian, sigma {sigma:g}, on each of its {len(all_cells())} counts before suppression",
        f"epsilon {epsilon:.6g} at delta {delta:g} (one release; {SURVEY_RELATION})",
    ]
    if any(getattr(source, "fedcvd_split", None) is not None for source in sources):
        lines.append(
            "note: a source split by fedcvd_split numbers its records in reading order; this epsilon does not cover it"
        )
    return lines


@data_app.command("survey")
def survey(
    sources: Annotated[
        list[Path] | None, typer.Argument(help="Source folders (or manifest CSV files).", exists=True)
    ] = None,
    config: ConfigOption = None,
    kind: KindOption = "auto",
    resolution: ResolutionOption = "hr",
    label_column: LabelColumnOption = None,
    min_records: Annotated[
        int, typer.Option(min=1, help="Hide every count below this (as a study's privacy.min_records).")
    ] = MIN_RECORDS,
    noise_sigma: Annotated[
        float | None, typer.Option(help="Discrete Gaussian noise of this sigma (> 0) on each count first.")
    ] = None,
    delta: Annotated[float, typer.Option(help="The delta of the epsilon shown (0 < delta < 1).")] = DELTA,
    as_json: Annotated[bool, typer.Option("--json", help="Print the released survey as JSON (SiteSurvey).")] = False,
    exact: Annotated[
        bool, typer.Option("--exact", help="With --json: print the exact survey, which stays here.")
    ] = False,
) -> None:
    """Survey this site's records: the exact counts (they stay here) and the survey as it would leave the site."""
    from shared.wire.survey_release import release
    from site_agent.data.survey import survey_site

    if noise_sigma is not None and not noise_sigma > 0:
        raise typer.BadParameter("the noise's sigma is positive", param_hint="--noise-sigma")
    if not 0 < delta < 1:
        raise typer.BadParameter("delta lies between 0 and 1", param_hint="--delta")
    configs = _sources(sources or [], config, kind, resolution, label_column)
    try:
        counted = survey_site(configs)
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    released = release(counted, min_records=min_records, noise_sigma=noise_sigma)
    noise = _noise_lines(noise_sigma, delta, configs) if noise_sigma is not None else []
    if as_json:
        if exact:
            typer.echo("the EXACT survey: it stays at this site; what would leave it is the released one", err=True)
        for line in noise if not exact else []:
            typer.echo(line, err=True)
        typer.echo((counted if exact else released).model_dump_json(indent=2))
        return
    typer.echo(f"EXACT survey of {len(configs)} source(s): it stays at this site, never sent\n")
    typer.echo(survey_table(counted))
    settings = f"min_records {min_records}, " + (f"noise sigma {noise_sigma:g}" if noise_sigma else "no noise")
    typer.echo(f"\nRELEASED survey ({settings}): exactly what would leave this site\n")
    typer.echo(survey_table(released))
    legend = f"{HIDDEN} suppressed: fewer than {min_records} records, or hidden so that no such count can be worked out"
    typer.echo("\n" + "\n".join([legend, *noise]))
