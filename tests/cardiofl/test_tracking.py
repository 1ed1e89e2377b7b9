"""Tracking a study to a real MLflow store and a real TensorBoard event file, read back with their own readers."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cardiofl.client.http import CardioflClient
from cardiofl.tracking import MlflowTracker, TensorBoardTracker, flat_params, track_study
from shared.tensors import load
from site_agent.data import SiteData
from tests.coordinator.factories import ADMIN
from tests.site_agent.test_agent import SITES, site_data
from tests.site_agent.test_differential_privacy import DP, config, run_service

__all__ = ["site_data"]

# MLflow's own SQL store still asks SQLAlchemy 2.1 for a loader strategy it deprecates: MLflow's, not ours.
MLFLOW_SQL = "ignore:The ``noload`` loader strategy is deprecated"


def test_flat_params_name_each_leaf_by_its_path() -> None:
    flat = flat_params({"training": {"lr": 0.1, "optimizer": "sgd"}, "sites": ["a", "b"], "params": {}})
    assert flat == {"training.lr": "0.1", "training.optimizer": "sgd", "sites": '["a", "b"]', "params": "{}"}


@pytest.mark.filterwarnings(MLFLOW_SQL)
def test_a_dp_study_is_tracked_to_mlflow_and_tensorboard(
    coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path
) -> None:
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    study_id, _ = run_service(coordinator, site_data, tmp_path, config(privacy={"dp": DP, "min_records": 1}))
    coordinator.headers.update(ADMIN)
    client = CardioflClient(coordinator)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    trackers = [MlflowTracker(uri, "cardiofl-tests", f"study {study_id}"), TensorBoardTracker(tmp_path / "tb")]
    assert track_study(client, study_id, trackers, wait=2) == 3  # two training rounds and the final evaluation
    rounds = {r.number: r for r in client.rounds(study_id)}

    mlflow = MlflowClient(tracking_uri=uri)
    run = mlflow.get_run(trackers[0].run_id)  # type: ignore[attr-defined]
    assert run.info.status == "FINISHED" and run.data.params["training.lr"] == "0.05"
    assert run.data.params["privacy.dp.noise_multiplier"] == "1.1" and run.data.params["study.id"] == str(study_id)
    epsilon = mlflow.get_metric_history(run.info.run_id, "epsilon")
    assert [(m.step, m.value) for m in epsilon] == [(t, rounds[t].pooled["privacy"]["epsilon"]) for t in (1, 2)]
    loss = mlflow.get_metric_history(run.info.run_id, "train_loss")
    assert [(m.step, m.value) for m in loss] == [(t, rounds[t].pooled["train_loss"]) for t in (1, 2)]
    pooled = {m.step: m.value for m in mlflow.get_metric_history(run.info.run_id, "global/micro_f1")}
    assert pooled == {t: rounds[t].pooled["eval"]["micro_f1"] for t in (1, 2)}  # theta^g_1 and theta^g_2, read later
    for site in SITES:
        final = mlflow.get_metric_history(run.info.run_id, f"site/{site}/map")
        expected = next(u.local_eval for u in rounds[3].updates if u.site == site)
        assert final[-1].step == 3 and final[-1].value == pytest.approx(expected["map"])
    (artifact,) = mlflow.list_artifacts(run.info.run_id)
    downloaded = Path(mlflow.download_artifacts(run.info.run_id, artifact.path, str(tmp_path / "back")))
    assert load(downloaded.read_bytes())[0].keys() == load(client.download_global_model(study_id, 2))[0].keys()

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"epsilon", "train_loss", "global/micro_f1", *(f"site/{s}/micro_f1" for s in SITES)} <= set(
        events.Tags()["scalars"]
    )
    assert [(e.step, e.value) for e in events.Scalars("epsilon")] == [
        (t, pytest.approx(rounds[t].pooled["privacy"]["epsilon"], rel=1e-6)) for t in (1, 2)
    ]
    assert "params/text_summary" in events.Tags()["tensors"]  # the terms as text
    (text,) = events.Tensors("params/text_summary")
    assert b"privacy.dp.noise_multiplier | 1.1" in text.tensor_proto.string_val[0]


def test_study_track_needs_a_destination_and_writes_to_the_one_given(
    coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from contextlib import contextmanager

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from typer.testing import CliRunner

    from cardiofl import tracking_cli
    from cardiofl.cli import app

    study_id, _ = run_service(coordinator, site_data, tmp_path, config())
    coordinator.headers.update(ADMIN)

    @contextmanager
    def in_process(url: str, token: str | None):  # noqa: ANN202
        yield CardioflClient(coordinator)

    monkeypatch.setattr(tracking_cli, "connected", in_process)
    refused = CliRunner().invoke(app, ["study", "track", str(study_id)])
    assert refused.exit_code != 0 and "--mlflow URI, --tensorboard DIR or both" in refused.output
    done = CliRunner().invoke(app, ["study", "track", str(study_id), "--tensorboard", str(tmp_path / "tb")])
    assert done.exit_code == 0 and f"study {study_id} completed: 3 round attempt(s) tracked" in done.output
    events = EventAccumulator(str(tmp_path / "tb" / f"study{study_id}"))
    events.Reload()
    assert [e.step for e in events.Scalars("train_loss")] == [1, 2]
