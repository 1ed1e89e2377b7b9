"""`cardiofl study survey`, and `study show|watch` of studies with site jobs, against a mocked coordinator.

The coordinator's answers (tests/cardiofl/job_results.py) are the read views of shared/wire/jobs.py, served
over an httpx.MockTransport: the commands are checked on known counts and figures, whatever serves them.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from typer.testing import CliRunner

from cardiofl.cli import app
from cardiofl.client import cli as client_cli
from cardiofl.client import survey_cli
from cardiofl.client.http import CardioflClient
from shared.wire.jobs import EvaluationResults, ExternalResults, SurveyResults
from shared.wire.protocol import EvalSummary
from tests.cardiofl.job_results import (
    EVALUATE,
    SURVEY,
    TRAIN,
    evaluation_results,
    external_results,
    mock_coordinator,
    survey_results,
)

runner = CliRunner()


@pytest.fixture()
def requests(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths the commands request of the mocked coordinator, which they reach through `connected`."""
    seen: list[str] = []
    client = CardioflClient(mock_coordinator(seen))

    @contextmanager
    def in_process(url: str, token: str | None) -> Iterator[CardioflClient]:
        yield client

    monkeypatch.setattr(client_cli, "connected", in_process)
    monkeypatch.setattr(survey_cli, "connected", in_process)
    monkeypatch.setattr(
        client_cli.console, "_width", None
    )  # each invocation's COLUMNS decides (see test_study_figures)
    return seen


def lines_of(args: list[str], columns: int = 120) -> list[str]:
    result = runner.invoke(app, args, env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= columns
    return lines


def row(lines: list[str], *cells: str) -> str:
    """The one table row whose cells start with these."""
    found = [line for line in lines if [c.strip() for c in line.strip("│").split("│")][: len(cells)] == list(cells)]
    assert len(found) == 1, (cells, found)
    return found[0]


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("│").split("│")]


def test_the_client_reads_each_view_as_its_wire_model() -> None:
    seen: list[str] = []
    client = CardioflClient(mock_coordinator(seen))
    survey, external, evaluations = client.survey(SURVEY), client.external(TRAIN), client.evaluations(EVALUATE)
    assert isinstance(survey, SurveyResults) and survey == survey_results()
    assert isinstance(external, ExternalResults) and external == external_results()
    assert isinstance(evaluations, EvaluationResults) and evaluations == evaluation_results()
    assert seen == ["/api/v1/studies/2/survey", "/api/v1/studies/1/external", "/api/v1/studies/3/evaluations"]
    assert [s.site for s in survey.sites] == ["lyon", "oslo"] and survey.awaiting == ["riga"]


def test_study_survey_prints_each_site_and_the_pool_with_the_legend(requests: list[str]) -> None:
    lines = lines_of(["study", "survey", str(SURVEY)])
    assert requests == ["/api/v1/studies/2/survey"]
    # all groups: lyon 120 + 40 + (7 excluded, hidden); oslo 80 + 30 + 12
    assert cells(row(lines, "records", "records")) == ["records", "records", "≥160", "122", "≥282"]
    assert cells(row(lines, "labels", "NORM")) == ["labels", "NORM", "≥80", "≥40", "≥120"]
    assert cells(row(lines, "labels", "AFIB")) == ["labels", "AFIB", "≥15", "≥32", "≥47"]
    assert cells(row(lines, "labels", "LVH")) == ["labels", "LVH", "–", "–", "–"]
    assert cells(row(lines, "quality", "flat_lead")) == ["quality", "flat_lead", "≥12", "0", "≥12"]
    assert cells(row(lines, "reason", "unreadable")) == ["reason", "unreadable", "–", "12", "≥12"]
    assert "groups: train, test, excluded" in lines and "awaiting: riga" in lines
    legend = "\n".join(lines)
    assert "– suppressed: a count below 10 (the study's min_records)" in legend
    assert "≥n: the sum of the counts shown; some were suppressed" in legend and "noise" not in legend

    kept = lines_of(["study", "survey", str(SURVEY), "--group", "test", "--group", "train"])
    assert cells(row(kept, "records", "records")) == ["records", "records", "160", "110", "270"]
    assert cells(row(kept, "labels", "NORM")) == ["labels", "NORM", "80", "40", "120"]
    assert cells(row(kept, "labels", "AFIB")) == ["labels", "AFIB", "≥15", "32", "≥47"]
    assert not [line for line in kept if "reason" in line]  # only the excluded group has reasons
    assert "groups: train, test" in kept


def test_study_survey_names_the_noise_and_what_it_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    noisy = survey_results(noise_sigma=3.0, awaiting=())

    class Client:
        def survey(self, study_id: int) -> SurveyResults:
            return noisy

    @contextmanager
    def in_process(url: str, token: str | None) -> Iterator[Client]:
        yield Client()

    monkeypatch.setattr(survey_cli, "connected", in_process)
    monkeypatch.setattr(client_cli.console, "_width", None)
    lines = lines_of(["study", "survey", str(SURVEY), "--group", "excluded"])
    assert "each site's counts carry discrete Gaussian noise of sigma 3: epsilon = 10.895 at delta = 1e-06" in lines
    assert cells(row(lines, "records", "records")) == ["records", "records", "–", "12", "≥12"]
    assert not [line for line in lines if line.startswith("awaiting")]
    printed = runner.invoke(app, ["study", "survey", str(SURVEY), "--json"])
    assert SurveyResults.model_validate_json(printed.output) == noisy


def figures(summary: EvalSummary) -> list[str]:
    """macro-AUROC with its interval, micro-F1 and mAP, written out here."""
    assert summary.macro_auroc is not None and summary.macro_auroc_low is not None
    auroc = f"{summary.macro_auroc:.3f} ({summary.macro_auroc_low:.3f}–{summary.macro_auroc_high:.3f})"
    return [auroc, f"{summary.micro_f1:.3f}", f"{summary.map:.3f}"]


def test_study_show_puts_the_validation_sites_apart_and_marks_the_final_round(requests: list[str]) -> None:
    lines = lines_of(["study", "show", str(TRAIN)])
    assert requests == ["/api/v1/studies/1", "/api/v1/studies/1/rounds", "/api/v1/studies/1/external"]
    text = "\n".join(lines)
    training = text.index("micro-F1: sites' personalised models")
    external = text.index("External validation: theta^g_t with phi_0")
    assert training < external  # the training sites' tables first, the validation sites after them
    assert "validation sites (never trained, not in the tables above): graz, riga" in lines
    assert "  each evaluates theta^g_t of rounds 2, 4, … and the final one, on all its records" in lines
    graz2, riga2, graz4 = (r.evaluation for r in external_results().results)
    assert cells(row(lines, "2", "graz")) == ["2", "graz", "50", *figures(graz2)]
    assert cells(row(lines, "2", "riga")) == ["2", "riga", "70", *figures(riga2)]
    assert cells(row(lines, "4 (final)", "graz")) == ["4 (final)", "graz", "50", *figures(graz4)]
    assert cells(row(lines, "4 (final)", "riga")) == ["4 (final)", "riga", "awaiting", "–", "–", "–"]

    printed = json.loads(runner.invoke(app, ["study", "show", str(TRAIN), "--json"]).output)
    assert ExternalResults.model_validate(printed["external"]) == external_results()
    assert set(printed) == {"study", "rounds", "external"}


def test_study_show_of_an_evaluate_study_shows_each_site_before_and_after(requests: list[str]) -> None:
    lines = lines_of(["study", "show", str(EVALUATE)])
    assert requests[-1] == "/api/v1/studies/3/evaluations"
    text = "\n".join(lines)
    assert "micro-F1: sites'" not in text  # it trains nothing: no round tables
    assert "Evaluation of the final model of study abababababababababababababababab" in text
    results = evaluation_results().results
    lyon, oslo = results
    assert lyon.adapted is not None
    assert cells(row(lines, "lyon", "as released")) == ["lyon", "as released", "40", *figures(lyon.evaluation)]
    adapted = row(lines, "lyon", "adapted on 120 records")
    assert cells(adapted) == ["lyon", "adapted on 120 records", "40", *figures(lyon.adapted)]
    assert cells(row(lines, "oslo", "as released")) == ["oslo", "as released", "30", *figures(oslo.evaluation)]
    assert not [line for line in lines if line.startswith("│ oslo ") and "adapted" in line]  # oslo did not adapt
    assert cells(row(lines, "riga", "awaiting")) == ["riga", "awaiting", "–", "–", "–", "–"]


def test_study_show_of_a_survey_study_gives_the_records_per_group_and_the_command(requests: list[str]) -> None:
    lines = lines_of(["study", "show", str(SURVEY)])
    assert requests[-1] == "/api/v1/studies/2/survey"
    assert "survey: 2 site(s) reported (lyon, oslo)" in lines
    assert "  records pooled: train 200, test 70, excluded ≥12" in lines
    assert "  awaiting: riga" in lines and "  the tables: cardiofl study survey 2 --url http://127.0.0.1:8000" in lines
    assert not [line for line in lines if "round" in line and "│" in line]
    (hint,) = [line.split(": ", 1)[1] for line in lines if line.startswith("  the tables: ")]
    pasted = lines_of(shlex.split(hint)[1:])  # as pasted: it asks for the survey's tables at the same coordinator
    assert requests[-1] == "/api/v1/studies/2/survey" and any("lyon" in line for line in pasted)


def test_study_watch_prints_each_external_result_once(requests: list[str]) -> None:
    lines = lines_of(["study", "watch", str(TRAIN)], columns=200)
    graz2, riga2, graz4 = (r.evaluation for r in external_results().results)
    auroc, f1, mean_ap = figures(graz4)
    assert lines == [
        "round 4 (train, attempt 1) completed: 0 sites, train loss 0.500",
        f"  external: theta^g_2 at graz (never trained), 50 records: macro-AUROC {figures(graz2)[0]}, "
        f"micro-F1 {figures(graz2)[1]}, mAP {figures(graz2)[2]}",
        f"  external: theta^g_2 at riga (never trained), 70 records: macro-AUROC {figures(riga2)[0]}, "
        f"micro-F1 {figures(riga2)[1]}, mAP {figures(riga2)[2]}",
        f"  external: theta^g_4 (final) at graz (never trained), 50 records: macro-AUROC {auroc}, "
        f"micro-F1 {f1}, mAP {mean_ap}",
        "study 1 completed",
    ]
