"""The clinical figures in `cardiofl study show` and `study watch`: values, intervals and bounds, in 120 columns."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cardiofl.cli import app
from cardiofl.client import cli as client_cli
from cardiofl.client.figures import CLINICAL_LABELS, clinical_tables, round_table
from cardiofl.client.http import CardioflClient
from shared.evaluation.figure_names import CLINICAL_METRICS
from shared.wire.api import RoundPublic
from shared.wire.metrics import MetricSummary, figure_text
from tests.coordinator.factories import ADMIN, reported_study

runner = CliRunner()


def test_a_figure_is_written_with_its_bound_and_interval_where_it_has_them() -> None:
    pooled = MetricSummary(macro_auroc=0.8123, macro_auroc_bound=0.0041, macro_auroc_low=0.7712, macro_auroc_high=0.853)
    assert figure_text(pooled, "macro_auroc") == "0.812±0.004 (0.771–0.853)"
    assert figure_text(pooled, "macro_auroc", interval=False) == "0.812±0.004"
    assert figure_text(pooled, "macro_auroc", ci="95% CI ") == "0.812±0.004 (95% CI 0.771–0.853)"
    site = MetricSummary(ece=0.0523, ece_low=0.041, ece_high=0.0675, micro_f1=0.5)
    assert figure_text(site, "ece") == "0.052 (0.041–0.068)"
    assert figure_text(site, "micro_f1") == "0.500"  # no interval: the figure alone
    assert figure_text(site, "macro_auroc") == figure_text(None, "macro_auroc") == "–"
    newer = MetricSummary.model_validate({"brier": 0.1234, "brier_low": 0.1, "brier_high": 0.15})  # an extra field
    assert figure_text(newer, "brier") == "0.123 (0.100–0.150)"
    assert list(CLINICAL_LABELS) == list(CLINICAL_METRICS)  # a column for every clinical figure, in its order


@pytest.fixture()
def study(coordinator: TestClient, monkeypatch: pytest.MonkeyPatch) -> tuple[int, list[RoundPublic]]:
    """A finished study whose sites reported every figure; the CLI talks to it in-process."""
    study_id = reported_study(coordinator)
    coordinator.headers.update(ADMIN)
    client = CardioflClient(coordinator)

    @contextmanager
    def in_process(url: str, token: str | None) -> Iterator[CardioflClient]:
        yield client

    monkeypatch.setattr(client_cli, "connected", in_process)
    # rich fixes a console's width when COLUMNS is set as it is made (pytest-xdist's workers set 80): let each
    # invocation's COLUMNS decide, as a terminal's width does
    monkeypatch.setattr(client_cli.console, "_width", None)
    return study_id, client.rounds(study_id)


def _interval(summary: MetricSummary | None, name: str) -> str:
    """Written out here, independently of `figure`: the figure and its 95% interval."""
    assert summary is not None
    value, low, high = (getattr(summary, f"{name}{end}") for end in ("", "_low", "_high"))
    return f"{value:.3f} ({low:.3f}–{high:.3f})"


def test_study_show_prints_the_clinical_figures_with_intervals_and_bounds(
    study: tuple[int, list[RoundPublic]],
) -> None:
    study_id, rounds = study
    shown = runner.invoke(app, ["study", "show", str(study_id)], env={"COLUMNS": "120"})
    assert shown.exit_code == 0, shown.output
    first, second, final = rounds
    glob = first.pooled.eval if first.pooled else None  # theta^g_1, read by round 2's sites
    assert glob is not None and glob.macro_auroc_bound is not None and glob.ece_bound is not None
    auroc = (
        f"{glob.macro_auroc:.3f}±{glob.macro_auroc_bound:.3f} ({glob.macro_auroc_low:.3f}–{glob.macro_auroc_high:.3f})"
    )
    (row,) = [line for line in shown.output.splitlines() if line.startswith("│ 1 ") and "│ 80 " in line]
    assert auroc in row and _interval(glob, "balanced_accuracy") in row  # the global model, per round
    assert f"{glob.sensitivity:.3f}" in row and f"{glob.specificity:.3f}" in row
    assert f"{glob.ece:.3f}±{glob.ece_bound:.3f}" in row
    for update in final.updates:  # each site's personalised model in the final evaluation, bootstrap intervals
        (line,) = [line for line in shown.output.splitlines() if line.startswith(f"│ {update.site} ")]
        for name in ("macro_auroc", "balanced_accuracy", "ece"):
            assert _interval(update.local_eval, name) in line, name
    mean = final.pooled.local_eval if final.pooled else None
    assert mean is not None and mean.macro_auroc is not None
    (line,) = [line for line in shown.output.splitlines() if line.startswith("│ mean ")]
    assert f"│ {mean.macro_auroc:.3f} " in line and "(" not in line  # a mean of sites has no interval
    per_round = {u.site: f"{u.local_eval.macro_auroc:.3f}" for u in second.updates if u.local_eval}
    (row,) = [
        line for line in shown.output.splitlines() if line.startswith("│ 2 ") and "completed" in line and "±" in line
    ]
    assert all(value in row for value in per_round.values())  # the macro-AUROC table: each site per round
    assert "macro-AUROC: sites' personalised models" in shown.output and "micro-F1" in shown.output
    lines = shown.output.splitlines()
    assert max(len(line) for line in lines) <= 120
    wide = runner.invoke(app, ["study", "show", str(study_id)], env={"COLUMNS": "300"}).output
    assert [line.rstrip() for line in wide.splitlines()] == [line.rstrip() for line in lines]  # nothing squeezed


def test_study_show_json_passes_every_figure_through(study: tuple[int, list[RoundPublic]]) -> None:
    study_id, rounds = study
    shown = runner.invoke(app, ["study", "show", str(study_id), "--json"])
    assert shown.exit_code == 0, shown.output
    printed = json.loads(shown.output)["rounds"]
    for given, round_ in zip(printed, rounds, strict=True):
        assert given["pooled"] == round_.pooled.model_dump(mode="json") if round_.pooled else given["pooled"] is None
    glob = printed[0]["pooled"]["eval"]
    assert {"macro_auroc_low", "macro_auroc_high", "macro_auroc_bound", "ece_bound", "auroc_classes"} <= set(glob)
    local = printed[2]["updates"][0]["local_eval"]
    assert {"micro_f1_low", "map_high", "ece_low", "sensitivity_high", "specificity_low"} <= set(local)


def test_study_watch_prints_each_rounds_clinical_figures(study: tuple[int, list[RoundPublic]]) -> None:
    study_id, rounds = study
    text = runner.invoke(app, ["study", "watch", str(study_id)], env={"COLUMNS": "120"}).output
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 120
    first, second, final = rounds
    for earlier, later in ((first, second), (second, final)):
        glob = earlier.pooled.eval if earlier.pooled else None
        assert glob is not None and glob.macro_auroc_bound is not None
        auroc = f"{glob.macro_auroc:.3f}±{glob.macro_auroc_bound:.3f} ({glob.macro_auroc_low:.3f}–"
        read = lines.index(
            f"round {later.number} ({later.kind}, attempt 1) completed: 2 sites"
            + (f", train loss {later.pooled.train_loss:.3f}" if later.kind == "train" and later.pooled else "")
        )
        mean = later.pooled.local_eval if later.pooled else None
        assert mean is not None and mean.balanced_accuracy is not None
        assert lines[read + 1].startswith(f"  personalised (mean): macro-AUROC {mean.macro_auroc:.3f}, ")
        assert f"bal. acc. {mean.balanced_accuracy:.3f}, sens. {mean.sensitivity:.3f}" in lines[read + 1]
        assert lines[read + 2].startswith(f"  theta^g_{earlier.number} pooled: macro-AUROC {auroc}")
        assert lines[read + 2].endswith(f"ECE {glob.ece:.3f}±{glob.ece_bound:.3f}")
    assert lines[-1] == f"study {study_id} completed"
    watched = [
        json.loads(line) for line in runner.invoke(app, ["study", "watch", str(study_id), "--json"]).output.splitlines()
    ]
    assert watched[0]["pooled"]["local_eval"]["macro_auroc"] == pytest.approx(first.pooled.local_eval.macro_auroc)  # type: ignore[union-attr]
    assert watched[0]["updates"][0]["local_eval"]["ece_high"] == first.updates[0].local_eval.ece_high  # type: ignore[union-attr]


def test_without_clinical_figures_show_prints_fedcvds_alone() -> None:
    """A site below privacy.min_records (or a coordinator before them) sends none: no empty clinical table."""
    plain = RoundPublic.model_validate(
        {
            **{"id": 1, "study_id": 1, "number": 1, "attempt": 1, "kind": "train", "status": "completed"},
            **{"participants": {"lyon": 1.0}, "opened_at": "2024-05-01T12:00:00", "deadline_at": "2024-05-01T13:00:00"},
            **{"closed_at": None, "note": "", "base_sha256": "0" * 64, "base_size": 10, "global_model_sha256": None},
            "updates": [],
            "pooled": {"train_loss": 0.5, "eval": {"micro_f1": 0.5, "map": 0.4, "n_samples": 12}},
        }
    )
    assert clinical_tables([plain]) == []
    assert round_table([plain], "micro_f1").row_count == 1


def test_a_buffered_studys_late_update_shows_its_staleness_beside_its_site() -> None:
    update = {"num_examples": 10, "sha256": "2" * 64, "size": 9, "weight": 0.4, "train_seconds": 1.0,
              "received_at": "2024-05-01T12:30:00", "train_loss": 0.5, "eval": None,
              "local_eval": {"micro_f1": 0.25, "map": 0.5, "n_samples": 12}}  # fmt: skip
    released = RoundPublic.model_validate(
        {
            **{"id": 3, "study_id": 1, "number": 3, "attempt": 1, "kind": "train", "status": "completed"},
            **{"participants": {"a": 1.0, "b": 1.0}, "opened_at": "2024-05-01T12:00:00"},
            **{"deadline_at": "2024-05-01T13:00:00", "closed_at": None, "note": "", "base_sha256": "0" * 64},
            **{"base_size": 10, "global_model_sha256": None, "pooled": None},
            "updates": [{**update, "site": "a", "base_round": 2, "staleness": 0},
                        {**update, "site": "b", "base_round": 0, "staleness": 2}],
        }
    )  # fmt: skip
    table = round_table([released], "micro_f1")
    cells = [list(column.cells) for column in table.columns]
    assert cells[3] == ["0.250"] and cells[4] == ["0.250 (τ2)"]  # a fresh, b two versions behind
