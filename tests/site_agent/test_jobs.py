"""A site's jobs against a fake coordinator: checked, run once, and what is posted is the JobReport alone."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from shared.study.rules import initial_state
from shared.tensors.codec import TensorDict, dump
from shared.terms import StudyTerms
from shared.wire.jobs import JobKind, JobReport, SiteJob, jobs_url, report_url
from shared.wire.protocol import PROTOCOL_VERSION, StudyOffer
from shared.wire.survey_release import release
from shared.wire.urls import global_model_url, initial_local_url
from site_agent.adaptation import evaluate_with_adaptation
from site_agent.approvals import Approvals, study_key
from site_agent.client import CoordinatorClient
from site_agent.data import ChallengeSource, SiteData, open_site_data
from site_agent.data.survey import survey_site
from site_agent.data.synthetic import generate_sites
from site_agent.device import resolve_runtime
from site_agent.jobs import ADAPTED_ROUND, JobRunner, job_id, reported_rounds, sent_report
from site_agent.released_evaluation import released_summary
from site_agent.store import SiteStore, generate_key
from site_agent.worker import SiteWorker

UID = "cd" * 16
SITE = "rome"
RUNTIME = resolve_runtime("cpu")
TRAINING = {"lr": 0.05, "batch_size": 8, "max_steps": 2}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> ChallengeSource:
    """The site's one configured data source: 40 synthetic records."""
    folder = generate_sites(tmp_path_factory.mktemp("ecg") / "raw", n_sites=1, records_per_site=40, seed=3)[0]
    return ChallengeSource(path=folder, name=SITE)


@pytest.fixture(scope="module")
def site_data(source: ChallengeSource, tmp_path_factory: pytest.TempPathFactory) -> SiteData:
    """The source opened as the agent opens it."""
    return open_site_data(source, tmp_path_factory.mktemp("cache"))


def train_terms(**changes: Any) -> StudyTerms:
    """A tiny training study of lyon and oslo, validated at rome every 2nd of its 4 rounds."""
    raw = {"sites": ["lyon", "oslo"], "validation_sites": [SITE], "validation_every": 2, "rounds": 4}
    return StudyTerms.model_validate({**raw, "model": {"preset": "tiny"}, "training": TRAINING, "seed": 4, **changes})


def survey_terms(**survey: Any) -> StudyTerms:
    """A survey study of rome, its counts suppressed below 5 records."""
    return StudyTerms.model_validate(
        {
            "sites": [SITE],
            "kind": "survey",
            "survey": survey,
            "privacy": {"min_records": 5},
            "model": {"preset": "tiny"},
        }
    )


def blob(tensors: TensorDict) -> tuple[bytes, str]:
    """The safetensors bytes of `tensors` and their sha256."""
    body = dump(tensors)
    return body, hashlib.sha256(body).hexdigest()


@dataclass
class FakeCoordinator:
    """Lists jobs, serves blobs by URL, takes reports; records every request the agent makes."""

    jobs: list[SiteJob] = field(default_factory=list)
    blobs: dict[str, bytes] = field(default_factory=dict)
    refuse_reports: bool = False
    offers: list[StudyOffer] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)  # the `wait` of each task poll
    requests: list[tuple[str, str, bytes]] = field(default_factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        """Answer one request as the coordinator would."""
        path = request.url.path
        self.requests.append((request.method, path, request.read()))
        if request.method == "GET" and path == jobs_url():
            return httpx.Response(200, json=[job.model_dump(mode="json") for job in self.jobs])
        if request.method == "GET" and path in self.blobs:
            return httpx.Response(200, content=self.blobs[path])
        if request.method == "POST" and "/reports/" in path:
            if self.refuse_reports:
                return httpx.Response(409, json={"error": {"code": "conflict", "message": "another report"}})
            return httpx.Response(200, json={"accepted": True})
        if path == "/api/v1/sites/me/studies":
            offers = [offer.model_dump(mode="json") for offer in self.offers]
            return httpx.Response(200, json={"data": offers, "count": len(offers)})
        if request.method == "PUT" and path.endswith("/approval"):
            return httpx.Response(204)
        if path == "/api/v1/tasks/next":
            self.waits.append(float(request.url.params["wait"]))
            return httpx.Response(204)
        if path == "/api/v1/sites/me/signing-key":
            return httpx.Response(204)
        return httpx.Response(404, json={"error": {"code": "not_found", "message": path}})

    def posted(self) -> list[tuple[str, bytes]]:
        """(path, body) of every POST."""
        return [(path, body) for method, path, body in self.requests if method == "POST"]

    def paths(self) -> list[tuple[str, str]]:
        """(method, path) of every request."""
        return [(method, path) for method, path, _ in self.requests]


def make_job(terms: StudyTerms, kind: JobKind, number: int = 0, **changes: Any) -> SiteJob:
    """A job of study 7 for rome, as an honest coordinator lists it (downloads given in `changes`)."""
    values: dict[str, Any] = {
        "protocol": PROTOCOL_VERSION,
        "study_id": 7,
        "study_uid": UID,
        "site": SITE,
        "terms": terms,
        "kind": kind,
        "round": number,
        "report_url": report_url(7, kind, number),
    }
    return SiteJob.model_validate({**values, **changes})


def offer_of(terms: StudyTerms) -> StudyOffer:
    """Study 7 with `terms`, as offered to rome before it reported an approval."""
    return StudyOffer(
        protocol=PROTOCOL_VERSION, study_id=7, study_uid=UID, site=SITE, name="trial", status="running", terms=terms
    )


def approve(store: SiteStore, terms: StudyTerms) -> None:
    """The operator approves study 7 with `terms`, from its offer."""
    Approvals(store).approve(offer_of(terms), by="operator")


def runner_for(
    coordinator: Callable[[httpx.Request], httpx.Response],
    store: SiteStore,
    data: SiteData,
    sources: list[ChallengeSource] | None = None,
) -> JobRunner:
    http = httpx.Client(transport=httpx.MockTransport(coordinator), base_url="https://coordinator.test")
    return JobRunner(
        site=SITE,
        client=CoordinatorClient(http),
        store=store,
        approvals=Approvals(store),
        data=lambda: data,
        runtime=RUNTIME,
        sources=sources or [],
    )


def worker_for(
    coordinator: FakeCoordinator, store: SiteStore, data: SiteData, source: ChallengeSource, poll_wait_s: float = 0.0
) -> SiteWorker:
    """Rome's site worker, speaking to `coordinator`."""
    http = httpx.Client(transport=httpx.MockTransport(coordinator), base_url="https://coordinator.test")
    client = CoordinatorClient(http, poll_wait_s=poll_wait_s)
    return SiteWorker(site=SITE, client=client, store=store, data=lambda: data, runtime=RUNTIME, sources=[source])


@pytest.fixture()
def store(tmp_path: Path) -> SiteStore:
    """The site's encrypted store."""
    return SiteStore(tmp_path / "store", generate_key(), SITE)


def external_job(
    terms: StudyTerms, coordinator: FakeCoordinator, number: int
) -> tuple[SiteJob, TensorDict, TensorDict]:
    """theta^g_t (the seeded model, scaled by t) and phi_0 served, and the job to evaluate them."""
    theta, phi = initial_state(terms)
    theta = {
        name: tensor * (1 + 0.01 * number) if tensor.is_floating_point() else tensor for name, tensor in theta.items()
    }
    (model, model_sha), (local, local_sha) = blob(theta), blob(phi)
    coordinator.blobs[global_model_url(7, number)] = model
    coordinator.blobs[initial_local_url(7)] = local
    downloads = {
        "model_url": global_model_url(7, number),
        "model_sha256": model_sha,
        "initial_local_url": initial_local_url(7),
        "initial_local_sha256": local_sha,
    }
    return make_job(terms, JobKind.EXTERNAL, number, **downloads), theta, phi


def test_the_survey_job_posts_exactly_the_released_survey_of_the_sources(
    store: SiteStore, site_data: SiteData, source: ChallengeSource
) -> None:
    terms = survey_terms()
    approve(store, terms)
    coordinator = FakeCoordinator(jobs=[make_job(terms, JobKind.SURVEY)])
    runner = runner_for(coordinator, store, site_data, [source])

    assert runner.run_next() is True
    expected = JobReport(kind=JobKind.SURVEY, survey=release(survey_site([source]), min_records=5))
    assert coordinator.posted() == [(report_url(7, JobKind.SURVEY), expected.model_dump_json().encode())]
    assert coordinator.paths() == [("GET", jobs_url()), ("POST", report_url(7, JobKind.SURVEY))]  # nothing else
    assert expected.survey is not None and expected.survey.min_records == 5
    assert runner.run_next() is False  # reported: listed again, it is not run again
    assert len(coordinator.posted()) == 1


def test_a_noisy_survey_is_released_once_and_sent_again_as_it_was(
    store: SiteStore, site_data: SiteData, source: ChallengeSource
) -> None:
    terms = survey_terms(noise_sigma=3.0)
    approve(store, terms)
    coordinator = FakeCoordinator(jobs=[make_job(terms, JobKind.SURVEY)])
    coordinator.refuse_reports = True  # lost: the coordinator lists the job again after the agent restarts
    assert runner_for(coordinator, store, site_data, [source]).run_next() is True
    coordinator.refuse_reports = False
    restarted = runner_for(coordinator, store, site_data, [source])
    assert restarted.run_next() is True

    first, second = (body for _, body in coordinator.posted())
    assert first == second  # the kept release, not fresh noise (which would spend epsilon twice)
    report = JobReport.model_validate_json(first)
    assert report.survey is not None and (report.survey.noise_sigma, report.survey.min_records) == (3.0, 5)
    assert sent_report(store, job_id(make_job(terms, JobKind.SURVEY))) == report


def test_the_external_job_reports_released_summary_on_all_records(store: SiteStore, site_data: SiteData) -> None:
    terms = train_terms()
    approve(store, terms)
    coordinator = FakeCoordinator()
    job, theta, phi = external_job(terms, coordinator, 2)
    coordinator.jobs = [job]
    assert runner_for(coordinator, store, site_data).run_next() is True

    direct = released_summary(
        terms,
        SITE,
        2,
        global_tensors=theta,
        initial_local=phi,
        splits=[site_data.train, site_data.test],
        runtime=RUNTIME,
    )
    assert direct.n_samples == len(site_data.train) + len(site_data.test)
    expected = JobReport(kind=JobKind.EXTERNAL, round=2, evaluation=direct)
    assert coordinator.posted() == [(job.report_url, expected.model_dump_json().encode())]
    assert reported_rounds(store, study_key(7, UID)) == [2]


def test_a_second_final_round_is_refused_after_the_first(store: SiteStore, site_data: SiteData) -> None:
    terms = train_terms(rounds=6, validation_every=3)
    approve(store, terms)
    coordinator = FakeCoordinator()
    first, _, _ = external_job(terms, coordinator, 4)  # off the schedule: the final round of a study that ended
    second, _, _ = external_job(terms, coordinator, 5)
    coordinator.jobs = [first, second]
    runner = runner_for(coordinator, store, site_data)
    assert runner.run_next() and runner.run_next()
    assert [path for path, _ in coordinator.posted()] == [first.report_url]
    assert "this site evaluated round 4 as the study's final one already" in runner.refused[job_id(second)]


def test_the_evaluate_job_reports_before_and_after_and_keeps_the_adapted_phi(
    store: SiteStore, site_data: SiteData
) -> None:
    base = StudyTerms.model_validate({"sites": [SITE], "model": {"preset": "tiny"}, "training": TRAINING, "seed": 4})
    theta, phi = initial_state(base)
    (model, model_sha), (local, local_sha) = blob(theta), blob(phi)
    spec = {
        "study_uid": "e" * 32,
        "model_sha256": model_sha,
        "initial_local_sha256": local_sha,
        "adapt_local_epochs": 1,
    }
    terms = StudyTerms.model_validate({**base.model_dump(mode="json"), "kind": "evaluate", "evaluation": spec})
    approve(store, terms)
    urls: dict[str, Any] = {
        "model_url": "/api/v1/studies/3/models/4",
        "initial_local_url": "/api/v1/studies/3/models/0/local",
    }
    coordinator = FakeCoordinator(blobs={urls["model_url"]: model, urls["initial_local_url"]: local})
    coordinator.jobs = [
        make_job(terms, JobKind.EVALUATE, model_sha256=model_sha, initial_local_sha256=local_sha, **urls)
    ]
    assert runner_for(coordinator, store, site_data).run_next() is True

    direct = evaluate_with_adaptation(
        terms, SITE, global_tensors=theta, initial_local=phi, data=site_data, runtime=RUNTIME
    )
    assert direct.after is not None and direct.local is not None
    expected = JobReport(
        kind=JobKind.EVALUATE, evaluation=direct.before, adapted=direct.after, adapt_records=len(site_data.train)
    )
    assert coordinator.posted() == [(report_url(7, JobKind.EVALUATE), expected.model_dump_json().encode())]
    kept = store.load_local(study_key(7, UID))
    assert kept is not None and kept[0] == ADAPTED_ROUND
    assert kept[1].keys() == direct.local.keys() and all(torch.equal(kept[1][k], direct.local[k]) for k in kept[1])
    assert not any(name in json.loads(coordinator.posted()[0][1]) for name in ("local", "tensors"))


def test_an_evaluation_of_another_model_is_refused_before_any_download(store: SiteStore, site_data: SiteData) -> None:
    spec = {"study_uid": "e" * 32, "model_sha256": "a" * 64, "initial_local_sha256": "b" * 64}
    terms = StudyTerms.model_validate(
        {"sites": [SITE], "kind": "evaluate", "evaluation": spec, "model": {"preset": "tiny"}}
    )
    approve(store, terms)
    urls: dict[str, Any] = {"model_url": "/m", "initial_local_url": "/l", "initial_local_sha256": "b" * 64}
    coordinator = FakeCoordinator(jobs=[make_job(terms, JobKind.EVALUATE, model_sha256="c" * 64, **urls)])
    runner = runner_for(coordinator, store, site_data)
    assert runner.run_next() is True
    assert coordinator.paths() == [("GET", jobs_url())]  # nothing downloaded, nothing posted
    assert (
        f"the job's model digest {'c' * 12} is not the terms' {'a' * 12}" in runner.refused[job_id(coordinator.jobs[0])]
    )
    assert runner.run_next() is False  # remembered: not tried again at every poll
    assert coordinator.paths() == [("GET", jobs_url())] * 2


def test_an_unapproved_study_or_other_terms_run_no_job(store: SiteStore, site_data: SiteData) -> None:
    terms = train_terms()
    coordinator = FakeCoordinator()
    job, _, _ = external_job(terms, coordinator, 2)
    coordinator.jobs = [job]
    runner = runner_for(coordinator, store, site_data)
    runner.approvals.auto_approve = True  # an offer would be approved; a job never is
    assert runner.run_next() is True
    assert "this site's operator has not approved study 7" in runner.refused[job_id(job)]
    assert store.approved_studies() == []

    approve(store, train_terms(rounds=6))  # the operator approved other terms than the job carries
    other = runner_for(coordinator, store, site_data)
    assert other.run_next() is True
    assert "its terms differ from those this site's operator approved at rounds" in other.refused[job_id(job)]
    assert coordinator.posted() == [] and all(
        method == "GET" and path == jobs_url() for method, path in coordinator.paths()
    )


def test_a_job_for_a_training_site_of_the_study_is_refused(store: SiteStore, site_data: SiteData) -> None:
    terms = train_terms(sites=["lyon", SITE], validation_sites=["oslo"])
    approve(store, terms)
    coordinator = FakeCoordinator()
    job, _, _ = external_job(terms, coordinator, 2)
    coordinator.jobs = [job]
    runner = runner_for(coordinator, store, site_data)
    assert runner.run_next() is True
    assert "the study's terms do not name 'rome' among its validation sites" in runner.refused[job_id(job)]
    assert coordinator.posted() == []


def test_a_refused_report_is_remembered_and_kept(store: SiteStore, site_data: SiteData) -> None:
    terms = train_terms()
    approve(store, terms)
    coordinator = FakeCoordinator(refuse_reports=True)
    job, _, _ = external_job(terms, coordinator, 2)
    coordinator.jobs = [job]
    runner = runner_for(coordinator, store, site_data)
    assert runner.run_next() is True and runner.run_next() is False
    assert "the coordinator refused its external report: 409 conflict: another report" in runner.refused[job_id(job)]
    assert len(coordinator.posted()) == 1
    assert sent_report(store, job_id(job)) == JobReport.model_validate_json(coordinator.posted()[0][1])


def test_the_worker_runs_a_job_in_a_poll_without_a_task(
    store: SiteStore, site_data: SiteData, source: ChallengeSource
) -> None:
    terms = survey_terms()
    approve(store, terms)
    coordinator = FakeCoordinator(jobs=[make_job(terms, JobKind.SURVEY)])
    worker = worker_for(coordinator, store, site_data, source)
    assert worker.poll_once() is True
    methods = [(method, path) for method, path in coordinator.paths() if path != "/api/v1/sites/me/signing-key"]
    assert methods == [
        ("GET", "/api/v1/sites/me/studies"),
        ("GET", "/api/v1/tasks/next"),
        ("GET", jobs_url()),
        ("POST", report_url(7, JobKind.SURVEY)),
    ]
    assert worker.poll_once() is False  # nothing left: the survey is reported


def test_a_poll_that_reports_an_approval_asks_for_a_task_without_waiting_and_runs_the_job_due(
    store: SiteStore, site_data: SiteData, source: ChallengeSource
) -> None:
    terms = survey_terms()
    approve(store, terms)  # the operator approved it; the coordinator has not been told yet
    coordinator = FakeCoordinator(jobs=[make_job(terms, JobKind.SURVEY)], offers=[offer_of(terms)])
    worker = worker_for(coordinator, store, site_data, source, poll_wait_s=7.0)
    assert worker.poll_once() is True  # approval reported, no wait for a task, the survey (due at once) run
    assert [path for method, path in coordinator.paths() if method == "POST"] == [report_url(7, JobKind.SURVEY)]
    assert worker.poll_once() is False  # told before: this poll waits as usual
    assert coordinator.waits == [0.0, 7.0]


def test_a_coordinator_without_jobs_is_asked_once(store: SiteStore, site_data: SiteData) -> None:
    asked: list[str] = []

    def older(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(404, json={"error": {"code": "not_found", "message": "no such route"}})

    runner = runner_for(older, store, site_data)
    assert runner.run_next() is False and runner.listing is False
    assert runner.run_next() is False
    assert asked == [jobs_url()]


def test_the_client_skips_a_job_it_cannot_read() -> None:
    terms = survey_terms()
    good = make_job(terms, JobKind.SURVEY).model_dump(mode="json")
    bad = {**good, "kind": "mine-bitcoin"}
    http = httpx.Client(
        transport=httpx.MockTransport(lambda r: httpx.Response(200, json=[bad, good])), base_url="https://c.test"
    )
    assert CoordinatorClient(http).jobs() == [make_job(terms, JobKind.SURVEY)]
