"""The client and the commands against the coordinator itself: site reports stored as accepted, read back by the API."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cardiofl import card_cli
from cardiofl.cli import app
from cardiofl.client import cli as client_cli
from cardiofl.client import survey_cli
from cardiofl.client.http import CardioflClient
from shared.wire.card import ModelCard
from tests.cardiofl.job_results import MIN_RECORDS, evaluation, released
from tests.coordinator.factories import ADMIN, create_study, enrol
from tests.coordinator.test_card_jobs import external_report, store_report, survey_report, trained

runner = CliRunner()


@pytest.fixture()
def client(coordinator: TestClient, monkeypatch: pytest.MonkeyPatch) -> CardioflClient:
    """The admin's client of the in-process coordinator, which the commands use."""
    coordinator.headers.update(ADMIN)
    researcher = CardioflClient(coordinator)

    @contextmanager
    def in_process(url: str, token: str | None) -> Iterator[CardioflClient]:
        yield researcher

    for module in (client_cli, survey_cli, card_cli):
        monkeypatch.setattr(module, "connected", in_process)
    monkeypatch.setattr(client_cli.console, "_width", None)
    return researcher


def test_a_surveys_reports_read_back_through_the_client_the_command_and_the_card(
    coordinator: TestClient, client: CardioflClient
) -> None:
    for site in ("lyon", "oslo", "riga"):
        enrol(coordinator, site)
    survey_id = create_study(coordinator, ["lyon", "oslo", "riga"], kind="survey", privacy={"min_records": MIN_RECORDS})
    for site in ("lyon", "oslo"):
        store_report(coordinator, survey_id, site, survey_report(site))
    results = client.survey(survey_id)
    assert [(s.site, s.survey) for s in results.sites] == [("lyon", released("lyon")), ("oslo", released("oslo"))]
    assert results.awaiting == ["riga"] and results.min_records == MIN_RECORDS and results.noise_sigma is None

    shown = runner.invoke(app, ["study", "survey", str(survey_id), "--group", "train"], env={"COLUMNS": "120"})
    assert shown.exit_code == 0, shown.output
    (records,) = [line for line in shown.output.splitlines() if line.startswith("│ records ")]
    assert [cell.strip() for cell in records.strip("│").split("│")] == ["records", "records", "120", "80", "200"]
    assert "awaiting: riga" in shown.output.splitlines()

    study_id = create_study(coordinator, ["lyon", "oslo"])
    card = runner.invoke(app, ["study", "card", str(study_id), "--format", "json", "--survey", str(survey_id)])
    assert card.exit_code == 0, card.output
    data = ModelCard.model_validate_json(card.output).data
    assert data is not None and data.chosen == "named" and data.study_id == survey_id
    assert [(row.key, row.pooled.text) for row in data.records] == [
        ("train", "200"),
        ("test", "70"),
        ("excluded", "≥12"),
    ]


def test_a_validation_sites_reports_read_back_through_show(coordinator: TestClient, client: CardioflClient) -> None:
    study_id = trained(coordinator)
    graz = evaluation(7, 70)
    store_report(coordinator, study_id, "graz", external_report(2, graz))
    external = client.external(study_id)
    assert external.validation_sites == ["graz", "riga"] and external.final_round == 2
    assert [(r.site, r.round, r.evaluation) for r in external.results] == [("graz", 2, graz)]
    shown = runner.invoke(app, ["study", "show", str(study_id)], env={"COLUMNS": "120"})
    assert shown.exit_code == 0, shown.output
    (row,) = [line for line in shown.output.splitlines() if line.startswith("│ 2 (final) ") and "graz" in line]
    assert f"{graz.macro_auroc:.3f} ({graz.macro_auroc_low:.3f}–{graz.macro_auroc_high:.3f})" in row
    (awaited,) = [line for line in shown.output.splitlines() if line.startswith("│ 2 (final) ") and "riga" in line]
    assert "awaiting" in awaited
