"""Tracking a study to a real MLflow store and a real TensorBoard event file, read back with their own readers."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from cardiofl.client.http import CardioflClient
from cardiofl.experiment.runner import simulate_study
from cardiofl.tracking import MlflowTracker, RunTracking, TensorBoardTracker, flat_params, track_study
from shared.tensors.codec import dump, load
from shared.terms import StudyTerms
from site_agent.data import SiteData
from site_agent.device import resolve_runtime
from tests.coordinator.factories import ADMIN, reported_study
from tests.site_agent.test_agent import SITES, site_data
from tests.site_agent.test_differential_privacy import DP, config, run_service, seeded_noise

__all__ = ["seeded_noise", "site_data"]

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
    assert [(m.step, m.value) for m in epsilon] == [(t, rounds[t].pooled.privacy.epsilon) for t in (1, 2)]
    loss = mlflow.get_metric_history(run.info.run_id, "train_loss")
    assert [(m.step, m.value) for m in loss] == [(t, rounds[t].pooled.train_loss) for t in (1, 2)]
    pooled = {m.step: m.value for m in mlflow.get_metric_history(run.info.run_id, "global/micro_f1")}
    assert pooled == {t: rounds[t].pooled.eval.micro_f1 for t in (1, 2)}  # theta^g_1 and theta^g_2, read later
    for site in SITES:
        final = mlflow.get_metric_history(run.info.run_id, f"site/{site}/map")
        expected = next(u.local_eval for u in rounds[3].updates if u.site == site)
        assert final[-1].step == 3 and final[-1].value == pytest.approx(expected.map)
    (artifact,) = mlflow.list_artifacts(run.info.run_id)
    downloaded = Path(mlflow.download_artifacts(run.info.run_id, artifact.path, str(tmp_path / "back")))
    assert load(downloaded.read_bytes())[0].keys() == load(client.download_global_model(study_id, 2))[0].keys()

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"epsilon", "train_loss", "global/micro_f1", *(f"site/{s}/micro_f1" for s in SITES)} <= set(
        events.Tags()["scalars"]
    )
    assert [(e.step, e.value) for e in events.Scalars("epsilon")] == [
        (t, pytest.approx(rounds[t].pooled.privacy.epsilon, rel=1e-6)) for t in (1, 2)
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


class Recorded:
    """A tracker that keeps what it is handed, and refuses a scalar logged twice at one step."""

    def __init__(self) -> None:
        self.given: dict[str, str] = {}
        self.logged: dict[tuple[int, str], float] = {}
        self.artifacts: list[bytes] = []
        self.closed = False

    def params(self, values: Mapping[str, str]) -> None:
        self.given.update(values)

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            assert (step, key) not in self.logged, f"{key} logged twice at step {step}"
            self.logged[step, key] = value

    def artifact(self, path: Path) -> None:
        self.artifacts.append(path.read_bytes())

    def close(self) -> None:
        self.closed = True


def test_the_runner_tracks_what_the_service_tracks_for_the_same_study(
    coordinator: TestClient, site_data: dict[str, SiteData], tmp_path: Path, seeded_noise: None
) -> None:
    """A DP study with central noise drawn from one key: the runner's run and the service's study log the same."""
    values = config(privacy={"dp": DP, "min_records": 1})
    study_id, _ = run_service(coordinator, site_data, tmp_path, values)
    coordinator.headers.update(ADMIN)
    service = Recorded()
    track_study(CardioflClient(coordinator), study_id, [service], wait=2)

    study = StudyTerms.model_validate(values)
    runner = Recorded()
    tracking = RunTracking([runner], study, {"run": "FedDualAtt|6:2|3"})
    outcomes = list(simulate_study(study, site_data, resolve_runtime("cpu")))
    for outcome in outcomes:
        tracking.round(outcome.record(study.model.config().n_classes))
    tracking.finish(dump(outcomes[-1].global_model), "run.safetensors")

    assert runner.logged == service.logged  # every scalar at every step, to the bit
    steps = {key: sorted(step for step, name in runner.logged if name == key) for _, key in runner.logged}
    assert steps["train_loss"] == steps["epsilon"] == steps["global/micro_f1"] == [1, 2]
    assert all(steps[f"site/{site}/map"] == [1, 2, 3] for site in SITES)  # round 3: the final evaluation
    assert runner.given.pop("run") == "FedDualAtt|6:2|3"
    assert {service.given.pop(key) for key in ("study.id", "study.name")} == {str(study_id), "trial"}
    assert runner.given == service.given  # the same terms
    (ours,), (theirs,) = (load(body)[0] for body in runner.artifacts), (load(body)[0] for body in service.artifacts)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)  # theta^g_2 to the bit
    assert runner.closed and service.closed


def test_the_clinical_figures_are_tracked_with_their_interval_ends_and_bounds(coordinator: TestClient) -> None:
    study_id = reported_study(coordinator)  # every site reports every figure, the clinical ones too
    coordinator.headers.update(ADMIN)
    client = CardioflClient(coordinator)
    recorded = Recorded()
    assert track_study(client, study_id, [recorded], wait=2) == 3
    rounds = {r.number: r for r in client.rounds(study_id)}
    pooled = ("macro_auroc", "macro_auroc_low", "macro_auroc_high", "macro_auroc_bound", "balanced_accuracy")
    pooled += ("balanced_accuracy_low", "sensitivity", "sensitivity_high", "specificity_low", "ece", "ece_bound")
    for t in (1, 2):  # theta^g_t, logged once round t + 1's sites read it
        glob = rounds[t].pooled.eval if rounds[t].pooled else None
        assert {name: recorded.logged[t, f"global/{name}"] for name in pooled} == {n: getattr(glob, n) for n in pooled}
    exact = ("macro_auroc", "macro_auroc_high", "balanced_accuracy", "ece", "ece_low", "micro_f1_low", "map_high")
    for t in (1, 2, 3):  # each site's personalised model, exact with its bootstrap interval
        for update in rounds[t].updates:
            logged = {name: recorded.logged[t, f"site/{update.site}/{name}"] for name in exact}
            assert logged == {name: getattr(update.local_eval, name) for name in exact}
    names = {name for _, name in recorded.logged}
    assert "global/auroc_classes" not in names and "global/n_samples" not in names  # counts are not figures
    assert not {name for name in names if name.startswith("site/") and name.endswith("_bound")}  # exact: no bound


@pytest.mark.filterwarnings(MLFLOW_SQL)
@pytest.mark.parametrize("jobs", ["1", "2"])  # in this process, or each run in a worker of its own
def test_experiment_run_tracks_each_run_to_mlflow_and_tensorboard(tmp_path: Path, jobs: str) -> None:
    import json

    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from typer.testing import CliRunner

    from cardiofl.cli import app

    experiment = tmp_path / "tiny.toml"
    experiment.write_text(
        'name = "tiny-tracked"\npreset = "tiny"\nheads = ["8:0", "6:2"]\nseeds = [4]\nrounds = 2\n'
        f'device = "cpu"\ncache_dir = "{tmp_path / "cache"}"\n[privacy]\nmin_records = 3\n'
        "[synthetic]\nsites = 2\nrecords_per_site = 30\nseed = 5\n"
        '[training]\noptimizer = "adam"\nlr = 0.003\nbatch_size = 8\nmax_steps = 2\n'
    )
    uri, results = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "results.jsonl"
    done = CliRunner().invoke(
        app,
        ["experiment", "run", str(experiment), "--results", str(results), "--no-report"]
        + ["--mlflow", uri, "--tensorboard", str(tmp_path / "tb"), "--jobs", jobs],
    )
    assert done.exit_code == 0, done.output
    records = [json.loads(line) for line in results.read_text().splitlines()]
    mlflow = MlflowClient(tracking_uri=uri)
    tracked = mlflow.get_experiment_by_name("tiny-tracked")
    assert tracked is not None
    runs = {run.info.run_name: run for run in mlflow.search_runs([tracked.experiment_id])}
    assert set(runs) == {"FedDualAtt|8:0|4", "FedDualAtt|6:2|4"}
    for name, run in runs.items():
        rounds = {r["round"]: r for r in records if r.get("run") == name and r["type"] == "round"}
        assert run.info.status == "FINISHED" and run.data.params["run.heads"] == name.split("|")[1]
        assert run.data.params["model.heads"] == name.split("|")[1] and run.data.params["rounds"] == "2"
        loss = mlflow.get_metric_history(run.info.run_id, "train_loss")
        assert [(m.step, m.value) for m in loss] == [(t, rounds[t]["train_loss"]) for t in (1, 2)]
        pooled = mlflow.get_metric_history(run.info.run_id, "global/map")
        assert [(m.step, m.value) for m in pooled] == [(t, rounds[t + 1]["previous_global"]["map"]) for t in (1, 2)]
        site = mlflow.get_metric_history(run.info.run_id, "site/site-2/micro_f1")
        assert [(m.step, m.value) for m in site] == [
            (t, rounds[t]["sites"]["site-2"]["local"]["micro_f1"]) for t in (1, 2, 3)
        ]
        assert not mlflow.get_metric_history(run.info.run_id, "epsilon")  # no DP, no epsilon
        (artifact,) = mlflow.list_artifacts(run.info.run_id)
        assert artifact.path == f"FedDualAtt-{name.split('|')[1].replace(':', '-')}-4-theta-g.safetensors"
        events = EventAccumulator(str(tmp_path / "tb" / artifact.path.removesuffix("-theta-g.safetensors")))
        events.Reload()
        assert [(e.step, e.value) for e in events.Scalars("train_loss")] == [
            (t, pytest.approx(rounds[t]["train_loss"], rel=1e-6)) for t in (1, 2)
        ]
