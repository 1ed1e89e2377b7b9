"""The local baseline end to end: the service equals the runner, nothing but metrics leaves a site, the report."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from cardiofl.experiment.grid import run_experiment
from cardiofl.experiment.readings import PHI_K_AVERAGED
from cardiofl.experiment.report import write_report
from cardiofl.experiment.results import read_results, trained_alone
from cardiofl.experiment.runner import load_sites, simulate_study
from shared.algorithms.exchange import OWN_MODELS
from shared.study.rules import study_exchange
from shared.tensors.codec import load
from shared.terms import StudyTerms
from tests.cardiofl.experiment.test_head_splits_service import service_equals_runner
from tests.cardiofl.experiment.test_runner import CPU, tiny_experiment
from tests.coordinator.factories import ADMIN
from tests.site_agent.algorithms.conftest import assert_same

LOCAL = {"label": "Local", "algorithm": {"name": "local"}}


def test_local_in_the_service_equals_the_runner_and_sends_metrics_only(coordinator: TestClient, tmp_path: Path) -> None:
    experiment = tiny_experiment(tmp_path, seeds=[7], heads=["6:2"], privacy={"min_records": 3}, methods=[LOCAL])
    data = load_sites(experiment)
    (key,) = experiment.runs()
    study = experiment.study(key)

    created, service, outcomes, sent = service_equals_runner(coordinator, tmp_path, study, data)

    assert service == {1: {}, 2: {}}  # theta^g holds no tensor
    private = study_exchange(study).local_names()  # every model tensor
    for bodies in sent.values():
        assert len(bodies) == study.rounds + 1  # two training rounds and the final evaluation
        for body in bodies:
            assert load(body)[0] == {}
            assert not [name for name in private if name.encode() in body]  # no private name anywhere on the wire
    # what the sites reported is the runner's to the bit: each site's own model after each round, and pooled
    rounds = {
        r["number"]: r for r in coordinator.get(f"/api/v1/studies/{created['id']}/rounds", headers=ADMIN).json()["data"]
    }
    n_classes = study.model.config().n_classes
    for number, record in enumerate((o.record(n_classes) for o in outcomes), start=1):
        shown = rounds[number]
        assert {u["site"]: u["local_eval"] for u in shown["updates"]} == {
            site: values["local"] for site, values in record["sites"].items()
        }
        assert shown["pooled"]["local_eval"] == record["local"] and shown["pooled"]["global_label"] == OWN_MODELS
        if number > 1:  # Global of a local study: the sites' own models after round t - 1, pooled
            assert rounds[number - 1]["pooled"]["eval"] == record["previous_global"]
    assert outcomes[-1].readings == {}  # no theta^g_T to read with the sites' phi_k averaged

    # each site trains alone: a study of site-1 by itself leaves it the same model
    alone = StudyTerms.model_validate({**study.model_dump(mode="json"), "sites": ["site-1"]})
    solo = list(simulate_study(alone, data, CPU, evaluate_final=False))
    assert_same(solo[-1].results["site-1"].local, outcomes[study.rounds - 1].results["site-1"].local)


def test_an_experiment_with_the_local_baseline_reports_each_site_alone_against_federated(tmp_path: Path) -> None:
    local = {**LOCAL, "heads": ["8:0"]}
    config = tiny_experiment(
        tmp_path, seeds=[0, 1], privacy={"min_records": 3}, methods=[{"label": "FedDualAtt"}, local]
    )
    results = tmp_path / "results.jsonl"
    run_experiment(config, results, runtime=CPU)
    runs = read_results(results)
    assert sorted((run.method, run.heads) for run in runs if trained_alone(run)) == [("Local", "8:0")] * 2
    assert all(run.global_readings == {} for run in runs if trained_alone(run))
    assert all(PHI_K_AVERAGED in run.global_readings for run in runs if not trained_alone(run))

    written = write_report(results, tmp_path / "report")
    assert written["local_vs_federated.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = written["table.md"].read_text()
    assert "| Local | 8:0 |" in table and f"{OWN_MODELS}: Local shared nothing" in table
