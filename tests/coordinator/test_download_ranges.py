"""Model downloads honour one Range (206), refuse one outside the model (416), and go whole when If-Range differs."""

from __future__ import annotations

import hashlib

import pytest
from fastapi.testclient import TestClient

from coordinator.main import create_app
from coordinator.storage import blobs
from tests.conftest import coordinator_settings_for
from tests.coordinator.factories import ADMIN, enrol, next_task, running_study


def _model(client: TestClient, *, local: bool = False) -> tuple[str, dict[str, str], bytes]:
    """(url, a site's headers, the whole body) of round 0's theta^g, or of its phi_0."""
    _, headers = running_study(client, sites=("lyon",))
    task = next_task(client, headers["lyon"])
    url = task["global_model_url"] + ("/local" if local else "")
    whole = client.get(url, headers=headers["lyon"])
    assert whole.status_code == 200 and whole.headers["accept-ranges"] == "bytes"
    assert whole.headers["content-length"] == str(len(whole.content))
    assert "content-range" not in whole.headers
    if not local:
        assert hashlib.sha256(whole.content).hexdigest() == task["global_model_sha256"]
    return url, headers["lyon"], whole.content


@pytest.mark.parametrize("local", [False, True])
def test_a_range_of_a_model_is_sent_as_206_with_its_content_range(client: TestClient, local: bool) -> None:
    url, site, whole = _model(client, local=local)
    size = len(whole)
    etag = f'"{hashlib.sha256(whole).hexdigest()}"'
    cases = {
        "bytes=100-4195": (100, 4196),
        f"bytes={size - 10}-": (size - 10, size),
        "bytes=-25": (size - 25, size),
        f"bytes=7-{size + 1000}": (7, size),  # an end past the last byte stops at it
        f"Bytes = {size - 1}-{size - 1}": (size - 1, size),
        "bytes=0-": (0, size),
    }
    for asked, (start, end) in cases.items():
        part = client.get(url, headers={**site, "Range": asked, "If-Range": etag})
        assert part.status_code == 206, (asked, part.text)
        assert part.content == whole[start:end], asked
        assert part.headers["content-range"] == f"bytes {start}-{end - 1}/{size}", asked
        assert part.headers["content-length"] == str(end - start)
        assert part.headers["etag"] == etag and part.headers["accept-ranges"] == "bytes"


def test_a_range_outside_the_model_or_not_a_byte_range_is_416_with_the_size(client: TestClient) -> None:
    url, site, whole = _model(client)
    size = len(whole)
    for asked in (f"bytes={size}-", f"bytes={size + 5}-{size + 9}", "bytes=9-2", "bytes=-0", "bytes=x-", "bytes=-"):
        refused = client.get(url, headers={**site, "Range": asked})
        assert refused.status_code == 416, asked
        assert refused.headers["content-range"] == f"bytes */{size}"
        assert refused.json()["error"]["code"] == "range_not_satisfiable"


def test_a_range_is_ignored_under_another_etag_another_unit_or_several_ranges(client: TestClient) -> None:
    url, site, whole = _model(client)
    etag = f'"{hashlib.sha256(whole).hexdigest()}"'
    ignored = [
        {"Range": "bytes=10-", "If-Range": f'"{"0" * 64}"'},  # the held bytes are of another blob: all of this one
        {"Range": "bytes=10-", "If-Range": f"W/{etag}"},  # a weak tag never matches If-Range
        {"Range": "bytes=10-", "If-Range": "Sun, 06 Dec 2026 10:00:00 GMT"},  # no Last-Modified to compare
        {"Range": "bytes=0-9,20-29"},  # several ranges: the whole body, no multipart answer
        {"Range": "items=0-9"},
    ]
    for headers in ignored:
        response = client.get(url, headers={**site, **headers})
        assert response.status_code == 200, headers
        assert response.content == whole and "content-range" not in response.headers
    cached = client.get(url, headers={**site, "Range": "bytes=10-", "If-None-Match": etag})
    assert cached.status_code == 304 and cached.content == b""  # the copy held is current: no bytes at all


def test_a_range_is_refused_to_a_site_of_another_study_as_the_whole_model_is(client: TestClient) -> None:
    url, _, _ = _model(client)
    stranger = enrol(client, "graz")
    refused = client.get(url, headers={**stranger, "Range": "bytes=0-9"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "not_a_participant"
    assert client.get(url, headers={**ADMIN, "Range": "bytes=0-9"}).status_code == 206


def test_a_range_of_a_model_over_the_cache_budget_reads_only_its_chunks(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blobs, "CHUNK_BYTES", 4096)
    with TestClient(create_app(coordinator_settings_for(database_url, download_cache_bytes=0))) as client:
        url, site, whole = _model(client)
        reads: list[tuple[int, int]] = []
        real_read = blobs.read_range

        def counted_read(engine: object, digest: str, offset: int, length: int) -> bytes:
            reads.append((offset, length))
            return real_read(engine, digest, offset, length)  # type: ignore[arg-type]

        monkeypatch.setattr(blobs, "read_range", counted_read)
        part = client.get(url, headers={**site, "Range": "bytes=10000-20000"})
    assert part.status_code == 206 and part.content == whole[10000:20001]
    assert reads == [(10000, 4096), (14096, 4096), (18192, 1809)]
