"""`CardioflClient`: torch-free to import, and each call answered with its wire model by the real coordinator."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

import httpx
import pytest
from fastapi.testclient import TestClient

from cardiofl.client import ApiError, CardioflClient
from shared.evaluation.figure_names import CLINICAL_METRICS
from shared.tensors.codec import load
from shared.terms import StudyTerms
from shared.wire.api import (
    AuditEventPublic,
    GlobalModelPublic,
    RoundPublic,
    SiteEnrolled,
    SitePublic,
    StatusReport,
    StudyPublic,
    TokenIssued,
    TokenPublic,
)
from shared.wire.metrics import MetricSummary
from tests.coordinator.factories import ADMIN, bearer, local_eval, reported_study, study_config

ROOT = Path(__file__).resolve().parents[2]

# With torch set to None in sys.modules, any `import torch` on the way raises ImportError.
TORCH_FREE = """
import sys
sys.modules["torch"] = None
import cardiofl.client
from cardiofl.client import ApiError, CardioflClient, tls_from_env
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "coordinator", "site_agent"))
print(json.dumps({"loaded": loaded, "torch": sys.modules["torch"] is None}))
"""


def test_the_client_imports_without_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import json" + TORCH_FREE], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer == {"loaded": ["torch"], "torch": True}  # only the stand-in: neither torch nor a service loaded


@pytest.fixture()
def admin(coordinator: TestClient) -> CardioflClient:
    """The bootstrap admin's client of the in-process coordinator (a TestClient is an httpx.Client)."""
    coordinator.headers.update(ADMIN)
    return CardioflClient(coordinator)


def as_role(coordinator: TestClient, token: str | None) -> CardioflClient:
    """A client of the same app under another token (none: no Authorization header)."""
    headers = bearer(token) if token else {}
    http = httpx.Client(transport=coordinator._transport, base_url=coordinator.base_url, headers=headers)
    return CardioflClient(http)


def test_sites_and_tokens_are_typed(admin: CardioflClient) -> None:
    enrolled = admin.enrol_site("lyon")
    assert isinstance(enrolled, SiteEnrolled) and enrolled.site.name == "lyon"
    assert enrolled.token.role == "site" and enrolled.token.site == "lyon" and enrolled.token.token
    admin.enrol_site("oslo")
    sites = admin.sites()
    assert all(isinstance(s, SitePublic) for s in sites) and [s.name for s in sites] == ["lyon", "oslo"]

    issued = admin.create_token("researcher", "ana")
    assert isinstance(issued, TokenIssued) and issued.role == "researcher" and issued.token
    listed = {t.id: t for t in admin.tokens()}
    assert all(isinstance(t, TokenPublic) for t in listed.values())
    assert listed[issued.id].label == "ana" and listed[issued.id].revoked_at is None
    assert admin.revoke_token(issued.id) is None
    assert {t.id: t for t in admin.tokens()}[issued.id].revoked_at is not None

    rotated = admin.rotate_site_token("lyon")
    assert isinstance(rotated, TokenIssued) and rotated.site == "lyon" and rotated.token != enrolled.token.token
    live = [t.id for t in admin.tokens() if t.site == "lyon" and t.revoked_at is None]
    assert live == [rotated.id]


def test_a_study_from_creation_to_its_first_model(admin: CardioflClient, coordinator: TestClient) -> None:
    for name in ("lyon", "oslo"):
        admin.enrol_site(name)
    issued = admin.create_token("researcher", "ana")
    researcher = as_role(coordinator, issued.token)
    study = researcher.create_study("typed", MappingProxyType(study_config(["lyon", "oslo"])))  # any Mapping
    assert isinstance(study, StudyPublic) and isinstance(study.config, StudyTerms)
    assert (study.name, study.status, study.config.model.heads) == ("typed", "draft", "6:2")
    assert study.created_by == f"token:{issued.id}"

    started = researcher.study_action(study.id, "start")
    assert isinstance(started, StudyPublic) and (started.status, started.current_round) == ("running", 1)
    assert researcher.study(study.id).status == "running"
    assert [s.id for s in researcher.studies()] == [study.id]
    assert researcher.study_action(study.id, "pause").status == "paused"
    assert researcher.study_action(study.id, "resume").status == "running"

    rounds = researcher.rounds(study.id)
    assert all(isinstance(r, RoundPublic) for r in rounds)
    assert [(r.number, r.kind, r.status, sorted(r.participants)) for r in rounds] == [
        (1, "train", "open", ["lyon", "oslo"])
    ]
    assert researcher.round(study.id, 1).id == rounds[0].id

    (model,) = researcher.global_models(study.id)
    assert isinstance(model, GlobalModelPublic) and model.round == 0
    body = researcher.download_global_model(study.id, 0)
    assert isinstance(body, bytes) and hashlib.sha256(body).hexdigest() == model.sha256
    assert load(body)[1]["round"] == "0"
    initial = researcher.download_initial_local(study.id)
    assert hashlib.sha256(initial).hexdigest() == model.local_sha256

    events = researcher.audit(study.id)
    assert events and all(isinstance(e, AuditEventPublic) and e.study_id == study.id for e in events)

    status = researcher.status()
    assert isinstance(status, StatusReport)
    assert [(s.id, s.status, s.current_round) for s in status.studies] == [(study.id, "running", 1)]
    assert sorted(s.name for s in status.sites) == ["lyon", "oslo"]


def test_rounds_carry_the_clinical_figures_as_typed_fields(admin: CardioflClient, coordinator: TestClient) -> None:
    study_id = reported_study(coordinator)  # round t: site i reported local_eval(10 t + i, clinical=True)
    rounds = admin.rounds(study_id)
    stored = coordinator.get(f"/api/v1/studies/{study_id}/rounds").json()["data"]
    ends = ("_low", "_high")
    typed = {*CLINICAL_METRICS, *(f"{name}{end}" for name in (*CLINICAL_METRICS, "micro_f1", "map") for end in ends)}
    for number, (round_, raw) in enumerate(zip(rounds, stored, strict=True), start=1):
        for i, update in enumerate(sorted(round_.updates, key=lambda u: u.site)):
            assert isinstance(update.local_eval, MetricSummary) and not update.local_eval.model_extra
            sent = local_eval(10 * number + i, clinical=True)
            assert {key: getattr(update.local_eval, key) for key in typed} == {key: sent[key] for key in typed}
            assert update.local_eval.auroc_classes == sent["auroc_classes"]
        glob = round_.pooled.eval if round_.pooled else None
        if round_.kind == "train":  # theta^g_t from the histograms: each figure with its interval, two with bounds
            assert isinstance(glob, MetricSummary) and not glob.model_extra
            assert glob.macro_auroc_low is not None and glob.macro_auroc_low < glob.macro_auroc < glob.macro_auroc_high
            assert glob.macro_auroc_bound is not None and glob.ece_bound is not None and glob.ece is not None
            assert glob.model_dump(mode="json") == raw["pooled"]["eval"]  # what was stored, key for key
        mean = round_.pooled.local_eval if round_.pooled else None
        assert mean is not None and mean.macro_auroc is not None and mean.macro_auroc_low is None  # a mean: no interval


def test_create_study_posts_the_name_and_config_as_given() -> None:
    sent: list[dict[str, object]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append({"method": request.method, "path": request.url.path, "body": json.loads(request.content)})
        return httpx.Response(418, json={"error": {"code": "teapot", "message": "no studies here"}})

    client = CardioflClient(httpx.Client(transport=httpx.MockTransport(answer), base_url="http://coordinator"))
    config = {"sites": ["lyon"], "rounds": 3, "future_key": {"kept": True}}  # sent as is: the coordinator judges
    with pytest.raises(ApiError) as refused:
        client.create_study("raw", config)
    assert sent == [{"method": "POST", "path": "/api/v1/studies", "body": {"name": "raw", "config": config}}]
    assert (refused.value.status, refused.value.code) == (418, "teapot")
    assert str(refused.value) == "418 teapot: no studies here"


def test_refusals_are_api_errors_with_status_and_code(admin: CardioflClient, coordinator: TestClient) -> None:
    admin.enrol_site("lyon")
    viewer = as_role(coordinator, admin.create_token("viewer").token)
    study = admin.create_study("trial", study_config(["lyon"]))
    admin.study_action(study.id, "start")
    refusals = [
        (lambda: admin.study(999), 404, "not_found"),
        (lambda: admin.download_global_model(study.id, 7), 404, "not_found"),
        (lambda: admin.enrol_site("lyon"), 409, "already_exists"),
        (lambda: admin.study_action(study.id, "start"), 409, "invalid_transition"),
        (lambda: admin.create_study("bad", {"sites": []}), 422, "invalid_request"),
        (lambda: viewer.create_study("peek", study_config(["lyon"])), 403, "forbidden"),
        (lambda: viewer.tokens(), 403, "forbidden"),
        (lambda: as_role(coordinator, None).studies(), 401, "unauthenticated"),
    ]
    for call, status, code in refusals:
        with pytest.raises(ApiError) as refused:
            call()
        assert (refused.value.status, refused.value.code) == (status, code), refused.value
        assert str(refused.value).startswith(f"{status} {code}: ") and "\n" not in str(refused.value)


def test_an_unreachable_coordinator_is_an_api_error_without_a_status() -> None:
    client = CardioflClient.connect("http://127.0.0.1:9/", "token", timeout=5)
    with pytest.raises(ApiError, match="cannot reach the coordinator at http://127.0.0.1:9") as refused:
        client.status()
    assert (refused.value.status, refused.value.code) == (None, None)
    client.close()
