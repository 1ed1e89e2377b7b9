import hashlib
import json
import struct

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from coordinator.main import create_app
from coordinator.models import AuditEvent, Blob, Update
from shared.model.network import build_model, preset
from shared.model.partition import model_partition
from shared.tensors.codec import dump
from shared.wire.protocol import UPDATE_META_KEY
from tests.conftest import coordinator_settings_for
from tests.coordinator.factories import (
    ADMIN,
    OCTETS,
    download,
    enrol,
    eval_stats,
    next_task,
    running_study,
    shifted,
    train_and_upload,
    update_body,
    upload,
)


def _counts(sessions: sessionmaker[Session]) -> tuple[int, int]:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(Update)), session.scalar(
            select(func.count()).select_from(Blob)
        )


def _initial_local() -> dict[str, torch.Tensor]:
    config = preset("tiny", "6:2")
    return model_partition(config).split(build_model(config, seed=5).state_dict())[1]


@pytest.fixture()
def lyon(client: TestClient) -> tuple[dict, dict, dict]:
    """(task, headers, theta^g_0) of site lyon in a fresh two-site study."""
    _, headers = running_study(client)
    task = next_task(client, headers["lyon"])
    return task, headers["lyon"], download(client, task["global_model_url"], headers["lyon"])


def test_valid_update_is_stored_with_its_receipt(client: TestClient, lyon, sessions) -> None:
    task, headers, base = lyon
    body = update_body(shifted(base, 0.5), 12, eval_stats=eval_stats(1).to_dict())
    response = upload(client, task, headers, body)
    assert response.status_code == 201
    receipt = response.json()
    assert receipt["round"] == 1 and receipt["site"] == "lyon" and receipt["num_examples"] == 12
    assert receipt["size"] == len(body)
    assert receipt["sha256"] == hashlib.sha256(body).hexdigest()
    assert _counts(sessions)[0] == 1


def test_same_bytes_twice_give_the_same_receipt(client: TestClient, lyon, sessions) -> None:
    task, headers, base = lyon
    body = update_body(shifted(base, 0.5), 12)
    first = upload(client, task, headers, body)
    again = upload(client, task, headers, body)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json() == first.json()
    assert _counts(sessions)[0] == 1


def test_different_bytes_for_an_accepted_update_conflict(client: TestClient, lyon, sessions) -> None:
    task, headers, base = lyon
    assert upload(client, task, headers, update_body(shifted(base, 0.5), 12)).status_code == 201
    response = upload(client, task, headers, update_body(shifted(base, 0.25), 12))
    assert response.status_code == 409 and response.json()["error"]["code"] == "update_conflict"
    assert _counts(sessions)[0] == 1


def _bad_cases(base: dict, local: dict) -> dict[str, tuple[bytes, int, str]]:
    missing = dict(base)
    missing.pop("head.bias")
    nan = shifted(base, 0.0)
    nan["head.weight"][0, 0] = float("nan")
    inf = shifted(base, 0.0)
    inf["head.bias"][0] = float("inf")
    good = update_body(base, 5)
    no_meta = dump(base)
    bad_meta = dump(base, {UPDATE_META_KEY: json.dumps({"num_examples": 5})})
    return {
        "private tensors": (update_body({**base, **local}, 5), 422, "private_tensors_in_payload"),
        "unexpected name": (update_body({**base, "extra": torch.zeros(2)}, 5), 422, "unexpected_tensors"),
        "missing name": (update_body(missing, 5), 422, "missing_tensors"),
        "wrong shape": (update_body({**base, "head.bias": torch.zeros(21)}, 5), 422, "shape_mismatch"),
        "wrong dtype": (update_body({**base, "head.bias": base["head.bias"].double()}, 5), 422, "dtype_mismatch"),
        "NaN": (update_body(nan, 5), 422, "non_finite_values"),
        "Inf": (update_body(inf, 5), 422, "non_finite_values"),
        "truncated": (good[: len(good) - 3], 422, "malformed_payload"),
        "garbage": (b"\x00" * 3, 422, "malformed_payload"),
        "not safetensors": (b"PK\x03\x04" + b"\x00" * 64, 422, "malformed_payload"),
        "header nested too deep": (_raw_header("[" * 50_000 + "]" * 50_000), 422, "malformed_payload"),
        "dtype given as a list": (
            _raw_header('{"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4),
            422,
            "malformed_payload",
        ),
        "huge finite loss": (_meta_body(base, 5, loss="1e308"), 422, "invalid_update_meta"),
        "Infinity in a reported rate": (
            dump(base, {UPDATE_META_KEY: _meta_json(5, '{"loss": 0.5, "samples_per_second": Infinity}')}),
            422,
            "invalid_update_meta",
        ),
        "no meta": (no_meta, 422, "invalid_update_meta"),
        "incomplete meta": (bad_meta, 422, "invalid_update_meta"),
        "n_k zero": (_meta_body(base, 0), 422, "invalid_update_meta"),
        "n_k negative": (_meta_body(base, -4), 422, "invalid_update_meta"),
        "n_k absurd": (update_body(base, 10**12), 422, "invalid_update_meta"),
        "n_k a string": (
            dump(base, {UPDATE_META_KEY: _meta_json('"20"', '{"loss": 0.5}')}),
            422,
            "invalid_update_meta",
        ),
        "n_k a float": (dump(base, {UPDATE_META_KEY: _meta_json("20.0", '{"loss": 0.5}')}), 422, "invalid_update_meta"),
        "n_k a bool": (dump(base, {UPDATE_META_KEY: _meta_json("true", '{"loss": 0.5}')}), 422, "invalid_update_meta"),
        "NaN loss": (_meta_body(base, 5, loss="NaN"), 422, "invalid_update_meta"),
        "bad eval stats": (update_body(base, 5, eval_stats={"n_bins": 3}), 422, "invalid_metrics"),
        "eval stats of another model": (
            update_body(base, 5, eval_stats=eval_stats(2, n_classes=5).to_dict()),
            422,
            "invalid_metrics",
        ),
    }


def _meta_json(num_examples: int | str, metrics: str) -> str:
    return f'{{"num_examples": {num_examples}, "metrics": {metrics}, "train_seconds": 1.0}}'


def _meta_body(base: dict, num_examples: int, loss: str = "0.5") -> bytes:
    return dump(base, {UPDATE_META_KEY: _meta_json(num_examples, f'{{"loss": {loss}}}')})


def _raw_header(header: str, data: bytes = b"") -> bytes:
    """A payload with `header` verbatim as its header (padded to 8 bytes)."""
    encoded = header.encode() + b" " * (-len(header) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + data


CASES = [
    "private tensors",
    "unexpected name",
    "missing name",
    "wrong shape",
    "wrong dtype",
    "NaN",
    "Inf",
    "truncated",
    "garbage",
    "not safetensors",
    "header nested too deep",
    "dtype given as a list",
    "huge finite loss",
    "Infinity in a reported rate",
    "no meta",
    "incomplete meta",
    "n_k zero",
    "n_k negative",
    "n_k absurd",
    "n_k a string",
    "n_k a float",
    "n_k a bool",
    "NaN loss",
    "bad eval stats",
    "eval stats of another model",
]


@pytest.mark.parametrize("case", CASES)
def test_invalid_upload_is_refused_and_nothing_is_stored(client: TestClient, lyon, sessions, case: str) -> None:
    task, headers, base = lyon
    local = _initial_local()
    body, status, code = _bad_cases(base, local)[case]
    before = _counts(sessions)
    response = upload(client, task, headers, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    assert _counts(sessions) == before
    with sessions() as session:
        event = session.scalars(select(AuditEvent).order_by(AuditEvent.id.desc())).first()
    assert event is not None and event.detail["code"] == code
    assert event.action == ("privacy.violation" if case == "private tensors" else "update.refused")
    # the site can still send a good update afterwards
    assert upload(client, task, headers, update_body(base, 5)).status_code == 201


def _metrics_body(base: dict, metrics: dict) -> bytes:
    """An upload whose metrics are written verbatim, as a hostile or outdated agent could."""
    return dump(base, {UPDATE_META_KEY: _meta_json(30, json.dumps({"loss": 0.5, **metrics}))})


def _hostile_metrics() -> dict[str, tuple[dict, str, str]]:
    histograms = eval_stats(7, n_samples=40).to_dict()
    scalars = {"n_samples": 40, "loss": 0.7, "micro_f1": 0.5, "map": 0.4, "map_present": 0.5}
    return {
        "per-site report with histograms": (
            {"local_eval": {**scalars, "pos_hist": histograms["pos_hist"], "tp": histograms["tp"]}},
            "invalid_update_meta",
            "local_eval.pos_hist",
        ),
        "per-site statistics under another key": (
            {"local_eval_stats": histograms},
            "invalid_update_meta",
            "metrics.local_eval_stats: a site reports scalar metrics only",
        ),
        "pooled statistics of too few records": (
            {"eval_stats": eval_stats(8, n_samples=19).to_dict()},
            "invalid_metrics",
            "19 test records, below the study's privacy.min_records 20",
        ),
        "marker carrying counts": (
            {"eval_stats": {"too_few_records": True, "tp": histograms["tp"]}},
            "invalid_metrics",
            "carries nothing else",
        ),
        "clinical figures of too few records": (
            {"local_eval": {**scalars, "n_samples": 19, "macro_auroc": 0.8, "sensitivity_low": 0.2}},
            "invalid_metrics",
            "macro_auroc, sensitivity_low of 19 test records, below the study's privacy.min_records 20",
        ),
        "a macro over more classes than the model has": (
            {"local_eval": {**scalars, "macro_auroc": 0.8, "auroc_classes": 21}},
            "invalid_metrics",
            "local_eval averages 21 classes; the study's model has 20",
        ),
        "an interval whose ends are swapped": (
            {"local_eval": {**scalars, "ece": 0.1, "ece_low": 0.2, "ece_high": 0.05}},
            "invalid_metrics",
            "the interval of ece ends below its start",
        ),
        "swapped ends of a FedCVD figure's interval": (
            {"local_eval": {**scalars, "micro_f1_low": 0.9, "micro_f1_high": 0.1}},
            "invalid_metrics",
            "the interval of micro_f1 ends below its start",
        ),
        "an interval with one end": (
            {"local_eval": {**scalars, "sensitivity_low": 0.3}},
            "invalid_metrics",
            "the interval of sensitivity has one end only",
        ),
        "a clinical figure outside [0, 1]": (
            {"local_eval": {**scalars, "macro_auroc": 1.5}},
            "invalid_update_meta",
            "local_eval.macro_auroc",
        ),
    }


@pytest.mark.parametrize("case", list(_hostile_metrics()))
def test_per_sample_information_is_refused_with_its_reason(client: TestClient, lyon, sessions, case: str) -> None:
    task, headers, base = lyon
    metrics, code, reason = _hostile_metrics()[case]
    response = upload(client, task, headers, _metrics_body(base, metrics))
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == code and reason in error["message"]
    assert _counts(sessions)[0] == 0
    # the same site is accepted with scalars and the marker
    scalars = {"n_samples": 12, "loss": 0.7, "micro_f1": 0.5, "map": 0.4, "map_present": None}
    fine = _metrics_body(base, {"local_eval": scalars, "eval_stats": {"too_few_records": True}})
    assert upload(client, task, headers, fine).status_code == 201


def test_privacy_violation_names_the_private_tensors(client: TestClient, lyon, sessions) -> None:
    task, headers, base = lyon
    local = _initial_local()
    response = upload(client, task, headers, update_body({**base, **local}, 5))
    assert "blocks.0.local_branch.in_proj.weight" in response.json()["error"]["message"]
    with sessions() as session:
        event = session.scalars(select(AuditEvent).where(AuditEvent.action == "privacy.violation")).one()
    assert event.actor == "site:lyon" and event.round_id == task["round_id"]


def test_upload_over_the_size_limit_is_refused(database_url: str, sessions) -> None:
    with TestClient(create_app(coordinator_settings_for(database_url, max_upload_bytes=4096))) as client:
        _, headers = running_study(client)
        task = next_task(client, headers["lyon"])
        base = download(client, task["global_model_url"], headers["lyon"])
        response = upload(client, task, headers["lyon"], update_body(base, 5))
    assert response.status_code == 413 and response.json()["error"]["code"] == "payload_too_large"
    assert _counts(sessions)[0] == 0


def test_upload_needs_octet_stream(client: TestClient, lyon) -> None:
    task, headers, base = lyon
    response = client.post(
        task["update_url"], content=update_body(base, 5), headers={**headers, "Content-Type": "application/json"}
    )
    assert response.status_code == 415 and response.json()["error"]["code"] == "unsupported_media_type"


def test_site_not_selected_cannot_upload(client: TestClient, lyon) -> None:
    task, _, base = lyon
    stranger = enrol(client, "graz")
    response = upload(client, task, stranger, update_body(base, 5))
    assert response.status_code == 403 and response.json()["error"]["code"] == "not_a_participant"


def test_upload_to_unknown_round_is_refused_as_to_a_round_of_others(client: TestClient, lyon) -> None:
    task, headers, base = lyon
    response = client.post("/api/v1/rounds/999/updates", content=update_body(base, 5), headers={**headers, **OCTETS})
    assert response.status_code == 403 and response.json()["error"]["code"] == "not_a_participant"


def test_upload_to_a_closed_round_is_refused_but_a_repeat_still_gets_its_receipt(client: TestClient) -> None:
    study_id, headers = running_study(client)
    tasks = {name: next_task(client, h) for name, h in headers.items()}
    base = download(client, tasks["lyon"]["global_model_url"], headers["lyon"])
    first = update_body(base, 5)
    assert upload(client, tasks["lyon"], headers["lyon"], first).status_code == 201
    assert client.post(f"/api/v1/studies/{study_id}/cancel", headers=ADMIN).status_code == 200
    late = upload(client, tasks["oslo"], headers["oslo"], update_body(base, 5))
    assert late.status_code == 409 and late.json()["error"]["code"] == "round_closed"
    assert upload(client, tasks["lyon"], headers["lyon"], first).status_code == 200


def test_an_update_lacking_what_the_weighting_reads_is_refused(client: TestClient) -> None:
    study_id, headers = running_study(client, aggregation={"name": "uncertainty"})
    without = train_and_upload(client, headers["lyon"], 0.1, 10)
    assert without.status_code == 422 and without.json()["error"]["code"] == "invalid_metrics"
    assert "entropy" in without.json()["error"]["message"]
    rounds = client.get(f"/api/v1/studies/{study_id}/rounds", headers=ADMIN).json()["data"]
    assert rounds[0]["updates"] == []  # nothing stored
    assert train_and_upload(client, headers["lyon"], 0.1, 10, entropy=0.4).status_code == 201


def _refusals(sessions: sessionmaker[Session]) -> list[tuple[str, str | None, str]]:
    with sessions() as session:
        events = session.scalars(
            select(AuditEvent).where(AuditEvent.action == "update.refused").order_by(AuditEvent.id)
        ).all()
        return [(event.actor, event.detail["code"], str(event.round_id)) for event in events]


def test_every_refused_upload_of_a_known_caller_is_audited(client: TestClient, lyon, sessions) -> None:
    task, headers, base = lyon
    body = update_body(base, 5)
    url = task["update_url"]
    round_id = str(task["round_id"])
    graz = enrol(client, "graz")  # enrolled, but not in this study
    assert client.post(url, content=body, headers={**graz, **OCTETS}).status_code == 403
    assert client.post(url, content=body, headers={**headers, "Content-Type": "text/plain"}).status_code == 415
    assert client.post(url, content=body, headers={**ADMIN, **OCTETS}).status_code == 403  # not a site
    too_far = "/api/v1/rounds/99999999999/updates"
    assert client.post(too_far, content=body, headers={**headers, **OCTETS}).status_code == 422
    assert upload(client, task, headers, body).status_code == 201
    other = update_body(shifted(base, 1.0), 5)
    assert upload(client, task, headers, other).status_code == 409  # other bytes for an accepted update
    assert client.post(url, content=body, headers=OCTETS).status_code == 401  # unknown caller: not written
    assert _refusals(sessions) == [
        ("site:graz", "not_a_participant", round_id),
        ("site:lyon", "unsupported_media_type", round_id),
        ("admin:env", "forbidden", round_id),
        ("site:lyon", "invalid_request", "None"),
        ("site:lyon", "update_conflict", round_id),
    ]


def test_an_oversized_upload_is_refused_and_audited(database_url: str, tmp_path) -> None:
    settings = coordinator_settings_for(database_url, max_upload_bytes=4096, blob_dir=str(tmp_path / "blobs"))
    with TestClient(create_app(settings)) as client:
        _, headers = running_study(client)
        task = next_task(client, headers["lyon"])
        response = client.post(task["update_url"], content=b"\0" * 5000, headers={**headers["lyon"], **OCTETS})
        assert response.status_code == 413
        sessions = client.app.state.coordinator.sessions
        assert _refusals(sessions) == [("site:lyon", "payload_too_large", str(task["round_id"]))]
