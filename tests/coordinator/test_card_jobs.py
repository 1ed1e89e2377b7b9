"""The model card's External validation and Data sections, from stored site reports, in JSON, Markdown and HTML."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from coordinator.models import Site, SiteReport
from shared.wire.card import ModelCard
from shared.wire.jobs import JobKind, JobReport
from shared.wire.protocol import EvalSummary
from tests.cardiofl.job_results import MIN_RECORDS, evaluation, released
from tests.coordinator.factories import ADMIN, approve, create_study, enrol, evaluate_and_upload, train_and_upload

CARD = "/api/v1/studies/{}/card"


def store_report(client: TestClient, study_id: int, site: str, report: JobReport) -> None:
    """A site's report as the coordinator stores it once accepted: its validated body, by kind and round."""
    app: Any = client.app  # the coordinator's FastAPI app, whose state holds its sessions
    with app.state.coordinator.sessions.begin() as session:
        site_id = session.scalar(select(Site.id).where(Site.name == site))
        body = report.model_dump(mode="json")
        session.add(
            SiteReport(study_id=study_id, site_id=site_id, kind=report.kind.value, round_number=report.round, body=body)
        )


def survey_report(site: str) -> JobReport:
    return JobReport(kind=JobKind.SURVEY, survey=released(site))


def external_report(t: int, summary: EvalSummary) -> JobReport:
    return JobReport(kind=JobKind.EXTERNAL, round=t, evaluation=summary)


def trained(client: TestClient) -> int:
    """A completed 2-round study of lyon and oslo, validated at graz and riga (each enrolled and approving)."""
    headers = {site: enrol(client, site) for site in ("lyon", "oslo", "graz", "riga")}
    study_id = create_study(
        client, ["lyon", "oslo"], validation_sites=["graz", "riga"], privacy={"min_records": MIN_RECORDS}
    )
    for site_headers in headers.values():
        approve(client, site_headers, study_id)
    assert client.post(f"/api/v1/studies/{study_id}/start", headers=ADMIN).status_code == 200
    for _ in (1, 2):
        for site in ("lyon", "oslo"):
            assert train_and_upload(client, headers[site], 0.01, 30).status_code == 201
    for site in ("lyon", "oslo"):
        assert evaluate_and_upload(client, headers[site]).status_code == 201
    assert client.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()["status"] == "completed"
    return study_id


def _get(client: TestClient, study_id: int, **params: Any) -> Any:
    response = client.get(CARD.format(study_id), params=params, headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json() if params.get("format", "json") == "json" else response.text


def interval(summary: EvalSummary, key: str) -> str:
    """A site's figure as the card writes it: three decimals and its 95% bootstrap interval."""
    value, low, high = (getattr(summary, f"{key}{end}") for end in ("", "_low", "_high"))
    return f"{value:.3f} (95% CI {low:.3f}–{high:.3f})"


def test_the_card_shows_the_final_model_at_the_validation_sites_apart(client: TestClient) -> None:
    study_id = trained(client)
    empty = ModelCard.model_validate(_get(client, study_id))
    assert empty.external is not None and empty.external.round is None and not empty.external.final
    assert [(s.site, s.eval) for s in empty.external.sites] == [("graz", None), ("riga", None)]
    assert "No validation site has reported an evaluation yet." in _get(client, study_id, format="md")

    early, graz, riga = evaluation(1, 50), evaluation(2, 70), evaluation(3, 90)
    store_report(client, study_id, "graz", external_report(1, early))
    card = ModelCard.model_validate(_get(client, study_id))
    assert card.external is not None and card.external.round == 1 and not card.external.final  # not theta^g_T
    assert "θ^g\\_1, the newest global model a validation site evaluated: not the final model" in _get(
        client, study_id, format="md"
    )

    store_report(client, study_id, "graz", external_report(2, graz))
    store_report(client, study_id, "riga", external_report(2, riga))
    card = ModelCard.model_validate(_get(client, study_id))
    external = card.external
    assert external is not None and external.round == 2 and external.final and external.rounds == [1, 2]
    assert external.validation_sites == ["graz", "riga"] and external.every == 1
    shown = {site.site: site.eval for site in external.sites}
    assert shown["graz"] is not None and shown["graz"].n_samples == 70 and shown["graz"].macro_auroc == graz.macro_auroc
    assert shown["riga"] is not None and shown["riga"].macro_auroc_low == riga.macro_auroc_low
    assert [s.site for s in card.sites] == ["lyon", "oslo"]  # the training sites' figures hold no validation site

    markdown, html = _get(client, study_id, format="md"), _get(client, study_id, format="html")
    section = markdown[markdown.index("## External validation") : markdown.index("## Differential privacy")]
    assert "Sites that never trained: graz, riga." in section and "Rounds evaluated so far: 1, 2." in section
    assert "The final global model θ^g\\_2 (after the last round, 2)" in section
    for name, summary in (("graz", graz), ("riga", riga)):
        (row,) = [line for line in section.splitlines() if line.startswith(f"| {name} |")]
        assert row.startswith(f"| {name} | {summary.n_samples} | {summary.micro_f1:.3f}")
        assert interval(summary, "macro_auroc") in row and interval(summary, "balanced_accuracy") in row
    assert interval(early, "macro_auroc") not in markdown  # theta^g_1 is not the final model
    assert "<h2>External validation</h2>" in html and interval(riga, "macro_auroc") in html


def test_a_study_without_validation_sites_or_a_survey_has_neither_section(client: TestClient) -> None:
    enrol(client, "lyon")
    study_id = create_study(client, ["lyon"])
    card = ModelCard.model_validate(_get(client, study_id))
    assert card.external is None and card.data is None
    markdown = _get(client, study_id, format="md")
    assert "## External validation" not in markdown and "## Data" not in markdown


@pytest.fixture()
def surveyed(client: TestClient) -> tuple[int, int]:
    """(a draft training study of lyon and oslo, the survey study both reported to)."""
    for site in ("lyon", "oslo", "riga"):
        enrol(client, site)
    survey_id = create_study(client, ["lyon", "oslo", "riga"], kind="survey", privacy={"min_records": MIN_RECORDS})
    for site in ("lyon", "oslo"):
        store_report(client, survey_id, site, survey_report(site))
    return create_study(client, ["lyon", "oslo"]), survey_id


def test_the_data_section_pools_the_newest_complete_survey_of_the_training_sites(
    client: TestClient, surveyed: tuple[int, int]
) -> None:
    study_id, survey_id = surveyed
    newer = create_study(client, ["lyon", "oslo"], kind="survey", privacy={"min_records": MIN_RECORDS})
    store_report(client, newer, "lyon", survey_report("lyon"))  # oslo has not reported to it: not picked
    data = ModelCard.model_validate(_get(client, study_id)).data
    assert data is not None and data.study_id == survey_id and data.chosen == "latest"
    assert data.sites == ["lyon", "oslo"] and data.awaiting == [] and data.min_records == MIN_RECORDS
    assert data.noise_sigma is None and data.epsilon is None
    # lyon: 120 train, 40 test, 7 excluded (hidden whole); oslo: 80, 30, 12
    assert [(r.key, r.sites["lyon"].text, r.sites["oslo"].text, r.pooled.text) for r in data.records] == [
        ("train", "120", "80", "200"),
        ("test", "40", "30", "70"),
        ("excluded", "–", "12", "≥12"),
    ]
    # kept records (train + test) are exact: 270; NORM 60 + 20 + 30 + 10; AFIB 15 + (3, hidden) + 20 + 12
    assert [(r.key, r.pooled.text, r.pooled.hidden) for r in data.labels] == [("NORM", "120", 0), ("AFIB", "≥47", 1)]
    assert data.labels[0].prevalence == pytest.approx(120 / 270) and data.labels[1].prevalence == pytest.approx(
        47 / 270
    )
    flat = next(r for r in data.quality if r.key == "flat_lead")
    assert (flat.sites["lyon"].text, flat.sites["oslo"].text, flat.pooled.text) == ("≥12", "0", "≥12")
    assert [r.key for r in data.quality] == [
        "flat_lead",
        "non_finite",
        "clipped",
        "amplitude_outlier",
        "baseline_wander",
    ]
    assert data.suppressed == {"lyon": 125, "oslo": 77} and data.counts == 198

    markdown, html = _get(client, study_id, format="md"), _get(client, study_id, format="html")
    section = markdown[markdown.index("## Data") : markdown.index("## Figures")]
    assert f"From survey study {survey_id} (trial, draft), the newest survey study that surveyed every" in section
    assert "| train | 120 | 80 | 200 |" in section and "| excluded | – | 12 | ≥12 |" in section
    assert "| NORM | 120 | 44.4% |" in section and "| AFIB | ≥47 | ≥17.4% |" in section
    assert "| flat\\_lead | ≥12 | 0 | ≥12 |" in section and "- lyon: 125 of its 198 counts" in section
    assert "<h2>Data</h2>" in html and "<td>≥17.4%</td>" in html


def test_a_named_survey_is_used_as_it_stands_and_must_survey_every_training_site(
    client: TestClient, surveyed: tuple[int, int]
) -> None:
    study_id, survey_id = surveyed
    noisy = create_study(client, ["oslo", "lyon"], kind="survey", survey={"noise_sigma": 3.0})
    store_report(client, noisy, "lyon", survey_report("lyon"))
    data = ModelCard.model_validate(_get(client, study_id, survey=noisy)).data
    assert data is not None and data.study_id == noisy and data.chosen == "named"
    assert data.sites == ["lyon"] and data.awaiting == ["oslo"] and data.noise_sigma == 3.0
    assert data.epsilon == pytest.approx(10.895, abs=1e-3) and data.delta == 1e-6
    markdown = _get(client, study_id, format="md", survey=noisy)
    assert "Not reported: oslo." in markdown and "sigma 3: epsilon = 10.895 at delta = 1e-06." in markdown
    # the survey study's own card reads its own survey
    own = ModelCard.model_validate(_get(client, survey_id)).data
    assert own is not None and own.chosen == "self" and own.sites == ["lyon", "oslo"] and own.awaiting == ["riga"]
    for named, code in (
        (study_id, "survey_not_survey"),
        (create_study(client, ["lyon"], kind="survey"), "survey_not_comparable"),
    ):
        refused = client.get(CARD.format(study_id), params={"survey": named}, headers=ADMIN)
        assert refused.status_code == 422 and refused.json()["error"]["code"] == code
    assert client.get(CARD.format(study_id), params={"survey": 999}, headers=ADMIN).status_code == 404
