"""The CLI's tables at 80 columns, the width rich assumes when the output is piped: cells fold, never cut.

Names, digests and paths that people compare or copy must come out whole: no cell ends in '…', and each
name can be read back from its column, whichever lines it was folded over.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cardiofl.cli import app
from cardiofl.client import cli as client_cli
from cardiofl.client.http import CardioflClient
from shared.plugins import installed_plugins
from tests.coordinator.factories import ADMIN, enrol

runner = CliRunner()
SITES = ("university-hospital-of-lyon-cardiology", "oslo-universitetssykehus-rikshospitalet")
STUDY = "ptbxl-superdiagnostic-[pilot]-fedprox-heads-6-2-long-named-study"  # brackets: not rich markup


def at_80(args: list[str]) -> str:
    """The command's output at 80 columns, checked to fit them and to cut nothing."""
    shown = runner.invoke(app, args, env={"COLUMNS": "80"})
    assert shown.exit_code == 0, shown.output
    assert max(len(line) for line in shown.output.splitlines()) <= 80, shown.output
    assert "…" not in shown.output, shown.output
    return shown.output


def columns(output: str) -> list[str]:
    """Each column of each table body in the output, its folded pieces joined back: a name is read whole there."""
    joined: list[str] = []
    block: list[list[str]] = []
    for line in [*output.splitlines(), ""]:
        if line.startswith("│") and line.endswith("│"):
            block.append([cell.strip() for cell in line[1:-1].split("│")])
            continue
        if block:
            joined.extend("".join(row[i] for row in block if i < len(row)) for i in range(max(map(len, block))))
            block = []
    return joined


def shown_whole(output: str, *names: str) -> None:
    read = columns(output)
    for name in names:
        assert any(name in column for column in read), (name, output)


@pytest.fixture()
def client(coordinator: TestClient, monkeypatch: pytest.MonkeyPatch) -> CardioflClient:
    """A coordinator with two long-named sites and a long-named study; the CLI talks to it in-process."""
    for site in SITES:
        enrol(coordinator, site)
    config = {"model": {"preset": "tiny", "heads": "6:2"}, "sites": list(SITES), "rounds": 2}
    created = coordinator.post("/api/v1/studies", json={"name": STUDY, "config": config}, headers=ADMIN)
    assert created.status_code == 201, created.text
    coordinator.headers.update(ADMIN)
    client = CardioflClient(coordinator)

    @contextmanager
    def in_process(url: str, token: str | None) -> Iterator[CardioflClient]:
        yield client

    monkeypatch.setattr(client_cli, "connected", in_process)
    monkeypatch.setattr(client_cli.console, "_width", None)  # each invocation's COLUMNS decides
    return client


def test_plugins_list_folds_names_digests_and_paths() -> None:
    output = at_80(["plugins", "list"])
    plugins = installed_plugins()
    assert plugins
    for plugin in plugins:
        identity = plugin.identity.sha256[:16] if plugin.identity else "-"
        shown_whole(output, plugin.group, plugin.name, plugin.distribution, identity, plugin.location)


def test_study_list_folds_the_names_of_the_study_and_its_sites(client: CardioflClient) -> None:
    shown_whole(at_80(["study", "list"]), STUDY, *SITES)


def test_site_list_folds_the_site_names(client: CardioflClient) -> None:
    shown_whole(at_80(["site", "list"]), *SITES)


def test_token_list_folds_the_site_names(client: CardioflClient) -> None:
    shown_whole(at_80(["token", "list"]), *SITES)


def test_study_show_folds_the_names(client: CardioflClient) -> None:
    (study,) = client.studies()
    shown_whole(at_80(["study", "show", str(study.id)]), STUDY, *SITES)
