"""A secure round's masked upload, cut halfway, resumes from the bytes the coordinator holds (upload sessions)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from coordinator.config import CoordinatorSettings
from coordinator.models import Update
from site_agent.data import SiteData
from tests.coordinator.factories import ADMIN
from tests.site_agent.test_agent import site_data
from tests.site_agent.test_secure_rounds import agents, run_study, secure_config

__all__ = ["site_data"]


class CutOnce(httpx.BaseTransport):
    """Passes requests on; the first update POSTed arrives only in half, and the answer to it is lost."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner
        self.cut: tuple[int, bytes] | None = None  # (bytes that arrived, the whole body)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.cut is None and request.method == "POST" and request.url.path.endswith("/updates"):
            body = request.read()
            self.cut = (len(body) // 2, body)
            half = httpx.Request(
                "POST", request.url, headers=request.headers, stream=httpx.ByteStream(body[: len(body) // 2])
            )
            self.inner.handle_request(half).read()
            raise httpx.RemoteProtocolError("the connection was cut mid-body", request=request)
        return self.inner.handle_request(request)


def test_a_masked_upload_cut_halfway_resumes_and_the_secure_study_completes(
    coordinator: TestClient, coordinator_settings: CoordinatorSettings, site_data: dict[str, SiteData], tmp_path: Path
) -> None:
    workers = agents(coordinator, site_data, tmp_path)
    lyon, recorder = workers["lyon"]
    lyon.client.resume_delay_s = 0.01
    cutting = CutOnce(lyon.client.http._transport)
    lyon.client.http._transport = cutting
    study_id = run_study(coordinator, workers, secure_config(rounds=1))
    assert coordinator.get(f"/api/v1/studies/{study_id}", headers=ADMIN).json()["status"] == "completed"
    assert cutting.cut is not None
    held, whole = cutting.cut
    patches = [(url, body) for url, body in recorder.bodies if "/updates/sessions/" in url and body]
    assert len(patches) == 1 and patches[0][1] == whole[held:]  # only the half that had not arrived, once
    assert patches[0][0].endswith(hashlib.sha256(whole).hexdigest())
    engine = create_engine(coordinator_settings.database_url)
    with Session(engine) as session:  # the masked vector stored is the one sent, bit for bit
        digests = session.scalars(select(Update.sha256)).all()
    engine.dispose()
    assert hashlib.sha256(whole).hexdigest() in digests and len(digests) == 4
