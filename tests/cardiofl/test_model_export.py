"""`cardiofl model export`: a researcher downloads a study's global model (theta^g_T with phi_0) as a .pt2 file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from cardiofl.cli import app
from cardiofl.client import CardioflClient
from cardiofl.client.http import ApiError
from cardiofl.model_export import global_evaluation_model
from shared.model.export import read_metadata
from shared.terms import StudyTerms
from tests.coordinator.factories import issue
from tests.site_agent.finished_study import (
    ROUNDS,
    FinishedStudy,
    finished_study,
    run_export_without_cardiofl,
    seeded_signals,
)

runner = CliRunner()


@pytest.fixture(scope="module")
def done(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FinishedStudy]:
    with finished_study(tmp_path_factory.mktemp("study")) as study:
        yield study


@pytest.fixture()
def api_over_testclient(done: FinishedStudy, monkeypatch: pytest.MonkeyPatch) -> None:
    """`CardioflClient.connect` reaches the in-process coordinator."""

    def connect(url: str, token: str | None, **_: object) -> CardioflClient:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return CardioflClient(httpx.Client(transport=done.coordinator._transport, base_url=url, headers=headers))

    monkeypatch.setattr(CardioflClient, "connect", staticmethod(connect))


def export(done: FinishedStudy, out: Path, token: str, *extra: str) -> str:
    args = ["model", "export", "--study", str(done.study_id), "--out", str(out), "--url", "http://testserver"]
    result = runner.invoke(app, [*args, "--token", token, *extra])
    assert result.exit_code == 0, result.output
    return result.output


def test_the_global_model_loads_without_cardiofl_and_is_theta_T_with_phi_0(
    done: FinishedStudy, api_over_testclient: None, tmp_path: Path
) -> None:
    researcher = issue(done.coordinator, "researcher")["Authorization"].removeprefix("Bearer ")
    out = tmp_path / "global.pt2"
    assert "(batch, 20) probabilities" in export(done, out, researcher)
    metadata = read_metadata(out)
    assert (metadata["model"], metadata["round"], metadata["study"]) == ("global", ROUNDS, done.study_id)
    assert metadata["input"]["shape"] == ["batch", 12, 5000] and metadata["output"]["kind"] == "probabilities"

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    loaded = run_export_without_cardiofl(out, outside)
    x = seeded_signals()
    with torch.no_grad():
        expected = torch.sigmoid(done.model(ROUNDS, done.blob("0/local"))(x)).numpy()
        personal = torch.sigmoid(done.personal_model()(x)).numpy()
    np.testing.assert_allclose(loaded, expected, atol=1e-5, rtol=0)
    assert np.abs(expected - personal).max() > 1e-4  # phi_0, not a site's phi_k


def test_an_earlier_round_and_the_refusals(done: FinishedStudy, api_over_testclient: None, tmp_path: Path) -> None:
    researcher = issue(done.coordinator, "researcher")["Authorization"].removeprefix("Bearer ")
    export(done, tmp_path / "r1.pt2", researcher, "--round", "1")
    assert read_metadata(tmp_path / "r1.pt2")["round"] == 1

    args = ["model", "export", "--study", str(done.study_id), "--out", str(tmp_path / "x.pt2")]
    args += ["--url", "http://testserver"]
    viewer = issue(done.coordinator, "viewer")["Authorization"].removeprefix("Bearer ")
    refused = runner.invoke(app, [*args, "--token", viewer])
    assert refused.exit_code == 1 and "403" in refused.output
    missing = runner.invoke(app, [*args, "--token", researcher, "--round", "9"])
    assert missing.exit_code == 1 and "no global model of round 9" in missing.output
    assert not (tmp_path / "x.pt2").exists()


def test_a_study_that_shares_nothing_has_no_global_model_to_export() -> None:
    terms = StudyTerms.model_validate({"sites": ["lyon"], "model": {"preset": "tiny"}, "algorithm": {"name": "local"}})
    client = SimpleNamespace(study=lambda _: SimpleNamespace(config=terms))  # refused before any download
    with pytest.raises(ApiError, match=r"study 4 shares no model tensor .*'local'.*`cardiofl site export`"):
        global_evaluation_model(client, 4)  # type: ignore[arg-type]
