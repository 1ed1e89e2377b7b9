"""`cardiofl data synth|inspect`: make synthetic sites, check what a site's archive will load (`survey`: survey.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from site_agent.data.sources import Source

data_app = typer.Typer(help="Generate synthetic ECG sites and inspect ECG archives.", no_args_is_help=True)

# How a command names its sources on the command line (inspect, survey): paths, and how to read them.
KindOption = Annotated[str, typer.Option(help="auto, or a kind: challenge, ptbxl, manifest, sph, a plug-in's.")]
ResolutionOption = Annotated[str, typer.Option(help="PTB-XL records: hr (500 Hz) or lr (100 Hz).")]
LabelColumnOption = Annotated[
    list[str] | None, typer.Option(help="Manifest column(s) holding the labels (default: labels), e.g. dx.")
]


@data_app.command("synth")
def synth(
    out: Annotated[Path, typer.Option("--out", help="Folder that receives site_00, site_01, ...")],
    sites: Annotated[int, typer.Option("--sites", min=1, help="Number of sites K.")] = 4,
    records: Annotated[int, typer.Option("--records", min=1, help="Records per site.")] = 200,
    seed: Annotated[int, typer.Option("--seed", help="The same seed writes the same files.")] = 0,
    heterogeneity: Annotated[float, typer.Option(min=0.0, help="0: identical sites; 1: strongly non-IID.")] = 1.0,
    corrupt_fraction: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Fraction of records per site written broken.")
    ] = 0.0,
) -> None:
    """Write K synthetic sites in the PhysioNet Challenge layout (.hea/.mat with SNOMED-CT #Dx)."""
    from site_agent.data.synthetic import generate_sites

    folders = generate_sites(out, sites, records, seed, heterogeneity=heterogeneity, corrupt_fraction=corrupt_fraction)
    for folder in folders:
        typer.echo(str(folder))


def source_for(path: Path, kind: str, resolution: str, label_column: list[str] | None) -> Source:
    """The source config for a path given on the command line; `auto` guesses the layout from what is there."""
    from site_agent.data.config import SOURCES, parse_source

    if kind == "auto":
        if path.is_file():
            kind = "manifest"
        elif (path / "ptbxl_database.csv").exists() or (path / "records500").is_dir():
            kind = "ptbxl"
        else:
            kind = "challenge"
    if kind not in SOURCES:  # the four built-in layouts and any plug-in's
        known = ", ".join(["auto", *sorted(SOURCES)])
        raise typer.BadParameter(f"unknown source kind {kind!r}; choose one of {known}", param_hint="--kind")
    if resolution not in ("hr", "lr"):
        raise typer.BadParameter("resolution must be hr or lr", param_hint="--resolution")
    values: dict[str, object] = {"kind": kind, "path": path}
    if kind == "manifest":
        values["label_column"] = tuple(label_column or ["labels"])
    if kind == "ptbxl":
        values["resolution"] = resolution
    return parse_source(values)


@data_app.command("inspect")
def inspect(
    sources: Annotated[list[Path], typer.Argument(help="Source folders (or manifest CSV files).", exists=True)],
    kind: KindOption = "auto",
    resolution: ResolutionOption = "hr",
    label_column: LabelColumnOption = None,
    cache_dir: Annotated[Path | None, typer.Option(help="Also build (or open) the cache here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Load every record through the real pipeline and print loaded / skipped-by-reason / label counts."""
    from site_agent.data.config import PreprocessConfig
    from site_agent.data.loader import open_site_data
    from site_agent.data.report import LoadReport
    from site_agent.data.scan import inspect_source

    configs = [source_for(path, kind, resolution, label_column) for path in sources]
    try:
        if cache_dir is not None:
            site = open_site_data(configs, cache_dir)
            report = site.report
            typer.echo(f"cache: {site.cache_path} (train {len(site.train)}, test {len(site.test)})", err=True)
        else:
            report = LoadReport([inspect_source(config, PreprocessConfig()) for config in configs])
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(report.to_dict(), indent=2) if as_json else str(report))
