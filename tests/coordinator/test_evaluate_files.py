"""Model files: a researcher uploads theta^g and phi_0 as safetensors, and an evaluate study names them by digest.

Tests taking `client` run on SQLite and on PostgreSQL (tests/coordinator/conftest.py).
"""

from __future__ import annotations

import hashlib
import io
import pickle
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from coordinator.config import CoordinatorSettings
from coordinator.main import create_app
from coordinator.models import AuditEvent, Blob, BlobLocation
from coordinator.storage.blob_parts import insert_parts
from shared.study.rules import initial_state
from shared.tensors.codec import dump, load
from shared.terms import terms_from
from tests.coordinator.factories import (
    ADMIN,
    OCTETS,
    download,
    enrol,
    issue,
    next_task,
    running_study,
    shifted,
    study_config,
    update_body,
)
from tests.coordinator.factories import upload as upload_update
from tests.coordinator.job_factories import evaluation_report, jobs, post_report, report_url, study_json

MODELS = "/api/v1/models"


def _error(response: Any) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


def model_files(**changes: Any) -> tuple[bytes, bytes]:
    """theta^g and phi_0 of a seeded model of a study config's model and algorithm: the files a researcher holds."""
    shared, local = initial_state(terms_from(study_config(["bern"], **changes)))
    return dump(shared), dump(local)


def upload(client: TestClient, body: bytes, headers: dict[str, str]) -> Any:
    """POST a model file's bytes."""
    return client.post(MODELS, content=body, headers={**headers, **OCTETS})


def uploaded(client: TestClient, theta: bytes, phi: bytes) -> dict[str, str]:
    """The `[evaluation]` digests of two uploaded files."""
    digests = {}
    for name, body in (("model_sha256", theta), ("initial_local_sha256", phi)):
        response = upload(client, body, ADMIN)
        assert response.status_code == 201, response.text
        digests[name] = response.json()["sha256"]
    return digests


def create(client: TestClient, evaluation: dict[str, Any], **changes: Any) -> Any:
    """POST an evaluate study of bern (enrolled before)."""
    config = study_config(["bern"], kind="evaluate", evaluation=evaluation, **changes)
    return client.post("/api/v1/studies", json={"name": "file", "config": config}, headers=ADMIN)


def test_a_researcher_uploads_a_model_file_and_the_same_bytes_are_the_same_model(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    theta, phi = model_files()
    first = upload(client, theta, ADMIN)
    assert first.status_code == 201, first.text
    assert first.json() == {"sha256": hashlib.sha256(theta).hexdigest(), "size": 124_248, "tensors": 106}
    assert (len(theta), len(load(theta)[0])) == (124_248, 106)
    again = upload(client, theta, issue(client, "researcher"))
    assert (again.status_code, again.json()) == (201, first.json())
    other = upload(client, phi, ADMIN).json()
    assert (other["sha256"], other["tensors"]) == (hashlib.sha256(phi).hexdigest(), 8)
    with sessions() as session:
        events = session.scalars(
            select(AuditEvent).where(AuditEvent.action == "model.uploaded").order_by(AuditEvent.id)
        )
        audited = [(event.actor.split(":")[0], event.digest, event.detail) for event in events]
    assert audited == [
        ("admin", first.json()["sha256"], {"size": 124_248, "tensors": 106}),
        ("token", first.json()["sha256"], {"size": 124_248, "tensors": 106}),
        ("admin", other["sha256"], {"size": len(phi), "tensors": 8}),
    ]


def _torch_saved() -> bytes:
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("body", "code", "said"),
    [
        (b"not a model", "malformed_payload", "header length"),
        (pickle.dumps({"w": [1.0, 2.0]}), "malformed_payload", "header length"),
        (_torch_saved(), "malformed_payload", "header length"),
        (dump({"w": torch.tensor([1.0, float("nan")]), "b": torch.zeros(2)}), "non_finite_values", "NaN or Inf in 1"),
        (dump({"w": torch.tensor([float("inf")])}), "non_finite_values", "NaN or Inf in 1 tensor(s): w"),
    ],
    ids=["garbage", "pickle", "torch.save", "nan", "inf"],
)
def test_bytes_that_are_no_safetensors_of_finite_tensors_are_refused_and_not_kept(
    client: TestClient, body: bytes, code: str, said: str
) -> None:
    refused = upload(client, body, ADMIN)
    assert _error(refused) == (422, code)
    message = refused.json()["error"]["message"]
    assert message.startswith("not a model file of finite tensors: ") and said in message
    enrol(client, "bern")
    _, phi = model_files()
    named = {**uploaded(client, phi, phi), "model_sha256": hashlib.sha256(body).hexdigest()}
    assert _error(create(client, named)) == (422, "unknown_model")  # nothing of it was kept


def test_only_researchers_and_admins_upload_models_as_raw_bytes(client: TestClient) -> None:
    theta, _ = model_files()
    for headers in (enrol(client, "bern"), issue(client, "viewer")):
        assert _error(upload(client, theta, headers)) == (403, "forbidden")
    assert _error(upload(client, theta, {})) == (401, "unauthenticated")
    as_json = client.post(MODELS, content=theta, headers={**ADMIN, "Content-Type": "application/json"})
    assert _error(as_json) == (415, "unsupported_media_type")


def test_a_model_file_larger_than_the_upload_limit_is_refused(settings: CoordinatorSettings) -> None:
    theta, _ = model_files()
    _, phi = model_files()
    with TestClient(create_app(settings.model_copy(update={"max_upload_bytes": len(theta) - 1}))) as client:
        assert _error(upload(client, theta, ADMIN)) == (413, "payload_too_large")
        assert upload(client, phi, ADMIN).status_code == 201 and len(phi) < len(theta)


def test_an_evaluate_study_of_a_model_file_keeps_the_terms_model_and_evaluates_the_very_files(
    client: TestClient,
) -> None:
    algorithm = {"name": "fedprox", "params": {"mu": 0.1}}
    theta, phi = model_files(algorithm=algorithm, seed=7)
    digests = uploaded(client, theta, phi)
    evaluation = {**digests, "adapt_local_epochs": 1}
    study_id, headers = running_study(
        client, ("bern",), kind="evaluate", evaluation=evaluation, algorithm=algorithm, seed=7
    )
    config = study_json(client, study_id)["config"]
    assert (config["model"]["heads"], config["algorithm"]["name"], config["seed"]) == ("6:2", "fedprox", 7)
    assert config["algorithm"]["params"]["mu"] == 0.1
    assert config["evaluation"] == {"study_uid": None, **digests, "rounds": None, "adapt_local_epochs": 1}
    models = client.get(f"/api/v1/studies/{study_id}/models", headers=ADMIN).json()["data"]
    assert [(m["round"], m["sha256"], m["local_sha256"]) for m in models] == [
        (0, digests["model_sha256"], digests["initial_local_sha256"])
    ]
    (job,) = jobs(client, headers["bern"])
    assert (job["kind"], job["model_sha256"], job["initial_local_sha256"]) == (
        "evaluate",
        digests["model_sha256"],
        digests["initial_local_sha256"],
    )
    assert client.get(job["model_url"], headers=headers["bern"]).content == theta
    assert client.get(job["initial_local_url"], headers=headers["bern"]).content == phi
    report = evaluation_report("evaluate", adapted=True)
    assert post_report(client, headers["bern"], report_url(study_id, "evaluate"), report).status_code == 201
    results = client.get(f"/api/v1/studies/{study_id}/evaluations", headers=ADMIN).json()
    assert (results["evaluated_study_uid"], results["model_sha256"], results["awaiting"]) == (
        None,
        digests["model_sha256"],
        [],
    )
    assert results["results"][0]["evaluation"] == report["evaluation"]
    assert study_json(client, study_id)["status"] == "completed"


OTHER_HEADS = (
    "evaluation.model_sha256: not a model of the terms' model tiny 4:4 under algorithm 'fedavg': tensor "
    "'blocks.0.global_branch.in_proj.weight' has shape [72, 32], expected [48, 32] (and 5 more)"
)
SWAPPED = (
    "evaluation.model_sha256: not a model of the terms' model tiny 6:2 under algorithm 'fedavg': payload holds names "
    "outside the schema: "
    + ", ".join(
        f"blocks.{b}.local_branch.{p}.{w}" for b in (0, 1) for p in ("in_proj", "out_proj") for w in ("bias", "weight")
    )
)


@pytest.mark.parametrize(
    ("written", "swapped", "message"),
    [({"model": {"preset": "tiny", "heads": "4:4"}}, False, OTHER_HEADS), ({}, True, SWAPPED)],
    ids=["other heads", "swapped files"],
)
def test_files_that_are_not_a_model_of_the_terms_are_refused_naming_the_first_difference(
    client: TestClient, written: dict[str, Any], swapped: bool, message: str
) -> None:
    enrol(client, "bern")
    theta, phi = model_files()  # of tiny 6:2 under fedavg
    refused = create(client, uploaded(client, *((phi, theta) if swapped else (theta, phi))), **written)
    assert _error(refused) == (422, "model_not_of_terms")
    assert refused.json()["error"]["message"] == message


def test_a_digest_of_no_uploaded_model_is_refused(client: TestClient) -> None:
    enrol(client, "bern")
    theta, phi = model_files()
    digests = uploaded(client, theta, phi)
    unknown = create(client, {**digests, "initial_local_sha256": "0" * 64})
    assert _error(unknown) == (422, "unknown_model")
    assert unknown.json()["error"]["message"] == (
        f"evaluation.initial_local_sha256: no model {'0' * 64} on this coordinator: upload its file first "
        "(POST /api/v1/models)"
    )
    half = create(client, {"model_sha256": digests["model_sha256"]})
    assert _error(half) == (422, "invalid_request") and "missing initial_local_sha256" in half.text
    counted = create(client, {**digests, "rounds": 2})
    assert _error(counted) == (422, "invalid_request") and "a model file has none" in counted.text


def test_a_sites_update_is_no_model_even_where_the_database_keeps_it(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    _, headers = running_study(client, ("lyon",))
    task = next_task(client, headers["lyon"])
    trained = shifted(download(client, task["global_model_url"], headers["lyon"]), 0.1)
    body = update_body(trained, 30)
    receipt = upload_update(client, task, headers["lyon"], body)
    assert receipt.status_code == 201, receipt.text
    enrol(client, "bern")
    _, phi = model_files()
    named = {**uploaded(client, phi, phi), "model_sha256": receipt.json()["sha256"]}
    assert _error(create(client, named)) == (422, "unknown_model")  # kept in the blob store
    with sessions() as session:  # as a database from before the blob store keeps it
        stored = update(Blob).where(Blob.sha256 == receipt.json()["sha256"])
        session.execute(stored.values(location=BlobLocation.DATABASE))
        insert_parts(session, receipt.json()["sha256"], [body])
        session.commit()
    assert _error(create(client, named)) == (422, "unknown_model")  # else its sites and researchers could download it
    as_file = {**named, "model_sha256": uploaded(client, dump(trained), phi)["model_sha256"]}
    assert create(client, as_file).status_code == 201  # its very tensors are a model of the terms, as a file
