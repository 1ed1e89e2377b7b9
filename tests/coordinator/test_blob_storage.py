"""Updates kept in the blob store through the API: where the bytes go, when they leave, and damage caught."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from coordinator.db import make_sessionmaker, utc_now
from coordinator.models import AuditEvent, Blob, BlobLocation, BlobPart, Round, RoundStatus, Study, StudyStatus, Update
from coordinator.rounds.updates import accept_update
from coordinator.sites.security import Principal
from coordinator.storage.blobs import sha256_of
from coordinator.storage.retention import release_updates, sweep_store
from coordinator.storage.update_files import FileBlobStore
from shared.tensors.codec import load
from tests.coordinator.factories import (
    ADMIN,
    download,
    expected_average,
    next_task,
    running_study,
    shifted,
    update_body,
    upload,
)


def _store(client: TestClient) -> FileBlobStore:
    store = client.app.state.coordinator.blob_store
    assert isinstance(store, FileBlobStore)
    return store


def _trained(client: TestClient, headers: dict[str, str], delta: float) -> tuple[dict, bytes]:
    task = next_task(client, headers)
    base = download(client, task["global_model_url"], headers)
    return task, update_body(shifted(base, delta), 10)


def _rounds(sessions: sessionmaker[Session], study_id: int, number: int) -> list[Round]:
    with sessions() as session:
        return list(
            session.scalars(
                select(Round).where(Round.study_id == study_id, Round.number == number).order_by(Round.attempt)
            )
        )


def _location(sessions: sessionmaker[Session], digest: str) -> tuple[str, int]:
    with sessions() as session:
        blob = session.get(Blob, digest)
        assert blob is not None
        held = session.scalar(select(func.sum(func.length(BlobPart.data))).where(BlobPart.sha256 == digest))
        return blob.location, held or 0  # where the row says, and the bytes the database holds


def test_an_accepted_update_is_a_file_in_the_store_and_its_digest_in_the_database(
    client: TestClient, sessions: sessionmaker[Session], blob_dir: Path
) -> None:
    _, headers = running_study(client, sites=("lyon", "oslo"))
    task, body = _trained(client, headers["lyon"], 1.0)
    response = upload(client, task, headers["lyon"], body)
    assert response.status_code == 201, response.text
    digest = sha256_of(body)
    assert response.json()["sha256"] == digest
    assert _store(client).path(digest).read_bytes() == body
    assert _store(client).root == blob_dir.resolve()
    assert _location(sessions, digest) == (BlobLocation.STORE, 0)  # no copy of the bytes in the database
    assert list((blob_dir / "incoming").iterdir()) == []  # linked into place, the spool file gone
    refused = upload(client, next_task(client, headers["oslo"]), headers["oslo"], b"\x00" * 64)
    assert refused.status_code == 422
    assert list((blob_dir / "incoming").iterdir()) == []
    assert list(_store(client).digests()) == [digest]


def test_updates_leave_the_store_once_their_round_is_aggregated(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    study_id, headers = running_study(client, sites=("lyon", "oslo"))
    sent = {site: _trained(client, headers[site], delta) for site, delta in (("lyon", 1.0), ("oslo", 2.0))}
    for site, (task, body) in sent.items():
        assert upload(client, task, headers[site], body).status_code == 201
    assert _rounds(sessions, study_id, 1)[0].status == RoundStatus.COMPLETED
    for site, (task, body) in sent.items():
        digest = sha256_of(body)
        assert not _store(client).path(digest).exists()
        assert _location(sessions, digest) == (BlobLocation.RELEASED, 0)
        again = upload(client, task, headers[site], body)  # a lost receipt: the same answer, from the row
        assert again.status_code == 200 and again.json()["sha256"] == digest
    with sessions() as session:  # what the audit and the study keep: digests and the model they made
        accepted = session.scalars(select(AuditEvent.digest).where(AuditEvent.action == "update.accepted")).all()
    assert set(accepted) == {sha256_of(body) for _, body in sent.values()}
    assert list(_store(client).digests()) == []


def test_a_study_that_keeps_its_updates_keeps_their_files(client: TestClient, sessions: sessionmaker[Session]) -> None:
    study_id, headers = running_study(client, sites=("lyon",), keep_updates=True)
    task, body = _trained(client, headers["lyon"], 1.0)
    assert upload(client, task, headers["lyon"], body).status_code == 201
    assert _rounds(sessions, study_id, 1)[0].status == RoundStatus.COMPLETED
    with sessions() as session:
        assert release_updates(session) == 0
    assert _store(client).path(sha256_of(body)).read_bytes() == body
    assert _location(sessions, sha256_of(body))[0] == BlobLocation.STORE


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_stored_update_fails_its_round_cleanly_and_the_round_is_retried(
    client: TestClient, sessions: sessionmaker[Session], damage: str
) -> None:
    study_id, headers = running_study(client, sites=("lyon", "oslo"), round_retries=1)
    task, body = _trained(client, headers["lyon"], 1.0)
    assert upload(client, task, headers["lyon"], body).status_code == 201
    path = _store(client).path(sha256_of(body))
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(data)
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-4])
    else:
        path.unlink()
    task, body = _trained(client, headers["oslo"], 2.0)
    assert upload(client, task, headers["oslo"], body).status_code == 201  # the last one: aggregation runs
    first, retry = _rounds(sessions, study_id, 1)
    assert first.status == RoundStatus.FAILED and first.aggregation_lease is not None
    assert "stored update unreadable" in first.note
    assert retry.status == RoundStatus.OPEN and retry.attempt == 2
    with sessions() as session:
        failed = session.scalar(select(AuditEvent).where(AuditEvent.action == "round.failed"))
        assert failed is not None and "stored update unreadable" in failed.detail["reason"]
        study = session.get(Study, study_id)
        assert study is not None and study.status == StudyStatus.RUNNING
    assert next_task(client, headers["lyon"])["round_id"] == retry.id  # the sites are asked again


def test_updates_kept_in_the_database_before_the_store_are_still_aggregated(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    study_id, headers = running_study(client, sites=("lyon", "oslo"))
    old_task, old_body = _trained(client, headers["lyon"], 1.0)
    without_store = make_sessionmaker(sessions.kw["bind"])  # a coordinator from before the blob store
    with without_store() as session:
        site = Principal("site:lyon", "site", site_id=_site_id(sessions, "lyon"), site_name="lyon")
        _, created = accept_update(
            session, round_id=old_task["round_id"], site=site, body=old_body, max_num_examples=10**6, now=utc_now()
        )
    assert created and _location(sessions, sha256_of(old_body)) == (BlobLocation.DATABASE, len(old_body))
    task, body = _trained(client, headers["oslo"], 3.0)
    assert upload(client, task, headers["oslo"], body).status_code == 201
    assert _location(sessions, sha256_of(body))[0] == BlobLocation.RELEASED
    assert _location(sessions, sha256_of(old_body)) == (BlobLocation.DATABASE, len(old_body))  # left as it was
    round_ = client.get(f"/api/v1/studies/{study_id}/rounds/1", headers=ADMIN).json()
    assert round_["status"] == "completed"
    theta = download(client, f"/api/v1/studies/{study_id}/models/1", ADMIN)
    expected = expected_average([(load(old_body)[0], 0.5), (load(body)[0], 0.5)])
    assert theta.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(theta[name], tensor, rtol=1e-6, atol=1e-6)


def test_a_sweep_removes_files_no_row_claims_once_they_are_old(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    _, headers = running_study(client, sites=("lyon", "oslo"))
    task, body = _trained(client, headers["lyon"], 1.0)
    assert upload(client, task, headers["lyon"], body).status_code == 201
    store = _store(client)
    with store.incoming() as orphan:  # linked by a transaction that never committed
        orphan.write(b"orphan")
        store.add(orphan)
    orphan_path = store.path(orphan.sha256)
    assert sweep_store(sessions, older_than_s=3600) == 0  # too young: maybe an upload in flight
    assert sweep_store(sessions, older_than_s=0) == 1
    assert not orphan_path.exists()
    assert store.path(sha256_of(body)).exists()  # claimed by its row: kept


def _site_id(sessions: sessionmaker[Session], name: str) -> int:
    from coordinator.models import Site

    with sessions() as session:
        site_id = session.scalar(select(Site.id).where(Site.name == name))
        assert site_id is not None
        return site_id


def test_every_accepted_update_row_points_at_a_blob(client: TestClient, sessions: sessionmaker[Session]) -> None:
    _, headers = running_study(client, sites=("lyon",))
    task, body = _trained(client, headers["lyon"], 1.0)
    assert upload(client, task, headers["lyon"], body).status_code == 201
    with sessions() as session:
        rows = session.execute(select(Update.sha256, Blob.size).join(Blob, Blob.sha256 == Update.sha256)).all()
    assert rows == [(sha256_of(body), len(body))]


def test_cancelling_a_study_releases_what_its_open_round_received(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    study_id, headers = running_study(client, sites=("lyon", "oslo"))
    task, body = _trained(client, headers["lyon"], 1.0)
    assert upload(client, task, headers["lyon"], body).status_code == 201
    assert _store(client).path(sha256_of(body)).exists()  # oslo has not reported: the round is open
    assert client.post(f"/api/v1/studies/{study_id}/cancel", headers=ADMIN).status_code == 200
    assert not _store(client).path(sha256_of(body)).exists()
    assert _location(sessions, sha256_of(body)) == (BlobLocation.RELEASED, 0)
