"""Site jobs end to end: agents and the real coordinator app in process; a survey, validations, an evaluation."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from shared.tensors.codec import TensorDict, load
from shared.terms import StudyTerms
from shared.wire.jobs import EvaluationResults, ExternalResults, SurveyResults
from shared.wire.survey_release import release
from shared.wire.urls import global_model_url, initial_local_url
from site_agent.adaptation import evaluate_with_adaptation
from site_agent.client import CoordinatorClient
from site_agent.data import ChallengeSource, SiteData, open_site_data
from site_agent.data.survey import survey_site
from site_agent.data.synthetic import generate_sites
from site_agent.device import resolve_runtime
from site_agent.released_evaluation import released_summary
from site_agent.store import SiteStore, generate_key
from site_agent.worker import SiteWorker
from tests.coordinator.factories import ADMIN, create_study, enrol, offer
from tests.site_agent.test_agent import Recorder

SITES = ("lyon", "oslo", "rome")  # rome never trains: it surveys, validates and evaluates
TRAINING = {"lr": 0.05, "batch_size": 8, "max_steps": 2}
CPU = resolve_runtime("cpu")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ChallengeSource]:
    """Each site's configured source: 40 synthetic records."""
    folders = generate_sites(tmp_path_factory.mktemp("ecg") / "raw", n_sites=3, records_per_site=40, seed=3)
    return {name: ChallengeSource(path=folder, name=name) for name, folder in zip(SITES, folders, strict=True)}


@pytest.fixture(scope="module")
def datasets(sources: dict[str, ChallengeSource], tmp_path_factory: pytest.TempPathFactory) -> dict[str, SiteData]:
    """Each source opened as its agent opens it."""
    cache = tmp_path_factory.mktemp("cache")
    return {name: open_site_data(source, cache / name) for name, source in sources.items()}


def agent(
    coordinator: TestClient, name: str, tmp_path: Path, data: SiteData, source: ChallengeSource
) -> tuple[SiteWorker, Recorder, dict[str, str]]:
    """An enrolled site's worker (auto-approving offers, as in demos) over its data and configured source."""
    headers = enrol(coordinator, name)
    recorder = Recorder()
    http = httpx.Client(
        transport=coordinator._transport,
        base_url=str(coordinator.base_url),
        headers=headers,
        event_hooks={"request": [recorder]},
    )
    worker = SiteWorker(
        site=name,
        client=CoordinatorClient(http, poll_wait_s=0.0),
        store=SiteStore(tmp_path / name, generate_key(), name),
        data=lambda: data,
        runtime=CPU,
        progress_bar=False,
        auto_approve=True,
        sources=[source],
    )
    return worker, recorder, headers


def start(coordinator: TestClient, sites: list[str], **changes: object) -> int:
    """A started study's id."""
    study_id = create_study(coordinator, sites, **changes)
    response = coordinator.post(f"/api/v1/studies/{study_id}/start", headers=ADMIN)
    assert response.status_code == 200, response.text
    return study_id


def model(coordinator: TestClient, url: str) -> TensorDict:
    """The tensors of a stored blob, as researchers download it."""
    response = coordinator.get(url, headers=ADMIN)
    assert response.status_code == 200, response.text
    return load(response.content)[0]


def test_a_validation_site_surveys_validates_and_evaluates_through_the_service(
    coordinator: TestClient, tmp_path: Path, datasets: dict[str, SiteData], sources: dict[str, ChallengeSource]
) -> None:
    agents = {name: agent(coordinator, name, tmp_path, datasets[name], sources[name]) for name in SITES}
    rome, recorder, rome_headers = agents["rome"]

    # a survey study: rome releases the survey of its configured source, once
    survey_id = start(coordinator, ["rome"], kind="survey", privacy={"min_records": 5})
    assert rome.poll_once() is True
    surveys = SurveyResults.model_validate(coordinator.get(f"/api/v1/studies/{survey_id}/survey", headers=ADMIN).json())
    assert [reported.survey for reported in surveys.sites] == [release(survey_site([sources["rome"]]), min_records=5)]
    assert surveys.awaiting == []

    # a training study of lyon and oslo, validated at rome every 2nd of 3 rounds and at the final one
    train_id = start(
        coordinator,
        ["lyon", "oslo"],
        validation_sites=["rome"],
        validation_every=2,
        rounds=3,
        training=TRAINING,
        seed=9,
    )
    worked = []
    for _ in range(4):  # rounds 1 to 3 and the final evaluation; rome approves and validates as they come
        worked.append(rome.poll_once())
        for name in ("lyon", "oslo"):
            assert agents[name][0].poll_once()
    worked += [rome.poll_once(), rome.poll_once()]
    assert worked == [False, False, True, True, False, False]  # theta^g_2 once released, then theta^g_3
    terms = offer(coordinator, rome_headers, train_id).terms
    phi_0 = model(coordinator, initial_local_url(train_id))
    external = ExternalResults.model_validate(
        coordinator.get(f"/api/v1/studies/{train_id}/external", headers=ADMIN).json()
    )
    assert [(result.site, result.round) for result in external.results] == [("rome", 2), ("rome", 3)]
    site = datasets["rome"]
    for result in external.results:
        direct = released_summary(
            terms,
            "rome",
            result.round,
            global_tensors=model(coordinator, global_model_url(train_id, result.round)),
            initial_local=phi_0,
            splits=[site.train, site.test],
            runtime=CPU,
        )
        assert result.evaluation == direct and direct.n_samples == len(site.train) + len(site.test)

    # an evaluate study of the training study's final model, adapted to rome
    uid = coordinator.get(f"/api/v1/studies/{train_id}", headers=ADMIN).json()["uid"]
    evaluation = {"study_uid": uid, "adapt_local_epochs": 1}
    evaluate_id = start(coordinator, ["rome"], kind="evaluate", evaluation=evaluation, training=TRAINING)
    assert rome.poll_once() is True
    evaluate_terms: StudyTerms = offer(coordinator, rome_headers, evaluate_id).terms
    direct_adapted = evaluate_with_adaptation(
        evaluate_terms,
        "rome",
        global_tensors=model(coordinator, global_model_url(train_id, 3)),
        initial_local=phi_0,
        data=site,
        runtime=CPU,
    )
    results = EvaluationResults.model_validate(
        coordinator.get(f"/api/v1/studies/{evaluate_id}/evaluations", headers=ADMIN).json()
    )
    (reported,) = results.results
    assert (reported.evaluation, reported.adapted) == (direct_adapted.before, direct_adapted.after)
    assert reported.adapt_records == len(site.train)

    posted = [url for url, _ in recorder.bodies if "/reports/" in url]
    assert len(posted) == 4  # the survey, two external validations, the evaluation: nothing else was reported
    assert not any(url.endswith("/updates") for url, _ in recorder.bodies)  # rome never uploaded a tensor
